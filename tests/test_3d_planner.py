"""Chapter 07, the single-process pieces: the planner against the source article's figures and
against the measured ledger, the LR schedule, activation checkpointing equal to none."""

from __future__ import annotations

import functools
import itertools
import math

import pytest
import torch

from common.memory import ActivationMeter
from common.model import CONFIGS, LlamaConfig, build_model, count_parameters, loss_fn
from parallel3d.lr_schedule import warmup_cosine, warmup_cosine_scheduler
from parallel3d.memory_model import (
    GB,
    Layout,
    head_activation_bytes,
    layer_activation_bytes,
    memory_per_gpu,
    parameters_per_gpu,
    stage_layers,
    total_parameters,
)
from parallel3d.planner import (
    MODELS,
    TABLE_SCENARIOS,
    Hardware,
    article_alternative,
    article_row,
    article_scenario,
    main,
    plan,
    price,
    recommend,
    step_terms,
    why_not,
)
from parallel3d.recompute import apply_recompute, unwrapped_name


@functools.cache
def planned(name: str) -> list:
    """The table scenario's priced candidates (80 GB GPUs), computed once for the module."""
    _, gpus, seq, batch = next(row for row in TABLE_SCENARIOS if row[0] == name)
    return plan(MODELS[name], gpus, 80, seq, batch)


# --- the source article's numbers ---------------------------------------------------------------

def test_7b_needs_about_86_gb_on_one_gpu():
    """14 GB fp16 weights + 42 GB (grads + Adam m, v) + 30 GB activations ≈ 86 GB."""
    mem = article_scenario(CONFIGS["llama2-7b"], gpus=1, zero=0)
    assert mem["weights"] / GB == pytest.approx(14, rel=0.05)
    assert (mem["grads"] + mem["optimizer"]) / GB == pytest.approx(42, rel=0.05)
    assert mem["activations"] / GB == pytest.approx(30, rel=0.1)
    assert mem["total"] / GB == pytest.approx(86, rel=0.05)


def test_zero3_on_8_gpus_needs_about_11_gb():
    mem = article_scenario(CONFIGS["llama2-7b"], gpus=8, zero=3)
    assert mem["total"] / GB == pytest.approx(11, rel=0.1)


def test_weights_of_70b_and_405b_in_fp16():
    """The article: ~140 GB of weights for 70B, ~810 GB for 405B."""
    assert 2 * total_parameters(CONFIGS["llama2-70b"]) / GB == pytest.approx(140, rel=0.02)
    assert 2 * total_parameters(CONFIGS["llama3.1-405b"]) / GB == pytest.approx(810, rel=0.01)


@pytest.mark.parametrize("name", list(MODELS))
def test_parameter_count_formula_equals_the_model(name):
    model = build_model(MODELS[name], device="meta")
    assert total_parameters(MODELS[name]) == count_parameters(model)
    assert parameters_per_gpu(MODELS[name], 1, 1) == count_parameters(model)


def test_llama31_405b_at_tp8_pp16_dp128_fits_on_16k_gpus():
    """The article's example: 8 × 16 = 128 GPUs per model copy, 128 copies on 16,384 H100s."""
    cfg = CONFIGS["llama3.1-405b"]
    layout = Layout(tp=8, pp=16, dp=128, zero=1, micro_batch=1, virtual_stages=4, recompute="full")
    p = price(cfg, layout, seq_len=8192, global_batch=2048, gpu_mem_gb=80, hw=Hardware())
    assert layout.gpus == 16384 and p.fits, p.memory
    assert stage_layers(126, 16) == [8] * 14 + [7] * 2
    best = recommend(planned("llama3.1-405b"))
    assert best.layout.tp == 8 and best.layout.pp >= 8
    assert p.step_s <= 1.25 * best.step_s


