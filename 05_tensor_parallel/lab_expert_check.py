"""Lab 05 · experts: what `make lab-check N=5 LAB=expert` runs on your lab_expert.py.

A float64 MoE layer (8 experts, top-2, a shared expert) runs on 4 ranks, as two EP groups of 2
({0, 1} and {2, 3}) and as one of 4, each rank routing its own 6 tokens; the routing is skewed so
that some rank holds experts no token chooses (it receives no row, and must still post every
exchange). First the plan: every rank's all-to-alls of a forward and backward, recorded with the
rows not moved, checked under NCCL's rules (common/kernel/a2a_plan.py) before any real run. Then for
real: the counts each rank receives, the rows each local expert receives (and their counts), the
layer's output and input gradient on every rank, every expert's gradient (on the rank that holds
it) and the replicated parameters', against the same layer on one device at 1e-10; and what EP is
for, in bytes: the all-to-alls move exactly the rows the routing sends away (common/comm.py's
meter). Last, a 2-layer MoE LLaMA with data parallelism over 4 ranks and EP 2: your
reduce_gradients leaves every rank one device's gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from common.comm import CommMeter
from common.kernel.a2a_plan import A2ARecorder, a2a_errors
from common.kernel.model import build_model, loss_fn
from common.kernel.moe import permute
from common.labs.diagnosis import explain, first_difference
from common.labs.grader import Fail, Property
from common.labs.rank import at
from common.labs.tools import local_rows, one_device, rand, split
from tensor_parallel.lab_expert_hints import (
    BATCH,
    EPS,
    LAYER,
    LR,
    MODEL,
    SEQ,
    WORLD,
    E,
    T,
    ep_group,
    full_layer,
    members_of,
    one_device_layer,
    sorted_rows,
    tokens,
)

TITLE = "expert parallelism: the count exchange, dispatch and combine by all-to-all, the gradients"
# --- on every rank -------------------------------------------------------------------------------

def counts(lab, world: int) -> dict:
    """Seeded counts per rank, exchanged in each EP group."""
    out = {}
    for ep in EPS:
        g = ep_group(ep)
        mine = torch.randint(0, 9, (E,), generator=torch.Generator().manual_seed(dist.get_rank() + 10 * ep))
        at(phase=f"exchange_counts at EP {ep}")
        out[ep] = [list(map(int, row)) for row in lab.exchange_counts(mine, g.group)]
    return out


def _parallel(lab, ep: int):
    layer, g = full_layer(), ep_group(ep)
    at(phase=f"expert_parallel at EP {ep}")
    lab.expert_parallel(layer, g.group, lab.ExpertDispatcher)
    return layer, g


def plan(lab, world: int) -> dict:
    """A forward and backward at EP 2 and 4, every all-to-all recorded, the rows not moved (moved
    rows of a wrong plan could hang gloo too); what was recorded before an error is kept, so a
    plan that breaks a rule is named even when the code then fails on the rows it got."""
    out = {}
    for ep in EPS:
        layer, _ = _parallel(lab, ep)
        x, error = tokens(dist.get_rank()).requires_grad_(), None
        with A2ARecorder(post_rows=False) as recorder:
            try:
                at(phase=f"forward at EP {ep} (rows recorded, not moved)")
                y = layer(x)
                recorder.phase = "backward"
                at(phase=f"backward at EP {ep} (rows recorded, not moved)")
                (y * rand("ep g", *y.shape, rank=dist.get_rank())).sum().backward()
            except NotImplementedError:
                raise
            except Exception as caught:  # the records say why, or the check reports it
                error = f"{type(caught).__name__}: {caught}"
        out[ep] = {"records": recorder.records, "error": error}
    return out


def layer_run(lab, world: int) -> dict:
    """The layer for real at EP 2 and 4: what dispatch hands the local experts, the output, the
    gradients, and the bytes this rank's forward put on the wire."""
    out, rank = {}, dist.get_rank()
    for ep in EPS:
        layer, _ = _parallel(lab, ep)
        seen, dispatch = {}, layer.dispatcher.dispatch

        def recorded(x, plan, dispatch=dispatch, seen=seen):
            rows, local = dispatch(x, plan)
            seen.update(rows=rows.detach().clone(), local=[int(c) for c in local])
            return rows, local

        layer.dispatcher.dispatch = recorded
        x = tokens(rank).requires_grad_()
        with CommMeter() as meter:
            at(phase=f"forward at EP {ep}")
            y = layer(x)
        at(phase=f"backward at EP {ep}")
        (y * rand("ep g", *y.shape, rank=rank)).sum().backward()
        grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.grad is not None}
        out[ep] = {**seen, "y": y.detach().clone(), "dx": x.grad.clone(), "grads": grads,
                   "bytes": meter.bytes_sent}
    return out


