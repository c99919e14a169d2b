"""Lab 03's properties: what `make lab-check N=3` runs on your lab.py (common/labs/grader.py runs them).

A small LLaMA in float64 (Ψ = 43,168 parameters: 3 ranks need s = 14,390 and 2 elements of
padding) is trained with your Zero1 on 2 and 3 ranks, and on a world of 3 cut into groups of 1
and 2 (your `group=`), each rank on its group's slice of the global batch, and compared with the
same training on one device (common/reference.py): each rank's master before the first step, the
gradient gathered from the group's shards after `reduce_scatter_gradients`, the norm (max_norm
below the norm, so it clips, and above it, so min(1, ·) keeps the gradient) and the clipped
shards, and every rank's parameters after each step, at 1e-10. Then what the stage is for: the
master and the optimizer state hold s = ⌈Ψ/N⌉ elements per rank, the full gradient is dropped
after the reduce-scatter (ZeRO-1: it was whole until then), and a step moves the flat buffer once
each way.
"""

from __future__ import annotations

import torch

from common.kernel.model import build_model, get_config, loss_fn
from common.labs.diagnosis import steps_pattern
from common.labs.grader import Fail, Property
from common.labs.rank import at
from common.labs.tools import collectives, local_rows, members, one_device, split
from zero.lab_hints import (
    NUMEL,
    explain_grads,
    explain_norm,
    explain_params,
    master_error,
    owner_hint,
    shard_size,
)

TITLE = "the ZeRO-1 step: optimizer state and gradients sharded after backward"
CFG = get_config("tiny", n_layers=2)
BATCH, SEQ, LR = 6, 8, 1e-2  # the gradient's norm is ~1.2: max_norm 0.5 clips, 10 does not
LENGTHS, WORLDS = (NUMEL, 12, 13, 10, 1), (2, 3, 4, 7)  # owner_slice is asked for every rank of each


# --- on every rank -------------------------------------------------------------------------------

def owner_slices(lab, world: int) -> dict[tuple[int, int, int], tuple[int, int]]:
    """owner_slice for every rank of a few layouts (a pure function: one process asks for all)."""
    return {(n, w, r): tuple(lab.owner_slice(n, w, r)) for n in LENGTHS for w in WORLDS for r in range(w)}


