"""Lab 04's properties: what `make lab-check N=4` runs on your lab.py (common/labs/grader.py runs them).

In the order of a unit's life: what each rank keeps (its 1/N of the flat, padded parameters);
when full holds memory (what FSDP is for: whole only inside the unit's forward and backward); a
float64 LLaMA whose embedding, blocks, norm and head are ShardedUnits, trained on 2 and 3 ranks
and on a world of 3 cut into groups of 2 and 1 (your `group=`) against one device
(common/reference.py: every rank's shards of every gradient each step, at 1e-10); the collectives
each rank posts in a step.
"""

from __future__ import annotations

import torch
from torch import nn

from common.kernel.model import RMSNorm, build_model, get_config, loss_fn, rope_cos_sin
from common.labs.diagnosis import explain, first_difference, near, steps_pattern
from common.labs.grader import Fail, Property
from common.labs.rank import at
from common.labs.tools import collectives, local_rows, members, one_device, split
from common.reference import make_optimizer
from fsdp.lab_hints import ERROR_HINTS as ERROR_HINTS  # the grader reads a lab's error hints here
from fsdp.lab_hints import LIFE, PAD_HINT, UNITS, flat, guard, layout, shard_error, unshard

TITLE = "one FSDP unit: sharded at rest, gathered to compute, gradients reduce-scattered"
CFG = get_config("tiny", n_layers=2)
BATCH, SEQ, LR = 6, 8, 1e-2


# --- 1. the shard ------------------------------------------------------------------------------

def _shard_cases() -> dict[str, nn.Module]:
    """Units of P divisible by 3 not 2 (9), by neither (7), by 2 not 3 (the block: 13,376)."""
    torch.manual_seed(0)
    return {"Linear(2, 3)": nn.Linear(2, 3).double(), "RMSNorm(7)": RMSNorm(7, 1e-5).double(),
            "a tiny LLaMA block": build_model(CFG, dtype=torch.float64).layers[0]}


def shards(lab, world: int) -> dict:
    """What this rank keeps of each case."""
    mine = {}
    for name, module in _shard_cases().items():
        at(phase=f"ShardedUnit({name})")
        unit = lab.ShardedUnit(module)
        shard = getattr(unit, "shard", None)
        own = isinstance(shard, torch.Tensor)
        mine[name] = {"shard": shard.detach().clone() if own else None,
                      "parameters": [n for n, _ in unit.named_parameters()],
                      "storage": shard.untyped_storage().nbytes() if own else 0}
    return mine


def check_shards(runs) -> Fail | str:
    """Rank r keeps, as its only parameter `shard`, flat[r·S:(r+1)·S] of the unit's parameters
    flattened and zero-padded to N·S, S = ⌈P/N⌉ (P = 9, 7 and 13,376 on 2 and 3 ranks), in a
    storage of its own: S elements, not a view of the whole flat buffer."""
    failures, cases = [], []
    for run in runs:
        for case, module in _shard_cases().items():
            padded, p = flat(module, run.world), sum(q.numel() for q in module.parameters())
            cases.append((run.world, p))
            for rank, theirs in enumerate(run.ranks):
                if (error := shard_error(theirs[case], padded, p, rank, run.world)) is not None:
                    where = f"world {run.world}, rank {rank}, {case}"
                    failures.append((run.world, p, f"{where}: {error[0]}", error[1]))
                    break
    if not failures:
        return "every rank keeps its slice (P = 9, 7, 13,376 at world 2 and 3)"
    _, _, detail, hint = failures[0]
    pattern = all(p % w for w, p, *_ in failures) and any(p % w == 0 for w, p in cases)
    return Fail(detail, PAD_HINT if pattern else hint)


# --- 2. gathered only while the unit computes ------------------------------------------------

def life(lab, world: int) -> dict:
    """One forward and backward of one unit (a tiny block): when does full hold memory?"""
    block = build_model(CFG, dtype=torch.float64).layers[0]
    want, seen = flat(block, 1), {}
    unit = lab.ShardedUnit(block)

    def look(moment: str) -> None:
        full = getattr(unit, "full", None)
        size = full.untyped_storage().size() if isinstance(full, torch.Tensor) else 0
        right = size > 0 and full.numel() >= len(want) and torch.equal(full.detach()[: len(want)], want)
        seen[moment] = {"bytes": size, "values": right}

    look("after construction")
    block.register_forward_pre_hook(lambda *_: look("inside forward"))
    guard(unit, "the block")
    block.feed_forward.w1.register_forward_hook(  # its backward needs the weights gathered
        lambda m, i, out: [out.register_hook(lambda grad: look("inside backward")), None][1])
    x = torch.randn(2, SEQ, CFG.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0),
                    requires_grad=True)
    at(phase="forward")
    out = unit(x, *rope_cos_sin(CFG, torch.arange(SEQ), torch.float64))
    look("after forward")
    at(phase="backward")
    out.pow(2).sum().backward()
    look("after backward")
    return seen


