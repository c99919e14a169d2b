"""Lab 04's properties: what `make lab-check N=4` runs on your lab.py (common/grader.py runs them).

In the order of a unit's life: what each rank keeps (its 1/N of the flat, padded parameters);
when full holds memory; a float64 LLaMA whose embedding, blocks, norm and head are ShardedUnits,
trained on 2 and 3 ranks against one device (common/reference.py: every gathered gradient each
step, the parameters at the end, at 1e-10); the collectives each rank posts in a step.
"""

from __future__ import annotations

import traceback
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch import nn

from common.data import SyntheticTokens, local_micro_batches, split_inputs_targets
from common.diagnosis import explain, first_difference, steps_pattern
from common.grader import Property
from common.model import RMSNorm, build_model, get_config, loss_fn, rope_cos_sin
from common.patch import patch_dist
from common.reference import make_optimizer, make_reference

TITLE = "one FSDP unit: sharded at rest, gathered to compute, gradients reduce-scattered"
CFG = get_config("tiny", n_layers=2)
UNITS = ("tok_embeddings", "layers.0", "layers.1", "norm", "output")  # forward order
BATCH, SEQ, LR = 6, 8, 1e-2
TOLERANCE = 1e-10
FREED = "storage of size 0"  # torch's words for computing with a freed tensor
PAD_HINT = ("right where N divides the unit's size P, wrong where it does not: pad the flat with zeros "
            "to N·S, S = ⌈P/N⌉, so that every rank keeps S elements; cut the views from full[:P]")


def _everyone(obj) -> list:
    """Every rank's `obj`, in rank order (pickled: any size, None included)."""
    dist.all_gather_object(out := [None] * dist.get_world_size(), obj)
    return out


def _flat(module: nn.Module, world: int) -> torch.Tensor:
    """module's parameters flattened in module.parameters() order, zero-padded to N·⌈P/N⌉."""
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    return torch.cat([flat, flat.new_zeros(-len(flat) % world)])


def _caught(error: RuntimeError, lab) -> str:
    """The error in one line, and the last function of the lab file it came through."""
    if isinstance(error, NotImplementedError):
        raise error  # the grader stops at once and names what is left to write
    ours = [f.name for f in traceback.extract_tb(error.__traceback__)
            if Path(f.filename) == Path(lab.__file__)]
    return f"{type(error).__name__}: {str(error)[:200]}" + (f" (in {ours[-1]})" if ours else "")


def _freed_hint(error: str, phase: str) -> str:
    if FREED not in error:
        return ""
    if "gather)" in error:
        return "allocate full's storage (untyped_storage().resize_(bytes)) before gathering into it"
    if phase == "backward":
        return ("backward computed with freed parameters: gather again in the pre-backward hook "
                "(a hook registered on the forward's output)")
    return "the forward computed with freed parameters: gather before self.module(...), free after it"


def _guard(unit: nn.Module, name: str) -> None:
    """Raise, instead of crashing, when the wrapped module is about to compute with freed full
    parameters (an elementwise kernel reading freed memory may segfault rather than raise)."""
    def check(phase: str) -> None:
        full = getattr(unit, "full", None)
        if isinstance(full, torch.Tensor) and full.untyped_storage().size() == 0:
            raise RuntimeError(f"{name}'s {phase} was about to compute with full's {FREED}")

    def before_backward(module, inputs, out):  # the unit's hooks are on the view returned: they
        if isinstance(out, torch.Tensor) and out.requires_grad:  # run before the hook on `out`
            out.register_hook(lambda grad: check("backward"))
            out = out.view_as(out)
        return out

    unit.module.register_forward_pre_hook(lambda *_: check("forward"))
    unit.module.register_forward_hook(before_backward)


# --- 1. the shard ------------------------------------------------------------------------------

def _shard_cases() -> dict[str, nn.Module]:
    """Units of P divisible by 3 not 2 (9), by neither (7), by 2 not 3 (the block: 13,376)."""
    torch.manual_seed(0)
    return {"Linear(2, 3)": nn.Linear(2, 3).double(), "RMSNorm(7)": RMSNorm(7, 1e-5).double(),
            "a tiny LLaMA block": build_model(CFG, dtype=torch.float64).layers[0]}


