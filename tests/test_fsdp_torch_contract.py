"""Chapter 04 keeps torch's FSDP1 contract wherever it uses torch's names: the constructor's
signature and defaults, MixedPrecision's fields, the enums, the wrap policies, param_init_fn,
backward_prefetch, forward-input casting, buffers in state dicts; what it cannot honour fails
before any collective with the fix. Also: FSDP's traffic formula in closed form, and the refusal
of torch's FSDP2 yardstick where the installed torch cannot run it."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import os
from functools import partial

import pytest
import torch
import torch.distributed as dist
from torch import nn

from common.cli import ConfigError
from common.kernel.model import RMSNorm, TransformerBlock, build_model, get_config, loss_fn
from common.reference import relative_diff
from fsdp import (
    BackwardPrefetch,
    FullyShardedDataParallel,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
    UnitTraffic,
    fsdp_comm_bytes,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)
from fsdp.state import NOT_IMPLEMENTED
from fsdp.wrap import apply_auto_wrap

torch_fsdp = pytest.importorskip("torch.distributed.fsdp")
torch_wrap = pytest.importorskip("torch.distributed.fsdp.wrap")


# --- the names torch gave them, with torch's defaults --------------------------------------------

def default(value):
    return value.name if isinstance(value, torch_fsdp.BackwardPrefetch | BackwardPrefetch) else value


def test_constructor_has_torchs_parameters_in_torchs_order_with_torchs_defaults():
    """A positional or keyword call written for torch's FSDP1 means the same here; our own
    mechanism (`shard_init_fn`) is keyword-only, after torch's."""
    theirs = list(inspect.signature(torch_fsdp.FullyShardedDataParallel.__init__).parameters.values())
    ours = list(inspect.signature(FullyShardedDataParallel.__init__).parameters.values())
    assert [p.name for p in ours[: len(theirs)]] == [p.name for p in theirs]
    assert [default(p.default) for p in ours[: len(theirs)]] == [default(p.default) for p in theirs]
    keyword_only = inspect.Parameter.KEYWORD_ONLY
    assert [(p.name, p.kind) for p in ours[len(theirs):]] == [("shard_init_fn", keyword_only)]


def test_mixed_precision_has_torchs_fields_and_defaults():
    fields = lambda cls: [(f.name, f.default) for f in dataclasses.fields(cls)]  # noqa: E731
    assert fields(MixedPrecision) == fields(torch_fsdp.MixedPrecision)


def test_enums_have_torchs_members_hybrid_shard_included():
    """HYBRID_SHARD and _HYBRID_SHARD_ZERO2 work (tests/test_fsdp_hybrid.py); no member is refused."""
    assert list(BackwardPrefetch.__members__) == list(torch_fsdp.BackwardPrefetch.__members__)
    assert list(ShardingStrategy.__members__) == list(torch_fsdp.ShardingStrategy.__members__)


@pytest.mark.parametrize("module", [nn.Linear(4, 4), nn.ModuleList([nn.Linear(4, 4)]), nn.ModuleDict(),
                                    nn.MultiheadAttention(4, 1), nn.Sequential(nn.Linear(4, 4))])
def test_size_based_policy_answers_as_torchs(module):
    for recurse in (True, False):
        for numel in (0, 99, 100, 10**8):
            for kwargs in ({}, {"min_num_params": 100}):
                args = dict(module=module, recurse=recurse, nonwrapped_numel=numel, **kwargs)
                assert size_based_auto_wrap_policy(**args) == torch_wrap.size_based_auto_wrap_policy(**args)


class Unit(nn.Module):
    def __init__(self, module: nn.Module, **_):
        super().__init__()
        self.module = module


@pytest.mark.parametrize("module", [TransformerBlock(get_config("tiny")), RMSNorm(4, 1e-5), nn.Linear(4, 4)])
def test_transformer_policy_answers_as_torchs(module):
    """transformer_auto_wrap_policy(module, recurse, nonwrapped_numel, transformer_layer_cls), as
    torch's: recurse into everything; wrap exactly the listed classes."""
    for recurse in (True, False):
        args = dict(module=module, recurse=recurse, nonwrapped_numel=100,
                    transformer_layer_cls={TransformerBlock})
        assert transformer_auto_wrap_policy(**args) == torch_wrap.transformer_auto_wrap_policy(**args)