def check_life(runs) -> Fail | str:
    """What FSDP is for: full holds the unit's parameters (memory) inside its forward and inside
    its backward only, not after construction, forward or backward."""
    for run in runs:
        for rank, seen in enumerate(run.ranks):
            for moment, (gathered, hint) in LIFE.items():
                state = seen.get(moment, {"bytes": 0, "values": False})
                where = f"world {run.world}, rank {rank}: {moment}"
                if gathered and not state["values"]:
                    what = "not the unit's flat parameters" if state["bytes"] else "freed (0 bytes)"
                    return Fail(f"{where}, full is {what}", hint)
                if not gathered and state["bytes"]:
                    return Fail(f"{where}, full still holds {state['bytes']:,} bytes", hint)
    return "full holds memory inside forward and inside backward only (every rank, world 2 and 3)"


# --- 3. training equals one device -------------------------------------------------------------

def train(lab, world: int, steps: int = 1, optimizer: str = "sgd", groups: list[int] | None = None,
          backwards: int = 1) -> dict:
    """The tiny LLaMA with each of UNITS a ShardedUnit over this rank's group, on its slice of each
    global batch: this rank's gradient and parameter shards and collectives, each step. With
    `backwards` = 2 the same batch runs forward and backward twice: shard.grad must be their sum."""
    g, model = split(groups), build_model(CFG, seed=0, dtype=torch.float64)
    units = {name: lab.ShardedUnit(model.get_submodule(name), g.group) for name in UNITS}
    for name, unit in units.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, unit)
        guard(unit, name)
    opt = make_optimizer(model.parameters(), optimizer, LR)
    out = {"grads": [], "events": []}

    def held() -> dict[str, torch.Tensor | None]:
        return {n: None if u.shard.grad is None else u.shard.grad.detach().clone() for n, u in units.items()}

    for step in range(steps):
        ((inputs, targets),) = local_rows(step, g.rank, g.size, BATCH, CFG, SEQ)
        for _ in range(backwards):
            with collectives() as forward:
                at(step=step + 1, phase="forward")
                loss = loss_fn(model(inputs), targets)
            with collectives() as backward:
                at(phase="backward")
                loss.backward()
        out["grads"].append(held())
        out["events"].append((forward, backward))
        opt.step()
        opt.zero_grad(set_to_none=True)
    return out


def _compare(runs) -> Fail | None:
    """Each group's gradient shards joined, each step, against one device's; the first to differ
    (the world sizes where it does say whether padding is the cause)."""
    failing, passing, first = [], [], None
    for run in runs:
        want, steps = _want(run).grads, run.config.get("steps", 1)
        if (times := run.config.get("backwards", 1)) > 1:  # backward twice on one batch: the sum
            want = [{n: g * times for n, g in grads.items()} for grads in want]
        for ranks in members(run.config):
            n, found = len(ranks), None
            for k in range(steps):
                got, starts, problem = unshard([run.ranks[q]["grads"][k] for q in ranks], n)
                where = f"step {k + 1}, world {run.world}" + (f" (ranks {ranks})" if n < run.world else "")
                if problem:
                    found = Fail(f"{where}, {problem}", "the post-backward hook reduce-scatters full.grad "
                                                        "into self.shard.grad (S elements)", step=k)
                elif finding := first_difference(got, want[k]):
                    whose = ""
                    if finding.name in starts and got[finding.name].shape == want[k][finding.name].shape:
                        offset, size = starts[finding.name]
                        worst = int((got[finding.name] - want[k][finding.name]).abs().reshape(-1).argmax())
                        whose = f"; the largest difference is in rank {ranks[(offset + worst) // size]}'s"
                    hint = steps_pattern([k], steps) or explain(finding, n)
                    if times > 1 and near(finding.scale, 1 / times):
                        hint = (f"half the sum after {times} backwards on one batch: shard.grad was "
                                "overwritten, not accumulated (add the reduced shard to shard.grad when "
                                "it is not None, as autograd does with p.grad)")
                    found = Fail(f"{where}: grad of {finding}{whose}", hint, step=k)
                if found:
                    break
            (failing if found else passing).append(n)
            first = first or found
    if first is None:
        return None
    sizes = [sum(shape.numel() for _, shape in params) for params in layout().values()]
    divides = {w: all(p % w == 0 for p in sizes) for w in failing + passing}
    pattern = passing and not any(divides[w] for w in failing) and all(divides[w] for w in passing)
    return Fail(first.detail, PAD_HINT if pattern else first.hint, first.step)