def shards(lab, world: int) -> dict:
    """Every rank wraps the same modules; rank 0 brings back what each rank kept."""
    mine, cases = {}, _shard_cases()
    want = {name: (_flat(m, world), sum(p.numel() for p in m.parameters())) for name, m in cases.items()}
    for name, module in cases.items():
        try:
            unit = lab.ShardedUnit(module)
        except RuntimeError as error:
            mine[name] = {"error": _caught(error, lab)}
            continue
        shard = getattr(unit, "shard", None)
        mine[name] = {"shard": shard.detach().clone() if isinstance(shard, torch.Tensor) else None,
                      "parameters": [n for n, _ in unit.named_parameters()]}
    return {"ranks": _everyone(mine), "want": want}


def _shard_error(got: dict, flat: torch.Tensor, p: int, rank: int, world: int) -> tuple[str, str] | None:
    """What is wrong with rank `rank`'s shard of `flat` (P values, then zeros): (detail, hint)."""
    s, shard = len(flat) // world, got.get("shard")
    if "error" in got:
        return f"ShardedUnit raised {got['error']}", ""
    if got["parameters"] != ["shard"]:
        return (f"the unit's parameters are {got['parameters'][:3]}, not ['shard']", "self.shard = "
                "nn.Parameter(...), and delete the module's own (del m._parameters[name]): nothing else")
    if shard.shape != (s,):
        hint = PAD_HINT if shard.numel() in (p // world, p - (world - 1) * s) else "a 1-D shard, ⌈P/N⌉ long"
        return f"shard of shape {list(shard.shape)}, expected [{s}] = [⌈P/N⌉] (P = {p:,})", hint
    if torch.equal(shard, flat[rank * s : (rank + 1) * s]):
        return None
    for other in range(world):
        if torch.equal(shard, flat[other * s : (other + 1) * s]):
            return (f"holds rank {other}'s slice flat[{other * s}:{(other + 1) * s}], not rank {rank}'s",
                    "rank r keeps flat[r·S : (r+1)·S]: the offset is rank · S")
    wrong = int((shard != flat[rank * s : (rank + 1) * s]).sum())
    return (f"{wrong} of its {s} values differ from flat[{rank * s}:{(rank + 1) * s}] (P = {p:,})",
            "flatten the parameters in module.parameters() order, concatenate, pad with zeros to N·S")


def check_shards(runs) -> tuple[bool, str, str]:
    failures, cases = [], []  # (world, P, detail, hint); every (world, P)
    for config, got in runs:
        world = config["world"]
        for case, (flat, p) in got["want"].items():
            cases.append((world, p))
            for rank, theirs in enumerate(got["ranks"]):
                if (error := _shard_error(theirs[case], flat, p, rank, world)) is not None:
                    failures.append((world, p, f"world {world}, rank {rank}, {case}: {error[0]}", error[1]))
                    break
    if not failures:
        sizes = ", ".join(f"{c} (P = {p:,})" for c, (_, p) in runs[0][1]["want"].items())
        return True, f"{sizes} at world 2 and 3: every rank keeps its slice", ""
    _, _, detail, hint = failures[0]
    if all(p % w for w, p, *_ in failures) and any(p % w == 0 for w, p in cases):
        hint = PAD_HINT
    return False, detail, hint


# --- 2. gathered only while the unit computes ------------------------------------------------

LIFE = {  # moment: (gathered?, hint when it is not so)
    "after construction": (False, "free full at the end of __init__: between steps a rank keeps its shard"),
    "inside forward": (True, "forward gathers first: allocate full's storage, all-gather every shard into "
                             "it, then point the module's weights at views of full"),
    "after forward": (False, "free full once self.module(...) has returned: autograd keeps the views, and "
                             "backward gathers into the same storage again"),
    "inside backward": (True, "gather again in the pre-backward hook (a hook on the forward's output): the "
                              "forward freed the storage that backward's saved views point at"),
    "after backward": (False, "free full again once its gradient is reduce-scattered (post-backward hook)"),
}


def life(lab, world: int) -> list[dict]:
    """One forward and backward of one unit (a tiny block): when does full hold memory?"""
    block = build_model(CFG, dtype=torch.float64).layers[0]
    want, seen = _flat(block, 1), {}
    unit = lab.ShardedUnit(block)

    def look(moment: str) -> None:
        full = getattr(unit, "full", None)
        size = full.untyped_storage().size() if isinstance(full, torch.Tensor) else 0
        right = size > 0 and full.numel() >= len(want) and torch.equal(full.detach()[: len(want)], want)
        seen[moment] = {"bytes": size, "values": right}

    look("after construction")
    block.register_forward_pre_hook(lambda *_: look("inside forward"))
    _guard(unit, "the block")
    block.feed_forward.w1.register_forward_hook(  # its backward needs the weights gathered
        lambda m, i, out: [out.register_hook(lambda grad: look("inside backward")), None][1])
    x = torch.randn(2, SEQ, CFG.dim, dtype=torch.float64, generator=torch.Generator().manual_seed(0),
                    requires_grad=True)
    try:
        out = unit(x, *rope_cos_sin(CFG, torch.arange(SEQ), torch.float64))
        look("after forward")
        out.pow(2).sum().backward()
        look("after backward")
    except RuntimeError as error:
        seen["error"] = _caught(error, lab)
    return _everyone(seen)


def check_life(runs) -> tuple[bool, str, str]:
    for config, everyone in runs:
        for rank, seen in enumerate(everyone):
            where = f"world {config['world']}, rank {rank}"
            if "error" in seen:
                phase = "backward" if "after forward" in seen else "forward"
                return False, f"{where}: {phase} raised {seen['error']}", _freed_hint(seen["error"], phase)
            for moment, (gathered, hint) in LIFE.items():
                state = seen.get(moment, {"bytes": 0, "values": False})
                if gathered and not state["values"]:
                    what = "not the unit's flat parameters" if state["bytes"] else "freed (0 bytes)"
                    return False, f"{where}: {moment}, full is {what}", hint
                if not gathered and state["bytes"]:
                    return False, f"{where}: {moment}, full still holds {state['bytes']:,} bytes", hint
    return True, "full holds memory inside forward and inside backward only (every rank, world 2 and 3)", ""


# --- 3. training equals one device -------------------------------------------------------------

COLLECTIVES = {"all_gather_single": "gather", "all_gather_into_tensor": "gather", "all_reduce": "all_reduce",
               "reduce_scatter_single": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter"}


def _count_collectives(events: list):
    """Wrap dist's collectives (a context manager): each outermost call appends (kind, numel in,
    numel out, op)."""
    depth = [0]  # the old names call the new ones: count a call once

    def counted(kind, fn):
        def call(*args, **kwargs):
            if depth[0] == 0:
                tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
                op = kwargs.get("op", args[2] if kind == "reduce_scatter" and len(args) > 2 else "SUM")
                events.append((kind, tensors[-1].numel(), tensors[0].numel(), str(op).split(".")[-1]))
            depth[0] += 1
            try:
                return fn(*args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    return patch_dist({name: partial(counted, kind) for name, kind in COLLECTIVES.items()}, also=(c10d,))


def train(lab, world: int, steps: int = 1, optimizer: str = "sgd") -> dict:
    """Every rank: the tiny LLaMA with each of UNITS a ShardedUnit, on its slice of each global
    batch; rank 0 brings back every rank's gradient and parameter shards and collectives."""
    rank, model = dist.get_rank(), build_model(CFG, seed=0, dtype=torch.float64)
    units = {name: lab.ShardedUnit(model.get_submodule(name)) for name in UNITS}
    for name, unit in units.items():
        parent, _, attr = name.rpartition(".")
        setattr(model.get_submodule(parent), attr, unit)
        _guard(unit, name)
    opt = make_optimizer(model.parameters(), optimizer, LR)
    data, out = SyntheticTokens(CFG.vocab_size, SEQ, seed=0), {"grads": [], "events": [], "error": None}

    def shards(grad: bool) -> dict[str, torch.Tensor | None]:
        return {n: None if (t := u.shard.grad if grad else u.shard) is None else t.detach().clone()
                for n, u in units.items()}

    for step in range(steps):
        events, phase = [], "forward"
        try:
            with _count_collectives(events):
                (tokens,) = local_micro_batches(data.global_batch(step, BATCH), rank, world, BATCH // world)
                inputs, targets = split_inputs_targets(tokens)
                loss = loss_fn(model(inputs), targets)
                events.append(("end of forward",))
                phase = "backward"
                loss.backward()
        except RuntimeError as error:
            out["error"] = (step, phase, _caught(error, lab))
            break
        out["grads"].append(_everyone(shards(grad=True)))
        out["events"].append(_everyone(events))
        opt.step()
        opt.zero_grad(set_to_none=True)
    out["params"] = _everyone(shards(grad=False))
    return out if rank == 0 else {}


def _layout() -> dict[str, list[tuple[str, torch.Size]]]:
    """Each unit's original parameters (full names, shapes) in flat order."""
    model = build_model(CFG, dtype=torch.float64, device="meta")
    return {u: [(f"{u}.{n}", p.shape) for n, p in model.get_submodule(u).named_parameters()] for u in UNITS}


def _unshard(pieces_by_rank: list[dict], world: int) -> tuple[dict[str, torch.Tensor], dict, str]:
    """The ranks' shards of each unit concatenated and cut into the original tensors; also
    (where each tensor starts in its unit's flat, S), to name the rank whose shard is wrong."""
    tensors, starts = {}, {}
    for unit, params in _layout().items():
        pieces = [p[unit] for p in pieces_by_rank]
        if True in (missing := [p is None for p in pieces]):
            return {}, {}, f"rank {missing.index(True)}: the shard.grad of {unit} is None after backward"
        s, flat, offset = pieces[0].numel(), torch.cat(pieces), 0
        if {p.shape for p in pieces} != {(s,)} or s * world < sum(shape.numel() for _, shape in params):
            return {}, {}, f"{unit}: the ranks' shards have shapes {[list(p.shape) for p in pieces]}"
        for name, shape in params:
            tensors[name], starts[name] = flat[offset : offset + shape.numel()].view(shape), (offset, s)
            offset += shape.numel()
    return tensors, starts, ""


def _compare(got: dict, want: dict, steps: int, world: int) -> tuple[str, str] | None:
    """(detail, hint) of the first difference from one device, or None."""
    if got["error"] is not None:
        step, phase, error = got["error"]
        return f"step {step + 1}, world {world}, rank 0: {phase} raised {error}", _freed_hint(error, phase)
    failing = []
    for s in range(steps):
        grads, starts, problem = _unshard(got["grads"][s], world)
        if problem:
            return f"step {s + 1}, world {world}, {problem}", \
                "the post-backward hook reduce-scatters full.grad into self.shard.grad (S elements)"
        if finding := first_difference(grads, want["grads"][s], TOLERANCE):
            failing.append((s, finding, grads, starts))
    if failing:
        s, finding, grads, starts = failing[0]
        name, whose = finding.name, ""
        if name in starts and grads[name].shape == want["grads"][s][name].shape:
            offset, size = starts[name]
            worst = int((grads[name] - want["grads"][s][name]).abs().reshape(-1).argmax())
            whose = f"; the largest difference is in rank {(offset + worst) // size}'s shard"
        return f"step {s + 1}, world {world}: grad of {finding}{whose}", \
            steps_pattern([f[0] for f in failing], steps) or explain(finding, world)
    params, _, _ = _unshard(got["params"], world)
    if finding := first_difference(params, want["params"], TOLERANCE):
        return f"after {steps} steps, world {world}: parameter {finding}", \
            "the gradients were right: does the optimizer get the shards (model.parameters()), stepped once?"
    return None


def check_equal(runs) -> tuple[bool, str, str]:
    """Every run's gradients (each step) and final parameters against one device."""
    failing, passing, first = [], [], None
    for config, got in runs:
        steps, world = config.get("steps", 1), config["world"]
        trainer = make_reference(CFG, 0, torch.float64, config.get("optimizer", "sgd"), LR)
        data = SyntheticTokens(CFG.vocab_size, SEQ, seed=0)
        want = {"grads": [trainer.step(data.global_batch(step, BATCH))[1] for step in range(steps)],
                "params": trainer.parameters()}
        verdict = _compare(got, want, steps, world)
        (failing if verdict else passing).append(world)
        first = first or verdict
    if first is None:
        return True, f"every gradient and parameter within {TOLERANCE:g} at world {passing}", ""
    sizes = [sum(shape.numel() for _, shape in params) for params in _layout().values()]
    divides = {w: all(p % w == 0 for p in sizes) for w in failing + passing}
    pattern = passing and not any(divides[w] for w in failing) and all(divides[w] for w in passing)
    return False, first[0], PAD_HINT if pattern else first[1]


# --- 4. the collectives of a step --------------------------------------------------------------

def check_collectives(runs) -> tuple[bool, str, str]:
    """Per step and rank: one all-gather per unit in forward, one per unit in backward, one SUM
    reduce-scatter per unit in backward, nothing else."""
    (config, got), n = runs[0], len(UNITS)
    world = config["world"]
    if got["error"] is not None:
        return False, *_compare(got, {}, 0, world)
    padded = sorted(p + (-p % world) for p in (sum(s.numel() for _, s in ps) for ps in _layout().values()))
    for step, everyone in enumerate(got["events"]):
        for rank, events in enumerate(everyone):
            cut = events.index(("end of forward",))
            forward, backward = events[:cut], events[cut + 1 :]
            fwd, bwd = ([e[2] for e in phase if e[0] == "gather"] for phase in (forward, backward))
            rs = [(e[1], e[3]) for e in backward if e[0] == "reduce_scatter"]
            ar = [e for e in events if e[0] == "all_reduce"]
            for wrong, detail, hint in [
                (ar and not rs, f"{len(ar)} all-reduces and no reduce-scatter",
                 "reduce-scatter full.grad: a rank needs its shard's sum only (all-reduce sends twice that)"),
                (sorted(fwd) != padded, f"{len(fwd)} all-gathers in forward for {n} units",
                 "gather each unit once in its forward, into all N·S elements of full"),
                (sorted(bwd) != padded, f"{len(bwd)} all-gathers in backward for {n} units",
                 "forward frees the unit, so its backward gathers it again, once (the pre-backward hook)"),
                (sorted(i for i, _ in rs) != padded, f"{len(rs)} reduce-scatters in backward for {n} units",
                 "one reduce-scatter per unit per backward, when its gradient is whole (post-backward hook)"),
                (any(op != "SUM" for _, op in rs), f"reduce-scatter with ReduceOp.{rs[0][1] if rs else ''}",
                 "reduce with ReduceOp.SUM, then divide by N: gloo on torch 2.5-2.8 returns the SUM for AVG"),
                (ar, f"{len(ar)} all-reduces besides the reduce-scatters", "a unit needs no all-reduce"),
            ]:
                if wrong:
                    return False, f"step {step + 1}, world {world}, rank {rank}: {detail}", hint
    return True, f"per step and rank: {n} all-gathers in forward, {n} in backward, " \
                 f"{n} SUM reduce-scatters", ""


PROPERTIES = [
    Property("the shard: each rank keeps its 1/N of the flat, padded parameters",
             [{"world": 2}, {"world": 3}], shards, check_shards),
    Property("full parameters hold memory only inside forward and backward",
             [{"world": 2}, {"world": 3}], life, check_life),
    Property("one SGD step equals one device (2 and 3 ranks)",
             [{"world": 2}, {"world": 3}], train, check_equal),
    Property("three AdamW steps equal one device (2 and 3 ranks)",
             [{"world": w, "steps": 3, "optimizer": "adamw"} for w in (2, 3)], train, check_equal),
    Property("a step posts 2 all-gathers and 1 reduce-scatter per unit",
             [{"world": 2, "steps": 2}], train, check_collectives),
]
