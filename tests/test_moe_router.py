"""DeepSeek-V3's router in common/kernel/moe.py: the bias moves the choice, never the gates; group-
limited routing against a per-token loop of its rule; the bias update by hand; bad groups refused.
Trained with the bias (and groups, sigmoid) over DP × EP (05's train_expert strategy, with and
without TP), and over 07's 3D mesh (EP × PP with full recomputation), a run equals one device in
float64 at 1e-10 over 3 steps, and after every step every rank holds the single device's bias."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
import torch.distributed as dist

from common.cli import ConfigError
from common.dist import init_distributed
from common.kernel.model import LlamaConfig, get_config
from common.kernel.moe import (
    MoEFeedForward,
    route,
    update_bias_after_each_step,
    update_expert_bias,
)
from common.reference import make_reference
from common.training import loss_value, rank_micro_batches
from parallel3d import train as train3d
from parallel3d.checkpoint.trainer import load_trainer_state, save_trainer_state, trainer_config
from tensor_parallel import train_expert as ep_train
from tests.equivalence import RunRecord, TrainSpec, differences, spec_run
from tests.test_3d_experts import moe_flags, strategy_moe
from tests.test_moe_expert_parallel_train import train_cli

GAMMA = 0.05  # large enough that the bias changes choices within 3 steps of a tiny model


def scores_of(logits: torch.Tensor, gate: str) -> torch.Tensor:
    return logits.softmax(-1) if gate == "softmax" else logits.sigmoid()


@pytest.mark.parametrize("gate", ["softmax", "sigmoid"])
def test_the_bias_moves_the_choice_not_the_gates(gate):
    """A bias of +10 on expert 0 puts it in every token's top-k, whatever its score; the gates
    are the unbiased scores of the chosen experts, normalised over them."""
    logits = torch.randn(3, 5, 6, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    bias = torch.zeros(6, dtype=torch.float64)
    bias[0] = 10.0
    plan, _ = route(logits, 2, gate, None, bias=bias)
    s = scores_of(logits, gate).flatten(0, 1)
    assert (plan.experts == 0).any(-1).all()
    chosen = s.gather(-1, plan.experts)
    torch.testing.assert_close(plan.weights, chosen / chosen.sum(-1, keepdim=True), rtol=0, atol=1e-15)
    unbiased, _ = route(logits, 2, gate, None)
    assert not torch.equal(unbiased.experts, plan.experts)  # the bias did move choices


def groups_by_hand(s: torch.Tensor, bias: torch.Tensor, k: int, G: int, M: int) -> list[list[int]]:
    """Per token, DeepSeek-V3's rule in plain Python: groups ranked by the sum of their top-2
    biased scores, the top M kept, then the top k of the biased scores among their experts."""
    out, per = [], s.shape[-1] // G
    for row in (s + bias).tolist():
        groups = [sorted(row[g * per:(g + 1) * per], reverse=True) for g in range(G)]
        best = sorted(range(G), key=lambda g: -sum(groups[g][:2]))[:M]
        allowed = [e for e in range(len(row)) if e // per in best]
        out.append(sorted(sorted(allowed, key=lambda e: -row[e])[:k]))
    return out


@pytest.mark.parametrize("gate, E, k, G, M", [("sigmoid", 8, 2, 4, 2), ("softmax", 12, 3, 3, 1),
                                              ("sigmoid", 8, 4, 8, 4)])
def test_group_limited_routing_picks_the_top_k_of_the_top_groups(gate, E, k, G, M):
    gen = torch.Generator().manual_seed(E + k)
    logits = torch.randn(4, 6, E, generator=gen, dtype=torch.float64)
    bias = 0.3 * torch.randn(E, generator=gen, dtype=torch.float64)
    plan, _ = route(logits, k, gate, None, bias=bias, groups=(G, M))
    s = scores_of(logits, gate).flatten(0, 1)
    assert plan.experts.sort(-1).values.tolist() == groups_by_hand(s, bias, k, G, M)
    ungrouped, _ = route(logits, k, gate, None, bias=bias)
    same = torch.equal(ungrouped.experts.sort(-1).values, plan.experts.sort(-1).values)
    assert same == (E == G)  # groups of one expert: the top M groups are the top M experts


def test_the_update_is_gamma_times_the_sign_of_mean_minus_load():
    """Loads [6, 2, 4, 4] (mean 4): the overloaded expert down a step, the underloaded up, the
    mean ones unchanged; the choices of every training forward count, an eval forward's not."""
    layer = MoEFeedForward(4, 4, 4, 1, "sigmoid", bias_update_rate=0.25)
    layer.step_load = torch.tensor([6, 2, 4, 4])
    update_expert_bias(layer)
    assert layer.bias_steps.tolist() == [-1, 1, 0, 0] and layer.step_load is None
    assert layer.expert_bias.tolist() == [-0.25, 0.25, 0.0, 0.0]
    x = torch.randn(2, 3, 4)
    layer(x)
    layer(x)
    with torch.no_grad():
        layer(x)
    assert layer.step_load.sum().item() == 2 * 6  # two training forwards of 6 tokens, k = 1