@pytest.mark.parametrize("min_num_params", [1, 2_000, 20_000, 10**6])
def test_auto_wrap_makes_the_units_torchs_recursive_wrap_makes(min_num_params):
    """Same policy, same model: the same modules become units (torch asks the root whether to
    descend too; a size policy below its threshold makes no unit at all)."""
    policy = partial(size_based_auto_wrap_policy, min_num_params=min_num_params)
    units = lambda m: sorted(n for n, x in m.named_modules() if isinstance(x, Unit))  # noqa: E731
    ours, theirs = build_model(get_config("tiny", n_layers=2)), build_model(get_config("tiny", n_layers=2))
    apply_auto_wrap(ours, policy, Unit, lambda m: isinstance(m, Unit))
    torch_wrap._recursive_wrap(theirs, policy, Unit, ignored_modules=set(), ignored_params=set(),
                               only_wrap_children=True)
    assert units(ours) == units(theirs)


# --- what cannot be honoured fails at once (this process has no process group: no collective ran) --

@pytest.mark.parametrize("kwargs, error, message", [
    (dict(backward_prefetch=True), ValueError, r"takes a BackwardPrefetch or None.*BACKWARD_PRE"),
    (dict(sharding_strategy="FULL_SHARD"), ValueError, r"use a ShardingStrategy"),
    (dict(cpu_offload="offload"), NotImplementedError, r"offload is not implemented.*cpu_offload=None"),
    (dict(ignored_modules=["m"]), NotImplementedError, r"ignored_modules: not implemented"),
    (dict(ignored_states=["p"]), NotImplementedError, r"ignored_states: not implemented"),
    (dict(device_mesh="mesh"), NotImplementedError, r"device_mesh.*pass process_group=.*get_group\(1\)"),
    (dict(process_group=("intra", "inter")), ValueError, r"a pair of groups serves HYBRID_SHARD"),
    (dict(process_group=("intra", "inter"), sharding_strategy=ShardingStrategy.HYBRID_SHARD), ValueError,
     r"must be a tuple of two ProcessGroups, \(shard_group, replicate_group\)"),
    (dict(process_group="intra", sharding_strategy=ShardingStrategy._HYBRID_SHARD_ZERO2), ValueError,
     r"takes process_group=\(shard_group, replicate_group\) or None"),
    (dict(sharding_strategy=ShardingStrategy.HYBRID_SHARD), ValueError,
     r"Manual wrapping with ShardingStrategy.HYBRID_SHARD requires explicit.*build_mesh\(MeshShape"),
    (dict(param_init_fn=lambda m: None, shard_init_fn=lambda n, p: p), ValueError, r"both given: pass one"),
    (dict(sync_module_states=True, shard_init_fn=lambda n, p: p), ValueError, r"sync_module_states=True "
                                                                               r"with shard_init_fn"),
])
def test_options_we_cannot_honour_fail_before_any_collective(kwargs, error, message):
    assert not dist.is_initialized()
    with pytest.raises(error, match=message):
        FullyShardedDataParallel(nn.Linear(2, 2), **kwargs)


