"""Chapter 02 benchmark: ring vs naive vs torch's own all-reduce, from 4 KiB to 256 MiB.

    torchrun --standalone --nproc-per-node 4 02_ring_allreduce/bench.py      (`make bench-2`)

One launch measures every group size in --worlds (default: 2, 4, 8, … up to the launched ranks):
the first n ranks form a subgroup (`dist.new_group`, which every rank calls, in the same order) and
time the three all-reduces on float32 tensors side by side, interleaved by `common.bench` (round
after round in a rotating order: the background load of a shared machine drifts during a run),
while the other ranks wait at a barrier. A round times back-to-back calls; each cell is the median
over --rounds rounds of the slowest rank's mean per call. Reported as nccl-tests does: algbw = S / t
and busbw = algbw · 2(n-1)/n (the per-link bandwidth an optimal all-reduce needs, comparable across
n). The ring and the naive all-reduce run with check=False here, since torch's own does not check
either.
Prints the table, the alpha-beta fit per algorithm (with at least two sizes; one size has nothing
to fit), the ring/builtin busbw ratio at >= 16 MiB, saves the plot (--plot) and prints the results
as JSON on the last line. A smoke run that finishes in seconds:

    torchrun --standalone --nproc-per-node 2 02_ring_allreduce/bench.py --sizes 4K --rounds 1 --plot ''
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from functools import partial

import torch
import torch.distributed as dist

from common import bench as harness
from common.cli import ConfigError, exit_on_config_error, require
from common.dist import LaunchError, env_world_size, init_distributed
from common.report import human_bytes
from ring_allreduce import TIMED_ALL_REDUCES as ALGORITHMS
from ring_allreduce.cost_model import AlphaBeta, bus_bandwidth, fit, naive_terms, ring_terms
from ring_allreduce.ring import SEGMENT_BYTES

MODEL = {"ring": "ring", "naive": "naive", "builtin": "ring"}  # gloo's own all-reduce is a ring
# Messages per ring step: ours cuts a chunk into SEGMENT_BYTES segments; gloo's own segmentation is
# not known here, so the fit charges it one message per step.
SEGMENTS = {"ring": SEGMENT_BYTES, "naive": None, "builtin": None}


def terms(algorithm: str, size_bytes: int, n: int) -> tuple[float, float]:
    """(latencies, bytes) the alpha-beta model charges `algorithm` for one all-reduce."""
    if MODEL[algorithm] == "ring":
        return ring_terms(size_bytes, n, SEGMENTS[algorithm])
    return naive_terms(size_bytes, n)
UNITS = {"K": 2**10, "M": 2**20, "G": 2**30}
DEFAULT_PLOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bandwidth.png")


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("IB").removesuffix("B")
    scale = UNITS.get(text[-1:], 1)
    return int(float(text[:-1] if text[-1:] in UNITS else text) * scale)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--sizes", default="4K,16K,64K,256K,1M,4M,16M,64M,256M",
                   help="tensor sizes in bytes (K, M, G suffixes), float32")
    p.add_argument("--worlds", default=None, help="group sizes to measure (default 2, 4, 8 … ≤ ranks)")
    p.add_argument("--algorithms", default="ring,naive,builtin")
    p.add_argument("--rounds", type=int, default=3, help="rounds per cell; the median is reported")
    p.add_argument("--plot", default=DEFAULT_PLOT, help="PNG path ('' for none)")
    return p.parse_args(argv)


def validate(args: argparse.Namespace, world_size: int) -> tuple[list[int], list[int], list[str]]:
    """(sizes, worlds, algorithms), or a ConfigError naming the flag, the value and the fix."""
    try:
        sizes = [parse_size(s) for s in args.sizes.split(",")]
    except ValueError:
        raise ConfigError(f"--sizes {args.sizes!r}: use comma-separated sizes like 4K,1M,256M") from None
    require(all(s >= 4 and s % 4 == 0 for s in sizes),
            f"--sizes {args.sizes}: each size must be a positive multiple of 4 bytes (float32)")
    require(world_size >= 2, f"the bench needs at least 2 ranks, launched with {world_size}: use "
                             "--nproc-per-node 4 (make bench-2 NPROC=4)")
    if args.worlds is None:
        worlds = sorted({*(2**k for k in range(1, 8) if 2**k <= world_size), world_size})
    else:
        worlds = [int(w) for w in args.worlds.split(",")]
    require(all(2 <= w <= world_size for w in worlds),
            f"--worlds {args.worlds}: each group size must be between 2 and the {world_size} launched "
            f"ranks (or launch more: --nproc-per-node {max(worlds)})")
    algorithms = args.algorithms.split(",")
    require(all(a in ALGORITHMS for a in algorithms),
            f"--algorithms {args.algorithms}: use a subset of {','.join(ALGORITHMS)}")
    require(args.rounds >= 1, f"--rounds {args.rounds}: must be >= 1")
    return sizes, worlds, algorithms


def iterations(size_bytes: int) -> int:
    """Back-to-back calls per timing: many for small tensors (latency noise), 2 for the largest."""
    return max(2, min(100, (64 * 2**20) // size_bytes))


def measure(sizes: list[int], worlds: list[int], algorithms: list[str], rounds: int,
            device: torch.device | str = "cpu") -> list[dict]:
    """Run on every rank of the world; returns the rows (the same on every member). Each subgroup
    is destroyed before the next is made, so that nothing holds a process group at shutdown."""
    rows, rank = [], dist.get_rank()
    for n in worlds:
        group = dist.new_group(list(range(n)))  # every rank calls new_group
        if rank < n:
            for size in sizes:
                # Zeros: the values do not change the speed, and repeated in-place sums never overflow.
                tensor = torch.zeros(size // 4, dtype=torch.float32, device=device)
                calls = {a: partial(ALGORITHMS[a], tensor, group=group) for a in algorithms}
                seconds = harness.seconds_per_call(calls, iterations(size), rounds, tensor.device, group)
                for a in algorithms:
                    t = seconds[a]
                    rows.append({"n": n, "size": size, "algorithm": a, "seconds": t,
                                 "algbw": size / t, "busbw": bus_bandwidth(size, n, t)})
                del tensor, calls
        dist.barrier()
        dist.destroy_process_group(group)
        del group
    return rows


def fit_models(rows: list[dict]) -> dict[str, dict[int, AlphaBeta]]:
    """alpha, beta per algorithm and group size. On a real network one (alpha, beta) per algorithm
    would do; on one machine the n ranks share its cores, so the effective beta grows with n.
    Empty with fewer than two sizes: two unknowns need two measurements."""
    models: dict[str, dict[int, AlphaBeta]] = {}
    if len({r["size"] for r in rows}) < 2:
        return models
    for a, n in sorted({(r["algorithm"], r["n"]) for r in rows}):
        mine = [r for r in rows if r["algorithm"] == a and r["n"] == n]
        charged = [terms(a, r["size"], n) for r in mine]
        models.setdefault(a, {})[n] = fit([m for m, _ in charged], [b for _, b in charged],
                                          [r["seconds"] for r in mine])
    return models


def ratios(rows: list[dict], numerator: str, denominator: str, min_size: int = 16 * 2**20) -> dict:
    """busbw(numerator) / busbw(denominator) per (n, size >= min_size)."""
    cell = {(r["n"], r["size"], r["algorithm"]): r["busbw"] for r in rows}
    return {f"n={n} {human_bytes(s)}": cell[(n, s, numerator)] / cell[(n, s, denominator)]
            for (n, s, a) in cell if a == numerator and s >= min_size and (n, s, denominator) in cell}


def table(rows: list[dict], algorithms: list[str]) -> str:
    gb = 1e9
    head = f"{'n':>3} {'size':>10} " + "".join(f"{a + ' busbw':>15}{'(time)':>10}" for a in algorithms)
    lines = [head + ("  ring/builtin" if {"ring", "builtin"} <= set(algorithms) else "")]
    cell = {(r["n"], r["size"], r["algorithm"]): r for r in rows}
    for n, size in sorted({(r["n"], r["size"]) for r in rows}):
        line = f"{n:>3} {human_bytes(size):>10} "
        for a in algorithms:
            r = cell[(n, size, a)]
            line += f"{r['busbw'] / gb:>10.3f} GB/s{r['seconds'] * 1e3:>8.2f}ms"
        if {"ring", "builtin"} <= set(algorithms):
            line += f"{cell[(n, size, 'ring')]['busbw'] / cell[(n, size, 'builtin')]['busbw']:>14.2f}"
        lines.append(line)
    return "\n".join(lines)


def plot(rows: list[dict], models: dict[str, dict[int, AlphaBeta]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    worlds = sorted({r["n"] for r in rows})
    fig, axes = plt.subplots(1, len(worlds), figsize=(4.2 * len(worlds), 3.6), sharey=True, squeeze=False)
    colors = {"ring": "C0", "naive": "C3", "builtin": "C2"}
    for ax, n in zip(axes[0], worlds, strict=True):
        for a, per_n in models.items():
            mine = sorted((r["size"], r["busbw"]) for r in rows if r["algorithm"] == a and r["n"] == n)
            sizes = [s for s, _ in mine]
            ax.plot(sizes, [b / 1e9 for _, b in mine], "o-", color=colors.get(a), label=f"{a} (measured)")
            ax.plot(sizes, [bus_bandwidth(s, n, per_n[n].time(MODEL[a], s, n, SEGMENTS[a])) / 1e9
                            for s in sizes],
                    "--", color=colors.get(a), alpha=0.6, label=f"{a} (alpha-beta fit)")
        if not models:  # one size: the measured points only
            for a in sorted({r["algorithm"] for r in rows}):
                mine = [r for r in rows if r["algorithm"] == a and r["n"] == n]
                ax.plot([r["size"] for r in mine], [r["busbw"] / 1e9 for r in mine], "o",
                        color=colors.get(a), label=f"{a} (measured)")
        ax.set_xscale("log", base=2)
        ax.set_title(f"n = {n} ranks")
        ax.set_xlabel("all-reduce size (bytes)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("bus bandwidth (GB/s)")
    axes[0][-1].legend(fontsize=7)
    fig.suptitle("all-reduce bus bandwidth: ring vs naive vs torch (gloo)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def report(rows: list[dict], algorithms: list[str], plot_path: str, world_size: int) -> dict:
    """Print the table, the fits and the ratios (rank 0); return the JSON summary."""
    models = fit_models(rows)
    print(table(rows, algorithms))
    worlds = sorted({r["n"] for r in rows})
    if models:
        print("\nalpha-beta fit, T = latencies·alpha + bytes·beta (ring: 2(n-1)·⌈S/n/segment⌉ messages, "
              "builtin: 2(n-1), both 2(n-1)/n·S bytes; naive: 2 (its messages travel at once), "
              "2(n-1)·S), alpha in µs, 1/beta in GB/s:")
        print(" " * 10 + "".join(f"{'n = ' + str(n):>22}" for n in worlds))
    else:
        print("\nalpha-beta fit skipped: it needs at least two sizes (--sizes), this run measured one")
    for a, per_n in models.items():
        print(f"  {a:<8}" + "".join(f"{per_n[n].alpha * 1e6:>10.0f} µs{per_n[n].bandwidth / 1e9:>6.2f} GB/s"
                                    for n in worlds))
    summary = {"bench": "ring_allreduce", "world_size": world_size, "rows": rows,
               "fit": {a: {str(n): {"alpha_s": m.alpha, "beta_s_per_byte": m.beta} for n, m in per_n.items()}
                       for a, per_n in models.items()}}
    if {"ring", "builtin"} <= set(algorithms):
        ring_vs = ratios(rows, "ring", "builtin")
        summary["ring_over_builtin_busbw_at_16MiB_plus"] = ring_vs
        if ring_vs:
            print(f"\nring / builtin busbw at >= 16 MiB: min {min(ring_vs.values()):.2f}, "
                  f"median {statistics.median(ring_vs.values()):.2f} (target: median >= 0.95)")
    if {"naive", "builtin"} <= set(algorithms):
        naive_vs = ratios(rows, "naive", "builtin")
        summary["naive_over_builtin_busbw_at_16MiB_plus"] = naive_vs
        for n in sorted({r["n"] for r in rows}):
            mine = [v for k, v in naive_vs.items() if k.startswith(f"n={n} ")]
            if mine:
                print(f"naive / builtin busbw at >= 16 MiB, n = {n}: median {statistics.median(mine):.2f}")
    if plot_path:
        plot(rows, models, plot_path)
        print(f"plot saved to {plot_path}")
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        sizes, worlds, algorithms = validate(args, env_world_size())
    except (ConfigError, LaunchError) as error:
        exit_on_config_error(os.environ.get("RANK", "?"), error)
    ctx = init_distributed()
    start = time.perf_counter()
    rows = measure(sizes, worlds, algorithms, args.rounds, ctx.device)
    summary = report(rows, algorithms, args.plot, ctx.world_size) if ctx.is_main else {}
    summary["wall_s"] = time.perf_counter() - start
    harness.finish(summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
