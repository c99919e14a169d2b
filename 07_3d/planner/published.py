"""The planner against published runs: each run priced at its own layout (no search), and the
predicted figure beside the published one, in the source's own unit and definition.

    predicted tokens/s per GPU = global batch · s / (t_step · GPUs)
    predicted figure           = that × the source's FLOPs per token (its formula, below)

A source that reports TFLOP/s counts FLOPs its own way (Megatron-LM 2021 counts the recomputed
forward; Megatron-Core counts the output layer but not the embedding lookup), so the prediction
is converted with the same formula rather than compared with the planner's model FLOPs. `BAND` is how
far a bf16 prediction may fall from the published figure; FP8 runs are outside what the model
prices (a bf16 peak) and are only expected to come out below it.
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass, replace
from pathlib import Path

from common.kernel.model import LlamaConfig
from parallel3d.memory_model import GB, Layout, total_parameters
from parallel3d.planner.hardware import gpu
from parallel3d.planner.moe import MoEShape
from parallel3d.planner.pricing import Plan, model_of, price
from parallel3d.planner.published_runs import LEFT_OUT, RUNS, SHAPES, PublishedRun


def _megatron_2021(cfg: LlamaConfig, s: int) -> float:
    """Eq. 3 of the 2021 paper per token: 96·B·s·l·h²·(1 + s/6h + V/16lh) / (B·s), forward,
    backward and the recomputed forward of every layer, forward and backward of the logits."""
    L, h, V = cfg.n_layers, cfg.dim, cfg.vocab_size
    return 96 * L * h * h + 16 * L * s * h + 6 * h * V


def _megatron_core(cfg: LlamaConfig, s: int) -> float:
    """num_floating_point_operations (megatron/training/training.py at f2e5db40) per token for a
    GPT (MHA, MLP 4h, no SwiGLU): 12·L·h²·((2 + s/h) + 4) + 6hV = 72Lh² + 12Lhs + 6hV."""
    L, h, V = cfg.n_layers, cfg.dim, cfg.vocab_size
    return 72 * L * h * h + 12 * L * h * s + 6 * h * V


def _palm(cfg: LlamaConfig, s: int) -> float:
    """6N + 12·L·h·s with N every parameter: Llama 3 does not define its TFLOPs; PaLM's count."""
    return 6 * total_parameters(cfg) + 12 * cfg.n_layers * cfg.dim * s


# figure → (what the published number is, FLOPs per token of its definition or None for tokens)
FIGURES = {
    "megatron-2021 TFLOP/s": ("TFLOP/s per GPU, hardware FLOPs: Eq. 3, recomputation counted",
                              _megatron_2021),
    "megatron-core TFLOP/s": ("TFLOP/s per GPU (MFU = this / 989): Megatron-Core's model FLOPs",
                              _megatron_core),
    "palm TFLOP/s": ("TFLOP/s per GPU (Table 4's BF16 MFU = this / 989), read as 6N + 12·L·h·s",
                     _palm),
    "tokens/s": ("tokens per second per GPU", None),
}
BAND = 0.30  # |predicted / published - 1| for the bf16 runs (see the README's discussion)


@dataclass(frozen=True)
class Comparison:
    run: PublishedRun
    plan: Plan
    predicted: float

    @property
    def ratio(self) -> float:
        return self.predicted / self.run.value


def run_model(run: PublishedRun) -> tuple[LlamaConfig, MoEShape | None]:
    return (SHAPES[run.model], None) if run.model in SHAPES else model_of(run.model)