REFUSED_FSDP1 = [  # every public method of torch's FSDP1 not implemented here, and the fix it names
    ("apply", r"call fn on the module before wrapping it, or pass param_init_fn"),
    ("summon_full_params", r"model.full_state_dict\(rank0_only=False\)"),
    ("state_dict_type", r"state_dict\(\) is already FULL_STATE_DICT"),
    ("set_state_dict_type", r"full_state_dict\(rank0_only=True\) is FullStateDictConfig"),
    ("get_state_dict_type", r"local_state_dict\(\) is LOCAL_STATE_DICT"),
    ("full_optim_state_dict", r"optim_state_dict\(model, optim\)"),
    ("sharded_optim_state_dict", r"optim_state_dict\(model, optim\)"),
    ("shard_full_optim_state_dict", r"optim_state_dict_to_load\(model, optim, osd\)"),
    ("scatter_full_optim_state_dict", r"optim_state_dict_to_load\(model, optim, osd\)"),
    ("flatten_sharded_optim_state_dict", r"optim_state_dict_to_load\(model, optim, osd\)"),
    ("rekey_optim_state_dict", r"torch's current pair"),
    ("register_comm_hook", r"flat_param.py's reduce_grad"),
]


def test_the_refused_fsdp1_methods_are_all_listed():
    assert sorted(name for name, _ in REFUSED_FSDP1) == sorted(NOT_IMPLEMENTED)


@pytest.mark.parametrize("name, fix", REFUSED_FSDP1)
def test_torchs_fsdp1_methods_not_implemented_here_raise_naming_the_fix(name, fix):
    """Called the torch way, on the class (FSDP.summon_full_params(model)) or on a model, before any
    collective; nn.Module.apply would silently run on freed views, so it is refused too."""
    assert not dist.is_initialized()
    model = FullyShardedDataParallel.__new__(FullyShardedDataParallel)  # no process group needed
    for call in (lambda: getattr(FullyShardedDataParallel, name)(model, nn.Linear(2, 2)),
                 lambda: getattr(model, name)(lambda m: None)):
        with pytest.raises(NotImplementedError, match=rf"FullyShardedDataParallel.{name} \(torch's FSDP1\) "
                           rf"is not implemented here: .*{fix}"):
            call()


def test_cpu_offload_that_offloads_nothing_is_accepted_as_torchs_default():
    from fsdp.wrap import check_options
    check_options(None, ShardingStrategy.FULL_SHARD, None, torch_fsdp.CPUOffload(offload_params=False),
                  None, None, None, None, None, False)
    with pytest.raises(NotImplementedError, match="offload"):
        check_options(None, ShardingStrategy.FULL_SHARD, None, torch_fsdp.CPUOffload(offload_params=True),
                      None, None, None, None, None, False)


def test_keep_low_precision_grads_is_refused():
    with pytest.raises(NotImplementedError, match=r"keep_low_precision_grads=True.*drop the argument"):
        MixedPrecision(torch.bfloat16, keep_low_precision_grads=True)


# --- meta-device construction without param_init_fn, and the root-only methods ---------------------

class Bare(nn.Module):
    """A module with a parameter and no reset_parameters()."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(3))


def meta_defaults() -> dict:
    """torch's default for a meta module: to_empty + reset_parameters per module (same RNG draws
    as building it on CPU, here where breadth-first order is construction order)."""
    torch.manual_seed(0)
    cpu = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    torch.manual_seed(0)
    with torch.device("meta"):
        meta = nn.Sequential(nn.Linear(3, 4), nn.Linear(4, 2))
    fsdp = FullyShardedDataParallel(meta, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    same = all(torch.equal(fsdp.state_dict()[k], v) for k, v in cpu.state_dict().items())
    errors = []
    with torch.device("meta"):
        bare = Bare()
    for call in (lambda: FullyShardedDataParallel(bare), lambda: fsdp.units()[1].clip_grad_norm_(1.0),
                 lambda: fsdp.units()[1].state_dict()):
        try:
            call()
        except (ValueError, RuntimeError) as e:
            errors.append(str(e))
    return {"same": same, "errors": errors}


def test_meta_module_without_param_init_fn_is_reset_like_torchs_and_root_methods_refuse_units(pools):
    result = pools.run(1, meta_defaults)[0]
    assert result["same"]
    bare, clip, state = result["errors"]
    assert "Bare is on the meta device and has no reset_parameters(): pass param_init_fn" in bare
    assert "clip_grad_norm_() must be called on the root" in clip and "'0'" in clip
    assert "state_dict() must be called on the root" in state


# --- backward_prefetch: when the next unit's all-gather is issued ----------------------------------

def backward_order(prefetch: str | None) -> dict:
    """Two steps of 4 blocks with forward_prefetch=False (torch's default); the gathers, frees and
    reductions of the second step's backward, in issue order."""
    cfg = get_config("tiny", n_layers=4)
    model = FullyShardedDataParallel(build_model(cfg, 0, torch.float64),
                                     auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                                     backward_prefetch=prefetch and BackwardPrefetch[prefetch])
    for h in model._handles():  # reductions join the ledger's gathers and frees, in issue order
        def logged(grad, sync, h=h, reduce=h.reduce_grad):
            model.memory_trace.append({"event": "reduce", "unit": h.name, "phase": "backward",
                                       "live_units": []})
            reduce(grad, sync)
        h.reduce_grad = logged
    gen = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, cfg.vocab_size, (2, 7), generator=gen)
    for _ in range(2):
        model.memory_trace = []
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
    trace = model.memory_trace
    return {"events": [(e["event"], e["unit"]) for e in trace if e["phase"] == "backward"],
            "most_blocks": max(len([u for u in e["live_units"] if u != "<root>"]) for e in trace)}


