"""Chapter 07, the single-process pieces: the planner against the source article's figures and
against the measured ledger, the LR schedule, activation checkpointing equal to none."""

from __future__ import annotations

import functools
import itertools
import math
from unittest import mock

import pytest
import torch

from common.kernel.model import CONFIGS, LlamaConfig, build_model, count_parameters, loss_fn
from common.memory import ActivationMeter
from parallel3d.lr_schedule import warmup_cosine, warmup_cosine_scheduler
from parallel3d.memory_model import (
    GB,
    Layout,
    activation_bytes,
    comm_bytes_per_gpu,
    head_activation_bytes,
    layer_activation_bytes,
    memory_per_gpu,
    parameters_per_gpu,
    stage_layers,
    total_parameters,
)
from parallel3d.planner import (
    LONG_CONTEXT,
    MODELS,
    TABLE_SCENARIOS,
    Hardware,
    article_alternative,
    article_row,
    article_scenario,
    cp_verdict,
    fastest_with_cp,
    fastest_with_mesh,
    main,
    plan,
    price,
    recommend,
    step_terms,
    why_not,
)
from parallel3d.planner.saved import block_saved_terms
from parallel3d.recompute import apply_recompute, unwrapped_name
from tensor_parallel.formulas import cp_comm_bytes


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
    # 7-13B, 4-16 GPUs: ZeRO-2/3 or FSDP, TP 2-4 optional (the planner: none, see below)
    ("llama2-13b", lambda lo: lo.tp == 1 and lo.pp == 1 and lo.zero >= 2),
    # 30-70B, 16-64 GPUs: TP 4-8 inside the node + FSDP, PP if several nodes (the planner: TP 2
    # and FSDP over 32, no PP: with fused kernels and K/V unrepeated 80 blocks fit in 64 GB)
    ("llama2-70b", lambda lo: lo.tp == 2 and lo.pp == 1 and lo.zero == 3),
    # 70-200B, 64-256 GPUs: TP 8 + PP 4-8 + FSDP (the planner: TP 4, see the next test)
    ("llama-175b-shape", lambda lo: lo.tp == 4 and 4 <= lo.pp <= 8 and lo.recompute == "none"),
    # 400B+, 1000+ GPUs: TP 8 + PP 16+ + FSDP (the planner: PP 8 v8, see the test after)
    ("llama3.1-405b", lambda lo: (lo.tp, lo.pp, lo.virtual_stages, lo.recompute) == (8, 8, 8, "none")),
])
def test_recommendation_follows_the_articles_table(model, ok):
    best = recommend(planned(model))
    assert best is not None and ok(best.layout), best.layout


def test_175b_at_the_articles_tp_8_costs_its_collectives_for_memory_it_does_not_need():
    """With SP's activations at 1/t, TP 4 × PP 4 fits without recomputation (the pick), and the
    article's TP 8 (at PP 4) is priced within 5% of it: +2.7 s of TP collectives, half of it
    back in a smaller bubble. Simplest-within-5% takes TP 4."""
    plans = planned("llama-175b-shape")
    best = recommend(plans)
    tp8 = fastest_with_mesh(plans, 8, 1, 4)
    extra = {k: step_terms(tp8)[k] - v for k, v in step_terms(best).items()}
    assert (best.layout.tp, best.layout.pp) == (4, 4) and best.layout.recompute == "none"
    assert best.step_s < tp8.step_s <= 1.05 * best.step_s
    assert extra["TP"] > 2.0 and extra["bubble"] < 0, extra


def test_planner_page_shows_the_strategy_table_the_planner_prints_now():
    """07_3d/planner/README.md's strategy-by-size block is `strategy_table` of today's code."""
    from parallel3d.planner.published import README, readme_block
    from parallel3d.planner.report import STRATEGY_MARKER, strategy_table

    assert readme_block(README.read_text(encoding="utf-8"), STRATEGY_MARKER) == strategy_table(planned), (
        "07_3d/planner/README.md's strategy-by-size table is stale: run "
        "`python -m parallel3d.planner --write-readme` and update the prose around it")


def test_13b_needs_no_tp_once_dp_uses_every_nic_of_its_nodes():
    """13B on 2 nodes: at TP 1 a node holds 8 members of the DP group and NCCL's rings use its
    8 NICs, so FSDP over 16 GPUs hides all of its traffic. Priced with one NIC per GPU whatever
    t (the formula before), the DP traffic looked 8× dearer: FSDP's gathers no longer hid and
    the pick fell back to ZeRO-2 with a second of DP exposed."""
    best = recommend(planned("llama2-13b"))
    assert (best.layout.tp, best.layout.zero) == (1, 3) and best.times["dp_exposed"] == 0
    one_nic = mock.patch.object(Hardware, "ring_bandwidth",
                                lambda self, n, stride: self.bandwidth(n * stride))
    with one_nic:
        other = recommend(plan(MODELS["llama2-13b"], 16, 80, 4096, 1024))
    assert other.layout.zero < 3 and other.times["dp_exposed"] > 1.0, other.layout


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


