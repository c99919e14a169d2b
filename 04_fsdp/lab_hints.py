"""What a wrong shard of lab 04 usually means, and the guards that turn a freed parameter into an
error (its checks call these; lab_check.py says what runs).

`shard_error` names what is wrong with one rank's shard of a unit's flat, padded parameters (the
offset, the padding, the parameters kept); `LIFE` says when `full` must hold memory and what it
usually means when it does not; `guard` raises where computing with a freed `full` would read
freed memory; `unshard` joins the ranks' gradient shards back into the original tensors.
"""

from __future__ import annotations

import torch
from torch import nn

from common.kernel.model import build_model, get_config

CFG = get_config("tiny", n_layers=2)
UNITS = ("tok_embeddings", "layers.0", "layers.1", "norm", "output")  # forward order
FREED = "storage of size 0"  # torch's words for computing with a freed tensor
PAD_HINT = ("right where N divides the unit's size P, wrong where it does not: pad the flat with zeros "
            "to N·S, S = ⌈P/N⌉, so that every rank keeps S elements; cut the views from full[:P]")
ERROR_HINTS = [
    (("must match the existing size",), "a buffer shorter than what is copied into it: is the padded flat "
                                        "N·S ≥ P? S = ⌈P/N⌉ (pad with zeros), not ⌊P/N⌋"),
    (("gather) was about",), "allocate full's storage (untyped_storage().resize_(bytes)) before gathering"),
    (("backward was about to compute with",),
     "backward computed with freed parameters: gather again in the pre-backward hook (a hook registered on "
     "the forward's output)"),
    (("forward was about to compute with",),
     "the forward computed with freed parameters: gather before self.module(...), free after it"),
]


def flat(module: nn.Module, world: int) -> torch.Tensor:
    """module's parameters flattened in module.parameters() order, zero-padded to N·⌈P/N⌉."""
    flat = torch.cat([p.detach().reshape(-1) for p in module.parameters()])
    return torch.cat([flat, flat.new_zeros(-len(flat) % world)])


def guard(unit: nn.Module, name: str) -> None:
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


def shard_error(got: dict, flat: torch.Tensor, p: int, rank: int, world: int) -> tuple[str, str] | None:
    s, shard = len(flat) // world, got["shard"]
    if got["parameters"] != ["shard"]:
        return (f"the unit's parameters are {got['parameters'][:3]}, not ['shard']", "self.shard = "
                "nn.Parameter(...), and delete the module's own (del m._parameters[name]): nothing else")
    if shard.shape != (s,):
        hint = PAD_HINT if shard.numel() in (p // world, p - (world - 1) * s) else "a 1-D shard, ⌈P/N⌉ long"
        return f"shard of shape {list(shard.shape)}, expected [{s}] = [⌈P/N⌉] (P = {p:,})", hint
    if torch.equal(shard, flat[rank * s : (rank + 1) * s]):
        if (storage := got.get("storage", 0)) > s * shard.element_size():
            return (f"the shard lives in a storage of {storage:,} bytes, its S = {s} elements take "
                    f"{s * shard.element_size():,}", "a view of the whole flat buffer (right values, no "
                    "memory saved): clone the slice, so the shard has a storage of its own of S elements")
        return None
    for other in range(world):
        if torch.equal(shard, flat[other * s : (other + 1) * s]):
            return (f"holds rank {other}'s slice flat[{other * s}:{(other + 1) * s}], not rank {rank}'s",
                    "rank r keeps flat[r·S : (r+1)·S]: the offset is rank · S")
    wrong = int((shard != flat[rank * s : (rank + 1) * s]).sum())
    return (f"{wrong} of its {s} values differ from flat[{rank * s}:{(rank + 1) * s}] (P = {p:,})",
            "flatten the parameters in module.parameters() order, concatenate, pad with zeros to N·S")


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


def layout() -> dict[str, list[tuple[str, torch.Size]]]:
    """Each unit's original parameters (full names, shapes) in flat order."""
    model = build_model(CFG, dtype=torch.float64, device="meta")
    return {u: [(f"{u}.{n}", p.shape) for n, p in model.get_submodule(u).named_parameters()] for u in UNITS}


def unshard(pieces_by_rank: list[dict], world: int) -> tuple[dict[str, torch.Tensor], dict, str]:
    """The ranks' shards of each unit concatenated and cut into the original tensors; also
    (where each tensor starts in its unit's flat, S), to name the rank whose shard is wrong."""
    tensors, starts = {}, {}
    for unit, params in layout().items():
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


