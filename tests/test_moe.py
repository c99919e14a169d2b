"""common/kernel/moe.py, single process: the dense model unchanged, routing and gates by hand, the aux
loss by hand, dropless and capacity drops as documented, gradients to router and experts, the MoE
layer against a per-token loop of its docstring's formulas (forward, backward, aux loss), planted
bugs in combine and the aux loss caught, and the single-device reference training a MoE model.
Multi-rank MoE training against one device: tests/test_moe_training.py."""

from __future__ import annotations

import hashlib
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import common.kernel.moe
from common.kernel.model import (
    CONFIGS,
    FeedForward,
    LlamaConfig,
    build_model,
    count_parameters,
    feed_forward,
    get_config,
    loss_fn,
)
from common.kernel.moe import (
    LocalDispatcher,
    active_parameters,
    aux_loss,
    capacity,
    capacity_mask,
    route,
    sequence_balance_loss,
    set_aux_loss_scale,
    unpermute,
)
from common.reference import ReferenceTrainer


def moe_config(E: int, k: int, gate: str = "softmax", shared: int = 0, cf: float | None = None,
               dim: int = 8, hidden: int = 6, coef: float = 0.3) -> LlamaConfig:
    return LlamaConfig(dim=dim, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=8, n_experts=E, top_k=k,
                       n_shared_experts=shared, moe_hidden_dim=hidden, gate=gate, aux_loss_coef=coef,
                       capacity_factor=cf)


def make_layer(cfg: LlamaConfig, B: int, T: int, seed: int, dead: int = 0):
    """A float64 MoE layer with N(0, 0.5²) weights and an input x [B, T, dim]; `dead` > 0 skews
    the routing: x is shifted to +3 and the last `dead` router rows set to -2, so those experts
    (logits ≈ -6·dim) never get a token."""
    gen = torch.Generator().manual_seed(seed)
    layer = feed_forward(cfg, 0).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
        if dead:
            layer.router.weight[-dead:] = -2.0
    x = torch.randn(B, T, cfg.dim, generator=gen, dtype=torch.float64) + (3.0 if dead else 0.0)
    return layer, x.requires_grad_()