# --- context parallelism: the fourth dimension, for long sequences ------------------------------

def test_cp_divides_every_activation_term_by_cp_even_eager_scores():
    """Each saved tensor is linear in the tokens a rank holds; eager attention's a·s² scores
    fall by cp too, not cp²: a local query still meets all s keys."""
    cfg = MODELS["llama2-70b"]
    for eager in (False, True):
        for ac in ("none", "selective", "full"):
            one = activation_bytes(cfg, Layout(tp=8, recompute=ac), 131072, 1, eager_attention=eager)
            four = activation_bytes(cfg, Layout(tp=8, recompute=ac, cp=4), 131072, 1,
                                    eager_attention=eager)
            assert four == pytest.approx(one / 4, rel=1e-12), (eager, ac)


def test_cp_ring_bytes_are_chapter_05s_and_states_shard_over_dp_times_cp():
    """Per block and micro-batch, a CP rank sends chapter 05's `cp_comm_bytes` (cp-1 K/V blocks
    of GQA's 8 heads / t forward; K/V and the float32 dK/dV backward), recomputation one more
    forward pass; the gradients are reduced over dp·cp: CP 4 × DP 2 sends DP 8's bytes."""
    cfg, s, e = MODELS["llama2-70b"], 32768, 2
    ring = sum(cp_comm_bytes(1, s, cfg.n_kv_heads // 8, cfg.head_dim, 4, e).values())
    forward = cp_comm_bytes(1, s, cfg.n_kv_heads // 8, cfg.head_dim, 4, e)["forward K/V"]
    for ac, per_block in (("none", ring), ("full", ring + forward)):
        comm = comm_bytes_per_gpu(cfg, Layout(tp=8, cp=4, dp=2, zero=1, recompute=ac), s, 1)
        assert comm["cp"] == cfg.n_layers * per_block
    assert comm["dp"] == comm_bytes_per_gpu(cfg, Layout(tp=8, dp=8, zero=1), s, 1)["dp"]
    mem = memory_per_gpu(cfg, Layout(tp=8, cp=4, dp=2, zero=3), s, 1)
    assert mem["optimizer"] == memory_per_gpu(cfg, Layout(tp=8, dp=8, zero=3), s, 1)["optimizer"]


@pytest.mark.parametrize("sp", [False, True])
def test_full_recompute_reruns_the_trainers_collectives(sp):
    """Full recomputation reruns a block's forward only up to its last saved tensor: +1
    all-reduce per block and micro-batch (SP: +2 all-gathers + 1 reduce-scatter), the trainer's
    count (comm_formulas, checked against the meter), not +2 all-reduces."""
    from parallel3d.comm_formulas import tp_bytes_per_microbatch
    cfg, s, t = MODELS["llama2-70b"], 4096, 8
    a = s * cfg.dim * 2  # one micro-batch's [1, s, h] bf16 activations
    planner = {ac: comm_bytes_per_gpu(cfg, Layout(tp=t, recompute=ac, sequence_parallel=sp), s, 1)["tp"]
               for ac in ("none", "full")}
    trainer = {ac: tp_bytes_per_microbatch(cfg, t, 1, s, 2, sp, ac, cfg.n_layers, False, False)
               for ac in ("none", "full")}
    rerun = cfg.n_layers * (3 if sp else 2) * (t - 1) / t * a  # SP: 3 × (t-1)/t; else 2(t-1)/t
    assert trainer["full"] - trainer["none"] == pytest.approx(rerun, rel=1e-12)
    assert planner["full"] - planner["none"] == pytest.approx(rerun, rel=1e-12)


@functools.cache
def long_context_1024() -> list:
    """405B at 128K on 1,024 GPUs, 16M tokens (128 sequences) per step."""
    return plan(MODELS["llama3.1-405b"], 1024, 80, 131072, 128)


def test_405b_at_128k_fits_only_with_cp():
    """The rule of thumb, from the formulas: at 128K no CP-less layout fits. Even full
    recomputation keeps every block's input, s·h·e/t each, for the p micro-batches 1F1B holds
    on L/p blocks: L·s·h·e/t = 67.6 GB whatever p, plus one block's 13.6 GB while it is
    recomputed. TP stops at 8 and PP does not shrink it: only splitting the sequence does."""
    cfg, s = MODELS["llama3.1-405b"], 131072
    plans = long_context_1024()
    without = [p for p in plans if p.layout.cp == 1]
    assert without and not any(p.fits for p in without)
    smallest = min(without, key=lambda p: p.memory["total"])
    inputs = cfg.n_layers * s * cfg.dim * 2 / 8
    transient = s * sum(block_saved_terms(cfg, s, 8, True, "none", 2).values())
    assert (smallest.layout.tp, smallest.layout.recompute) == (8, "full")
    assert smallest.memory["activations"] == pytest.approx(inputs + transient, rel=1e-3)
    assert inputs / GB == pytest.approx(67.6, abs=0.1) and smallest.memory["total"] > 80 * GB
    best = recommend(plans)
    assert best is not None and best.layout.cp > 1, best
    assert cp_verdict(plans, best).startswith("CP: needed: the smallest CP-less footprint")


def test_llama3_long_context_mesh_fits_without_recomputation():
    """Llama 3 405B's 128K stage ran TP 8 × CP 16 × PP 16 on 16,384 GPUs, 16M tokens per step:
    128 sequences leave each of 16384/(8·p) replicas p/16 < p micro-batches without CP, so
    every layout there needs CP. Its mesh fits without recomputation (PP 16 holds 16
    micro-batches of 8 blocks: 70 GB, with flash attention's unrepeated K/V and fused norms and
    SwiGLU; 99 GB as this LLaMA saves them): the deeper pipeline's bubble (23% against 11%) and
    its sends are what it pays against the pick, CP 32 × PP 8."""
    name, gpus, seq, batch, mesh = LONG_CONTEXT
    plans = plan(MODELS[name], gpus, 80, seq, batch)
    best, llama3 = recommend(plans), fastest_with_mesh(plans, *mesh)
    assert all(p.layout.cp > 1 for p in plans)
    assert best.layout.cp >= 8 and best.times["cp_exposed"] == 0.0, best
    assert best.layout.recompute == "none" and llama3.layout.recompute == "none", why_not(best, llama3)
    assert (best.layout.cp, best.layout.pp) == (32, 8), best.layout
    extra = {k: step_terms(llama3)[k] - v for k, v in step_terms(best).items()}
    assert sorted(extra, key=extra.get)[-2:] == ["PP", "bubble"] and extra["work"] == 0, extra


def test_short_sequences_pick_no_cp_though_the_model_prices_it_cheap():
    """At 4K a CP-less layout fits, so the pick has cp = 1, though the step-time model, which
    hides the ring behind attention and prices none of its other costs, finds a CP layout
    faster: the rule of thumb decides, and the printout says so."""
    plans = planned("llama2-70b")
    best, cp = recommend(plans), fastest_with_cp(plans)
    assert best.layout.cp == 1
    assert cp is not None and cp.step_s < best.step_s
    assert cp_verdict(plans, best).startswith("CP: not needed (a layout fits without it)")


def test_ring_is_exposed_only_when_it_outlasts_the_attention():
    """The ring's transfer hides behind the attention of the block it carries: at 8K over the
    network (TP 4 × CP 8 spans 4 nodes) 7 K/V blocks outlast 1K tokens' causal attention; at
    128K the same ring hides."""
    cfg, hw = MODELS["llama3.1-405b"], Hardware()
    layout = Layout(tp=4, cp=8, pp=16, dp=32, zero=1, virtual_stages=4, recompute="none")
    assert price(cfg, layout, 8192, 2048, 80, hw).times["cp_exposed"] > 0
    long = Layout(tp=4, cp=8, pp=16, dp=8, zero=3, recompute="full")
    assert price(cfg, long, 131072, 128, 80, hw).times["cp_exposed"] == 0


def test_nothing_fits_is_reported():
    assert recommend(plan(CONFIGS["llama2-70b"], 1, 80, 4096, 8)) is None


def test_cli_prints_candidates_and_a_recommendation(capsys):
    assert main(["--model", "llama2-70b", "--gpus", "64", "--gpu-mem-gb", "80", "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "recommended: TP" in out and "article's table" in out
    assert "its pipeline depth, priced" not in out  # PP 4 is among the depths the article names
    assert main(["--model", "llama3.1-405b", "--gpus", "16384", "--seq-len", "8192",
                 "--global-batch", "2048", "--top", "0"]) == 0
    out = capsys.readouterr().out
    assert "its pipeline depth, priced: TP 8 × PP 16 v4" in out
    assert "AC: activation recomputation" in out and "v: virtual stages" in out  # the legend
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("n_kv_heads", [2, 4])
def test_selective_recomputation_drops_exactly_the_core_attentions_saved_tensors(n_kv_heads, dtype):
    """Selective = the core attention rerun (Korthikanti et al.): what it saves over none, on the
    ledger, is the formula's to the byte: the log-sum-exp and the GQA-repeated k, v beyond the
    unrepeated inputs the checkpoint keeps (with flash SDPA no s×s scores exist to drop)."""
    cfg = LlamaConfig(dim=64, n_layers=2, n_heads=4, n_kv_heads=n_kv_heads, vocab_size=64, multiple_of=16)
    b, s = 2, 24
    tokens = torch.randint(0, 64, (b, s + 1), generator=torch.Generator().manual_seed(0))
    peak = {}
    for mode in ("none", "selective"):
        model = build_model(cfg, 0, dtype)
        apply_recompute(model.layers, mode)
        with ActivationMeter(model.parameters()) as meter:
            loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        peak[mode] = meter.peak_bytes
    e = torch.empty((), dtype=dtype).element_size()
    formula = {m: cfg.n_layers * layer_activation_bytes(cfg, b * s, s, recompute=m, elem=e) for m in peak}
    assert peak["none"] - peak["selective"] == formula["none"] - formula["selective"] > 0


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


