"""Two NCCL rules that gloo cannot show, made checkable on CPU (test-only; CONTRIBUTING.md, "Rules of the
NCCL path"):

1. Every tensor a collective touches is on the rank's device. On CPU the rank's device IS the host,
   so `torch.tensor([...])` without `device=` is on the right device here and on the wrong one on
   a GPU (NCCL: "No backend type associated with device type cpu"). The device alone cannot tell
   them apart, so the guard tracks where a tensor's device came from: a TorchFunctionMode marks
   every tensor made by a factory call without `device=` (torch.tensor, zeros, arange, ...) as
   *host-default*, keeps the mark on results computed only from marked tensors (a stack or a sum
   of host tensors stays on the host), and drops it where the code names a device (`device=`,
   `.to(device)`, `.to(other)`, `.cuda()`). A collective that receives a marked tensor, or one not
   on the rank's device, raises `CollectiveDeviceError`. What it cannot see: tensors made by C++
   code (autograd's gradients, torch DDP's buckets) carry no mark, so a model built on the host
   and never moved is not caught; every host scalar or report tensor built in Python is.
2. Nothing holds a process group when it is destroyed: gloo's destructor, run by the last
   reference freed after the destroy, joins a worker thread that waits for the GIL, and the
   process hangs at exit, in most runs but not all. Rather than wait for a hang, the guard looks
   at `destroy_process_group` time (after `gc.collect()`) for live objects of the classes that
   hold one (torch DDP, ZeroRedundancyOptimizer, FSDP/FSDP2 modules, pipelining stages) and
   raises `LiveGroupHolderError` naming them.

    python -m torch.distributed.run --standalone --nproc-per-node 2 -m tests.collective_guard \\
        01_data_parallel/bench.py --model tiny ...

runs the script as `__main__` under both checks and prints, per rank on stderr, one line
"collective guard: rank R checked N collective calls on DEVICE".
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import runpy
import sys

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from common.kernel.patch import patch_dist

MARK = "_pfs_host_default"
COLLECTIVES = ("all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor",
               "all_gather_single", "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single",
               "all_to_all", "all_to_all_single", "gather", "scatter", "send", "recv", "isend", "irecv",
               "batch_isend_irecv")
_MOVES = {torch.Tensor.to, torch.Tensor.cuda}


class CollectiveDeviceError(RuntimeError):
    """A collective got a tensor that would not be on the rank's GPU under NCCL."""


class LiveGroupHolderError(RuntimeError):
    """The process group was destroyed while objects that hold it were alive."""


def is_host_default(t: torch.Tensor) -> bool:
    return bool(getattr(t, MARK, False))


def _tensors(tree) -> list[torch.Tensor]:
    leaves = tree_leaves(tree)
    out = [t for t in leaves if isinstance(t, torch.Tensor)]
    out += [op.tensor for op in leaves if isinstance(op, dist.P2POp)]
    return out


def _names_a_device(func, args, kwargs) -> bool:
    if kwargs.get("device") is not None:
        return True
    if func in _MOVES:  # .to(device) / .to("cuda") / .to(other_tensor) / .cuda()
        return func is torch.Tensor.cuda or any(
            isinstance(a, torch.device | str | torch.Tensor) for a in args[1:])
    return False