def price_published(run: PublishedRun, efficiency: float | None = None) -> Comparison:
    """The planner's step time at the run's own layout, converted to the run's figure."""
    cfg, moe = run_model(run)
    hw = gpu(run.gpu) if efficiency is None else gpu(run.gpu, efficiency=efficiency)
    layout = Layout(tp=run.tp, pp=run.pp, dp=run.dp, zero=run.zero, micro_batch=run.micro_batch,
                    virtual_stages=run.virtual_stages, recompute=run.recompute,
                    sequence_parallel=run.sequence_parallel and run.tp > 1, cp=run.cp, ep=run.ep,
                    schedule=run.schedule)
    if layout.gpus != run.gpus:
        raise ValueError(f"{run.name}: tp·cp·pp·dp = {layout.gpus}, not its {run.gpus} GPUs")
    plan = price(cfg, layout, run.seq_len, run.global_batch, run.gpu_mem_gb, hw, run.precision,
                 eager_attention=not run.flash_attention, moe=moe, act_bytes=run.act_bytes)
    tokens_per_gpu = run.global_batch * run.seq_len / (plan.step_s * run.gpus)
    flops = FIGURES[run.figure][1]
    return Comparison(run, plan, tokens_per_gpu * (flops(cfg, run.seq_len) / 1e12 if flops else 1))


def compare(efficiency: float | None = None) -> list[Comparison]:
    return [price_published(run, efficiency) for run in RUNS]


def memory_gb(c: Comparison) -> float:
    """The planner's memory per GPU of the busiest rank at the run's layout, in GB."""
    return c.plan.memory["total"] / GB


def fits(c: Comparison) -> bool:
    """A run that trained held its GPU: the priced memory within the GPU's (the picks keep 10%
    headroom on top; a published run shows what ran, not a margin)."""
    return c.plan.memory["total"] <= c.run.gpu_mem_gb * GB


def layout_name(c: Comparison) -> str:
    lo = c.plan.layout
    return (f"TP{lo.tp} PP{lo.pp}" + (f" v{lo.virtual_stages}" if lo.virtual_stages > 1 else "")
            + (" DualPipe" if lo.schedule == "dualpipe" else "") + (f" CP{lo.cp}" if lo.cp > 1 else "")
            + f" DP{lo.dp}" + (f" EP{lo.ep}" if lo.ep > 1 else "") + f" mb{lo.micro_batch} Z{lo.zero}"
            + f" {lo.recompute}")


def published_table() -> str:
    """Each run's layout, published and predicted figure, their ratio, the memory per GPU
    priced over the GPU's, the step's largest overheads: the block the planner's page shows
    (`write_readme` puts it there; a test compares)."""
    head = (f"{'run':<34}{'GPUs':>6} {'layout':<46}{'figure':<13}{'published':>10}{'predicted':>10}"
            f"{'ratio':>7}{'GB/GPU':>9}  priced overheads")
    lines = [head, "-" * len(head)]
    for c in compare():
        r, p = c.run, c.plan
        work = p.times["compute"] - p.times["bubble"]
        extra = {"bubble": p.times["bubble"], "TP": p.times["tp"], "PP": p.times["pp"],
                 "DP": p.times["dp_exposed"], "CP": p.times["cp_exposed"], "EP": p.times["ep"]}
        top = ", ".join(f"{k} {v / work:.0%}" for k, v in sorted(extra.items(), key=lambda kv: -kv[1])
                        if v / work >= 0.02) or "none"
        if p.times["ep_hidden"] / work >= 0.02:
            top += f" (EP {p.times['ep_hidden'] / work:.0%} hidden)"
        unit = r.figure.split()[-1] + (" FP8" if r.fp8 else "")
        gb = f"{memory_gb(c):.0f}/{r.gpu_mem_gb:.0f}"
        lines.append(f"{r.name:<34}{r.gpus:>6} {layout_name(c):<46}{unit:<13}{r.value:>10.0f}"
                     f"{c.predicted:>10.0f}{c.ratio:>7.2f}{gb:>9}  {top}")
    return "\n".join(lines)


def fit_steps(name: str = "DeepSeek-V3 pre-training") -> list[tuple[str, Comparison]]:
    """The run priced without what made it fit, then with each thing added in turn: the
    pipeline schedule, the precision, the recomputation, FP8 activation caching."""
    run = next(r for r in RUNS if r.name == name)
    base = replace(run, schedule="1f1b", precision="mixed", recompute="none", act_bytes=None)
    steps = [("1F1B, no recomputation, bf16 activations", base),
             ("+ DualPipe (two stages a rank, p+1 in flight; all-to-alls under the paired compute)",
              replace(base, schedule=run.schedule)),
             ("+ fp32 gradients and master, Adam's moments in bf16",
              replace(base, schedule=run.schedule, precision=run.precision)),
             ("+ norms, MLA up-projections and SwiGLU outputs recomputed",
              replace(run, act_bytes=None)),
             ("+ the linear layers' inputs cached in FP8 (the published run)", run)]
    return [(label, price_published(r)) for label, r in steps]


