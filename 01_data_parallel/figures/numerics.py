"""The numerics page's figures: the formats' ranges and ulps from torch.finfo, an update below
bf16's ulp vanishing without an fp32 master (a real run of `tiny`), and fp16's underflow and its
dynamic loss scale (a real run with common/loss_scaler.py)."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from common.data import SyntheticTokens, split_inputs_targets
from common.figures import Figure, Source, draw
from common.kernel.model import build_model, get_config, loss_fn
from common.loss_scaler import LossScaling
from common.numerics import FORMATS, float_format, lost_updates
from common.reference import make_reference

log2 = math.log2


# ---------------------------------------------------------------------------------------------
# num_formats: each format's range (smallest subnormal … max) and its ulp at 1


def formats_data(names: tuple[str, ...] = tuple(FORMATS)) -> dict:
    """`float_format` (torch.finfo) of each format, in log₂ where the figure plots it."""
    out = {}
    for name in names:
        f = float_format(FORMATS[name])
        out[name] = {**f, "log2": {k: log2(f[k]) for k in ("max", "smallest_normal", "smallest_subnormal",
                                                            "eps")}}
    return {"formats": out}


def formats_draw(data: dict):
    fig, (left, right) = draw.figure(height=3.2, ncols=2, nrows=1, gridspec_kw={"width_ratios": [2.3, 1]})
    names = list(data["formats"])
    for i, name in enumerate(names):
        f, lg = data["formats"][name], data["formats"][name]["log2"]
        color = draw.rank_color(i)
        left.barh(i, lg["smallest_normal"] - lg["smallest_subnormal"], left=lg["smallest_subnormal"],
                  color=color, alpha=0.3, height=0.6)
        left.barh(i, lg["max"] - lg["smallest_normal"], left=lg["smallest_normal"], color=color, height=0.6)
        left.text(lg["max"] + 3, i, f"max {f['max']:.4g}", va="center", fontsize=draw.SMALL)
        right.barh(i, -lg["eps"], color=color, height=0.6)
        right.text(-lg["eps"] + 0.5, i, f"2^{lg['eps']:.0f}  ({f['mantissa_bits']} stored bits)", va="center",
                   fontsize=draw.SMALL)
    for ax in (left, right):
        ax.set_yticks(range(len(names)),
                      [f"{n} (e{data['formats'][n]['exponent_bits']}m{data['formats'][n]['mantissa_bits']})"
                       for n in names], fontsize=8)
        ax.invert_yaxis()
    left.axvline(0, color="#555555", lw=0.6)
    left.set_xlim(-155, 175)
    left.set_xlabel("log₂ |x|: faint from the smallest subnormal, solid from the smallest normal to max")
    left.set_title("Range: what a format can hold at all", loc="left", fontsize=9)
    right.set_xlim(0, 40)
    right.set_xlabel("−log₂ ulp(1): bits of precision")
    right.set_title("Precision: the spacing at 1", loc="left", fontsize=9)
    fig.suptitle("Five formats, from torch.finfo: bf16 keeps fp32's range with fp16's width; fp16 and the "
                 "float8s trade range for precision", x=0.01, ha="left", fontsize=9.5)
    fig.tight_layout()
    return fig


# ---------------------------------------------------------------------------------------------
# num_bf16_updates: a real run of tiny, with and without an fp32 master


def bf16_updates_data(steps: int = 16, lr: float = 1e-3, lrs: tuple[float, ...] = (1e-2, 1e-3, 1e-4, 1e-5),
                      model: str = "tiny", n_layers: int = 2, batch: int = 4, seq_len: int = 16) -> dict:
    """Two single-device trainers from common.reference on the same batches: the bf16 mixed recipe
    (fp32 masters, a bf16 copy computes) and bf16 parameters stepped in place, AdamW at `lr`. Per
    step, the mean |θ − 1| of the RMSNorm weights (init 1, ulp 2⁻⁷ there): the fp32 master, its
    bf16 copy and the bf16-only model. And from the last step's master update Δ (direction Δ/lr),
    the fraction of elements `lost_updates` finds lost in bf16 at each of `lrs`, per tensor kind."""
    cfg = get_config(model, n_layers=n_layers)
    mixed = make_reference(cfg, 0, torch.float32, "adamw", lr, mixed_precision="bf16")
    plain = make_reference(cfg, 0, torch.bfloat16, "adamw", lr)
    data = SyntheticTokens(cfg.vocab_size, seq_len, seed=0)
    norms = lambda trainer: [p for n, p in trainer.model.named_parameters() if "norm" in n]  # noqa: E731
    drift = lambda ps: float(torch.cat([(p.detach().double() - 1).abs().flatten() for p in ps]).mean())  # noqa: E731
    rows = {"fp32 master": [0.0], "its bf16 copy": [0.0], "bf16 only": [0.0]}
    before = {}
    for step in range(steps):
        tokens = data.global_batch(step, batch)
        before = {n: p.detach().clone() for n, p in mixed.model.named_parameters()}
        mixed.step(tokens)
        plain.step(tokens)
        rows["fp32 master"].append(drift(norms(mixed)))
        rows["its bf16 copy"].append(drift([p.to(torch.bfloat16) for p in norms(mixed)]))
        rows["bf16 only"].append(drift(norms(plain)))
    lost = {}
    for name, p in mixed.model.named_parameters():
        kind = "RMSNorm weights (≈ 1)" if "norm" in name else "matrices (≈ 0.02)"
        direction = (p.detach() - before[name]) / lr
        for r in lrs:
            hits, total = lost.setdefault(kind, {}).setdefault(r, [0, 0]), direction.numel()
            hits[0] += int(lost_updates(before[name], r * direction, torch.bfloat16).sum())
            hits[1] += total
    # bf16 matmuls round differently per CPU kernel (avx2, avx512, default): the figure keeps two
    # significant digits, what it draws, so that its data is the same on every machine
    two = lambda x: float(f"{x:.2g}")  # noqa: E731
    return {"steps": steps, "lr": lr, "rows": {k: [two(x) for x in v] for k, v in rows.items()},
            "half_ulp_at_1": 2.0**-8,
            "lost": {k: {str(r): two(h / t) for r, (h, t) in v.items()} for k, v in lost.items()}}


def bf16_updates_draw(data: dict):
    fig, (left, right) = draw.figure(height=3.4, ncols=2, nrows=1)
    for i, (kind, fractions) in enumerate(data["lost"].items()):
        lrs = [float(r) for r in fractions]
        left.plot(lrs, [100 * v for v in fractions.values()], "o-", color=draw.rank_color(i), label=kind)
    left.set(xscale="log", xlabel="learning rate (the same AdamW direction)", ylabel="% of elements unmoved")
    left.invert_xaxis()
    left.set_ylim(-3, 103)
    left.legend(fontsize=draw.SMALL, loc="upper left")
    left.set_title("One step's update kept in bf16 without a master", loc="left", fontsize=9)
    steps = range(data["steps"] + 1)
    for i, (label, values) in enumerate(data["rows"].items()):
        right.plot(steps, values, "o-" if i else "-", color=draw.rank_color(i), label=label, ms=3)
    right.axhline(data["half_ulp_at_1"], color="#555555", ls="--", lw=0.8)
    right.text(0, data["half_ulp_at_1"] * 1.05, "half of bf16's ulp at 1 (2⁻⁸)", fontsize=draw.SMALL,
               va="bottom")
    right.set(xlabel="step", ylabel="mean |θ − 1| of the RMSNorm weights")
    right.legend(fontsize=draw.SMALL, loc="center right")
    right.set_title(f"A real run of tiny, AdamW at lr {data['lr']:g}", loc="left", fontsize=9)
    fig.tight_layout()
    return fig


def lr_times_four(trainer):
    """A perturbation for the test: the trainer's optimizer at four times the learning rate."""
    for group in trainer.optimizer.param_groups:
        group["lr"] *= 4
    return trainer