def _clone(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().clone()


def train(lab, world: int, steps: int = 1, optimizer: str = "adamw", clip: float | None = None,
          groups: list[int] | None = None) -> dict:
    """The model under your Zero1 on this rank's group, its slice of each global batch; what this
    rank holds at each moment of each step, and the collectives each call posts."""
    g = split(groups)
    model = build_model(CFG, seed=0, dtype=torch.float64)
    kwargs = {"lr": LR, "foreach": False} | ({"weight_decay": 0.1} if optimizer == "adamw" else {})
    inner = torch.optim.AdamW if optimizer == "adamw" else torch.optim.SGD
    at(phase="Zero1 over a bfloat16 model")
    half = lab.Zero1(build_model(CFG, seed=0, dtype=torch.bfloat16).parameters(), inner, group=g.group,
                     **kwargs)
    at(phase="Zero1.__init__")
    zero = lab.Zero1(model.parameters(), inner, group=g.group, **kwargs)
    out: dict = {"master0": _clone(zero.master), "bf16_master": getattr(half.master, "dtype", None),
                 "grads": [], "norms": [], "clipped": [], "params": [],
                 "kept": [], "ops": [], "full": []}
    for step in range(steps):
        ((inputs, targets),) = local_rows(step, g.rank, g.size, BATCH, CFG, SEQ)
        at(step=step + 1, phase="forward and backward")
        loss_fn(model(inputs), targets).backward()
        out["full"].append(sum(p.grad.numel() for p in model.parameters() if p.grad is not None))
        at(phase="reduce_scatter_gradients")
        with collectives() as reduce_ops:
            zero.reduce_scatter_gradients()
        out["kept"].append([n for n, p in model.named_parameters() if p.grad is not None])
        out["grads"].append(_clone(zero.master.grad))
        if clip is not None:
            at(phase="clip_grad_norm_")
            out["norms"].append(float(zero.clip_grad_norm_(clip)))
            out["clipped"].append(_clone(zero.master.grad))
        at(phase="step")
        with collectives() as step_ops:
            zero.step()
        out["ops"].append((reduce_ops, step_ops))
        out["params"].append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
        zero.zero_grad()
    state = [t for s in zero.optim.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    out["state"] = [t.numel() for t in state]
    out["stepped"] = sum(p.numel() for group in zero.optim.param_groups for p in group["params"])
    out["master_storage"] = zero.master.untyped_storage().nbytes() // zero.master.element_size()
    return out


# --- the checks, in the grader's process ---------------------------------------------------------

def _groups(run):
    """(size, [each member's result], config label) of each group of a run."""
    label = f"world {run.world}" + (f" in groups {run.config['groups']}" if run.config.get("groups") else "")
    return [(len(ranks), [run.ranks[q] for q in ranks], label) for ranks in members(run.config)]


def _want(run):
    c = run.config
    return one_device(CFG, c.get("steps", 1), BATCH, SEQ, c.get("optimizer", "adamw"), LR, c.get("clip"))


def check_owner_slices(runs) -> Fail | str:
    """owner_slice(n, N, r) = [r·s, (r+1)·s), s = ⌈n/N⌉, for Ψ and small lengths on 2, 3, 4 and 7 ranks."""
    got = runs[0].ranks[0]
    want = {(n, w, r): (r * -(-n // w), (r + 1) * -(-n // w)) for n, w, r in got}
    wrong = [case for case in got if got[case] != want[case]]
    if not wrong:
        return f"{len(got)} slices as expected (Ψ = {NUMEL:,} and small lengths; N = {WORLDS})"
    n, world, rank = wrong[0]
    return Fail(f"owner_slice({n}, {world}, {rank}) = {got[wrong[0]]}, expected {want[wrong[0]]}",
                owner_hint(wrong, got))


def check_master(runs) -> Fail | str:
    """Before the first step each rank's master is its slice of the flat initial parameters, in the
    master dtype (float64 here), s elements; over a bfloat16 model the master is float32."""
    for run in runs:
        for size, outs, label in _groups(run):
            if (dtype := outs[0]["bf16_master"]) != torch.float32:
                return Fail(f"{label}: Zero1 over a bfloat16 model keeps a {dtype} master",
                            "the master copy is float32 at least (master_dtype = promote_types(the "
                            "parameters' dtype, float32)): AdamW on bfloat16 values loses the small updates")
            if problem := master_error([o["master0"] for o in outs], size, label):
                return Fail(*problem)
    return "every rank's master is its slice of the initial parameters"


def check_grads(runs) -> Fail | str:
    """After reduce_scatter_gradients, the group's master.grad shards, joined, are one device's
    gradient, each step (1e-10)."""
    for run in runs:
        want, steps = _want(run), run.config.get("steps", 1)
        for size, outs, label in _groups(run):
            for k in range(steps):
                if problem := explain_grads([o["grads"][k] for o in outs], want.grads[k], size, label, k):
                    return Fail(problem[0], steps_pattern([k], steps) or problem[1], step=k)
    return "every gradient shard within 1e-10"


def check_params(runs) -> Fail | str:
    """After each step every rank's parameters are one device's (1e-10)."""
    for run in runs:
        want = _want(run)
        for size, outs, label in _groups(run):
            for k in range(run.config.get("steps", 1)):
                for r, out in enumerate(outs):
                    at = f"{label}, rank {r}"
                    if problem := explain_params(out["params"][k], want.params, k, size, at):
                        return Fail(*problem, step=k)
    return "every rank's parameters within 1e-10 after every step"


def check_norm(runs) -> Fail | str:
    """clip_grad_norm_ returns, on every rank, the norm of the whole gradient before clipping (as
    torch.nn.utils.clip_grad_norm_ on one device)."""
    for run in runs:
        want, clip = _want(run), run.config["clip"]
        for size, outs, label in _groups(run):
            for k in range(run.config.get("steps", 1)):
                if problem := explain_norm(outs, want, k, size, clip, label, run.config.get("groups")):
                    return Fail(*problem, step=k)
    return "‖g‖ as one device's on every rank, max_norm below and above it"


def check_clipped(runs) -> Fail | str:
    """After clip_grad_norm_, the shards are the gradient scaled by min(1, max_norm / (‖g‖ + 1e-6))."""
    for run in runs:
        want, clip = _want(run), run.config["clip"]
        for size, outs, label in _groups(run):
            for k in range(run.config.get("steps", 1)):
                coef = min(1.0, clip / (want.norms[k] + 1e-6))
                clipped = {n: g * coef for n, g in want.grads[k].items()}
                shards = [o["clipped"][k] for o in outs]
                if problem := explain_grads(shards, clipped, size, label, k):
                    if explain_grads(shards, want.grads[k], size, label, k) is None:
                        hint = ("the norm is right but the shard was not scaled: multiply master.grad by "
                                "min(1, max_norm / (‖g‖ + 1e-6))")
                    elif coef == 1.0:
                        hint = (f"max_norm {clip} is above ‖g‖ = {want.norms[k]:.3g}: the gradient must stay "
                                "as it is; min(1, ·) caps the coefficient at 1")
                    else:
                        hint = ("the norm is right, the scaling is not: coef = min(1, max_norm / "
                                "(‖g‖ + 1e-6)), the same on every rank")
                    return Fail(problem[0].replace("grad of", "clipped grad of"), hint, step=k)
    return "the clipped shards as torch's clip_grad_norm_"


def check_memory(runs) -> Fail | str:
    """What the stage is for, ZeRO-1's memory: the master's storage and each inner optimizer state
    tensor hold s = ⌈Ψ/N⌉ elements, and no full gradient is kept after reduce_scatter_gradients
    (backward leaves it whole until then: the peak is DDP's; ZeRO-2 reduce-scatters during backward)."""
    for run in runs:
        s = shard_size(run.world)
        for rank, out in enumerate(run.ranks):
            where = f"world {run.world}, rank {rank}"
            if kept := out["kept"][0]:
                return Fail(f"{where}: {len(kept)} full gradients kept after reduce_scatter_gradients "
                            f"({kept[0]}, …)",
                            "only the reduced shard is kept: set p.grad = None once the flat buffer is built")
            if (storage := out["master_storage"]) != s:
                return Fail(f"{where}: the master lives in a storage of {storage:,} elements, its slice is "
                            f"s = {s:,}", "a whole-model master copy on every rank (memory not 1/N): keep a "
                            "tensor of its own of s elements (clone the slice), not a view of a full copy")
            if out["stepped"] != s or any(n != s for n in out["state"]):
                state = f"{sum(out['state']):,} ({len(out['state'])} tensors)"
                return Fail(f"{where}: the inner optimizer steps {out['stepped']:,} elements and its state "
                            f"holds {state}; 1/N is s = {s:,} per state tensor, of Ψ = {NUMEL:,}",
                            "optimizer state for the whole model (memory not 1/N): give the inner optimizer "
                            "[self.master] only, this rank's s elements")
    run = runs[0]
    s, full = shard_size(run.world), run.ranks[0]["full"][0]
    return (f"ZeRO-1 at N = {run.world}: master and each optimizer state tensor s = {s:,} of Ψ = {NUMEL:,}; "
            f"gradient {full:,} elements after backward (the peak: whole), {s:,} after the reduce-scatter")


def check_collectives(runs) -> Fail | str:
    """Per step, reduce_scatter_gradients posts one reduce-scatter of the padded flat buffer (N·s
    elements) and step one all-gather of it, nothing else: the bytes of DDP's all-reduce."""
    for run in runs:
        padded_len = shard_size(run.world) * run.world
        for rank, out in enumerate(run.ranks):
            for k, (reduce_ops, step_ops) in enumerate(out["ops"]):
                posted = [", ".join(map(str, ops)) or "nothing" for ops in (reduce_ops, step_ops)]
                detail = (f"world {run.world}, rank {rank}, step {k + 1}: reduce_scatter_gradients posted "
                          f"{posted[0]}; step posted {posted[1]}")
                if any(p.op == "all_reduce" for p in reduce_ops):
                    return Fail(detail, "an all-reduce leaves the whole gradient on every rank (that is "
                                        "DDP): reduce-scatter the flat buffer: each rank receives its slice")
                if [(p.op, p.numel) for p in reduce_ops] != [("reduce_scatter", padded_len)]:
                    return Fail(detail, f"one reduce-scatter of the whole padded flat buffer ({padded_len:,} "
                                        "elements), not one per parameter and nothing else")
                if [(p.op, p.numel) for p in step_ops] != [("all_gather", padded_len)]:
                    return Fail(detail, f"one all-gather of the padded flat buffer ({padded_len:,} elements) "
                                        "after the inner step, nothing else")
    return "1 reduce-scatter + 1 all-gather of the N·s-element buffer per step"


CLIP = {"steps": 2, "optimizer": "sgd"}
PROPERTIES = [
    Property("the owner's slice [r·s, (r+1)·s) of the padded buffer", [{"world": 1}], owner_slices,
             [check_owner_slices]),
    Property("one and three AdamW steps equal one device (2, 3 ranks)",
             [{"world": 2}, {"world": 3, "steps": 3}], train, [check_master, check_grads, check_params]),
    Property("clipping by the global norm (SGD; 2, 3 ranks; groups of 1 and 2)",
             [{"world": 2, "clip": 0.5, **CLIP}, {"world": 3, "clip": 10.0, **CLIP},
              {"world": 3, "groups": [1, 2], "clip": 0.5, **CLIP}], train,
             [check_master, check_grads, check_norm, check_clipped, check_params]),
    Property("ZeRO-1's memory 1/N, a reduce-scatter + an all-gather (3 ranks)", [{"world": 3, "steps": 2}],
             train, [check_memory, check_collectives], after=("AdamW",)),
]