def fit_table(name: str = "DeepSeek-V3 pre-training") -> str:
    """`fit_steps` as the planner's page shows it: memory per GPU, step, predicted/published."""
    rows = fit_steps(name)
    run = rows[-1][1].run
    lines = [f"{name}, {layout_name(rows[-1][1])}, {run.gpus} × {run.gpu_mem_gb:.0f} GB {run.gpu}:"]
    for label, c in rows:
        lines.append(f"  {label:<86}{memory_gb(c):>6.1f} GB{c.plan.step_s:>7.2f} s{c.ratio:>6.2f}")
    return "\n".join(lines)


def published_report() -> str:
    """The table, the figures' definitions, the band, what was assumed, the sources, what was
    left out."""
    lines = [published_table()]
    notes = [*(f"{k}: {v[0]}" for k, v in FIGURES.items()),
             f"ratio = predicted / published; the test holds the bf16 runs and DeepSeek-V3 within "
             f"±{BAND:.0%}; FP8 runs are priced at the bf16 peak. Layout: Z the ZeRO level (0 DDP, 3 "
             "FSDP), then the recomputation (saved.py). GB/GPU: the busiest rank's memory priced, "
             "over the GPU's. Overheads: what the step spends beyond the work, as a fraction of it.",
             "measured memory (torchtitan's Memory(GiB), the allocator's peak) beside the priced: "
             + "; ".join(f"{c.run.name} {c.run.memory_gib * 2**30 / GB:.1f} GB measured, "
                         f"{memory_gb(c):.1f} priced" for c in compare() if c.run.memory_gib),
             "assumed (not stated by the source): "
             + "; ".join(sorted({f"{r.source.title.split(',')[0]}: {', '.join(r.assumed)}"
                                 for r in RUNS if r.assumed}))]
    lines += ["", *(textwrap.fill(n, 110, subsequent_indent="  ", break_on_hyphens=False)
                    for n in notes), "", "sources:"]
    seen = []
    for r in RUNS:
        if r.source not in seen:
            seen.append(r.source)
            lines.append(textwrap.fill(f"{r.source.title} ({r.source.year}), {r.source.where}; "
                                       f"{r.source.url}", 110, initial_indent="  ",
                                       subsequent_indent="    ", break_on_hyphens=False))
    lines += ["", "not found in the sources, or left out:",
              *(textwrap.fill(why, 110, initial_indent="  ", subsequent_indent="    ",
                              break_on_hyphens=False) for why in LEFT_OUT)]
    return "\n".join(lines)


README = Path(__file__).resolve().parent / "README.md"  # the planner's page
MARKER = "<!-- generated: python -m parallel3d.planner --write-readme (published runs); checked by tests -->"
FIT_MARKER = ("<!-- generated: python -m parallel3d.planner --write-readme (DeepSeek-V3's fit); "
              "checked by tests -->")


def _block(marker: str) -> re.Pattern:
    return re.compile(re.escape(marker) + r"\n```\n(.*?)\n?```", re.S)


def readme_block(text: str, marker: str = MARKER) -> str | None:
    """The fenced block after `marker` in a page's text, or None."""
    match = _block(marker).search(text)
    return match.group(1) if match else None


def write_readme(blocks: dict[str, str], path: Path = README) -> bool:
    """Put each {marker: content} into the page's block after that marker; whether it changed."""
    text = old_text = path.read_text(encoding="utf-8")
    for marker, content in blocks.items():
        if readme_block(text, marker) is None:
            raise ValueError(f"{path}: no block after {marker!r}: add the marker and an empty ``` block")
        new = f"{marker}\n```\n{content}\n```"
        text = _block(marker).sub(lambda _, new=new: new, text, count=1)
    path.write_text(text, encoding="utf-8")
    return text != old_text