@pytest.mark.parametrize("model, ok", [
    # ≤7B, 1-8 GPUs: FSDP or ZeRO-2, no TP, no PP
    ("llama2-7b", lambda lo: lo.tp == 1 and lo.pp == 1 and lo.zero >= 2),
    # 7-13B, 4-16 GPUs: ZeRO-2/3 or FSDP, TP 2-4 optional
    ("llama2-13b", lambda lo: lo.tp <= 4 and lo.pp == 1 and lo.zero >= 2),
    # 30-70B, 16-64 GPUs: TP 4-8 inside the node + FSDP, PP if several nodes (8 nodes: PP 4)
    ("llama2-70b", lambda lo: lo.tp == 4 and lo.pp == 4 and lo.zero >= 2),
    # 70-200B, 64-256 GPUs: TP 8 + PP 4-8 + FSDP (the planner: ZeRO-1, see the next test)
    ("llama-175b-shape", lambda lo: lo.tp == 8 and 4 <= lo.pp <= 8 and lo.recompute == "none"),
    # 400B+, 1000+ GPUs: TP 8 + PP 16+ + FSDP (the planner: PP 8 v8, see the test after)
    ("llama3.1-405b", lambda lo: (lo.tp, lo.pp, lo.virtual_stages, lo.recompute) == (8, 8, 8, "full")),
])
def test_recommendation_follows_the_articles_table(model, ok):
    best = recommend(planned(model))
    assert best is not None and ok(best.layout), best.layout


def test_175b_takes_the_articles_pp_4_to_8_because_pp_2_holds_too_much_per_stage():
    """PP 2 holds 48 blocks per GPU: with its gradients whole (DDP, ZeRO-1, which accumulate over
    the micro-batches) it fits only with full recomputation (+ a third of a forward); with them
    sharded (ZeRO-2, FSDP) every one of its 64 micro-batches reduce-scatters 18.5 GB of shards
    over the network, and that traffic no longer hides behind a micro-batch's backward."""
    plans = planned("llama-175b-shape")
    best = recommend(plans)
    assert article_alternative(plans, article_row(175e9)[2]) is not None
    pp2 = [p for p in plans if p.layout.pp == 2 and p.fits]
    assert all(p.layout.zero >= 2 or p.layout.recompute == "full" for p in pp2)
    fastest = min(pp2, key=lambda p: p.step_s)
    extra = {k: step_terms(fastest)[k] - v for k, v in step_terms(best).items()}
    assert fastest.layout.zero >= 2 and extra["DP"] > 1.0 and fastest.step_s > best.step_s, extra
    unsharded = min((p for p in pp2 if p.layout.zero <= 1), key=lambda p: p.step_s)
    assert unsharded.step_s > 1.25 * best.step_s


def test_405b_at_the_articles_pp_16_pays_a_bubble_twice_as_large():
    """2,048 sequences on 16,384 GPUs at TP 8: every replica runs m = p micro-batches, so the
    bubble (p-1)/(v·m) ≈ 1/v, and v ≤ L/p: 126 layers take PP 8 × v 8 (11%) but only PP 16 × v 4
    (23%: 16 × 8 chunks would need 128 layers). The bubble is most of PP 16's extra step time."""
    plans = planned("llama3.1-405b")
    best = recommend(plans)
    other = article_alternative(plans, article_row(405e9)[2])
    assert other.layout.pp == 16 and other.layout.virtual_stages == 4
    extra = {k: step_terms(other)[k] - v for k, v in step_terms(best).items()}
    assert other.step_s > 1.1 * best.step_s
    assert extra["bubble"] > 0.5 * (other.step_s - best.step_s), extra
    assert "bubble 15/(4·16) = 23.4%, 7/(8·8) = 10.9%" in why_not(best, other)


def test_nothing_fits_is_reported():
    assert recommend(plan(CONFIGS["llama2-70b"], 1, 80, 4096, 8)) is None