@pytest.mark.parametrize("changes, message", [
    (dict(n_expert_groups=3), r"n_expert_groups=3: use a divisor of n_experts=8"),
    (dict(n_expert_groups=4, topk_groups=5), r"topk_groups=5: use 1 … n_expert_groups=4"),
    (dict(n_expert_groups=8, topk_groups=1), r"hold 1 × 1 experts < top_k=2: raise topk_groups to 2"),
    (dict(bias_update_rate=-1.0), r"bias_update_rate=-1.0: use >= 0"),
])
def test_bad_groups_are_refused_naming_the_values(changes, message):
    with pytest.raises(ValueError, match=message):
        get_config("tiny-moe", **changes)


# --- trained over DP × EP (05) and the 3D mesh (07) against one device, bias included ----------

def layer_biases(model: torch.nn.Module) -> dict[int, list[int]]:
    """{layer index: bias_steps} of every MoE layer this rank holds (wrapper names stripped)."""
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, MoEFeedForward):
            out[int(re.search(r"layers\.(\d+)\.", name + ".").group(1))] = m.bias_steps.tolist()
    return out


def reference_with_bias(spec: TrainSpec) -> tuple[RunRecord, list[dict[int, list[int]]]]:
    """The single-device reference, its bias updated after each step; the biases after each."""
    trainer = make_reference(spec.cfg, spec.seed, spec.torch_dtype, spec.optimizer, spec.lr,
                             clip_grad=spec.clip_grad)
    update_bias_after_each_step(trainer.optimizer, trainer.model)
    data, losses, grads, biases = spec.data(), [], [], []
    for step in range(spec.steps):
        loss, g = trainer.step(data.global_batch(step, spec.global_batch))
        losses.append(loss)
        grads.append(g)
        biases.append(layer_biases(trainer.model))
    return RunRecord(losses, grads, {k: v.clone() for k, v in trainer.parameters().items()}), biases


def train_with_bias(spec: TrainSpec, factory, *args) -> tuple[RunRecord, list[dict[int, list[int]]]]:
    """Every rank: the shared loop's steps; its record (gathered on rank 0) and its biases."""
    strategy = factory(spec, *args)
    device = next(strategy.model.parameters()).device
    data, losses, grads, biases = spec.data(), [], [], []
    for step in range(spec.steps):
        micro = rank_micro_batches(strategy, data.global_batch(step, spec.global_batch),
                                   spec.micro_batch, device)
        losses.append(loss_value(strategy.forward_backward(micro)))
        full = strategy.full_gradients()
        if dist.get_rank() == 0:
            grads.append({n: t.detach().cpu().clone() for n, t in full.items()})
        strategy.step()
        strategy.zero_grad()
        biases.append(layer_biases(strategy.model))
    params = strategy.full_parameters()
    params = {n: t.detach().cpu().clone() for n, t in params.items()} if dist.get_rank() == 0 else {}
    return RunRecord(losses, grads, params), biases


def check_against_one_device(pools, spec: TrainSpec, factory, *args) -> None:
    reference, ref_biases = reference_with_bias(spec)
    results = pools.run(spec.world_size, train_with_bias, spec, factory, *args)
    losses = [sum(v) / len(v) for v in zip(*([x for x in r.losses if x is not None]
                                             for r, _ in results if None not in r.losses), strict=True)]
    record = RunRecord(losses, results[0][0].grads, results[0][0].params)
    diffs = differences(record, reference)
    assert max(diffs.values()) <= 1e-10, diffs
    for step, ref in enumerate(ref_biases):
        held = [b[step] for _, b in results]
        assert {layer for b in held for layer in b} == set(ref), step
        for rank, mine in enumerate(held):
            assert all(mine[layer] == ref[layer] for layer in mine), (step, rank, mine, ref)
    assert any(any(b) for b in ref_biases[0].values())  # the bias moved after the first step


def router_config(**changes) -> LlamaConfig:
    return get_config("tiny-moe", **{**dict(dim=16, n_layers=3, vocab_size=64, gate="sigmoid",
                                            aux_loss_coef=0.0, bias_update_rate=GAMMA, n_expert_groups=4,
                                            topk_groups=2), **changes})


def strategy_05(spec: TrainSpec, tp: int, ep: int):
    run = spec_run(spec, ep_train.validate, tp=tp, ep=ep, sequence_parallel=tp > 1, bias_update_rate=None)
    return ep_train.build(run, init_distributed())


@pytest.mark.parametrize("tp, ep", [(1, 2), (2, 2)])
def test_dp_and_ep_with_the_bias_router_equal_one_device(pools, tp, ep):
    """4 ranks: DP 4 with EP groups of 2 (2 micro-batches each), or TP 2 × DP 2 = EP 2 with SP."""
    spec = TrainSpec(cfg=router_config(), world_size=4, dp=4 // tp, global_batch=8, micro_batch=tp,
                     seq_len=8, steps=3, optimizer="adamw", seed=3)
    check_against_one_device(pools, spec, strategy_05, tp, ep)


