"""Memory ledger: bytes per rank of parameters, gradients, optimizer state, saved activations.

Parameter, gradient and optimizer bytes are counted from live tensors, once per storage (a
gradient that is a view into a flat bucket counts the bucket once). Activation bytes are what
autograd saves for backward, counted with `torch.autograd.graph.saved_tensors_hooks`: the peak of
the live total, each storage once, parameters excluded. On CUDA the ledger also reads
`torch.cuda.max_memory_allocated`.

Mixed-precision Adam on P parameters, for the lesson's arithmetic: weights 2P (bf16) + grads 2P +
fp32 master, m and v 12P = 16P bytes; 7B → 112 GB before activations.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn


def _storage_key(t: torch.Tensor) -> tuple:
    storage = t.untyped_storage()
    return (t.device.type, t.device.index, storage.data_ptr(), storage.nbytes())


def storage_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Total bytes of the distinct storages behind `tensors`."""
    seen: dict[tuple, int] = {}
    for t in tensors:
        if t is not None and t.device.type != "meta":
            key = _storage_key(t)
            seen[key] = key[3]
    return sum(seen.values())


def optimizer_state_tensors(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for state in optimizer.state.values() for v in state.values()
            if isinstance(v, torch.Tensor)]


def model_state_bytes(params: Iterable[nn.Parameter],
                      optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """{"params", "grads", "optimizer"} bytes held by this rank right now."""
    params = list(params)
    return {
        "params": storage_bytes(params),
        "grads": storage_bytes(p.grad for p in params if p.grad is not None),
        "optimizer": storage_bytes(optimizer_state_tensors(optimizer)) if optimizer else 0,
    }


class _Saved:
    """What the pack hook hands autograd; freeing it (after backward) frees the bytes."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter):
        self.tensor, self.meter = tensor, meter
        self.key = meter._add(tensor)

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._remove(self.key)


class ActivationMeter:
    """`with ActivationMeter(model.parameters()) as act:` … `act.peak_bytes` is the largest total
    of distinct saved storages alive at once (parameters excluded)."""

    def __init__(self, params: Iterable[torch.Tensor] = ()):
        self._param_keys = {_storage_key(p) for p in params if p.device.type != "meta"}
        self._live: dict[tuple, int] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _add(self, t: torch.Tensor) -> tuple | None:
        key = _storage_key(t)
        if key in self._param_keys:
            return None
        if key not in self._live:
            self.current_bytes += key[3]
            self.peak_bytes = max(self.peak_bytes, self.current_bytes)
        self._live[key] = self._live.get(key, 0) + 1
        return key

    def _remove(self, key: tuple) -> None:
        self._live[key] -= 1
        if self._live[key] == 0:
            del self._live[key]
            self.current_bytes -= key[3]

    def _pack(self, t: torch.Tensor) -> _Saved:
        return _Saved(t, self)

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor

    def __enter__(self) -> ActivationMeter:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)


def cuda_peak_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return None