@pytest.mark.parametrize("prefetch, most_blocks, gather_before_reduce, free_before_gather", [
    ("BACKWARD_PRE", 2, True, False),    # L2 gathered when L3's backward starts
    ("BACKWARD_POST", 1, True, True),    # L2 gathered once L3's gradient is done and L3 freed
    (None, 1, False, True),              # L2 gathered when its own backward starts
])
def test_backward_prefetch_issues_the_next_gather_where_torch_does(pools, prefetch, most_blocks,
                                                                   gather_before_reduce, free_before_gather):
    result = pools.run(2, backward_order, prefetch)[0]
    events = result["events"]
    assert result["most_blocks"] == most_blocks, events
    gather, free, reduce = (events.index(e) for e in
                            [("gather", "layers.2"), ("free", "layers.3"), ("reduce", "layers.3")])
    assert (gather < reduce, free < gather) == (gather_before_reduce, free_before_gather), events


# --- forward-input casting and buffers, as torch's MixedPrecision ----------------------------------

class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.register_buffer("scale", torch.full((4,), 0.5))

    def forward(self, x):
        return self.b(self.a(x) * self.scale)


def casts_seen() -> dict:
    seen = {}
    for root, units in [(True, False), (False, True), (False, False)]:
        torch.manual_seed(0)
        model = Scaled()
        model.a.register_forward_pre_hook(lambda _, x, key=(root, units): seen.__setitem__(key, x[0].dtype))
        fsdp = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({nn.Linear}),
                                        mixed_precision=MixedPrecision(
                                            torch.bfloat16, buffer_dtype=torch.bfloat16,
                                            cast_root_forward_inputs=root, cast_forward_inputs=units))
        with contextlib.suppress(RuntimeError):  # fp32 input, bf16 weight: nobody cast
            fsdp(torch.ones(2, 4))
    buffers = (model.scale.dtype, fsdp.state_dict()["scale"].dtype)
    torch.manual_seed(0)
    norms = nn.Sequential(nn.Linear(4, 4), RMSNorm(4, 1e-5))
    norms[1].register_forward_pre_hook(lambda m, _: seen.__setitem__("norm", m.weight.dtype))
    FullyShardedDataParallel(norms, mixed_precision=MixedPrecision(
        torch.bfloat16, _module_classes_to_ignore=(RMSNorm,)))(torch.ones(2, 4))  # no policy: as torch
    return {"seen": seen, "buffers": buffers}


def test_forward_inputs_are_cast_where_torch_casts_them_and_buffers_saved_in_their_dtype(pools):
    result = pools.run(1, casts_seen)[0]
    assert result["seen"] == {(True, False): torch.bfloat16,   # the root casts (torch's default)
                              (False, True): torch.bfloat16,   # each unit casts
                              (False, False): torch.float32,   # nobody does
                              "norm": torch.bfloat16}  # _module_classes_to_ignore needs a policy
    assert result["buffers"] == (torch.bfloat16, torch.float32)


