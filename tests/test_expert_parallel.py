"""05_tensor_parallel/expert_parallel.py: a MoE layer with its experts split over 2 and 4 ranks
(tokens dispatched by all-to-all) equals the layer on one device in float64 (output, aux loss and
every gradient, 1e-12), over drawn experts, top-k, gates, capacity and skewed routing (experts,
and whole ranks, without a token); a broken regrouping goes red; E not divisible by EP is refused."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from common.kernel.model import build_model, get_config, loss_fn
from common.kernel.moe import set_aux_loss_scale
from tensor_parallel.expert_parallel import AllToAllDispatcher, expert_parallel
from tests.test_moe import make_layer, moe_config


def run_layer(layer, x, R, scale):
    set_aux_loss_scale(layer, scale)
    y = layer(x)
    (y * R).sum().backward()
    return y.detach(), {n: p.grad for n, p in layer.named_parameters()}, x.grad, layer.last_aux_loss


class UnregroupedDispatcher(AllToAllDispatcher):
    """Broken: the received rows go to the local experts source-major, not regrouped by expert."""

    def dispatch(self, x, plan):
        rows, counts = super().dispatch(x, plan)
        in_splits, out_splits, regroup = self._state
        self._state = (in_splits, out_splits, torch.arange(len(regroup)))
        return rows[torch.argsort(regroup)], counts


def ep_vs_one_device(cfg_args, B, T, dead, seed, broken=False):
    """Every rank: the full layer on the whole batch; then the EP layer on this rank's B/ep
    sequences (loss Σ y·R, aux scaled by 1/ep: the global aux is the mean of the ranks'). Returns
    the max |difference| over output, aux, x.grad, expert gradients (this rank's slice) and the
    replicated gradients (summed over the group)."""
    cfg = moe_config(*cfg_args)
    ep, rank = dist.get_world_size(), dist.get_rank()
    layer, x = make_layer(cfg, B, T, seed, dead)
    R = torch.randn(x.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=x.dtype)
    y_ref, g_ref, x_ref, aux_ref = run_layer(layer, x, R, 1.0)
    layer.zero_grad(set_to_none=True)
    lo, hi = rank * B // ep, (rank + 1) * B // ep
    xs = x.detach()[lo:hi].clone().requires_grad_()
    expert_parallel(layer, None)
    if broken:
        layer.dispatcher = UnregroupedDispatcher(None, cfg.n_experts)
    y, g, x_grad, aux = run_layer(layer, xs, R[lo:hi], 1 / ep)
    aux_sum = aux.clone()
    dist.all_reduce(aux_sum)
    diffs = [(y - y_ref[lo:hi]).abs().max(), (x_grad - x_ref[lo:hi]).abs().max()]
    diffs.append((aux_sum / ep - aux_ref).abs())
    E_lo, E_hi = rank * cfg.n_experts // ep, (rank + 1) * cfg.n_experts // ep
    for name, grad in g.items():
        if name.startswith("experts."):
            diffs.append((grad - g_ref[name][E_lo:E_hi]).abs().max())
        else:
            dist.all_reduce(grad)
            diffs.append((grad - g_ref[name]).abs().max())
    return max(d.item() for d in diffs)


@st.composite
def ep_draws(draw):
    ep = draw(st.sampled_from([2, 4]))
    E = ep * draw(st.integers(1, 2))
    k = draw(st.integers(1, min(E, 3)))
    cfg_args = (E, k, draw(st.sampled_from(["softmax", "sigmoid"])), draw(st.integers(0, 1)),
                draw(st.sampled_from([None, 0.5, 1.25])))
    dead = draw(st.integers(1, E - k)) if k < E and draw(st.booleans()) else 0
    B, T = ep * draw(st.integers(1, 2)), draw(st.integers(1, 5))
    return ep, cfg_args, B, T, dead, draw(st.integers(0, 2**16))


@settings(max_examples=max(6, settings.default.max_examples // 2), deadline=None)
@given(draw=ep_draws())
def test_expert_parallel_equals_one_device(pools, draw):
    ep, cfg_args, B, T, dead, seed = draw
    assert max(pools.run(ep, ep_vs_one_device, cfg_args, B, T, dead, seed)) < 1e-12


@pytest.mark.parametrize("ep", [2, 4])
def test_a_rank_without_tokens_and_a_broken_regrouping(pools, ep):
    """All tokens on the first k experts (rank 0's with E = 2·ep, k 2): the other ranks receive
    nothing and still match; then the regrouping skipped: red."""
    args = ((2 * ep, 2, "softmax", 1, None), 2 * ep, 4, 2 * ep - 2, 7)
    assert max(pools.run(ep, ep_vs_one_device, *args)) < 1e-12
    assert max(pools.run(ep, ep_vs_one_device, *args[:-1], 8, broken=True)) > 1e-3


def refuse(E):
    layer, _ = make_layer(moe_config(E, 1), 1, 2, 0)
    try:
        expert_parallel(layer, None)
    except ValueError as error:
        return str(error)
    return None


def test_experts_not_divisible_by_ep_are_refused_on_every_rank(pools):
    assert pools.run(4, refuse, 6) == ["6 experts do not split over an expert-parallel group of 4 ranks: "
                                       "use an EP size that divides 6"] * 4


def model_ep_vs_one_device(seed: int) -> float:
    """tiny-moe (2 MoE layers, 8 experts, top-2, a shared expert, capacity 1.25) in float64: the
    global batch's mean loss on one device vs each rank's half (its loss and aux scaled by 1/ep,
    replicated gradients summed over the group). Max relative gradient difference."""
    cfg = get_config("tiny-moe", n_layers=2, first_dense_layers=0, capacity_factor=1.25, aux_loss_coef=0.1)
    ep, rank = dist.get_world_size(), dist.get_rank()
    tokens = torch.randint(0, cfg.vocab_size, (2 * ep, 9), generator=torch.Generator().manual_seed(seed))
    full = build_model(cfg, seed, torch.float64)
    loss_fn(full(tokens[:, :-1]), tokens[:, 1:]).backward()
    model = build_model(cfg, seed, torch.float64)
    expert_parallel(model, None)
    set_aux_loss_scale(model, 1 / ep)
    mine = tokens[2 * rank:2 * rank + 2]
    (loss_fn(model(mine[:, :-1]), mine[:, 1:]) / ep).backward()
    want = dict(full.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        ref = want[name].grad
        if ".experts." in name:
            E = ref.shape[0]
            ref = ref[rank * E // ep:(rank + 1) * E // ep]
        else:
            dist.all_reduce(p.grad)
        worst = max(worst, ((p.grad - ref).abs().max() / ref.abs().max().clamp_min(1e-300)).item())
    return worst


@pytest.mark.parametrize("ep", [2, 4])
def test_expert_parallel_model_gradients_equal_one_device(pools, ep):
    assert max(pools.run(ep, model_ep_vs_one_device, 0)) < 1e-10