# ---------------------------------------------------------------------------------------------
# num_fp16_scaling: where tiny's gradients fall in fp16, and the scale of a real fp16 run


def fp16_scaling_data(scale_log2: int = 16, loss_factor: float = 1 / 256, steps: int = 12,
                      init_log2: int = 24, growth_interval: int = 3, model: str = "tiny") -> dict:
    """tiny's fp32 gradient elements of loss_factor · loss (a histogram of log₂|g|, against fp16's
    smallest subnormal and normal, and after × 2^scale_log2); and `steps` steps of the fp16 recipe
    (make_reference, its DynamicLossScaler from 2^init_log2, growing every `growth_interval` good
    steps): the scale each step ran with and whether it was skipped."""
    cfg = get_config(model, n_layers=2)
    fmt = float_format(torch.float16)
    m = build_model(cfg, seed=0)
    inputs, targets = split_inputs_targets(SyntheticTokens(cfg.vocab_size, 16, seed=0).global_batch(0, 4))
    (loss_fn(m(inputs), targets) * loss_factor).backward()
    g = torch.cat([p.grad.flatten() for p in m.parameters()]).abs()
    g = g[g > 0].double().log2()
    bins = list(range(-40, 1))
    trainer = make_reference(cfg, 0, torch.float32, "adamw", 1e-3, mixed_precision="fp16",
                             loss_scaling=LossScaling(2.0**init_log2, 2.0, 0.5, growth_interval))
    data, scales, skipped = SyntheticTokens(cfg.vocab_size, 16, seed=0), [], []
    for step in range(steps):
        scales.append(trainer.scaler.get_scale())
        trainer.step(data.global_batch(step, 4))
        skipped.append(bool(trainer.scaler.found_inf.item()))
    below = lambda x: float((g < x).double().mean())  # noqa: E731
    return {"hist": torch.histc(g, bins=len(bins) - 1, min=bins[0], max=bins[-1]).tolist(), "bins": bins,
            "subnormal": log2(fmt["smallest_subnormal"]), "normal": log2(fmt["smallest_normal"]),
            "max": log2(fmt["max"]), "scale_log2": scale_log2, "loss_factor": loss_factor,
            "flushed": below(log2(fmt["smallest_subnormal"]) - 1),
            "flushed_scaled": below(log2(fmt["smallest_subnormal"]) - 1 - scale_log2),
            "scales": scales, "skipped": skipped, "growth_interval": growth_interval}


