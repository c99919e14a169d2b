"""The planner's report: the table of priced candidates, why the pick beats another layout term
by term, whether it needs context parallelism, and the source article's numbers and
strategy-by-size table against the planner's picks (`--article`). Where the pick's pipeline
depth is not one the article's table names, `why_not` prices the article's depth beside it.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from common.kernel.model import LlamaConfig
from parallel3d.memory_model import GB, Layout, memory_per_gpu, total_parameters
from parallel3d.planner.hardware import gpu
from parallel3d.planner.moe import moe_parameters
from parallel3d.planner.pricing import (
    MODELS,
    Plan,
    fastest_with_cp,
    fastest_with_mesh,
    model_of,
    plan,
    recommend,
    step_terms,
)
from parallel3d.planner.published import fit_table, price_published
from parallel3d.planner.published_runs import RUNS

# The source article's strategy-by-size table: (max params in B, GPUs, its advice, the pipeline
# depths it names).
ARTICLE_TABLE = [
    (7.5, "1-8", "FSDP or ZeRO-2; no TP, no PP", (1, 1)),
    (13.5, "4-16", "ZeRO-2/3 or FSDP; TP 2-4 optional", (1, 1)),
    (70.5, "16-64", "TP 4-8 inside the node + FSDP; PP if several nodes", (1, 64)),
    (200.0, "64-256", "TP 8 + PP 4-8 + FSDP; multi-node", (4, 8)),
    (math.inf, "1000+", "TP 8 + PP 16+ + FSDP", (16, 1 << 30)),
]


def article_row(n_params: float) -> tuple[str, str, tuple[int, int]]:
    """The article's (GPUs, advice, pipeline depths) for a model of `n_params` parameters."""
    for max_b, gpus, advice, pp_range in ARTICLE_TABLE:
        if n_params / 1e9 <= max_b:
            return gpus, advice, pp_range
    raise AssertionError


def article_alternative(plans: list[Plan], pp_range: tuple[int, int]) -> Plan | None:
    """The fastest fitting layout with a pipeline depth the article names (and, like the
    article's table, no context parallelism)."""
    lo, hi = pp_range
    return min((p for p in plans if p.fits and p.layout.cp == 1 and lo <= p.layout.pp <= hi),
               key=lambda p: p.step_s, default=None)


def bubble_text(p: Plan) -> str:
    """A plan's bubble over its work, with the schedule's formula: (p-1)/(v·m) for 1F1B,
    (p/2-1)(F&B+B-3W) per rank for DualPipe."""
    lo, work = p.layout, p.times["compute"] - p.times["bubble"]
    if lo.schedule == "dualpipe":
        return f"({lo.pp}/2-1)(F&B+B-3W) = {p.times['bubble'] / work:.1%}"
    fraction = (lo.pp - 1) / (lo.virtual_stages * p.microbatches)
    return f"{lo.pp - 1}/({lo.virtual_stages}·{p.microbatches}) = {fraction:.1%}"


def why_not(pick: Plan, other: Plan) -> str:
    """Why the planner prefers `pick` to `other`: their step times term by term (what differs by
    more than 0.05 s), the bubbles (p-1)/(v·m), the memory per GPU."""
    a, b = step_terms(pick), step_terms(other)
    diff = ", ".join(f"{k} {b[k] - a[k]:+.2f} s" for k in a if abs(b[k] - a[k]) > 0.05)
    bubble = ", ".join(bubble_text(p) for p in (other, pick))
    return (f"{other.layout.describe()}: {other.step_s:.2f} s, "
            f"{other.step_s / pick.step_s - 1:+.0%} against the pick ({diff or 'no term differs'}); "
            f"bubble {bubble}; {other.memory['total'] / GB:.1f} GB vs "
            f"{pick.memory['total'] / GB:.1f} GB per GPU")


