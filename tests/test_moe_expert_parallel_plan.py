"""Expert parallelism's collective plan under NCCL's rules (CONTRIBUTING.md, "Rules of
the NCCL path"), on 4 ranks with EP 2 and EP 4, forward and backward of a skewed MoE layer (every
token on rank 0's experts: the other ranks receive no row) and of tiny-moe (2 MoE layers).

Every rank records what it posts (op, group ranks, split lists, shapes, devices) and when it reads
a tensor on the host; the checks run in the test process over all ranks' records:
1. every rank of an EP group posts the same collectives in the same order on the same group;
2. each all-to-all pairs: rank q sends rank p exactly what p expects from q, splits sum to the
   tensors' rows, the rows agree;
3. every tensor handed to a collective is on the rank's device, made with device= (the
   host-default mark of tests/collective_guard.py), contiguous;
4. host reads: per MoE layer forward, one read of the count exchange's result (expert_parallel.py)
   and one of the routing counts (`permute`, common/kernel/moe.py): two syncs on a GPU; none in backward.
Planted bugs (a rank skipping an exchange it receives nothing from, a rank swapping two send
splits, a count tensor made without device=, a debug check reading the rows on the host) go red
with the rule's message; the first two would desynchronise real gloo, so they run with the token
all-to-alls recorded but not posted.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import pytest
import torch
import torch.distributed as dist

import tensor_parallel.expert_parallel as ep_module
from common.kernel.model import build_model, get_config, loss_fn
from common.kernel.moe import moe_layers
from common.kernel.patch import patch_dist
from tensor_parallel.expert_parallel import expert_parallel
from tests.collective_guard import HostDefaultTracker, is_host_default
from tests.test_moe import make_layer, moe_config

WORLD = 4
HOST_READS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__int__, torch.Tensor.__bool__,
              torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy}


class PlanRecorder(HostDefaultTracker):
    """On one rank: the collectives it posts and the tensors it reads on the host, in order, each
    tagged with the phase ("forward"/"backward"). `post=False` records token all-to-alls (those
    with split lists) without running them, for plans that would desynchronise gloo."""

    def __init__(self, post: bool = True):
        super().__init__()
        self.records, self.phase, self.post, self._outputs = [], "forward", post, set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in HOST_READS:
            t = args[0]
            what = "exchanged counts" if t.untyped_storage().data_ptr() in self._outputs else "other"
            self.records.append({"op": "host read", "phase": self.phase, "what": what})
        return super().__torch_function__(func, types, args, kwargs)

    def _tensor(self, t: torch.Tensor) -> dict:
        return {"rows": t.shape[0], "row": tuple(t.shape[1:]), "dtype": str(t.dtype), "device": str(t.device),
                "device_ok": t.device == torch.device("cpu"), "contiguous": t.is_contiguous(),
                "host_default": is_host_default(t)}

    def all_to_all_single(self, output, input, output_split_sizes=None, input_split_sizes=None,
                          group=None, async_op=False):
        n = dist.get_world_size(group)
        self.records.append({"op": "all_to_all_single", "phase": self.phase,
                             "group": tuple(dist.get_process_group_ranks(group or dist.group.WORLD)),
                             "in": self._tensor(input), "out": self._tensor(output),
                             "in_splits": list(input_split_sizes or [input.shape[0] // n] * n),
                             "out_splits": list(output_split_sizes or [output.shape[0] // n] * n)})
        self._outputs.add(output.untyped_storage().data_ptr())
        if self.post or input_split_sizes is None:
            return self._a2a(output, input, output_split_sizes, input_split_sizes, group=group,
                             async_op=async_op)

    def all_reduce(self, tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        self.records.append({"op": "all_reduce", "phase": self.phase, "in": self._tensor(tensor),
                             "group": tuple(dist.get_process_group_ranks(group or dist.group.WORLD))})
        return self._all_reduce(tensor, op, group=group, async_op=async_op)

    def _keep(self, attr: str, method):
        def wrap(torchs):
            setattr(self, attr, torchs)
            return method
        return wrap

    def __enter__(self):
        self._patched = patch_dist({"all_to_all_single": self._keep("_a2a", self.all_to_all_single),
                                    "all_reduce": self._keep("_all_reduce", self.all_reduce)})
        self._patched.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        self._patched.__exit__(*exc)
        return super().__exit__(*exc)


def planted(bug: str | None):
    """The bug on world rank 1 (group rank 1: under the skewed routing it receives no row)."""
    if bug is None or dist.get_rank() != 1:
        return contextlib.nullcontext()
    if bug == "device":  # the count tensor built without device=
        tensor = torch.tensor
        return mock.patch.object(torch, "tensor",
                                 lambda data, dtype=None, device=None: tensor(data, dtype=dtype))
    real = ep_module.all_to_all_rows

    def buggy(x, out_splits, in_splits, group):
        if bug == "skip" and sum(out_splits) == 0:  # "nothing arrives: skip the exchange"
            return x.new_zeros(0, x.shape[1])
        if bug == "sync" and not torch.isfinite(x).all():  # a debug check: a host read
            raise FloatingPointError("non-finite rows")
        if bug == "swap":
            in_splits = [in_splits[1], in_splits[0], *in_splits[2:]]
        return real(x, out_splits, in_splits, group)
    return mock.patch.object(ep_module, "all_to_all_rows", buggy)


def record_plans(ep: int, bug: str | None = None) -> dict:
    """Every rank: EP groups of `ep` consecutive ranks; forward + backward of a skewed layer
    (E = 2·ep, top-2, every token on experts 0, 1) and of tiny-moe; returns each one's records."""
    rank = dist.get_rank()
    groups = [dist.new_group(list(range(s, s + ep))) for s in range(0, WORLD, ep)]  # all, on every rank
    group, me = groups[rank // ep], rank % ep
    layer, x = make_layer(moe_config(2 * ep, 2, "softmax", 1), ep, 3, seed=5, dead=2 * ep - 2)
    expert_parallel(layer, group)
    tokens = torch.randint(0, 64, (ep, 9), generator=torch.Generator().manual_seed(3))
    cfg = get_config("tiny-moe", n_layers=2, first_dense_layers=0, capacity_factor=1.25)
    model = build_model(cfg, 0, torch.float64)
    expert_parallel(model, group)
    runs = {"layer": lambda: layer(x.detach()[me:me + 1].clone().requires_grad_()).square().sum(),
            "tiny-moe": lambda: loss_fn(model(tokens[me:me + 1, :-1] % cfg.vocab_size),
                                        tokens[me:me + 1, 1:] % cfg.vocab_size)}
    plans = {}
    for name, forward in runs.items():
        with PlanRecorder(post=bug not in ("skip", "swap")) as recorder, planted(bug):
            loss = forward()
            recorder.phase = "backward"
            loss.backward()
        plans[name] = {"records": recorder.records,
                       "moe_layers": len(moe_layers(model)) if name == "tiny-moe" else 1}
    return plans


def plan_errors(per_rank: list[dict]) -> list[str]:
    """NCCL's rules 1-4 (module doc) over every rank's records; one line per broken rule."""
    errors = []
    colls = [[r for r in recs if r["op"] != "host read"] for recs in per_rank]
    for rank, ops in enumerate(colls):
        for i, op in enumerate(ops):
            for side in ("in", "out") if "out" in op else ("in",):
                t = op[side]
                if not t["device_ok"] or t["host_default"] or not t["contiguous"]:
                    errors.append(f"rule 3: rank {rank} op {i} {op['op']} ({op['phase']}): {side}put "
                                  f"on {t['device']}, made without device= {t['host_default']}, contiguous "
                                  f"{t['contiguous']}: make it on the rank's device with device=")
            if op["op"] == "all_to_all_single":
                for side in ("in", "out"):
                    if sum(op[f"{side}_splits"]) != op[side]["rows"]:
                        splits = op[f"{side}_splits"]
                        errors.append(f"rule 2: rank {rank} op {i}: {side}_splits {splits} sum to "
                                      f"{sum(splits)}, the tensor has {op[side]['rows']} rows")
    for group in sorted({op["group"] for ops in colls for op in ops}):
        seqs = {r: [op for op in colls[r] if op["group"] == group] for r in group}
        keys = {r: [(op["op"], op["phase"], op["in"]["dtype"]) for op in seq] for r, seq in seqs.items()}
        first = group[0]
        for r in group[1:]:
            if keys[r] != keys[first]:
                i = next((i for i, (a, b) in enumerate(zip(keys[first], keys[r], strict=False)) if a != b),
                         min(len(keys[first]), len(keys[r])))
                show = {q: keys[q][i] if i < len(keys[q]) else "nothing" for q in (first, r)}
                errors.append(f"rule 1: group {group}: rank {first} posts {len(keys[first])} collectives, "
                              f"rank {r} {len(keys[r])}; first difference at #{i}: rank {first} "
                              f"{show[first]}, rank {r} {show[r]}: every rank posts every exchange, "
                              "even an empty one")
        if any(keys[r] != keys[first] for r in group):
            continue
        for i, op in enumerate(seqs[first]):
            if op["op"] != "all_to_all_single":
                continue
            for p_at, p in enumerate(group):
                for q_at, q in enumerate(group):
                    sent, expected = seqs[q][i]["in_splits"][p_at], seqs[p][i]["out_splits"][q_at]
                    if sent != expected or seqs[q][i]["in"]["row"] != seqs[p][i]["out"]["row"]:
                        errors.append(f"rule 2: group {group} all_to_all #{i} ({op['phase']}): rank {q} "
                                      f"sends rank {p} {sent} rows of {seqs[q][i]['in']['row']}, rank {p} "
                                      f"expects {expected} of {seqs[p][i]['out']['row']} from rank {q}")
    return errors


def host_reads(per_rank: list[dict], layers: int) -> list[str]:
    """Rule 4: per rank and MoE layer forward, the routing counts read (`permute`), then the
    exchanged counts (the dispatcher); none in backward."""
    errors = []
    for rank, recs in enumerate(per_rank):
        reads = [r for r in recs if r["op"] == "host read"]
        fwd = [r["what"] for r in reads if r["phase"] == "forward"]
        bwd = [r["what"] for r in reads if r["phase"] == "backward"]
        if fwd != ["other", "exchanged counts"] * layers or bwd:
            errors.append(f"rule 4: rank {rank}: host reads forward {fwd}, backward {bwd}; want per MoE "
                          f"layer ({layers}) the routing counts (other) then the exchanged counts, "
                          "none in backward")
    return errors


def check(results: list[dict]) -> list[str]:
    errors = []
    for name in results[0]:
        per_rank = [r[name]["records"] for r in results]
        found = plan_errors(per_rank) + host_reads(per_rank, results[0][name]["moe_layers"])
        errors += [f"{name}: {e}" for e in found]
    return errors


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_plan_keeps_nccl_rules(pools, ep):
    results = pools.run(WORLD, record_plans, ep)
    a2a = [r for r in results[1]["layer"]["records"] if r["op"] == "all_to_all_single"]
    assert [r["phase"] for r in a2a] == ["forward"] * 3 + ["backward"] * 2  # counts, rows, back; 2 reverse
    assert sum(a2a[1]["out_splits"]) == 0  # rank 1 receives no row: the skew is there
    assert not check(results), "\n".join(check(results))


@pytest.mark.parametrize("bug, rule", [("skip", "rule 1: group"), ("swap", "rule 2: group"),
                                       ("device", "rule 3: rank 1"), ("sync", "rule 4: rank 1")])
def test_a_planted_plan_bug_goes_red(pools, bug, rule):
    errors = check(pools.run(WORLD, record_plans, 2, bug))
    assert any(e.startswith(f"layer: {rule}") for e in errors), "\n".join(errors)