# --- the traffic formula, in closed form ----------------------------------------------------------

def test_fsdp_comm_bytes_in_closed_form():
    """P = 4 blocks of 1,000 elements (fp32, padded), root of 200, 4 ranks: (n-1)/n of each term."""
    n, f = 4, 3 / 4
    blocks = [UnitTraffic(1000, 4000, 4, False)] * 4
    root = UnitTraffic(200, 400, 4, True)
    ddp = 2 * f * 4000 * 4
    assert fsdp_comm_bytes(blocks, n, ShardingStrategy.FULL_SHARD) == pytest.approx(1.5 * ddp, rel=1e-15)
    assert fsdp_comm_bytes(blocks, n, ShardingStrategy.SHARD_GRAD_OP) == pytest.approx(ddp, rel=1e-15)
    assert fsdp_comm_bytes(blocks, n, ShardingStrategy.NO_SHARD) == pytest.approx(ddp, rel=1e-15)
    full = fsdp_comm_bytes([root, *blocks], n, ShardingStrategy.FULL_SHARD, micro_batches=3, no_sync=True,
                           clip=True)
    assert full == pytest.approx(f * (3 * (400 + 2 * 16000) + 4 * 4200) + 2 * f * 4, rel=1e-15)
    bf16 = [UnitTraffic(1000, 2000, 4, False, 8)]  # bf16 gathers, fp32 reduce, fp64 master: fp64 norm
    assert fsdp_comm_bytes(bf16, 2, ShardingStrategy.FULL_SHARD, clip=True) == pytest.approx(
        0.5 * (2 * 2000 + 4000) + 8, rel=1e-15)
    assert fsdp_comm_bytes(blocks, 1, ShardingStrategy.FULL_SHARD, clip=True) == 0.0


# --- HYBRID_SHARD: torch's process_group pair, its default groups, the API under HSDP -------------

