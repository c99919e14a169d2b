"""Chapter 05 context-parallel benchmark: ring attention against the all-gather variant and Ulysses.

    torchrun --standalone --nproc-per-node 4 05_tensor_parallel/bench_context_parallel.py
    (or `make bench-5-cp`)

One launch, one CP group of every rank, one attention layer of `--model`'s shape (its query and
K/V heads, head_dim) on `--batch` sequences of `--seq-len` tokens, forward + backward. Three
contenders on the same tensors, timed by `common.bench` (one step of each per round in a rotated
order, so all see the same background load; a step counts as its slowest rank's time; medians):

    dense       each rank attends over the whole sequence alone (what CP splits; SDPA's kernel)
    ring        `ring_attention` on the rank's s/cp zig-zag tokens: K/V blocks go round the ring,
                the next block's transfer posted before the current block's attention
    all_gather  `all_gather_attention` (Llama 3's): every K/V block gathered at once, kept for
                backward, dK/dV reduce-scattered
    ulysses     `ulysses_attention` (DeepSpeed's): q, k, v all-to-all'd to H/cp heads of the whole
                sequence, SDPA's kernel, the output all-to-all'd back (not run, with the reason,
                where cp does not divide the heads)

Beside the times: the bytes each rank sends (chapter 05's `cp_comm_bytes`) and the K/V it keeps
for backward (`cp_activation_bytes`' K/V term: the ring keeps its own s/cp block, the all-gather
the whole sequence's; Ulysses' its H_kv'/cp gathered heads and SDPA's repeat of them to H/cp),
the variants' trade-off; and each variant's largest difference from the
dense output on the rank's tokens (exactness at a glance). Both CP variants compute a block with
explicit matmuls (they need its log-sum-exp), so ring/dense mixes the split with the kernel;
ring/all_gather compares like with like. Prints a table, then one JSON line.

torch's own context parallelism (`torch.distributed.tensor.experimental.context_parallel`) is not
a contender: on gloo/CPU in torch 2.13 it fails at the first attention call. It shards its buffers
in place (`resize_`, refused for tensors that require grad); its ring handlers are registered
only for the CUDA SDPA kernels (flash, efficient, cuDNN), so the CPU kernel
(`aten._scaled_dot_product_flash_attention_for_cpu`) has no sharding strategy; and forcing the
math kernel mixes plain tensors with DTensors. On CUDA with NCCL and two GPUs or more it should
run; it is not measured here.
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
import torch.distributed as dist

from common import bench as harness
from common.comm import CommMeter
from common.dist import print0
from common.kernel.model import causal_attention, get_config
from tensor_parallel import all_gather_attention, check_cp_sizes, ring_attention, shard_sequence
from tensor_parallel.formulas import cp_comm_bytes, ulysses_comm_bytes
from tensor_parallel.ulysses import check_ulysses_sizes, ulysses_attention

MiB = 2**20
TORCH_CP = ("not run: on gloo/CPU torch 2.13's context_parallel has no sharding strategy for the "
            "CPU SDPA kernel (its ring handlers cover the CUDA flash/efficient/cuDNN kernels only)")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.bench_parser(__doc__, warmup=1, steps=5)
    p.set_defaults(seq_len=2048)
    p.add_argument("--batch", type=int, default=1, help="sequences (every rank holds s/cp of each)")
    return harness.parse_checked(p, argv, positive=("batch",))


def attention_inputs(args: argparse.Namespace, device: torch.device) -> dict[str, torch.Tensor]:
    """q [B, H, s, d], k, v [B, H_kv, s, d] and the output gradient, float32, the same on every
    rank (seeded)."""
    cfg = get_config(args.model)
    g = torch.Generator(device="cpu").manual_seed(args.seed)
    shapes = {"q": cfg.n_heads, "k": cfg.n_kv_heads, "v": cfg.n_kv_heads, "dout": cfg.n_heads}
    return {name: torch.randn(args.batch, heads, args.seq_len, cfg.head_dim, generator=g).to(device)
            for name, heads in shapes.items()}


def forward_backward(attend, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """attend(q, k, v) and its backward from `dout`; returns the detached output."""
    q, k, v = (tensors[n].detach().requires_grad_() for n in "qkv")
    out = attend(q, k, v)
    out.backward(tensors["dout"])
    return out.detach()


def _ratio(measured: float | None, formula: float | None) -> str:
    return "-" if measured is None or not formula else f"{measured / formula:.4f}"


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = get_config(args.model)

    def check(world: int) -> str | None:
        try:
            check_cp_sizes(args.seq_len, world)
        except ValueError as error:
            return str(error)
        return None

    ctx = harness.launch(check=check)
    cp, rank = ctx.world_size, dist.get_rank()
    full = attention_inputs(args, ctx.device)
    local = {n: shard_sequence(x, cp, rank, dim=2) for n, x in full.items()}
    contenders = {
        "dense": partial(forward_backward, causal_attention, full),
        "ring": partial(forward_backward, ring_attention, local),
        "all_gather": partial(forward_backward, all_gather_attention, local),
    }
    try:
        check_ulysses_sizes(args.seq_len, cfg.n_heads, cfg.n_kv_heads, cp)
        contenders["ulysses"], ulysses_skipped = partial(forward_backward, ulysses_attention, local), None
    except ValueError as error:
        ulysses_skipped = f"not run: {error}"
    split = [n for n in contenders if n != "dense"]
    dense_here = shard_sequence(contenders["dense"](), cp, rank, dim=2)
    measured, diffs = {}, []
    for n in split:  # one metered step each: the bytes actually sent, against the formula below
        with CommMeter() as meter:
            diffs.append((contenders[n]() - dense_here).abs().max())
        measured[n] = meter.bytes_sent
    diff = torch.stack(diffs)
    dist.all_reduce(diff, op=dist.ReduceOp.MAX)
    max_diff = dict(zip(split, diff.tolist(), strict=True))

    median = harness.interleaved({n: (lambda _, f=f: f()) for n, f in contenders.items()},
                                 args.steps, args.warmup, ctx.device).median
    ratio = median["ring"] / median["all_gather"]
    e = full["q"].element_size()
    sent = {n: sum(cp_comm_bytes(args.batch, args.seq_len, cfg.n_kv_heads, cfg.head_dim, cp, e,
                                 variant=n).values()) for n in ("ring", "all_gather")}
    block = 2 * args.batch * cfg.n_kv_heads * (args.seq_len // cp) * cfg.head_dim * e
    kv_held = {"dense": block * cp, "ring": block, "all_gather": block * cp}
    if "ulysses" in contenders:
        sent["ulysses"] = sum(ulysses_comm_bytes(args.batch, args.seq_len, cfg.n_heads, cfg.n_kv_heads,
                                                 cfg.head_dim, cp, e).values())
        heads = (max(cfg.n_kv_heads, cp) + cfg.n_heads) // cp  # gathered + repeated, per K and V
        kv_held["ulysses"] = 2 * args.batch * heads * args.seq_len * cfg.head_dim * e
    print0(f"chapter 5 CP bench · {args.model}'s attention (H {cfg.n_heads}, H_kv {cfg.n_kv_heads}, "
           f"d {cfg.head_dim}) · cp = {cp} ranks · {ctx.backend} on {ctx.device} · "
           f"{args.batch} × {args.seq_len} tokens · forward + backward · median of {args.steps} "
           f"(+{args.warmup})")
    print0(f"{'contender':<12}{'step ms':>10}{'/ dense':>9}{'sent MiB':>10}{'measured/formula':>17}"
           f"{'K/V kept MiB':>14}{'max |Δ| vs dense':>18}")
    for n in contenders:
        print0(f"{n:<12}{1e3 * median[n]:>10.2f}{median[n] / median['dense']:>9.3f}"
               f"{sent.get(n, 0) / MiB:>10.2f}{_ratio(measured.get(n), sent.get(n)):>17}"
               f"{kv_held[n] / MiB:>14.2f}"
               f"{max_diff.get(n, 0.0):>18.1e}")
    print0(f"ring / all_gather: {ratio:.3f} (step time) · sent {sent['ring'] / sent['all_gather']:.2f}× "
           f"· K/V kept {kv_held['ring'] / kv_held['all_gather']:.2f}×")
    if "ulysses" in contenders:
        print0(f"ulysses / ring: {median['ulysses'] / median['ring']:.3f} (step time) · sent "
               f"{sent['ulysses'] / sent['ring']:.2f}× · K/V kept "
               f"{kv_held['ulysses'] / kv_held['ring']:.2f}×")
    else:
        print0(f"ulysses: {ulysses_skipped}")
    print0(f"torch's context_parallel: {TORCH_CP}")
    harness.finish({
        "chapter": 5, "bench": "context_parallel", "model": args.model, "world_size": cp,
        "backend": ctx.backend, "device": str(ctx.device), "batch": args.batch,
        "seq_len": args.seq_len, "warmup": args.warmup, "steps": args.steps,
        "step_s_median": median, "ring_over_all_gather": ratio, "sent_bytes_per_rank": sent,
        "sent_bytes_measured": measured,
        "kv_kept_bytes": kv_held, "max_abs_diff_vs_dense": max_diff, "torch_context_parallel": TORCH_CP,
        "ulysses_skipped": ulysses_skipped,
    })


if __name__ == "__main__":
    main()
