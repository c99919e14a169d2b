"""What a checkpoint must hold to resume *exactly*, beyond the weights, and how to collect it.

    weights     every parameter's slice (the fp32 master copy in mixed precision)
    optimizer   AdamW's exp_avg and exp_avg_sq, sliced like their parameter; its step count t
                (bias correction 1 − β^t: a lost t changes every later update); lr, betas, ...
    schedule    the LR scheduler's position (warm-up + cosine is a function of the step)
    data        where the data stream is: here batches are a pure function of (seed, step)
    RNG         torch's CPU (and CUDA) generator and Python's `random`, per rank (dropout,
                sampling; the course's model draws nothing after init, but a trainer people
                copy will)

A rank describes each parameter it holds as a `ParamSlice`: which elements of the local
parameter (a whole TP slice, or a range of an FSDP flat parameter) hold which region of the global
tensor. The same description slices every optimizer tensor of that parameter. Depends only on torch.
"""

from __future__ import annotations

import base64
import random
from dataclasses import dataclass

import torch

from .reshard import Region
from .save import Shard

OPTIM = "optim."


@dataclass(frozen=True)
class ParamSlice:
    """Elements [start, start + region.numel) of `param.view(-1)` hold `region` of the tensor
    named by its key. A whole TP slice: start 0 and region.box(...)."""

    param: torch.Tensor
    region: Region
    start: int = 0

    def of(self, tensor: torch.Tensor) -> Shard:
        """The same slice of `tensor` (the parameter, or an optimizer state of its shape)."""
        r = self.region
        local = tensor.detach().view(-1)[self.start : self.start + r.numel]
        if r.flat_start == 0 and r.numel == tensor.numel() and tuple(tensor.shape) == r.box_shape:
            return Shard(tensor.detach(), r.global_shape, r.offsets)
        return Shard(local, r.global_shape, r.offsets, r.box_shape, r.flat_start)


def model_shards(slices: dict[str, ParamSlice]) -> dict[str, Shard]:
    """{name: Shard} of the parameters."""
    return {name: s.of(s.param) for name, s in slices.items()}


def optimizer_shards(optimizer: torch.optim.Optimizer, slices: dict[str, ParamSlice]) -> dict[str, Shard]:
    """{"optim.<name>.<key>": Shard} of every optimizer state tensor: those shaped like the
    parameter take its slice; scalars (AdamW's `step`) are saved whole (replicated)."""
    out = {}
    for name, s in slices.items():
        for key, value in optimizer.state.get(s.param, {}).items():
            if not isinstance(value, torch.Tensor):
                continue
            if value.shape == s.param.shape:
                out[f"{OPTIM}{name}.{key}"] = s.of(value)
            elif value.dim() == 0:
                out[f"{OPTIM}{name}.{key}"] = Shard(value.detach(), (), ())
    return out


def init_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create the optimizer's lazily built state (so a load has tensors to fill) without changing
    any parameter: one step with zero gradients at lr = 0 (torch DCP does the same)."""
    if all(optimizer.state.get(p) for g in optimizer.param_groups for p in g["params"]):
        return
    lrs = [group["lr"] for group in optimizer.param_groups]
    no_grad = [p for g in optimizer.param_groups for p in g["params"] if p.grad is None]
    for p in no_grad:
        p.grad = torch.zeros_like(p)
    for group in optimizer.param_groups:
        group["lr"] = 0.0
    optimizer.step()
    for group, lr in zip(optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    for p in no_grad:
        p.grad = None


def param_groups_state(optimizer: torch.optim.Optimizer) -> list[dict]:
    """The hyperparameters of each param group (lr as the schedule last set it), as JSON."""
    return [{k: list(v) if isinstance(v, tuple) else v for k, v in g.items()
             if k != "params" and isinstance(v, (int, float, bool, str, tuple, type(None)))}
            for g in optimizer.param_groups]


def load_param_groups_state(optimizer: torch.optim.Optimizer, saved: list[dict]) -> None:
    if len(saved) != len(optimizer.param_groups):
        raise ValueError(f"the checkpoint has {len(saved)} param groups, the optimizer "
                         f"{len(optimizer.param_groups)}")
    for group, values in zip(optimizer.param_groups, saved, strict=True):
        for k, v in values.items():
            group[k] = tuple(v) if isinstance(group.get(k), tuple) else v


def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode()


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8).clone()


def capture_rng_state(device: torch.device | None = None) -> dict:
    """This rank's random-number generators, as JSON."""
    version, internal, gauss = random.getstate()
    state = {"python": [version, list(internal), gauss], "torch": _b64(torch.get_rng_state())}
    if device is not None and torch.device(device).type == "cuda":
        state["cuda"] = _b64(torch.cuda.get_rng_state(device))
    return state


def restore_rng_state(state: dict, device: torch.device | None = None) -> None:
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    torch.set_rng_state(_unb64(state["torch"]))
    if "cuda" in state and device is not None and torch.device(device).type == "cuda":
        torch.cuda.set_rng_state(_unb64(state["cuda"]), device)