def train(lab, world: int) -> dict:
    """A 2-layer MoE LLaMA, data parallel over the world (one row per rank), EP groups of 2: one
    backward and your reduce_gradients; this rank's gradients."""
    rank = dist.get_rank()
    ep = split([2, 2])
    expert_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # the ranks holding the same experts
    model = build_model(MODEL, seed=0, dtype=torch.float64)
    lab.expert_parallel(model, ep.group, lab.ExpertDispatcher)
    ((inputs, targets),) = local_rows(0, rank, world, BATCH, MODEL, SEQ)
    at(phase="forward and backward")
    loss_fn(model(inputs), targets).backward()
    at(phase="reduce_gradients")
    lab.reduce_gradients(model, expert_groups[rank % 2])
    return {n: None if p.grad is None else p.grad.clone() for n, p in model.named_parameters()}


def check_counts(runs) -> Fail | str:
    """exchange_counts: rank p of each EP group receives, from every rank s of its group, s's
    counts for p's local experts, received[s][e] = counts_s[p·E/ep + e]."""
    for ep in EPS:
        local = E // ep
        for rank, out in enumerate(runs[0].ranks):
            members, p = members_of(ep, rank), rank % ep
            want = [torch.randint(0, 9, (E,), generator=torch.Generator().manual_seed(s + 10 * ep))
                    [p * local : (p + 1) * local].tolist() for s in members]
            if out[ep] != want:
                hint = ("the whole count vector of each source: send rank q only counts[q·E/ep : (q+1)·E/ep]"
                        if len(out[ep][0]) == E else
                        "received[s][e] is what rank s sends my local expert e: one all-to-all of the "
                        "count vector, read as [ep, E/ep]")
                return Fail(f"EP {ep}, rank {p} of ranks {members}: received {out[ep]}, expected {want}",
                            hint)
    return "every rank's received counts exact at EP 2 and 4"


def check_plan(runs) -> Fail | str:
    """The all-to-alls of a forward and backward, recorded without moving rows (a rank receiving
    no row), keep NCCL's rules: every rank of a group posts the same ones in the same order,
    what q sends p is what p expects from q, contiguous tensors."""
    for ep in EPS:
        records = [out[ep]["records"] for out in runs[0].ranks]
        if errors := a2a_errors(records):
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            return Fail(f"EP {ep}: {errors[0]}{more}",
                        "every rank posts every exchange (the counts, the rows, the rows back; backward: the "
                        "rows back and forth again), with splits that pair, even when it has no row to send")
        raised = [(rank, out[ep]["error"]) for rank, out in enumerate(runs[0].ranks) if out[ep]["error"]]
        if raised:
            return Fail(f"EP {ep}, rank {raised[0][0]} raised {raised[0][1]} (with the rows not moved)",
                        "the plan's all-to-alls pair, but the code failed on what they returned: check the "
                        "shapes you give each all-to-all and the regrouping's indices")
        if not any(r["in"]["dtype"].startswith("float") for r in records[0]):
            return Fail(f"EP {ep}: no rows moved by all_to_all_single",
                        "dispatch the rows with all_to_all_single and the splits the counts give")
    return "every rank posts the same all-to-alls, paired, at EP 2 and 4"


def check_dispatch(runs) -> Fail | str:
    """dispatch hands each local expert exactly the rows every rank of the group routed to it (in
    any order within an expert), expert by expert, and the local counts."""
    for ep in EPS:
        local = E // ep
        for rank, out in enumerate(runs[0].ranks):
            members, p = members_of(ep, rank), rank % ep
            plans = one_device_layer(members)[4]
            rows = [permute(tokens(q).reshape(T, -1), plan) for q, plan in zip(members, plans, strict=True)]
            per_expert = [torch.cat([r[sum(c[: p * local + e]) : sum(c[: p * local + e + 1])]
                                     for r, c in rows]) for e in range(local)]
            want = [len(t) for t in per_expert]
            where = f"EP {ep}, rank {p} of ranks {members}"
            if out[ep]["local"] != want:
                return Fail(f"{where}: local counts {out[ep]['local']}, expected {want}",
                            "local expert e gets Σ_s received[s][e] rows: from every source")
            got = out[ep]["rows"].split(want)
            for e, (g, w) in enumerate(zip(got, per_expert, strict=True)):
                if not torch.equal(sorted_rows(g), sorted_rows(w)):
                    return Fail(f"{where}: local expert {e} got rows that are not those routed to it",
                                "the rows arrive source-major: regroup them expert-major (every source's "
                                "rows for local expert 0, then for 1, …), as the local counts say")
    return "every local expert gets exactly its rows at EP 2 and 4"


