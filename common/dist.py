"""Process-group setup from torchrun's environment.

One process per device. The backend follows the hardware: NCCL when CUDA is available (one GPU per
local rank), gloo on CPU processes otherwise; `PFS_BACKEND=gloo|nccl` overrides. On CPU every rank
runs `torch.set_num_threads(1)` so that N ranks on a laptop do not fight over its cores.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

# Imported before any init_process_group, on purpose: torch.distributed.nn's functions take
# `group=group.WORLD` as a default argument, so when it is first imported after init (torch.optim
# pulls it in through torch._dynamo at the first step) they pin the live process group for good;
# destroy_process_group then cannot join gloo's worker threads, and one still releasing a finished
# all-reduce at interpreter exit aborts the process ("terminate called without an active
# exception"; seen in ~1 of 4 runs of chapter 02's demo on 4 CPU ranks).
import torch.distributed.nn

TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
DEFAULT_TIMEOUT_S = 300.0


class LaunchError(RuntimeError):
    """Raised when the process was not started the way the program needs."""


@dataclass(frozen=True)
class DistContext:
    rank: int
    world_size: int
    local_rank: int
    backend: str
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def pick_backend() -> str:
    """`PFS_BACKEND` if set, else nccl when CUDA is available, else gloo."""
    backend = os.environ.get("PFS_BACKEND") or ("nccl" if torch.cuda.is_available() else "gloo")
    if backend not in ("gloo", "nccl"):
        raise LaunchError(f"PFS_BACKEND={backend!r} is not supported: use 'gloo' or 'nccl'")
    return backend


def pick_device(backend: str, local_rank: int) -> torch.device:
    """NCCL needs one CUDA device per process; gloo runs on CPU."""
    if backend == "nccl":
        if local_rank >= torch.cuda.device_count():
            raise LaunchError(
                f"local rank {local_rank} has no GPU ({torch.cuda.device_count()} visible): "
                f"launch at most {torch.cuda.device_count()} processes per node, or PFS_BACKEND=gloo"
            )
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def env_world_size() -> int:
    """WORLD_SIZE from torchrun's environment, readable before the process group exists
    (so that bad input can be rejected before any collective)."""
    missing = [v for v in TORCHRUN_VARS if v not in os.environ]
    if missing:
        raise LaunchError(
            f"{', '.join(missing)} not set: this program is one rank of a distributed job. Launch it "
            "with `torchrun --standalone --nproc-per-node N <script> ...` or `make run-<chapter>`"
        )
    return int(os.environ["WORLD_SIZE"])


def init_distributed(backend: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> DistContext:
    """Join the job torchrun started. A collective that waits longer than `timeout_s` raises
    instead of hanging for torch's default 30 minutes."""
    world_size = env_world_size()
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    backend = backend or pick_backend()
    device = pick_device(backend, local_rank)
    if device.type == "cpu":
        torch.set_num_threads(1)
    if not dist.is_initialized():
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(
            backend, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s), **kwargs
        )
    return DistContext(rank, world_size, local_rank, backend, device)


def shutdown() -> None:
    """Destroy the process group, after collecting the garbage cycles that may still hold it (a
    module whose hooks reference itself, a torch DDP Reducer): freed after the destroy, the last
    reference runs gloo's destructor, which joins a worker thread that waits for the GIL this
    thread holds, and the process hangs at exit (pytorch#56297, #75097). Callers drop their own
    references (`del`) first; this only collects what nothing references any more."""
    gc.collect()
    if dist.is_initialized():
        dist.destroy_process_group()


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device`: CUDA kernels run asynchronously, so a host clock read
    around GPU work must follow this. A no-op on CPU, where an op has finished when it returns."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def print0(*args, **kwargs) -> None:
    """print on global rank 0 only (or always, when there is no process group)."""
    if not dist.is_initialized() or dist.get_rank() == 0:
        print(*args, **kwargs, flush=True)


def default_nproc(chapter: int) -> int:
    """Ranks for `make run-N`: one per GPU, else 4 CPU processes (8 for the 3D chapter)."""
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.cuda.device_count()
    return 8 if chapter == 7 else 4


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="print the default rank count for a chapter")
    parser.add_argument("--nproc", type=int, metavar="CHAPTER", required=True)
    print(default_nproc(parser.parse_args().nproc))