def fp16_scaling_draw(data: dict):
    fig, (left, right) = draw.figure(height=3.4, ncols=2, nrows=1, gridspec_kw={"width_ratios": [1.4, 1]})
    bins, hist, s = data["bins"], data["hist"], data["scale_log2"]
    left.bar(bins[:-1], hist, width=1, align="edge", color="#999999", label="|g| (fp32)")
    left.bar([b + s for b in bins[:-1]], hist, width=1, align="edge", color="#0072B2", alpha=0.5,
             label=f"|g| · 2^{s}")
    marks = ((data["subnormal"], "fp16's smallest subnormal", "#D55E00"),
             (data["normal"], "smallest normal", "#E69F00"), (data["max"], "max 65504", "#D55E00"))
    for x, text, color in marks:
        left.axvline(x, color=color, ls="--", lw=0.9)
        left.text(x + 0.3, max(hist) * 0.95, text, rotation=90, va="top", fontsize=draw.SMALL, color=color)
    left.set(xlabel="log₂ |g|", ylabel="gradient elements")
    left.legend(fontsize=draw.SMALL, loc="upper left")
    left.set_title(f"tiny's gradients of loss / {round(1 / data['loss_factor'])}: "
                   f"{100 * data['flushed']:.0f}% flush to 0 in fp16,\n"
                   f"{100 * data['flushed_scaled']:.1f}% after × 2^{s}", loc="left", fontsize=8.5)
    steps = range(len(data["scales"]))
    right.step(steps, [log2(v) for v in data["scales"]], where="post", color="#0072B2")
    for i, skip in enumerate(data["skipped"]):
        if skip:
            right.plot([i], [log2(data["scales"][i])], "x", color="#D55E00", ms=7, mew=2)
    right.set(xlabel="step", ylabel="log₂ of the loss scale s")
    right.set_title(f"A real fp16 run: × marks a skipped step (an inf);\nback off ÷2, grow ×2 after "
                    f"{data['growth_interval']} good steps", loc="left", fontsize=8.5)
    fig.tight_layout()
    return fig


def interval_of_one(scaler):
    """A perturbation for the test: a scaler that grows after every good step."""
    scaler.settings = replace(scaler.settings, growth_interval=1)
    return scaler


FIGURES = [
    Figure(name="num_formats", path="01_data_parallel/figures/num_formats.svg", data=formats_data,
           draw=formats_draw,
           sources=(Source("common.numerics:float_format", perturb=lambda f: {**f, "max": 2 * f["max"]}),),
           alt="the range and the spacing at 1 of fp32, bf16, fp16, e4m3 and e5m2, from torch.finfo"),
    Figure(name="num_bf16_updates", path="01_data_parallel/figures/num_bf16_updates.svg",
           data=bf16_updates_data, draw=bf16_updates_draw,
           sources=(Source("common.reference:make_reference", perturb=lr_times_four),
                    Source("common.numerics:lost_updates", perturb=lambda lost: ~lost)),
           alt="updates below half of bf16's ulp vanish from bf16 parameters; an fp32 master keeps them"),
    Figure(name="num_fp16_scaling", path="01_data_parallel/figures/num_fp16_scaling.svg",
           data=fp16_scaling_data, draw=fp16_scaling_draw,
           sources=(Source("common.numerics:float_format", perturb=lambda f: {**f, "max": 2 * f["max"]}),
                    Source("common.loss_scaler:DynamicLossScaler", perturb=interval_of_one)),
           alt="tiny's gradients against fp16's range, shifted by the loss scale; the scale of a real run"),
]
