"""The planner's command line:

    python -m parallel3d.planner --model llama2-70b --gpus 64 --gpu-mem-gb 80
    python -m parallel3d.planner --model llama3.1-405b --gpus 16384 --seq-len 131072 \\
        --global-batch 128                     # long context: where CP becomes necessary
    python -m parallel3d.planner --article      # the source article's numbers and table
    python -m parallel3d.planner --published    # predicted against published runs
    python -m parallel3d.planner --write-readme   # both tables into 07_3d/planner/README.md
    python -m parallel3d.planner --model deepseek-v3 --gpus 2048 --gpu H800 --global-batch 15360
"""

from __future__ import annotations

import argparse

from parallel3d.memory_model import GB, PRECISIONS, total_parameters
from parallel3d.planner.hardware import GPUS, gpu
from parallel3d.planner.moe import moe_parameters
from parallel3d.planner.pricing import MODELS, MOE_MODELS, model_of, plan, recommend
from parallel3d.planner.published import (
    FIT_MARKER,
    MARKER,
    README,
    fit_table,
    published_report,
    published_table,
    write_readme,
)
from parallel3d.planner.report import (
    STRATEGY_MARKER,
    article_alternative,
    article_report,
    article_row,
    assumptions,
    cp_verdict,
    format_plans,
    strategy_table,
    why_not,
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m parallel3d.planner",
                                description="Plan a layout: which (TP, CP, PP, DP, ZeRO level, micro-batch, "
                                            "recompute) fits a model on G GPUs of M GB.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=[*MODELS, *MOE_MODELS], default="llama2-70b")
    p.add_argument("--gpus", type=int, default=64)
    p.add_argument("--gpu", choices=GPUS, default="H100", help="peak and links: planner/hardware.py")
    p.add_argument("--gpu-mem-gb", type=float, default=80.0)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per optimizer step (default: 4M tokens)")
    p.add_argument("--precision", choices=PRECISIONS, default="mixed",
                   help="bytes per parameter: article (2+2+4), mixed (2+2+12), fp32 (4+4+8)")
    p.add_argument("--eager-attention", action="store_true",
                   help="keep the s×s scores (no flash attention; the default assumes it)")
    p.add_argument("--no-sequence-parallel", action="store_true",
                   help="TP without sequence parallelism (the default puts SP at every TP > 1)")
    p.add_argument("--headroom", type=float, default=0.9, help="usable fraction of GPU memory")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--skew", type=float, default=1.0,
                   help="MoE routing skew: max/mean tokens per expert rank (1: balanced)")
    p.add_argument("--top", type=int, default=12, help="candidates to print")
    p.add_argument("--article", action="store_true", help="print the article's numbers and table")
    p.add_argument("--published", action="store_true",
                   help="price published runs at their layouts, beside their measured throughput")
    p.add_argument("--write-readme", action="store_true",
                   help="rewrite the generated tables of 07_3d/planner/README.md (strategy by size, "
                        "published runs)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.write_readme:
        changed = write_readme({STRATEGY_MARKER: strategy_table(), MARKER: published_table(),
                               FIT_MARKER: fit_table()})
        print(f"{README}: {'rewritten' if changed else 'up to date'}")
        return 0
    if args.article:
        print(article_report())
        return 0
    if args.published:
        print(published_report())
        return 0
    cfg, moe = model_of(args.model)
    batch = args.global_batch or max(1, 4 * 2**20 // args.seq_len)
    problems = [msg for ok, msg in [
        (args.gpus > 0, f"--gpus {args.gpus}: must be positive"),
        (args.gpu_mem_gb > 0, f"--gpu-mem-gb {args.gpu_mem_gb}: must be positive"),
        (args.seq_len > 0, f"--seq-len {args.seq_len}: must be positive"),
        (batch > 0, f"--global-batch {batch}: must be positive"),
        (0 < args.headroom <= 1, f"--headroom {args.headroom}: must be in (0, 1]"),
        (args.skew >= 1, f"--skew {args.skew}: max/mean tokens per expert rank is at least 1"),
    ] if not ok]
    if problems:
        print("error: " + "; ".join(problems))
        return 2
    hw = gpu(args.gpu, gpus_per_node=args.gpus_per_node)
    plans = plan(cfg, args.gpus, args.gpu_mem_gb, args.seq_len, batch, hw, args.precision,
                 args.headroom, args.eager_attention, moe, args.skew,
                 sequence_parallel=not args.no_sequence_parallel)
    n = moe_parameters(cfg, moe) if moe else total_parameters(cfg)
    active = f" ({moe_parameters(cfg, moe, True) / 1e9:.2f}B active)" if moe else ""
    print(f"{args.model}: {n / 1e9:.2f}B parameters{active}, "
          f"{args.gpus} × {args.gpu_mem_gb:g} GB {args.gpu}, "
          f"{batch} × {args.seq_len} tokens per step, {args.precision} precision "
          f"({sum(PRECISIONS[args.precision])} bytes/parameter of model states)")
    print(f"{len(plans)} candidates, {sum(p.fits for p in plans)} fit in "
          f"{args.headroom:.0%} of {args.gpu_mem_gb:g} GB\n")
    print(format_plans(plans, args.top))
    best = recommend(plans)
    rows, advice, pp_range = article_row(n)
    print(f"\nrecommended: {best.layout.describe() if best else 'nothing fits: add GPUs'}")
    print(f"  assumes {assumptions(not args.eager_attention, not args.no_sequence_parallel)}")
    if best:
        print(f"  {best.memory['total'] / GB:.1f} GB per GPU, step ≈ {best.step_s:.2f} s, "
              f"MFU ≈ {best.mfu:.0%}")
    print(cp_verdict(plans, best))
    print(f"the article's table for this size ({rows} GPUs): {advice}")
    other = article_alternative(plans, pp_range)
    if best and other and not pp_range[0] <= best.layout.pp <= pp_range[1]:
        print(f"  its pipeline depth, priced: {why_not(best, other)}")
    return 0


