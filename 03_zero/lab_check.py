"""Lab 03's properties: what `make lab-check N=3` runs on your lab.py (common/grader.py runs them).

A small LLaMA in float64 (Ψ = 43,168 parameters: 3 ranks need one element of padding) is trained
with your Zero2 on 2 and 3 ranks, each rank on its slice of the global batch, and compared with
the same training on one device (common/reference.py): the gradient gathered from every rank's
shard after `reduce_scatter_gradients`, the norm and the clipped gradient, and every rank's
parameters after each step, at 1e-10. Then what ZeRO-2 is for: each rank's master copy and
optimizer state hold its slice only, and a step moves the flat buffer once each way.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.distributed as dist

from common.data import SyntheticTokens, local_micro_batches, split_inputs_targets
from common.diagnosis import explain, first_difference, steps_pattern
from common.grader import Property
from common.model import build_model, get_config, loss_fn
from common.patch import patch_dist
from common.reference import make_reference

TITLE = "the ZeRO-2 step"
CFG = get_config("tiny", n_layers=2)
BATCH, SEQ, LR, MAX_NORM = 6, 8, 1e-2, 0.5  # the gradient's norm is ~1.2: 0.5 clips every step
TOLERANCE = 1e-10
COLLECTIVES = ("all_reduce", "reduce_scatter_single", "reduce_scatter_tensor", "reduce_scatter",
               "all_gather_single", "all_gather_into_tensor", "all_gather", "broadcast", "reduce",
               "all_to_all_single", "send", "recv", "isend", "irecv")


def _layout() -> tuple[list[str], list[torch.Size]]:
    model = build_model(CFG, dtype=torch.float64, device="meta")
    return [n for n, _ in model.named_parameters()], [p.shape for p in model.parameters()]


NAMES, SHAPES = _layout()
NUMEL = sum(shape.numel() for shape in SHAPES)
OFFSETS = {name: sum(shape.numel() for shape in SHAPES[:i]) for i, name in enumerate(NAMES)}
LENGTHS, WORLDS = (NUMEL, 12, 13, 10, 1), (2, 3, 4, 7)  # owner_slice is asked for every rank of each


def shard_size(world: int) -> int:
    return -(-NUMEL // world)


# --- what runs on every rank ---------------------------------------------------------------------

@contextmanager
def counted_collectives() -> Iterator[list[tuple[str, int]]]:
    """Every collective posted through torch.distributed inside, as (name, elements of its largest
    tensor argument): the flat buffer for a reduce-scatter (its input) or an all-gather (its output)."""
    ops: list[tuple[str, int]] = []

    def wrap(name, fn):
        def call(*args, **kwargs):
            sizes = [sum(t.numel() for t in a) if isinstance(a, (list, tuple)) else a.numel()
                     for a in [*args, *kwargs.values()]
                     if torch.is_tensor(a) or (isinstance(a, (list, tuple)) and a and torch.is_tensor(a[0]))]
            ops.append((name, max(sizes, default=0)))
            return fn(*args, **kwargs)
        return call

    with patch_dist({name: partial(wrap, name) for name in COLLECTIVES}):
        yield ops


def _grad(zero) -> torch.Tensor | None:
    return None if zero.master.grad is None else zero.master.grad.detach().clone()


def train(lab, world: int, steps: int = 1, optimizer: str = "adamw", clip: float | None = None) -> list[dict]:
    """Every rank: the model under your Zero2, its slice of each global batch; what each rank saw,
    gathered to every rank (rank 0's copy goes to the check)."""
    rank = dist.get_rank()
    model = build_model(CFG, seed=0, dtype=torch.float64)
    if optimizer == "adamw":
        zero = lab.Zero2(model.parameters(), torch.optim.AdamW, lr=LR, weight_decay=0.1, foreach=False)
    else:
        zero = lab.Zero2(model.parameters(), torch.optim.SGD, lr=LR, foreach=False)
    data = SyntheticTokens(CFG.vocab_size, SEQ, seed=0)
    out: dict = {"master0": zero.master.detach().clone(), "grads": [], "norms": [], "clipped": [],
                 "params": [], "kept": [], "ops": []}
    for step in range(steps):
        (tokens,) = local_micro_batches(data.global_batch(step, BATCH), rank, world, BATCH // world)
        inputs, targets = split_inputs_targets(tokens)
        loss_fn(model(inputs), targets).backward()
        with counted_collectives() as reduce_ops:
            zero.reduce_scatter_gradients()
        out["kept"].append([n for n, p in model.named_parameters() if p.grad is not None])
        out["grads"].append(_grad(zero))
        if clip is not None:
            out["norms"].append(float(zero.clip_grad_norm_(clip)))
            out["clipped"].append(_grad(zero))
        with counted_collectives() as step_ops:
            zero.step()
        out["ops"].append((reduce_ops, step_ops))
        out["params"].append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone())
        zero.zero_grad()
    state = [t for s in zero.optim.state.values() for t in s.values() if torch.is_tensor(t) and t.dim() > 0]
    out["state"] = [t.numel() for t in state]
    out["stepped"] = sum(p.numel() for g in zero.optim.param_groups for p in g["params"])
    out["master"] = zero.master.detach().clone()
    out["master_storage"] = zero.master.untyped_storage().nbytes() // zero.master.element_size()
    gathered: list = [None] * world
    dist.all_gather_object(gathered, out)
    return gathered


def owner_slices(lab, world: int) -> dict[tuple[int, int, int], tuple[int, int]]:
    """owner_slice for every rank of a few layouts (a pure function: one process asks for all)."""
    return {(n, w, r): tuple(lab.owner_slice(n, w, r)) for n in LENGTHS for w in WORLDS for r in range(w)}


# --- the checks, in the grader's process ---------------------------------------------------------

def _initial() -> torch.Tensor:
    model = build_model(CFG, seed=0, dtype=torch.float64)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _padded(flat: torch.Tensor, world: int) -> torch.Tensor:
    return torch.cat([flat, flat.new_zeros(shard_size(world) * world - NUMEL)])


def _split(flat: torch.Tensor) -> dict[str, torch.Tensor]:
    return {name: flat[OFFSETS[name] : OFFSETS[name] + shape.numel()].view(shape)
            for name, shape in zip(NAMES, SHAPES, strict=True)}


def _flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([tensors[n].reshape(-1) for n in NAMES])


def _worst_owner(name: str, got: torch.Tensor, want: torch.Tensor, world: int) -> int:
    """The rank whose slice holds the element of `name` that differs most."""
    worst = int((got[name].reshape(-1) - want[name].reshape(-1)).abs().argmax())
    return (OFFSETS[name] + worst) // shard_size(world)


def check_owner_slices(runs) -> tuple[bool, str, str]:
    """owner_slice for every rank of every layout against [r·s, (r+1)·s), s = ⌈n / N⌉."""
    got = runs[0][1]
    want = {(n, w, r): (r * -(-n // w), (r + 1) * -(-n // w)) for n, w, r in got}
    wrong = [case for case in got if got[case] != want[case]]
    if not wrong:
        worlds = ", ".join(map(str, WORLDS))
        return True, f"{len(got)} slices as expected (Ψ = {NUMEL:,} and small lengths; N = {worlds})", ""
    n, world, rank = wrong[0]
    s, (start, _) = -(-n // world), got[wrong[0]]
    detail = f"owner_slice({n}, {world}, {rank}) = {got[wrong[0]]}, expected {want[wrong[0]]}"
    if all(n % w for n, w, _ in wrong):
        hint = (f"right whenever N divides the length, wrong otherwise (here {n} on {world} ranks): padding. "
                "The buffer is padded up to a multiple of N, s = ⌈numel / N⌉ (not numel // N); the padding "
                "is the end of the last rank's slice")
    elif start - rank * s in (s, -s):
        other = rank + (start - rank * s) // s
        hint = f"shard offset off by one slice: that is rank {other}'s; rank r starts at r·s"
    else:
        hint = "rank r owns [r·s, (r+1)·s) with s = ⌈numel / N⌉: equal slices in rank order"
    return False, detail, hint


def _check_master(gathered: list[dict], world: int):
    """Each rank's master before the first step against its slice of the initial parameters."""
    s, full = shard_size(world), _padded(_initial(), world)
    for rank, out in enumerate(gathered):
        master, where = out["master0"], f"before step 1, world {world}, rank {rank}"
        if master.dtype != torch.float64:
            return f"{where}: a {master.dtype} master for a float64 model", \
                "the master copy is float32 at least, float64 for a float64 model: master_dtype"
        if master.numel() != s:
            whole = " (the whole model)" if master.numel() in (NUMEL, s * world) else ""
            return f"{where}: the master has {master.numel():,} elements{whole}, its slice " \
                   f"s = ⌈{NUMEL:,} / {world}⌉ = {s:,}", \
                "self.master is this rank's slice of the flattened parameters only: s elements"
        if not torch.equal(master, full[rank * s : (rank + 1) * s]):
            owners = [q for q in range(world) if torch.equal(master, full[q * s : (q + 1) * s])]
            return f"{where}: the master is not the parameters' slice [{rank * s:,}, {(rank + 1) * s:,})", \
                (f"shard offset off by one slice: rank {rank}'s master holds rank {owners[0]}'s values; "
                 "take the parameters' flat [start, end) of this rank" if owners else
                 "the master must be the initial parameters laid end to end, in the order given, at this "
                 "rank's [start, end)")
    return None


def reference(steps: int, optimizer: str, clip: float | None = None) -> dict:
    """One device: gradients before clipping, the norm torch's clip_grad_norm_ takes, the clipped
    gradients, and the flat parameters before the first step and after each."""
    trainer = make_reference(CFG, 0, torch.float64, optimizer, LR, clip_grad=clip)
    data = SyntheticTokens(CFG.vocab_size, SEQ, seed=0)
    out: dict = {"grads": [], "norms": [], "clipped": [], "params": [_initial()]}
    for step in range(steps):
        grads = trainer.step(data.global_batch(step, BATCH))[1]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        coef = torch.clamp((clip or 0.0) / (norm + 1e-6), max=1.0)
        out["grads"].append(grads)
        out["norms"].append(float(norm))
        out["clipped"].append({n: g * coef for n, g in grads.items()})
        out["params"].append(_flat(trainer.parameters()).clone())
    return out


def _gathered_grad(gathered: list[dict], key: str, step: int, world: int):
    """(the full gradient as {name: tensor} from every rank's shard, None) or (None, what is wrong)."""
    s, shards = shard_size(world), []
    for rank, out in enumerate(gathered):
        shard = out[key][step]
        if shard is None:
            return None, f"step {step + 1}, world {world}, rank {rank}: master.grad is None after " \
                         "reduce_scatter_gradients"
        if shard.numel() != s:
            return None, f"step {step + 1}, world {world}, rank {rank}: master.grad has " \
                         f"{shard.numel():,} elements, the slice s = {s:,}"
        shards.append(shard.double())
    return _split(torch.cat(shards)[:NUMEL]), None


def _check_grads(gathered, want: dict, key: str, step: int, world: int, what: str):
    got, problem = _gathered_grad(gathered, key, step, world)
    if problem:
        return problem, "self.master.grad: this rank's s elements of the averaged gradient"
    if finding := first_difference(got, want, TOLERANCE):
        name = finding.name.split(" ")[0]
        where = "" if finding.missing or name not in want else \
            f", worst in rank {_worst_owner(name, got, want, world)}'s shard"
        return f"step {step + 1}, world {world}: {what} of {finding}{where}", explain(finding, world)
    return None


def _check_params(gathered, want: dict, step: int, world: int):
    s = shard_size(world)
    after, before = want["params"][step + 1], want["params"][step]
    for rank, out in enumerate(gathered):
        got = out["params"][step]
        if finding := first_difference(_split(got), _split(after), TOLERANCE):
            stale = [q for q in range(world)
                     if torch.equal(got[q * s : (q + 1) * s], before[q * s : (q + 1) * s])
                     and not torch.equal(after[q * s : (q + 1) * s], before[q * s : (q + 1) * s])]
            detail = f"after step {step + 1}, world {world}, rank {rank}: parameter {finding}"
            if stale:
                return detail + f"; the slices of ranks {stale} kept their old values", \
                    ("parameters not updated: the all-gather sent stale values, or the master never "
                     "moved. Step the master first (the inner optimizer over self.master, with its .grad), "
                     "then all-gather it (cast to the parameters' dtype) and copy every slice into the "
                     "parameters")
            if step > 0:
                return detail, (f"right after step 1, wrong after step {step + 1}: what must last from step "
                                "to step does not: build the inner optimizer once (its m, v and step count "
                                "live in it) and step the same master, never rebuilt from the parameters")
            return detail, ("the gradients were right: does the inner optimizer step self.master with its "
                            ".grad, and is the all-gathered buffer copied back at each parameter's offset?")
    return None


def check_equal(runs) -> tuple[bool, str, str]:
    """Each step: the gradient gathered from the shards, then every rank's parameters."""
    for config, gathered in runs:
        world, steps = config["world"], config.get("steps", 1)
        want = reference(steps, config.get("optimizer", "adamw"))
        if problem := _check_master(gathered, world):
            return False, *problem
        for k in range(steps):  # the first thing that goes wrong: step k's gradients, then parameters
            if problem := _check_grads(gathered, want["grads"][k], "grads", k, world, "grad"):
                return False, problem[0], steps_pattern([k], steps) or problem[1]
            if problem := _check_params(gathered, want, k, world):
                return False, *problem
    worlds = sorted({c["world"] for c, _ in runs})
    return True, f"every gradient shard, every rank's parameters within {TOLERANCE:g} at world {worlds}", ""


def check_clipping(runs) -> tuple[bool, str, str]:
    """Each step: every rank's ‖g‖ against one device's, the clipped shards, the parameters."""
    for config, gathered in runs:
        world, steps, clip = config["world"], config.get("steps", 1), config["clip"]
        want = reference(steps, config.get("optimizer", "sgd"), clip)
        s = shard_size(world)
        if problem := _check_master(gathered, world):
            return False, *problem
        for k in range(steps):
            if problem := _check_grads(gathered, want["grads"][k], "grads", k, world, "grad"):
                return False, problem[0], "wrong before clipping: pass the properties above first"
            norms, norm = [out["norms"][k] for out in gathered], want["norms"][k]
            if any(abs(got - norm) > TOLERANCE * norm for got in norms):
                full = _padded(_flat(want["grads"][k]), world)
                local = [float(full[q * s : (q + 1) * s].norm()) for q in range(world)]
                diff = first_difference(_split(gathered[0]["params"][k]), _split(want["params"][k + 1]), 0.0)
                moved = f"; the parameters then differ by {diff.rel:.1g}" if diff else ""
                figures = ", ".join(f"rank {q} {got:.6g}" for q, got in enumerate(norms))
                detail = f"step {k + 1}, world {world}: ‖g‖ returned {figures}; one device {norm:.6g}{moved}"
                if all(abs(got - loc) <= 1e-9 * loc for got, loc in zip(norms, local, strict=True)):
                    coefs = ", ".join(f"×{min(1.0, clip / (x + 1e-6)):.3g}" for x in local)
                    hint = (f"clipping by the local shard's norm: each rank scaled its slice by its own "
                            f"coefficient ({coefs}; one device ×{min(1.0, clip / (norm + 1e-6)):.3g}). "
                            "All-reduce the sum of squares (SUM, one scalar) before the square root")
                elif all(abs(got - norm**2) <= 1e-9 * norm**2 for got in norms):
                    hint = "that is ‖g‖²: take the square root after the all-reduce"
                else:
                    hint = "‖g‖ = sqrt(Σ over ranks of Σ master.grad²), over the averaged shards"
                return False, detail, hint
            if problem := _check_grads(gathered, want["clipped"][k], "clipped", k, world, "clipped grad"):
                unclipped = _check_grads(gathered, want["grads"][k], "clipped", k, world, "grad") is None
                return False, problem[0], (
                    "the norm is right but the shard was not scaled: multiply master.grad by "
                    "min(1, max_norm / (‖g‖ + 1e-6))" if unclipped else
                    "the norm is right, the scaling is not: coef = min(1, max_norm / (‖g‖ + 1e-6)), "
                    "the same on every rank")
            if problem := _check_params(gathered, want, k, world):
                return False, *problem
    worlds = sorted({c["world"] for c, _ in runs})
    return True, f"‖g‖, the clipped shards, the parameters as torch's clip_grad_norm_ at world {worlds}", ""


def _names_of(ops: list[tuple[str, int]]) -> str:
    return ", ".join(f"{name}({n:,})" for name, n in ops) or "nothing"


def check_memory_and_comm(runs) -> tuple[bool, str, str]:
    """Per rank: no full gradient kept, a master and an optimizer state of s elements, and per step
    one reduce-scatter and one all-gather of the padded flat buffer, nothing else."""
    for config, gathered in runs:
        world = config["world"]
        s = shard_size(world)
        padded = s * world
        for rank, out in enumerate(gathered):
            where = f"world {world}, rank {rank}"
            if out["kept"][0]:
                return False, f"{where}: {len(out['kept'][0])} full gradients kept after " \
                              f"reduce_scatter_gradients ({out['kept'][0][0]}, …)", \
                    "ZeRO-2 keeps only the reduced shard: set p.grad = None once the flat buffer is built"
            if out["master_storage"] != s:
                return False, f"{where}: the master lives in a storage of {out['master_storage']:,} " \
                              f"elements, its slice is s = {s:,}", \
                    "a whole-model master copy on every rank (memory not 1/N): keep a tensor of its own " \
                    "of s elements (clone the slice), not a view of a full copy"
            state = sum(out["state"])
            if out["stepped"] != s or any(n != s for n in out["state"]):
                return False, f"{where}: the inner optimizer steps {out['stepped']:,} elements and its " \
                              f"state holds {state:,} ({len(out['state'])} tensors); 1/N is s = {s:,} " \
                              f"per state tensor, of Ψ = {NUMEL:,}", \
                    "optimizer state for the whole model (memory not 1/N): give the inner optimizer " \
                    "[self.master] only, this rank's s elements"
            for k, (reduce_ops, step_ops) in enumerate(out["ops"]):
                detail = (f"{where}, step {k + 1}: reduce_scatter_gradients posted {_names_of(reduce_ops)}; "
                          f"step posted {_names_of(step_ops)}")
                scatters = [n for name, n in reduce_ops if name.startswith("reduce_scatter")]
                gathers = [n for name, n in step_ops if name.startswith("all_gather")]
                if any(name == "all_reduce" for name, _ in reduce_ops):
                    return False, detail, ("an all-reduce leaves the whole gradient on every rank (that is "
                                           "DDP): reduce-scatter the flat buffer, so each rank receives "
                                           "its own slice only")
                if scatters != [padded] or len(reduce_ops) != 1:
                    return False, detail, (f"one reduce-scatter of the whole padded flat buffer ({padded:,} "
                                           "elements), not one per parameter and nothing else")
                if gathers != [padded] or len(step_ops) != 1:
                    return False, detail, (f"one all-gather of the padded flat buffer ({padded:,} elements) "
                                           "after the inner step, nothing else")
    return True, f"per rank: master and state of s elements, 1 reduce-scatter + 1 all-gather of " \
                 f"{padded:,} elements per step (world {world})", ""


PROPERTIES = [
    Property("the owner's slice [r·s, (r+1)·s) of the padded buffer", [{"world": 1}], owner_slices,
             check_owner_slices),
    Property("one and three AdamW steps equal one device (2, 3 ranks)",
             [{"world": 2}, {"world": 3, "steps": 3}], train, check_equal),
    Property("clipping by the global norm (SGD, 2, 3 ranks)",
             [{"world": 2, "steps": 2, "optimizer": "sgd", "clip": MAX_NORM},
              {"world": 3, "steps": 2, "optimizer": "sgd", "clip": MAX_NORM}], train, check_clipping),
    Property("memory 1/N, a reduce-scatter + an all-gather (3 ranks)",
             [{"world": 3, "steps": 2}], train, check_memory_and_comm),
]