def _want(run) -> object:
    return one_device(CFG, run.config.get("steps", 1), BATCH, SEQ, run.config.get("optimizer", "sgd"), LR)


def check_grads(runs) -> Fail | str:
    """After each backward, the group's shard.grad joined and cut into the original tensors are
    one device's gradients (1e-10); the grader's optimizer steps the shards, so a forward that
    computes with anything but the stepped shards shows at the next step's gradients."""
    return _compare(runs) or "every gradient within 1e-10"


# --- 4. the collectives of a step --------------------------------------------------------------

def check_collectives(runs) -> Fail | str:
    """Per step and rank: one all-gather of N·S elements per unit in forward, one per unit in
    backward, one SUM reduce-scatter per unit in backward, nothing else."""
    n = len(UNITS)
    for run in runs:
        sizes = [sum(s.numel() for _, s in ps) for ps in layout().values()]
        padded = sorted(p + (-p % run.world) for p in sizes)
        for rank, out in enumerate(run.ranks):
            for step, (forward, backward) in enumerate(out["events"]):
                fwd, bwd = ([p.numel for p in ops if p.op == "all_gather"] for ops in (forward, backward))
                rs = [p for p in backward if p.op == "reduce_scatter"]
                ar = [p for p in forward + backward if p.op == "all_reduce"]
                op = rs[0].reduce if rs else ""
                for wrong, detail, hint in [
                    (ar and not rs, f"{len(ar)} all-reduces and no reduce-scatter", "reduce-scatter "
                     "full.grad: a rank needs its shard's sum only (all-reduce sends twice that)"),
                    (sorted(fwd) != padded, f"{len(fwd)} all-gathers in forward for {n} units",
                     "gather each unit once in its forward, into all N·S elements of full"),
                    (sorted(bwd) != padded, f"{len(bwd)} all-gathers in backward for {n} units", "forward "
                     "frees the unit, so its backward gathers it again, once (the pre-backward hook)"),
                    (sorted(p.numel for p in rs) != padded, f"{len(rs)} reduce-scatters in backward for {n} "
                     "units", "one reduce-scatter per unit per backward, when its gradient is whole "
                     "(post-backward hook)"),
                    (any(p.reduce != "SUM" for p in rs), f"reduce-scatter with ReduceOp.{op}", "reduce with "
                     "ReduceOp.SUM, then divide by N: gloo on torch 2.5-2.8 returns the SUM for AVG"),
                    (ar, f"{len(ar)} all-reduces besides the reduce-scatters", "a unit needs no all-reduce"),
                ]:
                    if wrong:
                        return Fail(f"step {step + 1}, world {run.world}, rank {rank}: {detail}", hint)
    return f"per step and rank: {n} all-gathers in forward, {n} in backward, {n} SUM reduce-scatters"


PROPERTIES = [
    Property("the shard: each rank keeps its 1/N of the flat, padded parameters",
             [{"world": 2}, {"world": 3}], shards, [check_shards]),
    Property("full parameters hold memory only inside forward and backward",
             [{"world": 2}, {"world": 3}], life, [check_life]),
    Property("one SGD step equals one device (2, 3 ranks; groups of 2 and 1)",
             [{"world": 2}, {"world": 3}, {"world": 3, "groups": [2, 1]}], train, [check_grads]),
    Property("three AdamW steps equal one device (2 and 3 ranks)",
             [{"world": w, "steps": 3, "optimizer": "adamw"} for w in (2, 3)], train, [check_grads]),
    Property("two backwards before a step: shard.grad accumulates (2 ranks)",
             [{"world": 2, "backwards": 2}], train, [check_grads]),
    Property("a step posts 2 all-gathers and 1 reduce-scatter per unit",
             [{"world": 2, "steps": 2}], train, [check_collectives], after=("one SGD step",)),
]
