"""What gloo writes for one collective, against what the comm meter accounts for it.

    torchrun --standalone --nproc-per-node N common/gloo_bytes.py [--sizes 4096 1048576 ...]

Each collective runs once per size (float32, S = the full tensor's bytes) between two barriers,
and each rank reads its `wchar` (common/wire.py: bytes passed to write()/writev()) around it. Rank
0 prints, per collective and size, the mean written bytes per rank, the mean accounted bytes
(common/comm.py: nccl-tests' convention, e.g. 2(n-1)/n·S for an all-reduce), their ratio, and
each rank's written bytes ÷ S (a broadcast's root writes, the other ranks do not).
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable

import torch
import torch.distributed as dist

from common.comm import CommMeter
from common.wire import written_bytes

# gloo on CPU only, by design: `wchar` counts this process's own writes, which NCCL's are not
DEVICE = torch.device("cpu")


def collectives(n: int, rank: int, numel: int) -> dict[str, Callable[[], None]]:
    """One closure per collective on a tensor of `numel` floats (the full size S)."""
    full, shard = torch.ones(numel, device=DEVICE), torch.ones(numel // n, device=DEVICE)
    peer = rank ^ 1  # send/recv between pairs 0↔1, 2↔3

    def send_recv() -> None:
        if peer >= n:  # the last rank of an odd world sits this one out
            return
        if rank % 2 == 0:
            dist.send(full, peer)
        else:
            dist.recv(full, peer)

    return {
        "all_reduce": lambda: dist.all_reduce(full),
        "reduce_scatter_tensor": lambda: dist.reduce_scatter_tensor(shard, full),
        "all_gather_into_tensor": lambda: dist.all_gather_into_tensor(full, shard),
        "broadcast (root 0)": lambda: dist.broadcast(full, src=0),
        "send/recv (even → odd)": send_recv,
    }


def measure(op: Callable[[], None]) -> tuple[float, float]:
    """(bytes this rank wrote, bytes the meter accounts to this rank) for one call of `op`."""
    op()  # warm-up: gloo may set up pairs or buffers on first use
    dist.barrier()
    with CommMeter() as meter:
        before = written_bytes()
        op()
        written = written_bytes() - before
    dist.barrier()
    return float(written), float(meter.bytes_sent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 262144, 4194304],
                        help="float32 elements of the full tensor (divisible by the world size)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", category=FutureWarning)  # reduce_scatter_tensor's new name (2.13)
    dist.init_process_group("gloo")
    n, rank = dist.get_world_size(), dist.get_rank()
    if rank == 0:
        print(f"gloo, {n} ranks, torch {torch.__version__}; bytes per rank, mean over the ranks")
        print(f"{'collective':<24}{'S':>10}{'accounted':>12}{'written':>12}{'ratio':>8}"
              "   written ÷ S, rank 0 … n-1")
    for numel in args.sizes:
        for name, op in collectives(n, rank, numel).items():
            mine = torch.tensor(measure(op), dtype=torch.float64, device=DEVICE)
            every = [torch.zeros(2, dtype=torch.float64, device=DEVICE) for _ in range(n)]
            dist.all_gather(every, mine)
            if rank == 0:
                written, accounted = (sum(t[i].item() for t in every) / n for i in (0, 1))
                per_rank = " ".join(f"{t[0].item() / (numel * 4):.3f}" for t in every)
                print(f"{name:<24}{numel * 4:>10}{accounted:>12.0f}{written:>12.0f}"
                      f"{written / accounted:>8.4f}   {per_rank}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