def article_scenario(cfg: LlamaConfig, gpus: int, zero: int) -> dict[str, float]:
    """The article's 86 GB (one GPU) and 11 GB (ZeRO-3 on 8): fp16 weights, gradients and Adam
    m, v (8 bytes per parameter); a batch of 8 sequences of 512 tokens split over the GPUs;
    attention without flash (scores and softmax kept), no recomputation."""
    layout = Layout(tp=1, pp=1, dp=gpus, zero=zero, micro_batch=8 // gpus, recompute="none",
                    sequence_parallel=False)
    return memory_per_gpu(cfg, layout, seq_len=512, microbatches=1, precision="article",
                          eager_attention=True)


def format_plans(plans: list[Plan], top: int) -> str:
    head = (f"{'tp':>3}{'cp':>4}{'pp':>4}{'v':>3}{'dp':>6}{'ep':>4}{'zero':>6}{'mb':>4}{'m':>5}{'AC':>10} |"
            f"{'weights':>8}{'grads':>7}{'optim':>7}{'activ':>7}{'total':>7} GB |"
            f"{'TP':>8}{'CP':>7}{'PP':>7}{'DP':>8}{'EP':>7} GB/step |{'step s':>8}{'MFU':>6}  fits")
    lines = [head, "-" * len(head)]
    for p in plans[:top]:
        lo = p.layout
        mem, c = {k: v / GB for k, v in p.memory.items()}, {k: v / GB for k, v in p.comm.items()}
        lines.append(
            f"{lo.tp:>3}{lo.cp:>4}{lo.pp:>4}{lo.virtual_stages:>3}{lo.dp:>6}{lo.ep:>4}{lo.zero:>6}"
            f"{lo.micro_batch:>4}{p.microbatches:>5}{lo.recompute:>10} |{mem['weights']:>8.1f}"
            f"{mem['grads']:>7.1f}{mem['optimizer']:>7.1f}{mem['activations']:>7.1f}"
            f"{mem['total']:>7.1f}    |{c['tp']:>8.1f}{c['cp']:>7.1f}{c['pp']:>7.2f}{c['dp']:>8.1f}"
            f"{c['ep']:>7.1f}"
            f"         |{p.step_s:>8.2f}{p.mfu:>6.0%}  {'yes' if p.fits else 'no'}")
    return "\n".join([*lines, "", LEGEND])


LEGEND = """\
tp, cp, pp, dp: tensor-, context-, pipeline- and data-parallel degrees (GPUs = tp·cp·pp·dp; mesh
  order tp, cp, dp, pp, innermost first); ep: of the dp·cp ranks, how many split a mixture of
  experts' experts (expert parallelism; 1 for a dense model); v: virtual stages per GPU
  (interleaved 1F1B when > 1, "v8" in a layout's name); zero: 0 DDP, 1 and 2 ZeRO-1/2, 3 FSDP
  (ZeRO-3), sharded over dp·cp (an MoE's experts over dp·cp/ep);
  mb: sequences per micro-batch (s/cp tokens of each on a GPU); m: micro-batches per replica
  per step; AC: activation recomputation ("AC none": every block keeps its activations;
  selective: the core attention (QKᵀ, softmax, ·V) is rerun, see recompute.py; full: a block
  keeps only its input).
GB: per GPU of the busiest pipeline stage (weights, grads, optimizer state, saved activations);
  GB/step: bytes each GPU sends per step along each dimension (EP: the busiest rank's
  all-to-alls); step s: the modelled step time (compute + bubble + TP + exposed CP, PP, DP + EP);
  MFU: model FLOPs·tokens / (step·GPUs·peak), Megatron-LM's model FLOPs: 6 × every matmul's
  parameters (the head, not the embedding lookup; an MoE's active ones) + the attention scores
  (12·L·h·s), recomputation not counted; fits: total ≤ headroom × GPU memory."""


