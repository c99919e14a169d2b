"""Chapter 07's planner, its model of the hardware and of the work: the data-parallel rings over
the NICs a node brings, one model-FLOP count for the step's compute and MFU, and SP's activations
as Korthikanti et al. count them (with the out-of-sample 530B and 1T runs they price)."""

from __future__ import annotations

import contextlib
import dataclasses
from unittest import mock

import pytest

from parallel3d.memory_model import GB, Layout, layer_activation_bytes, memory_per_gpu, total_parameters
from parallel3d.planner import MODELS, Hardware, model_flops_per_token, price, step_terms
from parallel3d.planner.memory import memory_per_gpu as planner_memory


def test_dp_ring_bandwidth_counts_the_nics_a_node_brings():
    """A ring over n ranks t apart (DP strides t): inside a node NVLink; across nodes a node
    holds min(n, 8/t) members, each with its NIC: 400, 200, 100, 50 GB/s at t = 1, 2, 4, 8
    (NVLink's 450 caps it), divided by the 1:7 oversubscription beyond a pod; point-to-point
    and all-to-all traffic keeps one NIC per GPU."""
    hw = Hardware()
    assert [hw.ring_bandwidth(64, t) / GB for t in (1, 2, 4, 8)] == [400, 200, 100, 50]
    assert hw.ring_bandwidth(4, 2) / GB == 450 and hw.ring_bandwidth(2, 8) / GB == 50
    assert hw.ring_bandwidth(8192, 1) / GB == pytest.approx(400 / 7)
    assert dataclasses.replace(hw, network_gbps=100).ring_bandwidth(64, 1) / GB == 450
    assert hw.bandwidth(64) / GB == 50


def test_compute_and_mfu_count_the_same_model_flops():
    """One definition (Megatron-LM's model FLOPs) in the step's compute and in MFU: 6 × every
    matmul's parameters, the head but not the embedding lookup, + 12·L·h·s of attention scores.
    MFU · step · GPUs · peak / tokens gives it back; 6N with the embedding (PaLM's N, which
    counts it) reads 7.0% more matmul FLOPs on Llama 3 8B."""
    cfg = MODELS["llama3.1-8b"]
    s, batch, hw = 8192, 512, Hardware()
    flops = 6 * (total_parameters(cfg) - cfg.vocab_size * cfg.dim) + 12 * cfg.n_layers * cfg.dim * s
    assert model_flops_per_token(cfg, s) == flops
    assert 6 * total_parameters(cfg) / (flops - 12 * cfg.n_layers * cfg.dim * s) == pytest.approx(
        1.070, abs=0.001)
    for ac in ("none", "full"):
        p = price(cfg, Layout(dp=64, zero=3, recompute=ac), s, batch, 80, hw)
        assert p.mfu * p.step_s * 64 * hw.peak_tflops * 1e12 == pytest.approx(flops * batch * s, rel=1e-12)
        work = step_terms(p)["work"]
        assert work == pytest.approx(flops * batch * s * (4 / 3 if ac == "full" else 1)
                                     / (64 * hw.peak_tflops * 1e12 * hw.efficiency), rel=1e-12)


def test_sp_activations_are_korthikantis_count_for_this_llama():
    """Per layer with SP and TP, 2-byte activations, no recomputation: sbh(20 + 8F/h)/t +
    sb(4 + 4a)/t (formulas.py's derivation of Korthikanti's 34·sbh/t for RMSNorm, SwiGLU, GQA and
    flash attention): every term /t, the column layers' inputs included. Korthikanti et al.'s
    530B and 1T runs (TP 8, SP, selective recomputation, PP 35 v3 and PP 64, 2048 tokens) priced
    83 and 93 GB per GPU when the column layers kept their gathered inputs; they trained on 80 GB."""
    from parallel3d.planner.published_runs import gpt
    for cfg in (MODELS["llama2-70b"], gpt(20480, 105, 128, 51200)):
        s, b, h, t, a, F = 4096, 1, cfg.dim, 8, cfg.n_heads, cfg.hidden_dim
        korthikanti = s * b * h * (20 + 8 * F / h) / t + s * b * (4 + 4 * a) / t
        assert layer_activation_bytes(cfg, b * s, s, t, True, "none", 2) == pytest.approx(
            korthikanti, rel=1e-12)
    runs = [((20480, 105, 128, 35, 3, 280), 62.6, 83.2, 55.8), ((25600, 128, 160, 64, 1, 512), 69.0,
                                                                 92.7, 61.1)]
    for (h, L, a, pp, v, batch), now, before, planner in runs:
        layout = Layout(tp=8, pp=pp, virtual_stages=v, recompute="selective")
        mem = memory_per_gpu(gpt(h, L, a, 51200), layout, 2048, batch)
        assert mem["total"] / GB == pytest.approx(now, abs=0.05) and mem["total"] < 0.9 * 80 * GB
        priced = planner_memory(gpt(h, L, a, 51200), layout, 2048, batch)["total"]  # fused, saved.py
        assert priced / GB == pytest.approx(planner, abs=0.05)
        with gathered_inputs_saved():
            assert memory_per_gpu(gpt(h, L, a, 51200), layout, 2048, batch)["total"] / GB == pytest.approx(
                before, abs=0.05)


@contextlib.contextmanager
def gathered_inputs_saved():
    """The activation count before the column layers saved their local slice: under SP the norm
    outputs they read and the head's input held all s tokens."""
    import parallel3d.memory_model as mm
    from tensor_parallel import formulas

    def whole(x):
        terms = formulas.layer_activation_terms(x)
        key = "norm outputs, read by the column layers (2)"
        return terms | {key: terms[key] * x.t} if x.sequence_parallel else terms

    mm.layer_activation_bytes.cache_clear()
    try:
        with mock.patch.object(mm, "layer_activation_terms", whole):
            yield
    finally:
        mm.layer_activation_bytes.cache_clear()
