"""Construction without the full model: a rank's peak while it builds is its part, not the model.

Each strategy builds LLaMA on the meta device, splits or shards it, and only then draws the values
of what the rank holds (one parameter at a time, in float64 on CPU, then cast). On CPU the "device"
is the CPU, so the meter below counts every CPU storage allocated while the strategy is built:

    peak ≤ held + one       held = the bytes construction leaves alive (the rank's part)
    one (FSDP, pipeline) = max(U, P·(8 + 4))   a unit's gathered copy, allocated and freed at once;
                                               one parameter drawn in float64 and its fp32 copy
    one (ZeRO-3)         = 2·U + 8·P           a unit's flat values and their bound copy, and the
                                               parameter being drawn into them
    one (FSDP, torch's param_init_fn(module)) = U + 8·P   the unit materialized whole (freed before
                                               its gathered copy is allocated), one parameter drawn

U = the largest unit's bytes, P = the largest parameter's numel. On 2 ranks held is about half the
model (ZeRO-3, which also allocates its gradient shards, runs on 4). The negative control is the
old construction (build the whole model, then split or wrap it): its peak is at least the whole
model, above the bound. That the values are the reference's is what every chapter's equivalence
tests check (the reference draws with `build_model`).
"""

from __future__ import annotations

import weakref

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from common.dist import init_distributed
from common.kernel.model import TransformerBlock, build_model, get_config, initializer
from common.reference import relative_diff
from fsdp import FullyShardedDataParallel, ModuleWrapPolicy
from fsdp import train as fsdp_train
from pipeline import train as pipeline_train
from pipeline.stage import split_model
from zero import train as zero_train
from zero.engine import ZeroEngine

# 8 blocks of 50k parameters, embedding and head 16k each: one parameter, one unit ≪ model / 2
CFG = get_config("tiny", dim=64, n_layers=8, vocab_size=256)
MODEL_BYTES = sum(p.numel() for p in build_model(CFG, device="meta").parameters()) * 4  # fp32
LARGEST = max(p.numel() for p in build_model(CFG, device="meta").parameters())
UNIT = max(sum(p.numel() for p in b.parameters()) for b in build_model(CFG, device="meta").layers) * 4


class StorageMeter(TorchDispatchMode):
    """Peak and final bytes of the CPU storages created inside the block. Each op's outputs are
    remembered by a weak reference to their storage (a storage keeps one Python object while it
    lives, so the reference dies with the memory); after each op, and at exit, the live storages
    are summed at their current size (a `resize_(0)` counts from the next op on)."""

    def __init__(self) -> None:
        super().__init__()
        self.storages: weakref.WeakSet = weakref.WeakSet()
        self.peak = self.held = 0

    def live(self) -> int:
        return sum(s.nbytes() for s in self.storages)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type == "cpu":
                self.storages.add(t.untyped_storage())
        self.peak = max(self.peak, self.live())
        return out

    def __exit__(self, *exc):
        self.held = self.live()
        return super().__exit__(*exc)


def measure(new, old, one: int) -> dict[str, int]:
    with StorageMeter() as meter:
        built = new()
    with StorageMeter() as control:
        old()
    del built
    return {"peak": meter.peak, "held": meter.held, "one": one, "old": control.peak}


def fsdp_peaks() -> dict[str, int]:
    ctx = init_distributed()
    args = fsdp_train.parse_args(["--dtype", "float32"])
    args.cfg = CFG
    run = fsdp_train.validate(args, ctx.world_size)
    return measure(lambda: fsdp_train.FSDPStrategy(run, ctx),
                   lambda: fsdp_train.wrap_llama(build_model(CFG, 0, torch.float32), run),
                   max(UNIT, LARGEST * (8 + 4)))


def fsdp_param_init_fn_peaks() -> dict:
    """torch's contract, `param_init_fn(module)`: each unit materializes its own modules (to_empty,
    then the reference's values), then shards them; the values are the reference's."""
    init = initializer(CFG, 0)

    def wrap_meta() -> FullyShardedDataParallel:
        meta = build_model(CFG, 0, torch.float32, device="meta")
        names = {id(m): n for n, m in meta.named_modules()}

        def param_init_fn(module: nn.Module) -> None:
            module.to_empty(device="cpu", recurse=False)
            with torch.no_grad():
                for attr, p in module.named_parameters(recurse=False):
                    p.copy_(init(f"{names[id(module)]}.{attr}".lstrip(".")))

        return FullyShardedDataParallel(meta, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                                        param_init_fn=param_init_fn)

    run = fsdp_train.validate(fsdp_train.parse_args(["--dtype", "float32"]), dist.get_world_size())
    peaks = measure(wrap_meta, lambda: fsdp_train.wrap_llama(build_model(CFG, 0, torch.float32), run),
                    UNIT + LARGEST * 8)
    same = relative_diff(wrap_meta().state_dict(), build_model(CFG, 0, torch.float32).state_dict()) == 0
    return {**peaks, "same": same}


def pipeline_peaks() -> dict[str, int]:
    ctx = init_distributed()
    args = pipeline_train.parse_args(["--dtype", "float32", "--microbatches", "2",
                                      "--global-batch", "2", "--seq-len", "4"])
    args.cfg = CFG
    run = pipeline_train.validate(args, ctx.world_size)
    return measure(lambda: pipeline_train.PipelineStrategy(run, ctx),
                   lambda: split_model(build_model(CFG, 0, torch.float32), 2, 1, ctx.rank),
                   max(UNIT, LARGEST * (8 + 4)))


def zero3_peaks() -> dict[str, int]:
    ctx = init_distributed()
    args = zero_train.parse_args(["--dtype", "float32", "--stage", "3", "--global-batch", str(ctx.world_size),
                                  "--param-persistence-threshold", "0"])  # every parameter sharded
    args.cfg = CFG
    run = zero_train.validate(args, ctx.world_size)

    def old() -> None:
        model = build_model(CFG, 0, torch.float32)
        ZeroEngine(model, torch.optim.SGD, run.options,
                              unit_policy=zero_train.ZeroStrategy.unit_policy)

    return measure(lambda: zero_train.ZeroStrategy(run, ctx), old, 2 * UNIT + 8 * LARGEST)


def check(results: list[dict[str, int]], parts: int = 1) -> None:
    """`parts`: model-sized tensors of which a rank holds 1/world (ZeRO-3 also allocates its
    gradient shards up front)."""
    for rank, r in enumerate(results):
        assert r["held"] < 1.2 * parts * MODEL_BYTES / len(results), (rank, r, MODEL_BYTES)
        assert r["peak"] <= r["held"] + r["one"], (rank, r)
        assert r["old"] >= MODEL_BYTES and r["old"] > r["held"] + r["one"], (rank, r)  # the control


def test_fsdp_construction_peak_is_the_shard(pools):
    check(pools.run(2, fsdp_peaks))


def test_fsdp_param_init_fn_peak_is_one_unit_and_values_are_the_references(pools):
    """one = U + 8·P: a unit materialized whole (fp32), and one parameter drawn in float64."""
    results = pools.run(2, fsdp_param_init_fn_peaks)
    assert all(r.pop("same") for r in results)
    check(results)


def test_pipeline_construction_peak_is_the_stage(pools):
    check(pools.run(2, pipeline_peaks))


def test_zero3_construction_peak_is_the_shard(pools):
    check(pools.run(4, zero3_peaks), parts=2)  # 4 ranks: params + grads = half the model
