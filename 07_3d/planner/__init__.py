"""Plan a layout: which (TP, CP, PP, DP, EP, ZeRO level, micro-batch, recompute) fits a model on
G GPUs of M GB, what each GPU holds, what it sends, and which one to pick.

    hardware.py        the GPUs' peaks and links, and the achieved efficiency: the constants
    pricing.py         candidates, their memory / traffic / step time, the pick: pure
    saved.py           what a production framework saves per block, what each recomputation reruns
    memory.py          each GPU's states and activations on the busiest pipeline rank
    pipeline.py        the schedules' bubbles and micro-batches in flight (1F1B, DualPipe)
    moe.py             a mixture of experts: parameters, active compute, EP's units, all-to-alls
    report.py          the table, why the pick beats another layout, the source article's comparison
    published_runs.py  published layouts and their measured throughput, with sources
    published.py       each priced at its own layout, predicted beside published (`--published`)
    cli.py             `python -m parallel3d.planner --model llama2-70b --gpus 64 --gpu-mem-gb 80`
"""

from parallel3d.planner.cli import main, parse_args
from parallel3d.planner.hardware import ACHIEVED_EFFICIENCY, GPUS, gpu
from parallel3d.planner.memory import memory_per_gpu
from parallel3d.planner.moe import MoEShape, all_to_all_bytes, moe_parameters, moe_shape
from parallel3d.planner.pricing import (
    MODELS,
    MOE_MODELS,
    PLANNING_SHAPES,
    Hardware,
    Plan,
    candidates,
    complexity,
    fastest_with_cp,
    fastest_with_mesh,
    model_flops_per_token,
    model_of,
    plan,
    price,
    recommend,
    recompute_fraction,
    step_terms,
)
from parallel3d.planner.published import BAND, FIGURES, Comparison, compare, price_published, published_report
from parallel3d.planner.published_runs import RUNS, PublishedRun
from parallel3d.planner.report import (
    ARTICLE_TABLE,
    LEGEND,
    LONG_CONTEXT,
    MOE_SCENARIOS,
    TABLE_SCENARIOS,
    article_alternative,
    article_report,
    article_row,
    article_scenario,
    cp_verdict,
    format_plans,
    why_not,
)

__all__ = ["ACHIEVED_EFFICIENCY", "ARTICLE_TABLE", "BAND", "FIGURES", "GPUS", "LEGEND", "LONG_CONTEXT",
           "MODELS", "MOE_MODELS", "MOE_SCENARIOS", "PLANNING_SHAPES", "RUNS", "TABLE_SCENARIOS",
           "Comparison", "Hardware", "MoEShape", "Plan", "PublishedRun", "all_to_all_bytes",
           "article_alternative", "article_report", "article_row", "article_scenario", "candidates",
           "compare", "complexity", "cp_verdict", "fastest_with_cp", "fastest_with_mesh", "format_plans",
           "gpu", "main", "memory_per_gpu", "model_flops_per_token", "model_of", "moe_parameters",
           "moe_shape", "parse_args", "plan", "price", "price_published", "published_report",
           "recommend", "recompute_fraction", "step_terms", "why_not"]