def hsdp_api() -> dict:
    """World 4 with LOCAL_WORLD_SIZE=2 (two nodes): torch's default groups; sync_module_states
    (from rank-dependent init: inter-node then intra-node broadcast), use_orig_params, no_sync, the
    state dicts and shard_layout under HYBRID_SHARD, against the unwrapped model's gradients."""
    cfg = get_config("tiny", n_layers=2)
    previous, os.environ["LOCAL_WORLD_SIZE"] = os.environ["LOCAL_WORLD_SIZE"], "2"
    try:
        fsdp = FullyShardedDataParallel(build_model(cfg, seed=dist.get_rank(), dtype=torch.float64),
                                        sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                                        auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                                        sync_module_states=True, use_orig_params=True)
    finally:
        os.environ["LOCAL_WORLD_SIZE"] = previous
    ranks = [dist.get_process_group_ranks(g) for g in (fsdp.process_group, fsdp.replicate_group)]
    units_share = all(u.process_group is fsdp.process_group and u.replicate_group is fsdp.replicate_group
                      for u in fsdp.units())
    reference = build_model(cfg, seed=0, dtype=torch.float64)
    synced = relative_diff(fsdp.state_dict(), reference.state_dict()) == 0
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (8, 6), generator=gen)  # 2 micro-batches of 1 per rank
    rank = dist.get_rank()
    with fsdp.no_sync():
        loss_fn(fsdp(tokens[rank : rank + 1, :-1]), tokens[rank : rank + 1, 1:]).backward()
    loss_fn(fsdp(tokens[4 + rank : 5 + rank, :-1]), tokens[4 + rank : 5 + rank, 1:]).backward()
    for i in (0, 4):  # the reference: the mean over the 4 ranks of each rank's sum of 2 losses
        loss_fn(reference(tokens[i : i + 4, :-1]), tokens[i : i + 4, 1:]).backward()
    orig_grads_are_views = all(p.grad is not None and p.grad.untyped_storage().data_ptr()
                               == fsdp._handles()[0].flat_param.grad.untyped_storage().data_ptr()
                               for p in fsdp._handles()[0].orig)
    grad_diff = relative_diff(fsdp.full_gradients(rank0_only=False),
                              {n: p.grad for n, p in reference.named_parameters()})
    full = fsdp.state_dict()
    fresh = FullyShardedDataParallel(build_model(cfg, seed=5, dtype=torch.float64), process_group=(
        fsdp.process_group, fsdp.replicate_group), sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
    fresh.load_state_dict(full)
    layout = fsdp.shard_layout()
    return {"ranks": ranks, "units_share": units_share, "synced": synced, "grad_diff": grad_diff,
            "views": orig_grads_are_views, "round_trip": relative_diff(fresh.state_dict(), full),
            "shard_world": {u.shard_world for u in layout}, "shard_rank": layout[0].shard_rank}


def test_hybrid_shard_works_with_torchs_groups_and_the_whole_api(pools):
    """torch's contract: `process_group` is the shard (intra-node) group, the pair every unit
    shares; the default splits the world into nodes of LOCAL_WORLD_SIZE consecutive ranks."""
    for rank, r in enumerate(pools.run(4, hsdp_api)):
        node, local = divmod(rank, 2)
        assert r["ranks"] == [[2 * node, 2 * node + 1], [local, local + 2]], r["ranks"]
        assert r["units_share"] and r["synced"] and r["views"]
        assert r["grad_diff"] <= 1e-10 and r["round_trip"] == 0
        assert r["shard_world"] == {2} and r["shard_rank"] == local


# --- every torch argument and method, called as torch's docs call them, against torch's own FSDP1 ----

def torch_way(ours: bool) -> dict:
    """One user's FSDP1 code run on torch's FullyShardedDataParallel (CPU, gloo) and on ours: the
    constructor with every torch keyword argument (its types from its own module: torch's enums,
    MixedPrecision, ModuleWrapPolicy), accumulation under no_sync, clip_grad_norm_(max_norm,
    norm_type), state_dict(destination, prefix, keep_vars), FSDP.optim_state_dict(model, optim,
    optim_state_dict, group), then a fresh model: load_state_dict(state_dict, strict) and
    FSDP.optim_state_dict_to_load(..., is_named_optimizer, load_directly, group), one more step."""
    import fsdp as ns
    if ours:
        FSDP, api, device = FullyShardedDataParallel, ns, {"device_id": None}  # torch users' alias
    else:
        FSDP, device = torch_fsdp.FullyShardedDataParallel, {"device_id": torch.device("cpu")}
        api = type("torch_api", (), {"ShardingStrategy": torch_fsdp.ShardingStrategy,
                                     "MixedPrecision": torch_fsdp.MixedPrecision,
                                     "BackwardPrefetch": torch_fsdp.BackwardPrefetch,
                                     "ModuleWrapPolicy": torch_wrap.ModuleWrapPolicy})
    cfg, f32 = get_config("tiny", n_layers=2), torch.float32
    gen = torch.Generator().manual_seed(dist.get_rank())
    tokens = torch.randint(0, cfg.vocab_size, (3, 7), generator=gen)

    def build(seed: int):
        mp = api.MixedPrecision(param_dtype=f32, reduce_dtype=f32, buffer_dtype=f32,
                                keep_low_precision_grads=False, cast_forward_inputs=False,
                                cast_root_forward_inputs=True)
        model = FSDP(module=build_model(cfg, seed, f32), process_group=None,
                    sharding_strategy=api.ShardingStrategy.FULL_SHARD, cpu_offload=None,
                    auto_wrap_policy=api.ModuleWrapPolicy({TransformerBlock}),
                    backward_prefetch=api.BackwardPrefetch.BACKWARD_PRE, mixed_precision=mp,
                    ignored_modules=None, param_init_fn=None, sync_module_states=False,
                    forward_prefetch=False, limit_all_gathers=True, use_orig_params=False,
                    ignored_states=None, device_mesh=None, **device)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)

    def train(model, opt, rows) -> torch.Tensor:
        with model.no_sync():
            loss_fn(model(tokens[rows[0]:rows[0] + 1, :-1]), tokens[rows[0]:rows[0] + 1, 1:]).backward()
        loss_fn(model(tokens[rows[1]:rows[1] + 1, :-1]), tokens[rows[1]:rows[1] + 1, 1:]).backward()
        norm = model.clip_grad_norm_(max_norm=0.5, norm_type=2.0)
        opt.step()
        opt.zero_grad()
        return norm

    model, opt = build(0)
    norm = train(model, opt, (0, 1))
    state = model.state_dict(destination=None, prefix="", keep_vars=False)
    osd = FSDP.optim_state_dict(model=model, optim=opt, optim_state_dict=opt.state_dict(), group=None)
    facts = {"module": type(model.module).__name__, "world": model.process_group.size(),
             "mixed_precision": dataclasses.astuple(model.mixed_precision)[:6]}
    fresh, fresh_opt = build(5)
    missing = fresh.load_state_dict(state_dict=state, strict=True, assign=False)
    FSDP.optim_state_dict_to_load(model=fresh, optim=fresh_opt, optim_state_dict=osd,
                                  is_named_optimizer=False, load_directly=True, group=None)
    norm2 = train(fresh, fresh_opt, (2, 0))
    after = fresh.state_dict()
    del model, fresh, opt, fresh_opt
    return {"norms": [norm.item(), norm2.item()], "state": state, "optim": osd, "after": after,
            "missing": (list(missing.missing_keys), list(missing.unexpected_keys)), **facts}


