"""Chapter 04: our FullyShardedDataParallel trains the same numbers as one device, holds 1/N of
the state, keeps at most one unit (+1 prefetched) gathered, and sends 1.5× DDP's bytes."""

from __future__ import annotations

import types
from contextlib import nullcontext
from functools import partial

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

from common.cli import ConfigError
from common.comm import CommMeter
from common.data import local_micro_batches, split_inputs_targets
from common.dist import init_distributed
from common.kernel.model import TransformerBlock, build_model, get_config, loss_fn
from common.reference import TOLERANCE, ReferenceTrainer, make_reference, relative_diff
from common.run import Run
from fsdp import (
    FullyShardedDataParallel,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
    transformer_auto_wrap_policy,
)
from fsdp import train as fsdp_train
from fsdp.torch_fsdp2 import fsdp2_unavailable
from fsdp.train import FSDPStrategy, full_params_peak_formula
from tests.equivalence import (
    TrainSpec,
    check_strategy,
    check_strategy_rejected,
    data_parallel_specs,
    spec_args,
    with_spec,
)
from tests.harness import RankError, examples

STRATEGIES = ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD"]  # HSDP: test_fsdp_hybrid.py


def fsdp_strategy(spec: TrainSpec, sharding: str = "FULL_SHARD", no_sync: bool = False,
                  prefetch: bool = True) -> FSDPStrategy:
    """Built exactly as train.py builds it, from the namespace its parser would produce."""
    run = fsdp_run(spec, sharding, no_sync=no_sync, no_prefetch=not prefetch)
    return FSDPStrategy(run, init_distributed())


def fsdp_run(spec: TrainSpec, sharding: str, impl: str = "ours", dp: int | None = None, **flags) -> Run:
    """The run train.py's validate resolves from the namespace its parser would produce (on `dp`
    ranks: the data-parallel group's, the spec's world by default)."""
    flags = {"no_sync": False, "no_prefetch": False, "nodes": None, **flags}
    args = spec_args(spec, sharding_strategy=sharding, impl=impl, **flags)
    return fsdp_train.validate(args, dp or spec.world_size)


# --- the source article's loop, verbatim ----------------------------------------------------------

class LossModel(nn.Module):
    """`loss = model(batch)`: the article's model returns its loss."""

    def __init__(self, llama: nn.Module):
        super().__init__()
        self.llama = llama

    def forward(self, batch: torch.Tensor) -> torch.Tensor:
        inputs, targets = split_inputs_targets(batch)
        return loss_fn(self.llama(inputs), targets)


