"""Plan a layout: which (TP, CP, PP, DP, ZeRO level, micro-batch, recompute) fits a model on G GPUs
of M GB, what each GPU holds, what it sends, and which one to pick.

    pricing.py   candidates, their memory / traffic / step time (memory_model), the pick: pure
    report.py    the table, why the pick beats another layout, the source article's comparison
    cli.py       `python -m parallel3d.planner --model llama2-70b --gpus 64 --gpu-mem-gb 80`
"""

from parallel3d.planner.cli import main, parse_args
from parallel3d.planner.pricing import (
    MODELS,
    PLANNING_SHAPES,
    Hardware,
    Plan,
    candidates,
    complexity,
    fastest_with_cp,
    fastest_with_mesh,
    model_flops_per_token,
    plan,
    price,
    recommend,
    recompute_fraction,
    step_terms,
)
from parallel3d.planner.report import (
    ARTICLE_TABLE,
    LEGEND,
    LONG_CONTEXT,
    TABLE_SCENARIOS,
    article_alternative,
    article_report,
    article_row,
    article_scenario,
    cp_verdict,
    format_plans,
    why_not,
)

__all__ = ["ARTICLE_TABLE", "LEGEND", "LONG_CONTEXT", "MODELS", "PLANNING_SHAPES", "TABLE_SCENARIOS",
           "Hardware", "Plan", "article_alternative", "article_report", "article_row", "article_scenario",
           "candidates", "complexity", "cp_verdict", "fastest_with_cp", "fastest_with_mesh",
           "format_plans", "main", "model_flops_per_token", "parse_args", "plan", "price", "recommend",
           "recompute_fraction", "step_terms", "why_not"]