def test_torchs_fsdp1_calls_give_torchs_results(pools):
    """Every constructor argument by torch's keyword, the methods by torch's signatures: the same
    clipping norms, the same state dict and optimizer state dict (names, keys, values), the same
    resumed model, to float32 rounding; module, process_group and mixed_precision mean the same."""
    theirs, ours = (pools.run(2, torch_way, flag)[0] for flag in (False, True))
    assert ours["norms"] == pytest.approx(theirs["norms"], rel=1e-5)
    assert list(ours["state"]) == list(theirs["state"])
    assert relative_diff(ours["state"], theirs["state"]) < 1e-5
    assert list(ours["optim"]["state"]) == list(theirs["optim"]["state"])
    assert ours["optim"]["param_groups"] == theirs["optim"]["param_groups"]
    for name, state in theirs["optim"]["state"].items():
        mine = {k: v for k, v in ours["optim"]["state"][name].items() if k != "step"}
        assert relative_diff(mine, {k: v for k, v in state.items() if k != "step"}) < 1e-5, name
    assert relative_diff(ours["after"], theirs["after"]) < 1e-5
    for key in ("missing", "module", "world", "mixed_precision"):
        assert ours[key] == theirs[key], key


# --- torch's FSDP2 yardstick needs a torch whose stream has record_event (2.7+ on CPU) -------------

def test_fsdp2_yardstick_is_refused_with_the_torch_it_needs(monkeypatch, capsys):
    from fsdp import bench
    from fsdp import train as fsdp_train
    from fsdp.torch_fsdp2 import fsdp2_unavailable
    monkeypatch.setenv("PFS_BACKEND", "gloo")
    monkeypatch.delattr(torch.cpu.Stream, "record_event")  # what torch 2.6's CPU stream lacks
    assert "use torch >= 2.7 on CPU" in fsdp2_unavailable("cpu")
    with pytest.raises(ConfigError, match=r"--impl torch-fsdp2: torch .* has no record_event\(\).*>= 2.7"):
        fsdp_train.validate(fsdp_train.parse_args(["--impl", "torch-fsdp2"]), 2)
    fsdp_train.validate(fsdp_train.parse_args([]), 2)  # ours needs nothing of the sort
    with pytest.raises(SystemExit) as exit_info:
        bench.main(["--model", "tiny"])
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "torch >= 2.7" in lines[0], lines
