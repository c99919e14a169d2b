"""ZeRO-Offload's host side on a GPU: exact-size page-locked buffers, and the CPU step on many cores.

Page-locked (pinned) host memory is what lets a device↔host copy run asynchronously (DMA straight
from the pages, no staging copy). `tensor.pin_memory()` takes it from torch's caching host
allocator, which rounds every block up to a power of two to reuse it later: a 1.5 GiB flat buffer
reserves 2 GiB, and up to 2× the host memory in the worst case, on the side that offload exists to
spend memory on. `pinned_empty` instead allocates ordinary pageable memory of the exact size and
page-locks that range with `cudaHostRegister` (as torch's own checkpoint stager does), unlocked
again when the tensor is collected. The engine allocates each offloaded flat buffer once and
reuses it every step.

torchrun sets OMP_NUM_THREADS=1 (and the course's ranks `torch.set_num_threads(1)`), so the CPU
AdamW over a rank's whole shard, the longest part of an offloaded step, would use one core.
`host_step_threads` gives that step this rank's share of the host's cores,

    threads = min(cores this process may run on, cores of the machine // LOCAL_WORLD_SIZE),

and restores the count after. Only when the model computes on a GPU: on a CPU-only run the ranks'
own forward and backward already share the cores, and one thread each stays. Depends only on torch.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch

HOST_REGISTER_PORTABLE = 1  # cudaHostRegisterPortable: page-locked for every CUDA context


def pinned_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialized host tensor of exactly `numel` elements, page-locked for CUDA copies.
    Call it only on a machine with CUDA (the engine guards it by the compute device's type)."""
    t = torch.empty(numel, dtype=dtype)
    nbytes = t.numel() * t.element_size()
    if nbytes == 0:
        return t
    cudart = torch.cuda.cudart()
    error = int(cudart.cudaHostRegister(t.data_ptr(), nbytes, HOST_REGISTER_PORTABLE))
    if error != 0:
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed with cudaError {error}; set "
                           "\"pin_memory\": false in the offload section to offload without pinning")
    unregister = weakref.finalize(t, cudart.cudaHostUnregister, t.data_ptr())
    unregister.atexit = False  # at exit the CUDA context may already be gone; the OS frees it all
    return t


def buffer_empty(numel: int, dtype: torch.dtype, device: torch.device, compute: torch.device,
                 pin_memory: bool = True) -> torch.Tensor:
    """A buffer allocated once on `device`: on the host of a GPU run (`compute` on CUDA) page-locked
    at its exact size (`pinned_empty`), so that copies to and from the GPU run asynchronously."""
    if pin_memory and device.type == "cpu" and compute.type == "cuda":
        return pinned_empty(numel, dtype)
    return torch.empty(numel, dtype=dtype, device=device)


def host_cores_per_rank() -> int:
    """This rank's share of the host: the machine's cores split among the node's ranks, and never
    more than the cores this process is allowed to run on (taskset, SLURM's cpu binding)."""
    machine = os.cpu_count() or 1
    allowed = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else machine
    ranks_here = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    return max(1, min(allowed, machine // ranks_here))


@contextmanager
def host_step_threads(device: torch.device, offload_device: torch.device) -> Iterator[None]:
    """Run the block with `host_cores_per_rank()` intra-op threads when a GPU computes and the
    optimizer steps on the host; change nothing otherwise (CPU-only runs, no offload)."""
    if device.type != "cuda" or offload_device.type != "cpu":
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(host_cores_per_rank())
    try:
        yield
    finally:
        torch.set_num_threads(before)
