"""Memory ledger: bytes per rank of parameters, gradients, optimizer state, saved activations.

Parameter, gradient and optimizer bytes are counted from live tensors, once per storage (a
gradient that is a view into a flat bucket counts the bucket once). Activation bytes are what
autograd saves for backward, counted with `torch.autograd.graph.saved_tensors_hooks`: the peak of
the live total, each storage once, parameters excluded. Its hooks run on every saved tensor, so
the training loop enables it by default only on CPU (`--measure-activations`); on CUDA the
allocator gives the peak instead: `CudaPeakMeter` is `torch.cuda.max_memory_allocated` taken over
the windows it is entered for, each window starting from a reset, so what the job allocated
outside them (building the model, the `--check` gathers) cannot raise it, and the `--check`
reference, resident on rank 0 but idle in the windows, is subtracted (`exclude`).

Mixed-precision Adam on P parameters, for the lesson's arithmetic: weights 2P (bf16) + grads 2P +
fp32 master, m and v 12P = 16P bytes; 7B → 112 GB before activations.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager

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
    """What the pack hook hands autograd; freeing it (after backward) frees the bytes. It keeps
    the tensor detached (same storage and version counter): a saved output holds its grad_fn,
    whose saved variable would hold this object, a cycle through C++ that `gc` cannot see; a
    backward that retains the graph (ZB-H1's split B and W) never breaks it, so every graph and
    its activations would outlive the step."""

    __slots__ = ("key", "meter", "tensor")

    def __init__(self, tensor: torch.Tensor, meter: ActivationMeter):
        self.tensor, self.meter = tensor.detach(), meter
        self.key = meter._add(tensor)

    def __del__(self) -> None:
        if self.key is not None:
            self.meter._remove(self.key)


class ActivationMeter:
    """`with ActivationMeter(model.parameters()) as act:` … `act.peak_bytes` is the largest total
    of distinct saved storages alive at once (parameters excluded). `gathered()` returns the
    tensors that hold weights gathered for compute at that moment (FSDP's unsharded flat
    parameters): autograd saves them, but they are parameters, not activations."""

    def __init__(self, params: Iterable[torch.Tensor] = (),
                 gathered: Callable[[], Iterable[torch.Tensor]] = tuple):
        self._param_keys = {_storage_key(p) for p in params if p.device.type != "meta"}
        self._gathered = gathered
        self._live: dict[tuple, int] = {}
        self.current_bytes = 0
        self.peak_bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _add(self, t: torch.Tensor) -> tuple | None:
        key = _storage_key(t)
        if key in self._param_keys or any(_storage_key(g) == key for g in self._gathered()):
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


class CudaPeakMeter:
    """`with peak:` around each window to count; `peak.bytes` is the largest
    `torch.cuda.max_memory_allocated` of any window, less what `exclude` attributed to a
    bystander (None off CUDA). Entering resets the allocator's peak to what is allocated now, so a
    window's peak is what it found resident (live tensors, not freed ones) plus what it allocated
    on top; a bystander that stays resident but does not run in the windows (the `--check`
    reference's model and optimizer state) is subtracted, byte for byte in the allocator's units.
    The allocator counts on the host, at allocation and free, so no synchronize is needed."""

    def __init__(self, device: torch.device):
        self.device = device
        self.cuda = device.type == "cuda"
        self.bytes: int | None = 0 if self.cuda else None
        self.excluded = 0

    def __enter__(self) -> CudaPeakMeter:
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self.bytes = max(self.bytes, torch.cuda.max_memory_allocated(self.device) - self.excluded)

    @contextmanager
    def exclude(self) -> Iterator[None]:
        """What the block allocates and leaves alive belongs to a bystander: subtracted from every
        later window. Run nothing of the strategy's inside it."""
        before = torch.cuda.memory_allocated(self.device) if self.cuda else 0
        yield
        if self.cuda:
            self.excluded += torch.cuda.memory_allocated(self.device) - before