def check_layer(runs) -> Fail | str:
    """The layer's output and input gradient on every rank equal the full layer's on its tokens,
    each rank's experts' gradients the full layer's for those experts over its group's tokens,
    and the router's and the shared expert's its own tokens' (1e-10): combine undoes dispatch,
    and the all-to-all's backward swaps the splits."""
    for ep in EPS:
        local = E // ep
        for rank, out in enumerate(runs[0].ranks):
            members, p = members_of(ep, rank), rank % ep
            ys, dxs, total, own, _ = one_device_layer(members)
            where = f"EP {ep}, rank {p} of ranks {members}"
            for key, want in (("y", ys[p]), ("dx", dxs[p])):
                if finding := first_difference({key: out[ep][key]}, {key: want}):
                    return Fail(f"{where}: {finding}",
                                "the output comes back to the rank whose tokens they are: combine undoes the "
                                "regrouping (argsort), then the all-to-all with the splits swapped"
                                if key == "y" and finding.rel > 1e-6 else explain(finding, ep))
            want = {n: (g[p * local : (p + 1) * local] if n.startswith("experts.") else own[p][n])
                    for n, g in total.items()}
            if finding := first_difference(out[ep]["grads"], want):
                return Fail(f"{where}: grad of {finding}", explain(finding, ep))
    return "output, input gradient and every parameter's gradient exact on every rank at EP 2 and 4"


def check_bytes(runs) -> Fail | str:
    """What EP is for: a rank's forward puts on the wire the count exchange ((ep-1)/ep of E
    counts) and, each way, exactly the rows its routing sends to other ranks' experts."""
    for ep in EPS:
        local = E // ep
        for rank, out in enumerate(runs[0].ranks):
            members, p = members_of(ep, rank), rank % ep
            plans = one_device_layer(members)[4]
            counts = [plan.counts.tolist() for plan in plans]
            away = sum(counts[p][: p * local]) + sum(counts[p][(p + 1) * local :])
            back = sum(sum(c[p * local : (p + 1) * local]) for s, c in enumerate(counts) if s != p)
            want = (ep - 1) / ep * E * 8 + (away + back) * LAYER.dim * 8
            if abs(out[ep]["bytes"] - want) > 0.5:
                sent = out[ep]["bytes"]
                return Fail(f"EP {ep}, rank {p} of ranks {members}: the forward sent {sent:,.0f} B; the "
                            f"routing sends {away} rows away and {back} back ({want:,.0f} B with the counts)",
                            "send each row only to the rank that holds its expert (all_to_all_single with "
                            "the counts' splits), and back: not every row to every rank, not padded")
    return "the all-to-alls move exactly the routed rows (and E counts) at EP 2 and 4"


def check_reduction(runs) -> Fail | str:
    """After reduce_gradients, every rank holds one device's gradients: the replicated
    parameters' whole, its experts' slice (DP 4 × EP 2, a 2-layer MoE LLaMA, 1e-10)."""
    want = one_device(MODEL, 1, BATCH, SEQ, "sgd", LR).grads[0]
    for rank, got in enumerate(runs[0].ranks):
        p = rank % 2
        sliced = {n: g[p * E // 2 : (p + 1) * E // 2] if ".experts." in n else g for n, g in want.items()}
        if finding := first_difference(got, sliced):
            expert = ".experts." in finding.name
            hint = explain(finding, 4) if not expert else (
                "an expert's gradient: all-reduce it over expert_group (the ranks holding the same experts), "
                "then divide by the world's size, 4: every rank's tokens could reach it")
            return Fail(f"world 4 (EP groups of 2), rank {rank}: grad of {finding}", hint)
    return "every rank's gradients as one device's (DP 4 × EP 2)"


ONE_JOB = [{"world": WORLD}]
PROPERTIES = [
    Property("the all-to-all plan keeps NCCL's rules (EP 2 and 4, a rank with no row)", ONE_JOB, plan,
             [check_plan], gate=True),
    Property("exchange_counts: each rank gets every rank's counts for its experts", ONE_JOB, counts,
             [check_counts]),
    Property("dispatch and combine: the MoE layer equals one device (EP 2 and 4)", ONE_JOB, layer_run,
             [check_dispatch, check_layer, check_bytes], after=("exchange_counts",)),
    Property("reduce_gradients: DP 4 × EP 2 gradients equal one device", ONE_JOB, train, [check_reduction],
             after=("dispatch and combine",)),
]