def naive_moe(layer: nn.Module, x: torch.Tensor, cfg: LlamaConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """The docstring as loops: per sequence, per token in position order, its k experts (by
    descending logit), each kept while its expert has had < C tokens of this sequence; then the
    aux loss α · mean_b Σ_i f_bi P_bi. Returns (y [B, T, dim], aux)."""
    B, T, D = x.shape
    E, k, ex = cfg.n_experts, cfg.top_k, layer.experts
    C = None if cfg.capacity_factor is None else math.ceil(cfg.capacity_factor * T * k / E)
    rows, balance = [], []
    for b in range(B):
        placed, chosen, P = [0] * E, [0] * E, torch.zeros(E, dtype=x.dtype)
        for t in range(T):
            xt = x[b, t]
            logits = layer.router.weight @ xt
            s = torch.softmax(logits, 0) if cfg.gate == "softmax" else torch.sigmoid(logits)
            top = sorted(range(E), key=lambda e: -logits[e].item())[:k]
            total = sum(s[e] for e in top)
            out = layer.shared_expert(xt) if cfg.n_shared_experts else torch.zeros(D, dtype=x.dtype)
            for e in top:
                chosen[e] += 1
                if C is None or placed[e] < C:
                    placed[e] += 1
                    h = F.silu(ex.w1[e] @ xt) * (ex.w3[e] @ xt)
                    out = out + s[e] / total * (ex.w2[e] @ h)
            rows.append(out)
            P = P + s / s.sum()
        f = torch.tensor(chosen, dtype=x.dtype) * E / (k * T)
        balance.append((f * P / T).sum())
    return torch.stack(rows).view(B, T, D), cfg.aux_loss_coef * torch.stack(balance).mean()


def gradients(layer: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    grads = {n: p.grad.clone() for n, p in layer.named_parameters()} | {"x": x.grad.clone()}
    layer.zero_grad(set_to_none=True)
    x.grad = None
    return grads


def against_naive(layer: nn.Module, x: torch.Tensor, cfg: LlamaConfig, scale: float) -> float:
    """Max |difference| of the layer from `naive_moe`: output, aux value, and every gradient of
    Σ y·R (+ scale · aux for the loop, which the layer adds by MoEAuxLossAutoScaler)."""
    R = torch.randn(x.shape, generator=torch.Generator().manual_seed(1), dtype=x.dtype)
    set_aux_loss_scale(layer, scale)
    y = layer(x)
    (y * R).sum().backward()
    got = gradients(layer, x)
    y_ref, aux_ref = naive_moe(layer, x, cfg)
    ((y_ref * R).sum() + scale * aux_ref).backward()
    want = gradients(layer, x)
    diffs = [(y - y_ref).abs().max(), (layer.last_aux_loss - aux_ref).abs()]
    diffs += [(got[n] - want[n]).abs().max() for n in want]
    return max(d.item() for d in diffs)


@st.composite
def moe_draws(draw):
    E = draw(st.integers(2, 6))
    k = draw(st.integers(1, min(E, 3)))
    cfg = moe_config(E, k, draw(st.sampled_from(["softmax", "sigmoid"])), draw(st.integers(0, 1)),
                     draw(st.sampled_from([None, 0.5, 1.0, 1.25, 2.0])))
    dead = draw(st.integers(1, E - k)) if k < E and draw(st.booleans()) else 0
    return cfg, draw(st.integers(1, 3)), draw(st.integers(1, 6)), dead, draw(st.integers(0, 2**16))


@settings(max_examples=max(25, settings.default.max_examples))
@given(draw=moe_draws(), scale=st.sampled_from([1.0, 0.25]))
def test_moe_layer_equals_per_token_loop_forward_and_backward(draw, scale):
    cfg, B, T, dead, seed = draw
    layer, x = make_layer(cfg, B, T, seed, dead)
    assert against_naive(layer, x, cfg, scale) < 1e-12
    if dead:  # the skew left experts without a token: they ran on 0 rows and got zero gradients
        layer(x).sum().backward()
        assert (layer.last_tokens_per_expert[-dead:] == 0).all()
        assert layer.experts.w1.grad[-dead:].abs().max() == 0


class OffByOneDispatcher(LocalDispatcher):
    def dispatch(self, x, plan):
        inputs, counts = super().dispatch(x, plan)
        return inputs.roll(1, 0), counts  # each expert row gets its neighbour's token


class UnweightedDispatcher(LocalDispatcher):
    def combine(self, expert_outputs, plan):
        return unpermute(expert_outputs, replace(plan, weights=torch.ones_like(plan.weights)))


@pytest.mark.parametrize("dispatcher", [OffByOneDispatcher, UnweightedDispatcher])
def test_broken_dispatchers_are_caught_by_the_loop(dispatcher):
    """Negative controls of the property above: a permutation off by one, a combine without g."""
    cfg = moe_config(4, 2, shared=1)
    layer, x = make_layer(cfg, 2, 5, seed=3)
    layer.dispatcher = dispatcher()
    assert against_naive(layer, x, cfg, 1.0) > 1e-3


def test_aux_loss_is_alpha_when_balanced_and_alpha_e_over_k_when_collapsed():
    """Uniform p (a zero router): Σ_i f_i/E = 1 whatever the tie-breaking picks, aux = α. All
    tokens on the same k experts, each with p = 1/k: Σ_i f_i P_i = k · (E/k) · (1/k) = E/k."""
    cfg = moe_config(4, 2, coef=0.5)
    layer, x = make_layer(cfg, 3, 5, seed=0)
    with torch.no_grad():
        layer.router.weight.zero_()
    layer(x)
    assert abs(layer.last_aux_loss.item() - 0.5) < 1e-15
    logits = torch.full((2, 6, 4), -30.0, dtype=torch.float64)
    logits[..., 1] = 30.0
    logits[..., 2] = 30.0
    _, balance = route(logits, 2, "softmax", None)
    torch.testing.assert_close(balance, torch.full((2,), 4 / 2, dtype=torch.float64), rtol=1e-12, atol=0)


def test_balance_loss_decomposes_over_data_parallel_shards_and_a_batch_global_one_does_not():
    """mean over the batch of the per-sequence terms = mean of the two halves' means (what 2 DP
    ranks average); f·P of the whole batch as one sequence is not the mean of the halves'."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 6, 5, generator=gen, dtype=torch.float64) * 2
    logits[:2, :, 0] += 3  # the first two sequences prefer expert 0: the shards differ
    probs, experts = logits.softmax(-1), logits.topk(2, -1).indices
    per_sequence = lambda p, e: sequence_balance_loss(p, e).mean()  # noqa: E731
    batch_global = lambda p, e: sequence_balance_loss(p.flatten(0, 1)[None], e.flatten(0, 1)[None])[0]  # noqa: E731
    for loss, exact in ((per_sequence, True), (batch_global, False)):
        whole = loss(probs, experts)
        shards = (loss(probs[:2], experts[:2]) + loss(probs[2:], experts[2:])) / 2
        assert (abs(whole - shards).item() < 1e-15) == exact, (loss, whole, shards)


def test_capacity_is_exact_for_the_factor_as_written():
    assert capacity(1.25, 8, 2, 4) == 5 and capacity(1.0, 7, 1, 2) == 4
    assert capacity(1.1, 10, 2, 2) == 11  # float: 1.1·10·2/2 = 11.000000000000002 → 12


def test_capacity_keeps_first_come_per_sequence_and_expert():
    """C = 2 (cf 1, T 6, k 1, E 3). Sequence 0 sends everything to expert 0: positions 0, 1 kept.
    Sequence 1 alternates experts 0/1 with a second slot: each expert's first two slots, counted
    in position order over both slots, are kept."""
    experts = torch.tensor([[[0], [0], [0], [0], [0], [0]]])
    assert capacity_mask(experts, 3, 2).flatten().tolist() == [True, True, False, False, False, False]
    experts = torch.tensor([[[0, 1], [1, 2], [0, 1], [2, 0], [0, 2], [1, 0]]])
    kept = capacity_mask(experts, 3, 2)[0].tolist()
    assert kept == [[True, True], [True, True], [True, False], [True, False], [False, False],
                    [False, False]]


def test_dropped_tokens_get_only_the_residual_and_the_shared_expert():
    """Everything routed to expert 0 (k 1, E 4, T 8, cf 1 → C 2): y is 0 after position 1 in
    each sequence without a shared expert; with one, it is the shared expert's output there."""
    for shared in (0, 1):
        cfg = moe_config(4, 1, shared=shared, cf=1.0)
        layer, x = make_layer(cfg, 2, 8, seed=1, dead=3)
        y = layer(x)
        base = layer.shared_expert(x) if shared else torch.zeros_like(y)
        assert torch.equal(y[:, 2:], base[:, 2:]) and (y[:, :2] - base[:, :2]).abs().min() > 0


# --- configs ---------------------------------------------------------------------------------

def test_moe_configs_count_total_and_active_parameters():
    """Mixtral 8x7B exactly as published (46,702,792,704 / 12,879,925,248). DeepSeek-V3's
    attention is MLA, a shape the planner prices (its counts: tests/test_3d_published.py) and
    the model refuses to build rather than build something else."""
    model = build_model(get_config("mixtral-8x7b"), device="meta")
    assert (count_parameters(model), active_parameters(model)) == (46_702_792_704, 12_879_925_248)
    with pytest.raises(ValueError, match="multi-head latent attention"):
        build_model(get_config("deepseek-v3"), device="meta")
    counts = {"mixtral-8x7b", "deepseek-v3"}
    tiny = get_config("tiny-moe")
    assert tiny.n_heads % 4 == 0 and tiny.n_kv_heads % 4 == 0 and tiny.n_layers % 8 == 0
    assert tiny.n_experts % 4 == 0
    assert all(c.n_experts == 0 for n, c in CONFIGS.items() if "moe" not in n and n not in counts)


@pytest.mark.parametrize("field, value, message", [
    ("top_k", 9, "top_k=9"), ("gate", "relu", "gate='relu'"), ("n_shared_experts", 2, "n_shared_experts=2"),
    ("capacity_factor", 0.0, "capacity_factor=0.0"), ("first_dense_layers", 9, "first_dense_layers=9"),
])
def test_bad_moe_config_names_the_value(field, value, message):
    with pytest.raises(ValueError, match=message):
        get_config("tiny-moe", **{field: value})


# --- the dense model is the model before MoE --------------------------------------------------

# Recorded from common/kernel/model.py before the MoE change (commit 92e7fba), torch 2.13 CPU: tiny with
# 2 layers, seed 3, float64; the loss and the gradients of one batch. Checked bitwise in the
# session that added MoE; here the parameters bitwise, the loss to 1e-12 (BLAS may differ across
# torch versions).
DENSE_PARAMS_SHA256 = "90fff18a123769924f4a1dadcf2f2cbeb073a23a7dac6afe4491d708afa76b36"
DENSE_LOSS, DENSE_GRAD_NORM = 5.514712709258304, 2.1234253443842594


def test_dense_config_is_the_model_before_moe():
    cfg = get_config("tiny", n_layers=2)
    model = build_model(cfg, seed=3, dtype=torch.float64)
    assert all(type(b.feed_forward) is FeedForward for b in model.layers)
    assert not common.kernel.moe.moe_layers(model)
    digest = hashlib.sha256()
    for name, p in model.named_parameters():
        digest.update(name.encode())
        digest.update(p.detach().numpy().tobytes())
    assert digest.hexdigest() == DENSE_PARAMS_SHA256
    tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    loss = loss_fn(model(tokens[:, :-1]), tokens[:, 1:])
    loss.backward()
    grad_norm = torch.stack([p.grad.norm() ** 2 for p in model.parameters()]).sum().sqrt()
    assert abs(loss.item() - DENSE_LOSS) <= 1e-12 * DENSE_LOSS
    assert abs(grad_norm.item() - DENSE_GRAD_NORM) <= 1e-12 * DENSE_GRAD_NORM
    assert aux_loss(model) is None


# --- routing, gates and the aux loss by hand ---------------------------------------------------

def test_top_k_routing_and_gate_normalisation_by_hand():
    """Token logits [1, 3, 2, 0], k 2: experts (1, 2) in that order; softmax: g = e³, e² over
    their sum; sigmoid: σ(3), σ(2) over theirs. Every token's k gates sum to 1."""
    logits = torch.tensor([[[1.0, 3.0, 2.0, 0.0], [0.5, -1.0, 4.0, 2.5]]], dtype=torch.float64)
    for gate, score in (("softmax", torch.exp), ("sigmoid", torch.sigmoid)):
        plan, _ = route(logits, 2, gate, None)
        assert plan.experts.tolist() == [[1, 2], [2, 3]]
        s = score(torch.tensor([3.0, 2.0, 4.0, 2.5], dtype=torch.float64))
        want = torch.stack([s[:2] / s[:2].sum(), s[2:] / s[2:].sum()])
        torch.testing.assert_close(plan.weights, want, rtol=1e-15, atol=0)
        ones = torch.ones(2, dtype=torch.float64)
        torch.testing.assert_close(plan.weights.sum(-1), ones, rtol=1e-15, atol=0)


def hand_aux_error() -> float:
    """B 2, T 2, E 2, k 1, softmax. Sequence 0: p = (1/4, 3/4), (1/3, 2/3), both choose expert 1:
    f = (0, 2), P_1 = (3/4 + 2/3)/2 = 17/24, Σ f P = 17/12. Sequence 1: p = (3/4, 1/4) twice, both
    choose 0: f = (2, 0), Σ f P = 3/2. aux = α · (17/12 + 3/2)/2 = α · 35/24."""
    ln = math.log
    logits = torch.tensor([[[0, ln(3)], [0, ln(2)]], [[ln(3), 0], [ln(3), 0]]], dtype=torch.float64)
    _, balance = route(logits, 1, "softmax", None)
    return abs(0.3 * balance.mean().item() - 0.3 * 35 / 24)


def test_aux_loss_value_by_hand():
    assert hand_aux_error() < 1e-15


def test_a_planted_bug_in_the_aux_loss_goes_red(monkeypatch):
    """f·P over the whole batch as one sequence (not per sequence): f = (1, 1), P = (25, 23)/48,
    aux = α, off the hand value α · 35/24 by α · 11/24 = 0.1375."""
    per_sequence = common.kernel.moe.sequence_balance_loss

    def batch_global(probs, experts):
        return per_sequence(probs.flatten(0, 1)[None], experts.flatten(0, 1)[None]).expand(probs.shape[0])

    monkeypatch.setattr(common.kernel.moe, "sequence_balance_loss", batch_global)
    assert abs(hand_aux_error() - 0.3 * 11 / 24) < 1e-15


# --- routing precision: float32 under bf16 ------------------------------------------------------

class RecordingDispatcher(LocalDispatcher):
    def dispatch(self, x: torch.Tensor, plan):
        self.plan = plan
        return super().dispatch(x, plan)


def bf16_routing_differences(gate: str) -> list[str]:
    """A bf16 layer (mixed precision's compute copy: bf16 weights and inputs) against the float32
    routing of the same bf16 inputs and weights: which of experts, kept slots, gate weights (cast
    to bf16) and aux loss differ; and `route` handed bf16 logits against the float32 routing of
    the same logits. 512 tokens over 8 experts: bf16 logits flip some near ties."""
    cfg = moe_config(E=8, k=2, gate=gate, cf=1.25, dim=16, hidden=8, coef=0.1)
    layer, x = make_layer(cfg, B=8, T=64, seed=5)
    layer, x = layer.to(torch.bfloat16), x.detach().to(torch.bfloat16)
    layer.dispatcher = RecordingDispatcher()
    layer(x)
    got = layer.dispatcher.plan
    logits = F.linear(x.float(), layer.router.weight.float())
    plan, balance = route(logits, 2, gate, 1.25)
    given_bf16, bf16_balance = route(logits.to(torch.bfloat16), 2, gate, 1.25)  # route() handed bf16
    same_logits, same_balance = route(logits.to(torch.bfloat16).float(), 2, gate, 1.25)
    checks = {"route": torch.equal(given_bf16.experts, same_logits.experts)
              and torch.equal(given_bf16.weights, same_logits.weights.to(torch.bfloat16))
              and torch.equal(bf16_balance, same_balance),
              "experts": torch.equal(got.experts, plan.experts), "kept": torch.equal(got.kept, plan.kept),
              "weights": got.weights.dtype == torch.bfloat16
              and torch.equal(got.weights, plan.weights.to(torch.bfloat16)),
              "aux": torch.equal(layer.last_aux_loss, cfg.aux_loss_coef * balance.mean())}
    return sorted(k for k, same in checks.items() if not same)


@pytest.mark.parametrize("gate", ["softmax", "sigmoid"])
def test_routing_runs_in_float32_under_bf16(gate):
    """Every other MoE test is float64; under mixed precision the router's logits, gates, top-k and
    aux loss are float32's, only g is cast to the activations' bf16."""
    assert bf16_routing_differences(gate) == []


def test_routing_in_the_activations_dtype_is_caught(monkeypatch):
    """Planted: every float32 promotion of the routing dropped (logits, gates and aux in bf16)."""
    monkeypatch.setattr(torch, "promote_types", lambda a, b: a)
    assert {"aux", "experts", "route", "weights"} <= set(bf16_routing_differences("softmax"))


# --- dropless and gradients ---------------------------------------------------------------------

@pytest.mark.parametrize("skew", [False, True])
def test_dropless_every_token_reaches_its_k_experts(skew):
    """No capacity: all N·k slots kept, each token's row sent once to each of its k experts (also
    when every token picks the same k experts); the grouped rows are x's rows, per expert."""
    gen = torch.Generator().manual_seed(0)
    B, T, E, k, D = 3, 5, 4, 2, 3
    logits = torch.randn(B, T, E, generator=gen, dtype=torch.float64)
    if skew:
        logits[..., :k] += 100
    plan, _ = route(logits, k, "softmax", None)
    x = torch.randn(B * T, D, generator=gen, dtype=torch.float64)
    rows, counts = LocalDispatcher().dispatch(x, plan)
    assert plan.kept.all() and sum(counts) == B * T * k and rows.shape == (B * T * k, D)
    assert counts == torch.bincount(plan.experts.flatten(), minlength=E).tolist()
    groups = rows.split(counts)
    for n in range(B * T):
        for e in plan.experts[n].tolist():
            assert sum(bool((g == x[n]).all(-1).any()) for g in groups[e:e + 1]) == 1, (n, e)


def test_gradients_reach_the_router_and_every_used_expert():
    """tiny-moe (2 layers, layer 0 dense): one loss.backward gives every router, the experts that
    got tokens, and the shared expert a nonzero gradient; the router also learns from the aux loss
    alone (k 1 with softmax: g = 1, so the cross-entropy gives the router nothing)."""
    for k in (2, 1):
        cfg = get_config("tiny-moe", n_layers=2, top_k=k, aux_loss_coef=0.01)
        model = build_model(cfg, seed=0, dtype=torch.float64)
        tokens = torch.randint(0, cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        (layer,) = common.kernel.moe.moe_layers(model)
        used = layer.last_tokens_per_expert > 0
        assert layer.router.weight.grad.abs().amax(1).gt(0).all()
        assert layer.shared_expert.w1.weight.grad.abs().max() > 0
        for w in (layer.experts.w1, layer.experts.w2, layer.experts.w3):
            assert w.grad[used].flatten(1).abs().amax(1).gt(0).all()
            assert (w.grad[~used] == 0).all()


def test_the_single_device_reference_trains_a_moe_model():
    """common.reference on tiny-moe (float64, AdamW): 8 steps on one batch lower the loss, every
    parameter has a gradient each step, and the aux loss is reported by aux_loss(model)."""
    cfg = get_config("tiny-moe", n_layers=2)
    trainer = ReferenceTrainer(cfg, seed=0, dtype=torch.float64, lr=1e-2)
    tokens = torch.randint(0, cfg.vocab_size, (4, 17), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(8):
        loss, grads = trainer.step(tokens)
        losses.append(loss)
        assert set(grads) == {n for n, _ in trainer.model.named_parameters()}
    assert losses[-1] < losses[0] - 0.5, losses
    assert 0 < aux_loss(trainer.model).item() < 1