def test_3d_with_the_bias_router_equals_one_device(pools):
    """07 on 4 ranks: PP 2 × dp_shard 2 = EP 2, 1F1B over 2 micro-batches, full recomputation
    (each MoE forward runs twice: every load doubles, the signs stay)."""
    cfg = router_config(n_layers=4)
    spec = TrainSpec(cfg=cfg, world_size=4, dp=2, global_batch=4, micro_batch=1, seq_len=8, steps=3,
                     optimizer="adamw", seed=5)
    check_against_one_device(pools, spec, strategy_moe, moe_flags(1, 2, 2, 1, 2, "FULL_SHARD", ac="full"))


# --- 07's checkpoints carry the bias, resharded like any replicated tensor ---------------------

CKPT_SPEC = TrainSpec(cfg=router_config(n_layers=4), world_size=4, dp=2, global_batch=4, micro_batch=1,
                      seq_len=8, steps=3, optimizer="adamw", seed=5)


def identity(spec: TrainSpec) -> dict:
    data = {"seed": spec.seed, "data": "synthetic", "global_batch": spec.global_batch,
            "seq_len": spec.seq_len}
    return {"data": data, "config": trainer_config(spec.cfg, spec.optimizer)}


def train_steps(strategy, spec: TrainSpec, start: int, stop: int) -> list[dict[int, list[int]]]:
    data, biases = spec.data(), []
    for step in range(start, stop):
        micro = rank_micro_batches(strategy, data.global_batch(step, spec.global_batch), spec.micro_batch,
                                   strategy.device)
        strategy.forward_backward(micro)
        strategy.step()
        strategy.zero_grad()
        biases.append(layer_biases(strategy.model))
    return biases


def save_then_resume(root: str, spec: TrainSpec, flags_a: dict, flags_b: dict, saved_at: int):
    """Train `saved_at` steps on mesh A and save; build mesh B, load, return its biases right
    after the load, after each later step, and its final full parameters (rank 0)."""
    a = strategy_moe(spec, flags_a)
    train_steps(a, spec, 0, saved_at)
    save_trainer_state(a.checkpoints.state, root, saved_at, **identity(spec))
    spec = replace(spec, dp=flags_b["dp"])
    b = strategy_moe(spec, flags_b)
    start = load_trainer_state(b.checkpoints.state, root, **identity(spec))
    loaded = layer_biases(b.model)
    later = train_steps(b, spec, start, spec.steps)
    return loaded, later, b.full_parameters()


def test_a_3d_checkpoint_resumes_the_bias_on_another_mesh(pools, tmp_path):
    """Saved after step 2 on PP 2 × EP 2 (each stage holds its layers' biases), resumed on
    dp_shard 4 × EP 4 (every rank holds all): the loaded bias and the one after step 3 are the
    single device's, and so are the final parameters (a load that skips buffers goes red)."""
    reference, ref_biases = reference_with_bias(CKPT_SPEC)
    results = pools.run(4, save_then_resume, str(tmp_path), CKPT_SPEC,
                        moe_flags(1, 2, 2, 1, 2, "FULL_SHARD"), moe_flags(1, 4, 1, 1, 4, "FULL_SHARD"),
                        CKPT_SPEC.steps - 1)
    for loaded, later, _ in results:
        assert loaded == ref_biases[-2] and later == ref_biases[-1:]
    assert differences(RunRecord([1.0], [{}], results[0][2]), RunRecord([1.0], [{}], reference.params))[
        "param"] <= 1e-10


# --- the demos' flag ----------------------------------------------------------------------------

@pytest.mark.parametrize("module, argv, message", [
    (ep_train, ["--bias-update-rate", "0.001", "--check"], r"--bias-update-rate 0.001 with --check: the "
     r"single-device reference"),
    (ep_train, ["--bias-update-rate", "-1"], r"--bias-update-rate -1.0: use >= 0"),
    (train3d, ["--model", "tiny-moe", "--ep", "2", "--bias-update-rate", "0.01", "--check"],
     r"--bias-update-rate 0.01 with --check"),
    (train3d, ["--model", "tiny", "--bias-update-rate", "0.01"],
     r"with --model tiny: .* a mixture-of-experts"),
])
def test_bad_bias_flags_are_refused_before_any_collective(module, argv, message):
    with pytest.raises(ConfigError, match=message):
        module.validate(module.parse_args(argv), 4)


def test_the_demo_trains_with_the_flag_and_its_formula_counts_the_loads(pools):
    """05's report with --bias-update-rate: the meter's bytes equal the formula with the loads'
    all-reduce (2(d-1)/d · L·E·8 a step) and the run's model carries γ."""
    argv = ["--ep", "2", "--bias-update-rate", "0.001", "--dtype", "float64", "--steps", "2",
            "--global-batch", "4", "--seq-len", "8", "--data", "synthetic", "--log-every", "0"]
    assert ep_train.validate(ep_train.parse_args(argv), 4).model.bias_update_rate == 0.001
    report = pools.run(4, train_cli, argv)[0]
    assert report["comm_bytes_per_rank"] == pytest.approx(report["comm_bytes_formula"], rel=1e-12)