def assumptions(flash_attention: bool = True, sequence_parallel: bool = True) -> str:
    """What the picks assume of the framework, in words (`--eager-attention` and
    `--no-sequence-parallel` price a run without them)."""
    flash = ("flash attention (no s×s scores kept)" if flash_attention else
             "eager attention (the s×s scores and softmax kept for backward)")
    sp = ("sequence parallelism at every TP > 1" if sequence_parallel else
          "no sequence parallelism (the norm regions hold every token on each TP rank)")
    return f"{flash}; {sp}"


def cp_verdict(plans: list[Plan], best: Plan | None) -> str:
    """Why the pick has (or lacks) context parallelism: the smallest CP-less footprint when
    nothing fits without CP, else what the model says CP would buy."""
    if best is None:
        return "CP: nothing fits even with it"
    if best.layout.cp > 1:
        without = [p for p in plans if p.layout.cp == 1]
        if not without:
            return ("CP: needed: without it no layout gives each pipeline replica at least p "
                    "micro-batches (too few sequences per step for the GPUs)")
        small = min(without, key=lambda p: p.memory["total"])
        return (f"CP: needed: the smallest CP-less footprint, {small.layout.describe()}, holds "
                f"{small.memory['total'] / GB:.1f} GB per GPU, "
                f"{small.memory['activations'] / GB:.1f} GB of them activations: more than fits")
    other = fastest_with_cp(plans)
    if other is None or other.step_s >= best.step_s:
        return "CP: not needed, and no faster with it"
    return (f"CP: not needed (a layout fits without it); the fastest with CP, "
            f"{other.layout.describe()}, is priced {1 - other.step_s / best.step_s:.0%} faster: "
            f"the model hides the ring behind attention and leaves out its costs (`recommend`)")


STRATEGY_MARKER = ("<!-- generated: python -m parallel3d.planner --write-readme (strategy by size); "
                   "checked by tests -->")


def strategy_table(plans_of: Callable[[str], list[Plan]] | None = None) -> str:
    """The article's strategy-by-size table recomputed: per TABLE_SCENARIOS row the pick, its
    memory per GPU, step time and MFU, beside the article's advice; where the pick's pipeline
    depth is not one the article names, its depth priced (`why_not`). `plans_of(name)`: the
    scenario's priced candidates (default: `plan` at 80 GB)."""
    scenarios = {name: (gpus, seq, batch) for name, gpus, seq, batch in TABLE_SCENARIOS}
    plans_of = plans_of or (lambda name: plan(MODELS[name], scenarios[name][0], 80, *scenarios[name][1:]))
    lines = [f"{'model':<17}{'GPUs':>6}  {'pick':<45}{'GB/GPU':>7}{'step s':>8}{'MFU':>5}  | the article"]
    for name, (gpus, _, _) in scenarios.items():
        plans = plans_of(name)
        best = recommend(plans)
        rows, advice, pp_range = article_row(total_parameters(MODELS[name]))
        pick = best.layout.describe() if best else "nothing fits"
        numbers = (f"{best.memory['total'] / GB:>7.1f}{best.step_s:>8.2f}{best.mfu:>5.0%}" if best
                   else " " * 20)
        lines.append(f"{name:<17}{gpus:>6}  {pick:<45}{numbers}  | {rows} GPUs: {advice}")
        other = article_alternative(plans, pp_range)
        if best and other and not pp_range[0] <= best.layout.pp <= pp_range[1]:
            lines.append(f"  the article's depth, priced: {why_not(best, other)}")
    return "\n".join(lines)