def test_cli_prints_candidates_and_a_recommendation(capsys):
    assert main(["--model", "llama2-70b", "--gpus", "64", "--gpu-mem-gb", "80", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "recommended: TP" in out and "article's table" in out
    assert "its pipeline depth, priced" not in out  # PP 4 is among the depths the article names
    assert main(["--model", "llama3.1-405b", "--gpus", "16384", "--seq-len", "8192",
                 "--global-batch", "2048", "--top", "0"]) == 0
    assert "its pipeline depth, priced: TP 8 × PP 16 v4" in capsys.readouterr().out
    assert main(["--gpus", "0"]) == 2


# --- the memory model against the measured ledger ------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("mode", ["none", "selective", "full"])
@pytest.mark.parametrize("cfg", [
    LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, multiple_of=16),
    LlamaConfig(dim=96, n_layers=3, n_heads=6, n_kv_heads=6, vocab_size=128, multiple_of=32),
])
def test_activation_formula_within_10_percent_of_the_ledger(cfg, mode, dtype):
    """Saved activations (what the ledger's saved-tensor hooks see: the recomputation's own
    transient is not among them) against L · per-layer + head."""
    batch, seq = 2, 24
    model = build_model(cfg, 0, dtype)
    apply_recompute(model.layers, mode)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1))
    with ActivationMeter(model.parameters()) as meter:
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    e = torch.empty((), dtype=dtype).element_size()
    formula = (cfg.n_layers * layer_activation_bytes(cfg, batch * seq, seq, recompute=mode, elem=e)
               + head_activation_bytes(cfg, batch * seq, seq, elem=e))
    assert meter.peak_bytes == pytest.approx(formula, rel=0.1)


def test_model_state_formula_equals_bytes_per_parameter():
    """fp32: 4 + 4 + 8 bytes per parameter, and Adam's float32 step count per flat tensor (one
    per block, one for the embedding, norm and head)."""
    cfg = CONFIGS["small"]
    mem = memory_per_gpu(cfg, Layout(), seq_len=64, microbatches=1, precision="fp32")
    n = count_parameters(build_model(cfg, device="meta"))
    units = cfg.n_layers + 1
    assert (mem["weights"], mem["grads"], mem["optimizer"]) == (4 * n, 4 * n, 8 * n + 4 * units)


# --- activation checkpointing ------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["full", "selective"])
def test_activation_checkpointing_equals_none_in_float64(mode):
    cfg = LlamaConfig(dim=32, n_layers=3, n_heads=4, n_kv_heads=2, vocab_size=64, multiple_of=16)
    tokens = torch.randint(0, 64, (2, 13), generator=torch.Generator().manual_seed(0))
    grads = {}
    for m in ("none", mode):
        model = build_model(cfg, 0, torch.float64)
        apply_recompute(model.layers, m)
        loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
        loss.backward()
        grads[m] = (loss.item(), {unwrapped_name(n): p.grad for n, p in model.named_parameters()})
    assert grads[mode][0] == grads["none"][0]
    assert grads[mode][1].keys() == grads["none"][1].keys()
    for name, g in grads["none"][1].items():
        assert torch.equal(grads[mode][1][name], g), name


def test_unknown_checkpointing_mode_is_rejected():
    with pytest.raises(ValueError, match="use one of none, full, selective"):
        apply_recompute([], "some")


# --- LR schedule ---------------------------------------------------------------------------------

def test_warmup_then_cosine_to_min_ratio():
    f = [warmup_cosine(s, 100, 10, 0.1) for s in range(100)]
    assert f[0] == pytest.approx(0.1) and f[9] == pytest.approx(1.0)
    assert all(a < b for a, b in itertools.pairwise(f[:10]))
    assert f[10] == pytest.approx(1.0)
    assert f[55] == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert all(a >= b for a, b in itertools.pairwise(f[10:]))
    assert warmup_cosine(100, 100, 10, 0.1) == pytest.approx(0.1)


def test_scheduler_sets_the_optimizer_rate_per_step():
    p = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.SGD([p], lr=2.0)
    sched = warmup_cosine_scheduler(opt, total_steps=20, warmup_steps=4)
    seen = []
    for _ in range(20):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen == pytest.approx([2.0 * warmup_cosine(s, 20, 4) for s in range(20)])
