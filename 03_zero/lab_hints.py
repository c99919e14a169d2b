"""What a wrong shard of lab 03 usually means (its checks call these; lab_check.py says what runs).

The model's Ψ parameters laid end to end (`flat`, `unflat`), padded to N·s (`padded`), cut into
the ranks' slices: each diagnosis rebuilds what one device has in each rank's slice and names the
rule a wrong one broke (the offset, the padding, the 1/N, the global norm, the order of step and
all-gather).
"""

from __future__ import annotations

import torch

from common.kernel.model import build_model, get_config
from common.labs.diagnosis import explain, first_difference, near

CFG = get_config("tiny", n_layers=2)
_META = build_model(CFG, dtype=torch.float64, device="meta")
NAMES = [n for n, _ in _META.named_parameters()]
SHAPES = [p.shape for p in _META.parameters()]
NUMEL = sum(shape.numel() for shape in SHAPES)
OFFSETS = {name: sum(shape.numel() for shape in SHAPES[:i]) for i, name in enumerate(NAMES)}


def shard_size(world: int) -> int:
    return -(-NUMEL // world)


def flat(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    return torch.cat([tensors[n].reshape(-1) for n in NAMES])


def padded(tensor: torch.Tensor, world: int) -> torch.Tensor:
    return torch.cat([tensor, tensor.new_zeros(shard_size(world) * world - NUMEL)])


def unflat(tensor: torch.Tensor) -> dict[str, torch.Tensor]:
    return {name: tensor[OFFSETS[name] : OFFSETS[name] + shape.numel()].view(shape)
            for name, shape in zip(NAMES, SHAPES, strict=True)}


def owner_hint(wrong: list[tuple[int, int, int]], got: dict) -> str:
    n, world, rank = wrong[0]
    s, (start, _) = -(-n // world), got[wrong[0]]
    if all(n % w for n, w, _ in wrong):
        return (f"right whenever N divides the length, wrong otherwise (here {n} on {world} ranks): padding. "
                "The buffer is padded up to a multiple of N, s = ⌈numel / N⌉ (not numel // N); the padding "
                "is the end of the last rank's slice")
    if start - rank * s in (s, -s):
        other = rank + (start - rank * s) // s
        return f"shard offset off by one slice: that is rank {other}'s; rank r starts at r·s"
    return "rank r owns [r·s, (r+1)·s) with s = ⌈numel / N⌉: equal slices in rank order"


def master_error(masters: list[torch.Tensor | None], size: int, label: str) -> tuple[str, str] | None:
    """Each rank's master before the first step against its slice of the initial parameters."""
    s = shard_size(size)
    model = build_model(CFG, seed=0, dtype=torch.float64)
    full = padded(flat({n: p.detach() for n, p in model.named_parameters()}), size)
    for rank, master in enumerate(masters):
        where = f"before step 1, {label}, rank {rank} of its group of {size}"
        if master is None:
            return f"{where}: no master", "self.master: this rank's slice of the flattened parameters"
        if master.dtype != torch.float64:
            return f"{where}: a {master.dtype} master for a float64 model", \
                "the master copy is float32 at least, float64 for a float64 model: master_dtype"
        if master.numel() != s:
            whole = " (the whole model)" if master.numel() in (NUMEL, s * size) else ""
            return f"{where}: the master has {master.numel():,} elements{whole}, its slice s = " \
                   f"⌈{NUMEL:,} / {size}⌉ = {s:,}", "self.master is this rank's slice of the flattened " \
                                                   "parameters only: s elements"
        if not torch.equal(master, full[rank * s : (rank + 1) * s]):
            owners = [q for q in range(size) if torch.equal(master, full[q * s : (q + 1) * s])]
            return f"{where}: the master is not the parameters' slice [{rank * s:,}, {(rank + 1) * s:,})", \
                (f"shard offset off by one slice: rank {rank}'s master holds rank {owners[0]}'s values; take "
                 "the parameters' flat [start, end) of this rank (dist.get_rank(group))" if owners else
                 "the master must be the initial parameters laid end to end, in the order given, at this "
                 "rank's [start, end)")
    return None


def explain_grads(shards: list[torch.Tensor | None], want: dict, size: int, label: str,
                  k: int) -> tuple[str, str] | None:
    """The group's shards joined, against one device's gradient `want` at step k + 1."""
    s = shard_size(size)
    for rank, shard in enumerate(shards):
        where = f"step {k + 1}, {label}, rank {rank} of its group of {size}"
        if shard is None:
            return f"{where}: master.grad is None after reduce_scatter_gradients", \
                "self.master.grad: this rank's s elements of the averaged gradient"
        if shard.numel() != s:
            return f"{where}: master.grad has {shard.numel():,} elements, the slice s = {s:,}", \
                "self.master.grad: this rank's s elements of the averaged gradient"
    got = unflat(torch.cat([shard.double() for shard in shards])[:NUMEL])
    if (finding := first_difference(got, want)) is None:
        return None
    worst = int((got[finding.name] - want[finding.name]).abs().reshape(-1).argmax())
    owner = (OFFSETS[finding.name] + worst) // s
    return f"step {k + 1}, {label}: grad of {finding}, worst in rank {owner}'s shard", explain(finding, size)


def explain_params(got: torch.Tensor, params: list[dict], k: int, size: int,
                   where: str) -> tuple[str, str] | None:
    """A rank's flat parameters after step k + 1 against one device's (params[k + 1])."""
    s, after, before = shard_size(size), flat(params[k + 1]), flat(params[k])
    if (finding := first_difference(unflat(got), unflat(after))) is None:
        return None
    detail = f"after step {k + 1}, {where}: parameter {finding}"
    stale = [q for q in range(size) if torch.equal(got[q * s : (q + 1) * s], before[q * s : (q + 1) * s])
             and not torch.equal(after[q * s : (q + 1) * s], before[q * s : (q + 1) * s])]
    if stale:
        return detail + f"; the slices of ranks {stale} kept their old values", \
            ("parameters not updated: the all-gather sent stale values, or the master never moved. Step the "
             "master first (the inner optimizer over self.master, with its .grad), then all-gather it (cast "
             "to the parameters' dtype) and copy every slice into the parameters")
    if k > 0:
        return detail, (f"right after step 1, wrong after step {k + 1}: what must last from step to step "
                        "does not: build the inner optimizer once (its m, v and step count live in it) and "
                        "step the same master, never rebuilt from the parameters")
    return detail, ("the gradients were right: does the inner optimizer step self.master with its .grad, and "
                    "is the all-gathered buffer copied back at each parameter's offset?")


def explain_norm(outs: list[dict], want, k: int, size: int, clip: float, label: str,
                 groups: list[int] | None) -> tuple[str, str] | None:
    """Every rank's returned ‖g‖ at step k + 1 against one device's, and what a wrong one is."""
    norms, norm = [out["norms"][k] for out in outs], want.norms[k]
    if all(abs(got - norm) <= 1e-10 * norm for got in norms):
        return None
    s, coef = shard_size(size), min(1.0, clip / (norm + 1e-6))
    full = padded(flat(want.grads[k]), size)
    local = [float(full[q * s : (q + 1) * s].norm()) for q in range(size)]
    figures = ", ".join(f"rank {q} {got:.6g}" for q, got in enumerate(norms))
    detail = f"step {k + 1}, {label}: ‖g‖ returned {figures}; one device {norm:.6g}"
    if size > 1 and all(near(got, x, 1e-9) for got, x in zip(norms, local, strict=True)):
        coefs = ", ".join(f"×{min(1.0, clip / (x + 1e-6)):.3g}" for x in local)
        return detail, (f"clipping by the local shard's norm: each rank scaled its slice by its own "
                        f"coefficient ({coefs}; one device ×{coef:.3g}). All-reduce the sum of squares (SUM, "
                        "one scalar) before the square root")
    if all(near(got, norm**2, 1e-9) for got in norms):
        return detail, "that is ‖g‖²: take the square root after the all-reduce"
    if coef < 1 and all(near(got, norm * coef, 1e-6) for got in norms):
        return detail, ("that is the norm after clipping: return ‖g‖ before scaling, as torch's "
                        "clip_grad_norm_ returns the total norm of the original gradients")
    if groups and all(near(got, norm * len(groups) ** 0.5, 1e-9) for got in norms):
        return detail, (f"summed over the whole world, not over your group: the {len(groups)} groups' "
                        "squares added up; all-reduce with group=")
    return detail, "‖g‖ = sqrt(Σ over ranks of Σ master.grad²), over the averaged shards"