def article_loop(spec: TrainSpec, mixed: bool) -> dict:
    cfg, rank, world = spec.cfg, dist.get_rank(), dist.get_world_size()
    model = LossModel(build_model(cfg, spec.seed, spec.torch_dtype))
    dataloader = [local_micro_batches(spec.data().global_batch(s, spec.global_batch), rank, world,
                                      spec.global_batch // world)[0] for s in range(spec.steps)]
    # ---- the source article, with `from fsdp import ...` for torch's import, device_id=None (CPU)
    auto_wrap_policy = partial(
        transformer_auto_wrap_policy,
        transformer_layer_cls={TransformerBlock},
    )
    mixed_precision = MixedPrecision(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        buffer_dtype=torch.bfloat16,
    )
    model = FullyShardedDataParallel(
        model,
        auto_wrap_policy=auto_wrap_policy,
        mixed_precision=mixed_precision if mixed else None,
        sharding_strategy=ShardingStrategy.FULL_SHARD,
        device_id=None,
    )
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    # ---- observation only: when step() starts, every reduce-scatter has landed in .grad
    landed = []
    optimizer.register_step_pre_hook(lambda *_: landed.append(
        all(h.flat_param.grad is not None and h._reduce is None for h in model._handles())))
    losses = []
    for batch in dataloader:
        loss = model(batch)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    # ----
    full = model.full_state_dict()
    params = full and {n.removeprefix("llama."): t for n, t in full.items()}
    return {"losses": losses, "landed": landed, "params": params,
            "units": len(model.shard_layout())}


@pytest.mark.parametrize("mixed", [False, True])
def test_source_article_fsdp_loop_runs_verbatim(pools, mixed):
    spec = TrainSpec(cfg=get_config("tiny", n_layers=2), world_size=2, global_batch=4, micro_batch=2,
                     seq_len=6, steps=3, dtype="float32" if mixed else "float64",
                     mixed_precision="bf16" if mixed else "none")
    results = pools.run(2, article_loop, spec, mixed)
    assert all(all(r["landed"]) for r in results) and results[0]["units"] == 3
    trainer = make_reference(spec.cfg, spec.seed, spec.torch_dtype, mixed_precision=spec.mixed_precision)
    trainer.optimizer = torch.optim.AdamW(trainer.model.parameters(), lr=1e-4)  # the article's
    ref_losses = [trainer.step(spec.data().global_batch(s, spec.global_batch))[0] for s in range(spec.steps)]
    losses = [sum(r["losses"][s] for r in results) / 2 for s in range(spec.steps)]
    tolerance = TOLERANCE[spec.precision]
    assert max(abs(a - b) / b for a, b in zip(losses, ref_losses, strict=True)) <= tolerance
    metric = "global" if mixed else "max"
    assert relative_diff(results[0]["params"], trainer.parameters(), metric) <= tolerance


# --- equivalence properties ------------------------------------------------------------------------

@pytest.mark.parametrize("sharding", STRATEGIES)
@settings(max_examples=examples(2))  # + the float64 runs of train_cli and the user's loop (test_fsdp_drop_in)
@given(spec=data_parallel_specs(), clip=st.sampled_from([None, 1e-3, 1e3]), no_sync=st.booleans())
def test_fsdp_equals_single_device_float64(pools, sharding, spec, clip, no_sync):
    """Every strategy × world 1-4 × grad-accum (with and without no_sync) × clipping; the drawn
    shapes give unit sizes that do not divide by the world size (padded shards)."""
    check_strategy(pools, with_spec(spec, clip_grad=clip), fsdp_strategy, sharding, no_sync)


@settings(max_examples=examples(4))
@given(spec=data_parallel_specs(world_sizes=(2, 3), dtype="float32"), sharding=st.sampled_from(STRATEGIES),
       no_sync=st.booleans())
def test_fsdp_mixed_precision_equals_mixed_precision_reference(pools, spec, sharding, no_sync):
    """MixedPrecision(bf16, fp32, bf16), fp32 master shards and AdamW state, against the reference
    with the same casts: TOLERANCE['bf16-mixed'] = 5e-2 in the global relative norm."""
    check_strategy(pools, with_spec(spec, mixed_precision="bf16", clip_grad=1.0), fsdp_strategy,
                   sharding, no_sync)


def subgroup_strategy(spec: TrainSpec, sharding: str) -> FSDPStrategy:
    """World 4 as two data-parallel groups of 2, strided like 07's mesh ({0, 2} and {1, 3});
    each group shards over its own ranks and trains one replica."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[dist.get_rank() % 2]
    strategy = FSDPStrategy(fsdp_run(spec, sharding, dp=2), init_distributed(), process_group=group)
    strategy.dp_rank, strategy.dp_size = dist.get_rank(group), 2
    return strategy


@pytest.mark.parametrize("sharding", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_fsdp_on_a_sub_group_equals_single_device(pools, sharding):
    spec = TrainSpec(cfg=get_config("tiny", n_layers=2), world_size=4, dp=2, global_batch=4,
                     micro_batch=1, seq_len=5, steps=2, clip_grad=1e-2)
    check_strategy(pools, spec, subgroup_strategy, sharding)


def torch_fsdp2_strategy(spec: TrainSpec, sharding: str):
    from fsdp.torch_fsdp2 import TorchFSDP2Strategy
    return TorchFSDP2Strategy(fsdp_run(spec, sharding, impl="torch-fsdp2"), init_distributed())


FSDP2_MISSING = fsdp2_unavailable("cpu")  # the suite's ranks run on CPU (gloo)


@pytest.mark.skipif(FSDP2_MISSING is not None, reason=str(FSDP2_MISSING))
@pytest.mark.parametrize("sharding", ["FULL_SHARD", "SHARD_GRAD_OP"])
def test_torch_fsdp2_through_the_same_check(pools, sharding):
    """torch's own FSDP2 (fully_shard, the same units) held to the same reference (float64: FSDP2
    reduces with SUM and divides by N itself, so gloo's AVG handling never enters)."""
    spec = TrainSpec(cfg=get_config("tiny", n_layers=2), world_size=2, global_batch=4, micro_batch=1,
                     seq_len=5, steps=2, clip_grad=1e-2)
    check_strategy(pools, spec, torch_fsdp2_strategy, sharding)


# --- negative controls: the same check rejects a broken FSDP ----------------------------------------

def _finish_grad_without_divide(self) -> None:
    work, out, _ = self._reduce
    self._reduce = None
    work.wait()
    self.flat_param.grad = out if self.flat_param.grad is None else self.flat_param.grad.add_(out)


class LocalNormClipping(FSDPStrategy):
    """Clips each rank by the norm of its own shard only (the all-reduce of the norm is missing)."""

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=False)


def broken_strategy(spec: TrainSpec, broken: str) -> FSDPStrategy:
    if broken == "partial-clip-norm":
        return LocalNormClipping(fsdp_run(spec, "FULL_SHARD"), init_distributed())
    strategy = fsdp_strategy(spec)
    full = strategy.model.full_state_dict(rank0_only=False)
    for h in strategy.model._handles():
        if broken == "missing-1/N":
            h.finish_grad = types.MethodType(_finish_grad_without_divide, h)
        elif broken == "wrong-shard-offset":  # each rank starts from its neighbour's slice
            h.shard_rank = (h.shard_rank + 1) % h.shard_world
    strategy.model.load_state_dict(full)
    return strategy


NEGATIVE = TrainSpec(cfg=get_config("tiny", n_layers=1), world_size=2, global_batch=4, micro_batch=1,
                     seq_len=6, steps=2, clip_grad=1e-3, optimizer="sgd")


@pytest.mark.parametrize("broken", ["missing-1/N", "wrong-shard-offset", "partial-clip-norm"])
@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_broken_fsdp_is_rejected(pools, broken, optimizer):
    check_strategy_rejected(pools, with_spec(NEGATIVE, optimizer=optimizer), broken_strategy, broken)


# --- pipeline-stage shape (chapter 07): any module, input grads, forwards before backwards ---------

class Stage(nn.Module):
    """A slice of blocks taking hidden states, as one pipeline stage holds."""

    def __init__(self, blocks: list[nn.Module], cfg):
        super().__init__()
        self.cfg, self.blocks = cfg, nn.ModuleList(blocks)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        from common.kernel.model import rope_cos_sin
        cos, sin = rope_cos_sin(self.cfg, torch.arange(h.shape[1]), h.dtype)
        for block in self.blocks:
            h = block(h, cos, sin)
        return h


def stage_two_forwards_then_two_backwards(sharding: str) -> tuple[float, float]:
    """1F1B-like order F0 F1 B0 B1 on a stage of 3 blocks; grads of the input and the weights vs
    the unwrapped stage (world 2, local micro-batches of rank r's rows)."""
    cfg = get_config("tiny", n_layers=3)
    blocks = list(build_model(cfg, 0, torch.float64).layers)
    ref = Stage([TransformerBlock(cfg).double() for _ in blocks], cfg)
    ref.load_state_dict(Stage(blocks, cfg).state_dict())
    stage = FullyShardedDataParallel(Stage(blocks, cfg), sharding_strategy=ShardingStrategy[sharding],
                                     auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(4, 5, cfg.dim, generator=gen, dtype=torch.float64) for _ in range(2)]
    mine = [x[2 * dist.get_rank():][:2].clone().requires_grad_() for x in xs]
    outs = [stage(x) for x in mine]
    for out in outs:
        out.pow(2).mean().backward()  # each micro-batch's own backward (its own end callback)
    theirs = [x.clone().requires_grad_() for x in xs]
    for x in theirs:
        ref(x).pow(2).mean().backward()
    grads = stage.full_gradients(rank0_only=False)
    ref_grads = {n: p.grad for n, p in ref.named_parameters()}  # the mean over ranks = the whole batch
    input_diff = max((m.grad - t.grad[2 * dist.get_rank():][:2] * 2).abs().max().item()
                     for m, t in zip(mine, theirs, strict=True))
    return relative_diff(grads, ref_grads), input_diff


@pytest.mark.parametrize("sharding", STRATEGIES)
def test_stage_module_with_outstanding_forwards_matches_unwrapped(pools, sharding):
    for grad_diff, input_diff in pools.run(2, stage_two_forwards_then_two_backwards, sharding):
        assert grad_diff < 1e-12 and input_diff < 1e-12, (grad_diff, input_diff)


def sync_states_and_inf_norm() -> tuple[bool, float, float]:
    """Rank-dependent init + sync_module_states=True → every rank holds rank 0's model; the
    inf-norm clip returns the max |g| of the full gradients."""
    cfg = get_config("tiny", n_layers=2)
    model = build_model(cfg, seed=dist.get_rank())
    fsdp = FullyShardedDataParallel(model, sync_module_states=True,
                                    auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
    same = relative_diff(fsdp.full_state_dict(rank0_only=False), build_model(cfg, seed=0).state_dict()) == 0
    gen = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, cfg.vocab_size, (2, 7), generator=gen)
    loss_fn(fsdp(tokens[:, :-1]), tokens[:, 1:]).backward()
    full = fsdp.full_gradients(rank0_only=False)
    total = fsdp.clip_grad_norm_(1e-3, norm_type=float("inf"))
    return same, total.item(), max(g.abs().max().item() for g in full.values())


def test_sync_module_states_and_inf_norm_clipping(pools):
    for same, total, expected in pools.run(2, sync_states_and_inf_norm):
        assert same and total == expected


# --- state dicts --------------------------------------------------------------------------------

def state_dicts_after_training(spec: TrainSpec) -> dict:
    strategy = fsdp_strategy(spec)
    data = spec.data()
    for step in range(spec.steps):
        tokens = data.global_batch(step, spec.global_batch)
        strategy.forward_backward(local_micro_batches(tokens, strategy.dp_rank, strategy.dp_size,
                                                      spec.micro_batch))
        strategy.step()
        strategy.zero_grad()
    model = strategy.model
    full, local = model.full_state_dict(), model.local_state_dict()
    everywhere = model.state_dict()  # torch's default (FULL_STATE_DICT): the full dict on every rank
    fresh = fsdp_strategy(spec).model  # from init: load the full dict, then the local shards
    fresh.load_state_dict(everywhere)
    via_full = fresh.full_state_dict()
    fresh2 = fsdp_strategy(spec).model
    fresh2.load_local_state_dict({k: v.clone() for k, v in local.items()})
    via_local = fresh2.full_state_dict()
    return {"full": full, "everywhere": everywhere, "via_full": via_full, "via_local": via_local,
            "local_keys": sorted(local), "pads": [u.padded_numel - u.numel for u in model.shard_layout()]}


def test_full_state_dict_equals_reference_state_dict_and_round_trips(pools):
    """torch's contract for `state_dict()` / `load_state_dict()` (FULL_STATE_DICT): the reference's
    names, order and values on every rank; `full_state_dict()` the same on rank 0 only."""
    spec = TrainSpec(cfg=get_config("tiny", n_layers=2, dim=40, n_heads=4, n_kv_heads=2), world_size=3,
                     global_batch=6, micro_batch=1, seq_len=5, steps=2)
    result = pools.run(3, state_dicts_after_training, spec)
    trainer = ReferenceTrainer(spec.cfg, spec.seed, spec.torch_dtype, spec.optimizer, spec.lr)
    for s in range(spec.steps):
        trainer.step(spec.data().global_batch(s, spec.global_batch))
    reference = trainer.model.state_dict()
    full = result[0]["full"]
    assert list(full) == list(reference)  # original names, original order
    assert relative_diff(full, dict(reference)) <= 1e-10
    assert result[1]["full"] is None  # rank 0 only
    for r in result:
        everywhere = r["everywhere"]
        assert list(everywhere) == list(full) and all(torch.equal(full[n], everywhere[n]) for n in full)
    for key in ("via_full", "via_local"):
        assert all(torch.equal(full[n], result[0][key][n]) for n in full), key
    assert result[0]["local_keys"] == ["_flat_param", "layers.0._flat_param", "layers.1._flat_param"]
    assert any(result[0]["pads"]), "the shapes should leave a unit that 3 does not divide (padding)"


# --- memory: the ledger of gathered parameters and the sharded state ------------------------------

def traced_steps(spec: TrainSpec, sharding: str, prefetch: bool) -> dict:
    strategy = fsdp_strategy(spec, sharding, prefetch=prefetch)
    data, model = spec.data(), strategy.model
    for step in range(2):  # the first forward records the execution order that prefetch follows
        model.memory_trace = []
        tokens = data.global_batch(step, spec.global_batch)
        strategy.forward_backward(local_micro_batches(tokens, strategy.dp_rank, strategy.dp_size,
                                                      spec.micro_batch))
        strategy.step()
        memory = strategy.memory()
        strategy.zero_grad()
    unit_bytes = {u.name or "<root>": u.full_bytes for u in model.shard_layout()}
    _, formula = strategy.formulas(1)
    return {"trace": model.memory_trace, "unit_bytes": unit_bytes, "memory": memory, "formula": formula,
            "peak_formula": full_params_peak_formula(model)}


MEMORY_SPEC = TrainSpec(cfg=get_config("tiny", n_layers=4), world_size=4, global_batch=4, micro_batch=1,
                        seq_len=6, steps=1)


@pytest.mark.parametrize("prefetch", [True, False])
def test_full_shard_keeps_at_most_one_unit_plus_one_prefetched_gathered(pools, prefetch):
    result = pools.run(4, traced_steps, MEMORY_SPEC, "FULL_SHARD", prefetch)[0]
    trace, sizes = result["trace"], result["unit_bytes"]
    most = max(len([u for u in e["live_units"] if u != "<root>"]) for e in trace)
    assert most == (2 if prefetch else 1), trace
    assert max(e["live_bytes"] for e in trace) == result["peak_formula"]
    assert all(e["live_bytes"] <= sizes["<root>"] + 2 * max(sizes.values()) for e in trace)
    assert trace[-1]["live_bytes"] == 0  # nothing gathered once backward has returned
    gathers = [e["unit"] for e in trace if e["event"] == "gather"]
    assert gathers == ["<root>", *[f"layers.{i}" for i in range(4)],  # forward
                       *[f"layers.{i}" for i in reversed(range(4))]]  # backward (root kept)
    if prefetch:  # the next unit's gather starts before the current one is freed, both ways
        forward = [(e["event"], e["unit"]) for e in trace if e["phase"] == "forward"]
        backward = [(e["event"], e["unit"]) for e in trace if e["phase"] == "backward"]
        assert forward.index(("gather", "layers.1")) < forward.index(("free", "layers.0"))
        assert backward.index(("gather", "layers.2")) < backward.index(("free", "layers.3"))


def test_shard_grad_op_keeps_every_unit_from_forward_to_backward(pools):
    result = pools.run(4, traced_steps, MEMORY_SPEC, "SHARD_GRAD_OP", True)[0]
    assert max(e["live_bytes"] for e in result["trace"]) == sum(result["unit_bytes"].values())
    assert result["peak_formula"] == sum(result["unit_bytes"].values())


@pytest.mark.parametrize("world, sharding", [(4, "FULL_SHARD"), (3, "SHARD_GRAD_OP"), (2, "NO_SHARD")])
def test_sharded_state_is_a_1_over_n_share_of_ddp_state(pools, world, sharding):
    """params + grads + AdamW state per rank = exactly the formula, and within 5% of DDP's
    (4P·b)/N (padding to N per unit, AdamW's step counters); NO_SHARD holds all of DDP's."""
    spec = with_spec(MEMORY_SPEC, world_size=world, global_batch=world)
    result = pools.run(world, traced_steps, spec, sharding, True)[0]
    assert result["memory"] == result["formula"]
    P = build_model(spec.cfg).parameters()
    ddp = 4 * sum(p.numel() for p in P) * 8
    share = ddp if sharding == "NO_SHARD" else ddp / world
    assert abs(sum(result["memory"].values()) / share - 1) < 0.05


# --- communication ------------------------------------------------------------------------------

def metered_linear_step(sharding: str, grad_accum: int, no_sync: bool) -> dict:
    """A stack of 4 bias-free 8x8 linears, each a unit, root without parameters."""
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(4)]).double()
    fsdp = FullyShardedDataParallel(model, sharding_strategy=ShardingStrategy[sharding],
                                    auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    with CommMeter() as meter:
        for i in range(grad_accum):
            with fsdp.no_sync() if no_sync and i < grad_accum - 1 else nullcontext():
                fsdp(torch.randn(2, 8, dtype=torch.float64)).sum().backward()
    return {"comm": meter.as_dict(), "bytes": meter.bytes_sent}


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("sharding, ratio", [("FULL_SHARD", 1.5), ("SHARD_GRAD_OP", 1.0), ("NO_SHARD", 1.0)])
def test_comm_is_1_5x_ddp_for_full_shard_and_1x_otherwise(pools, world, sharding, ratio):
    n, P = world, 4 * 64
    ddp = 2 * (n - 1) / n * P * 8
    result = pools.run(world, metered_linear_step, sharding, 1, False)[0]
    assert result["bytes"] == pytest.approx(ratio * ddp, rel=1e-12)
    calls = {op.replace("_into_tensor", "_single").replace("_tensor", "_single"): s["calls"]
             for op, s in result["comm"].items()}
    expected = {"FULL_SHARD": {"all_gather_single": 8, "reduce_scatter_single": 4},
                "SHARD_GRAD_OP": {"all_gather_single": 4, "reduce_scatter_single": 4},
                "NO_SHARD": {"all_reduce": 4}}[sharding]
    assert calls == expected


def test_no_sync_reduces_once_per_step_and_gathers_every_micro_batch(pools):
    plain, synced = (pools.run(2, metered_linear_step, "FULL_SHARD", 3, no_sync)[0]["comm"]
                     for no_sync in (False, True))
    rs = next(op for op in plain if op.startswith("reduce_scatter"))
    ag = next(op for op in plain if op.startswith("all_gather"))
    assert (plain[rs]["calls"], synced[rs]["calls"]) == (12, 4)
    assert plain[ag]["calls"] == synced[ag]["calls"] == 24


def train_cli(argv: list[str]) -> dict:
    from common.training import train
    args = fsdp_train.parse_args(argv)
    run = fsdp_train.validate(args, dist.get_world_size())
    ctx = init_distributed()
    return train(run, ctx, fsdp_train.build(run, ctx), chapter=4)


CLI_ARGV = ["--model", "tiny", "--steps", "2", "--global-batch", "8", "--seq-len", "8", "--check",
            "--data", "synthetic", "--log-every", "0", "--grad-accum", "2", "--clip-grad", "1.0"]


@pytest.mark.parametrize("flags", [["--dtype", "float64", "--sharding-strategy", "FULL_SHARD"],
                                   ["--mixed-precision", "bf16", "--sharding-strategy", "SHARD_GRAD_OP",
                                    "--no-sync"]])
def test_train_check_passes_and_report_matches_formulas(pools, flags):
    report = pools.run(2, train_cli, [*CLI_ARGV, *flags])[0]
    assert report["check_passed"], report
    assert report["comm_bytes_per_rank"] == pytest.approx(report["comm_bytes_formula"], rel=1e-12)
    for key in ("params", "grads", "optimizer"):
        assert report["memory"][key] == report["memory_formula"][key], key
    assert report["full_params_peak"] == report["full_params_peak_formula"]
    assert report["memory"]["activations_peak"] > 0


# --- bad input --------------------------------------------------------------------------------------

def wrap_with(kind: str) -> None:
    cfg = get_config("tiny", n_layers=2)
    if kind == "policy-wraps-nothing":
        FullyShardedDataParallel(build_model(cfg), auto_wrap_policy=partial(
            transformer_auto_wrap_policy, transformer_layer_cls={nn.TransformerEncoderLayer}))
    elif kind == "shared-across-units":
        model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
        model[1].weight = model[0].weight
        FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    elif kind == "module-used-twice":
        block = nn.Linear(4, 4, bias=False)
        FullyShardedDataParallel(nn.Sequential(block, block), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    elif kind == "integer-mixed-precision":
        MixedPrecision(param_dtype=torch.int8)
    elif kind == "strategy-as-string":
        FullyShardedDataParallel(build_model(cfg), sharding_strategy="FULL_SHARD")


@pytest.mark.parametrize("kind, message", [
    ("policy-wraps-nothing", r"wrapped no submodule of Llama .*transformer_layer_cls"),
    ("shared-across-units", r"shared between units '0' and '1'"),
    ("module-used-twice", r"module '1' is the same module as the unit '0'"),
    ("integer-mixed-precision", r"param_dtype=torch.int8.*floating-point"),
    ("strategy-as-string", r"use a ShardingStrategy"),
])
def test_bad_wrapping_is_a_clear_error_on_every_rank(pools, kind, message):
    with pytest.raises(RankError, match=message) as info:
        pools.run(2, wrap_with, kind)
    assert sorted(info.value.errors) == [0, 1]
    pools.run(2, dist.barrier)  # no rank was left inside a collective


def world_one_step() -> dict:
    spec = TrainSpec(cfg=get_config("tiny", n_layers=2), world_size=1, global_batch=2, micro_batch=1,
                     seq_len=5, steps=1, mixed_precision="bf16", dtype="float32")
    strategy = fsdp_strategy(spec)
    tokens = spec.data().global_batch(0, 2)
    with CommMeter() as meter:
        strategy.forward_backward(local_micro_batches(tokens, 0, 1, 1))
        strategy.model.clip_grad_norm_(1.0)
    return meter.as_dict()


def test_world_size_one_works_without_collectives(pools):
    assert pools.run(1, world_one_step)[0] == {}


def validate_argv(argv: list[str]):
    return fsdp_train.validate(fsdp_train.parse_args(argv), dist.get_world_size())


@pytest.mark.parametrize("argv, message", [
    (["--sharding-strategy", "ZERO3"], r"--sharding-strategy 'ZERO3' is unknown: use one of FULL_SHARD"),
    (["--mixed-precision", "bf16", "--dtype", "float64"], r"--mixed-precision bf16 with --dtype float64"),
    (["--global-batch", "6"], r"--global-batch 6 is not divisible by the data-parallel size 4"),
])
def test_bad_flags_fail_on_every_rank_before_any_collective(pools, argv, message):
    with pytest.raises(RankError, match=message) as info:
        pools.run(4, validate_argv, argv)
    assert sorted(info.value.errors) == [0, 1, 2, 3]
    assert all(isinstance(e, str) for e in info.value.errors.values())
    assert ConfigError.__name__ in info.value.errors[0]


def test_torch_policy_function_works_too():
    """torch's own `transformer_auto_wrap_policy` has the same signature as ours."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy as torch_policy

    from fsdp.wrap import apply_auto_wrap
    model = build_model(get_config("tiny", n_layers=3))
    made = apply_auto_wrap(model, partial(torch_policy, transformer_layer_cls={TransformerBlock}),
                           lambda m: nn.Sequential(m), lambda m: False)
    assert made == 3