def article_report() -> str:
    """The source article's numbers, recomputed, and its table against the planner's picks."""
    cfg = MODELS["llama2-7b"]
    one, eight = article_scenario(cfg, 1, 0), article_scenario(cfg, 8, 3)
    lines = [f"llama2-7b ({total_parameters(cfg) / 1e9:.2f}B), the article's arithmetic "
             "(fp16 weights + grads + Adam m, v; 8 × 512 tokens; attention without flash):",
             "  one GPU:        " + ", ".join(f"{k} {v / GB:.1f} GB" for k, v in one.items()),
             "  ZeRO-3 on 8:    " + ", ".join(f"{k} {v / GB:.1f} GB" for k, v in eight.items()),
             "", "strategy by size (planner's pick, mixed precision, 4.2M tokens per step; 405B 16.8M;",
             f"  assumes {assumptions()}):", *("  " + line for line in strategy_table().splitlines())]
    name, gpus, seq, batch, mesh = LONG_CONTEXT
    plans = plan(MODELS[name], gpus, 80, seq, batch)
    best = recommend(plans)
    lines += ["", f"long context (not in the article): {name}, {gpus} GPUs, {batch} × {seq} "
              f"tokens per step: {best.layout.describe() if best else 'nothing fits'}",
              f"  {cp_verdict(plans, best)}"]
    llama3 = fastest_with_mesh(plans, *mesh)
    if best and llama3:
        lines.append(f"  Llama 3's TP {mesh[0]} × CP {mesh[1]} × PP {mesh[2]}, priced: "
                     f"{why_not(best, llama3)}")
    return "\n".join([*lines, "", *moe_report()])


def moe_report() -> list[str]:
    """The mixture-of-experts rows: the planner's pick, and the published layout priced."""
    lines = ["mixture of experts (EP borrows ranks from DP; all-to-alls priced on the critical "
             "path, balanced routing):"]
    for name, gpus, hw_name, seq, batch, published, label in MOE_SCENARIOS:
        cfg, moe = model_of(name)
        hw = gpu(hw_name)
        plans = plan(cfg, gpus, 80, seq, batch, hw, moe=moe, context_parallel=(1,))
        best = recommend(plans)
        size = (f"{moe_parameters(cfg, moe) / 1e9:.1f}B, {moe_parameters(cfg, moe, True) / 1e9:.1f}B "
                "active")
        pick = best.layout.describe() if best else "nothing fits"
        lines.append(f"  {name:<13} {gpus:>5} {hw_name}: {pick:<49} | {size}; {label}")
        if best and published:
            theirs = price_published(next(r for r in RUNS if r.name == published)).plan
            lines.append(f"    {label.split(':')[0]}'s layout, priced with its schedule, recomputation and "
                         f"FP8 activations, none of which the search tries: {why_not(best, theirs)}")
            lines += ["    what made it fit, each priced in turn (GB per GPU, step, predicted/published):",
                      *("    " + line for line in fit_table(published).splitlines()[1:])]
        ep = min((p for p in plans if p.fits and p.layout.ep > 1), key=lambda p: p.step_s, default=None)
        if best and ep and best.layout.ep == 1:
            lines.append(f"    the fastest with EP: {why_not(best, ep)}")
    return lines


# (model, GPUs, seq_len, global batch in sequences): one scenario per row of the article's table.
TABLE_SCENARIOS = [
    ("llama2-7b", 8, 4096, 1024),
    ("llama2-13b", 16, 4096, 1024),
    ("llama2-70b", 64, 4096, 1024),
    ("llama-175b-shape", 256, 4096, 1024),
    ("llama3.1-405b", 16384, 8192, 2048),
]
# (model, GPUs, GPU, seq_len, global batch, its published run's name or None, what is known of it)
MOE_SCENARIOS = [
    ("mixtral-8x7b", 64, "H100", 4096, 1024, None, "not in the article; no training layout published"),
    ("deepseek-v3", 2048, "H800", 4096, 15360, "DeepSeek-V3 pre-training",
     "DeepSeek-V3: the article's 671B MoE on 2,048 H800s, run as PP 16 (DualPipe) × EP 64 × ZeRO-1, "
     "no TP (its report)"),
]
# Llama 3 405B's long-context stage (Llama 3 paper, Table 4): 16,384 GPUs, 16M tokens per step
# of 128K-token sequences, on a TP 8 × CP 16 × PP 16 mesh.
LONG_CONTEXT = ("llama3.1-405b", 16384, 131072, 128, (8, 16, 16))