class HostDefaultTracker(TorchFunctionMode):
    """Marks tensors whose device is the host by default rather than by the code's choice."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is torch.Tensor.cpu:
            return out
        outputs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outputs:
            return out
        inputs = _tensors((args, kwargs))
        moved = _names_a_device(func, args, kwargs)
        if moved:
            mark = False
        elif inputs:
            mark = all(is_host_default(t) for t in inputs)
        else:
            mark = True  # a factory call without device=
        for t in outputs:
            if not moved and any(t is i for i in inputs):
                continue  # an in-place op: the tensor stays where it was
            if mark or is_host_default(t):
                with contextlib.suppress(AttributeError, RuntimeError):  # a type without __dict__
                    setattr(t, MARK, mark)
        return out


class CollectiveGuard:
    """Context manager: the two checks of the module doc, around torch.distributed's functions
    (wrapped from outside with common.kernel.patch.patch_dist, like common.comm.CommMeter, so nestable
    with it)."""

    def __init__(self, device: torch.device):
        self.device, self.calls = device, 0
        self._patched = contextlib.ExitStack()
        self._tracker = HostDefaultTracker()

    def check(self, op: str, tensors: list[torch.Tensor]) -> None:
        self.calls += 1
        for i, t in enumerate(tensors):
            if t.device != self.device:
                raise CollectiveDeviceError(f"{op}: tensor {i} is on {t.device}, the rank's device is "
                                            f"{self.device}: create it with device= (NCCL rejects it)")
            if is_host_default(t):
                raise CollectiveDeviceError(
                    f"{op}: tensor {i} {tuple(t.shape)} was made without device= (e.g. torch.tensor"
                    f"([...])): on CPU it is on the rank's device by chance, under NCCL it is on the "
                    "host and the call fails; pass device= (the rank's device)")

    def _wrap(self, op: str, fn):
        @functools.wraps(fn)
        def guarded(*args, **kwargs):
            self.check(op, _tensors((args, kwargs)))
            return fn(*args, **kwargs)
        return guarded

    def _wrap_destroy(self, fn):
        @functools.wraps(fn)
        def guarded(*args, **kwargs):
            if holders := live_group_holders():
                raise LiveGroupHolderError(
                    f"destroy_process_group with {', '.join(holders)} alive: free them first (del, "
                    "then common.dist.shutdown); freed after the destroy, gloo's destructor may "
                    "hang the process at exit")
            return fn(*args, **kwargs)
        return guarded

    def __enter__(self) -> CollectiveGuard:
        p2p = ("isend", "irecv")  # P2POp checks `op in [c10d.isend, c10d.irecv]`: wrap both names
        wrappers = {op: functools.partial(self._wrap, op) for op in COLLECTIVES if op not in p2p}
        self._patched.enter_context(patch_dist(wrappers | {"destroy_process_group": self._wrap_destroy}))
        self._patched.enter_context(patch_dist({op: functools.partial(self._wrap, op) for op in p2p},
                                               also=(c10d,)))
        self._tracker.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._tracker.__exit__(*exc)
        self._patched.close()


def _holder_classes() -> list[type]:
    import importlib

    found = []
    for module, name in (("torch.nn.parallel", "DistributedDataParallel"),
                         ("torch.distributed.optim", "ZeroRedundancyOptimizer"),
                         ("torch.distributed.fsdp", "FSDPModule"),
                         ("torch.distributed.fsdp", "FullyShardedDataParallel"),
                         ("torch.distributed.pipelining.stage", "_PipelineStageBase")):
        with contextlib.suppress(ImportError, AttributeError):  # older torch: no such class
            found.append(getattr(importlib.import_module(module), name))
    return found


def live_group_holders() -> list[str]:
    """Class names of the live objects that hold a process group (one entry per object), after
    collecting the unreachable cycles."""
    gc.collect()
    classes = tuple(_holder_classes())
    return sorted(type(o).__name__ for o in gc.get_objects() if issubclass(type(o), classes))


def rank_device() -> torch.device:
    """The device common.dist.init_distributed will give this rank."""
    from common.dist import pick_backend, pick_device

    return pick_device(pick_backend(), int(os.environ.get("LOCAL_RANK", "0")))


def main(argv: list[str]) -> None:
    if not argv:
        raise SystemExit("usage: python -m tests.collective_guard SCRIPT [ARGS...]")
    guard = CollectiveGuard(rank_device())
    sys.argv = list(argv)
    try:
        with guard:
            runpy.run_path(argv[0], run_name="__main__")
    finally:
        print(f"collective guard: rank {os.environ.get('RANK', '?')} checked {guard.calls} "
              f"collective calls on {guard.device}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
