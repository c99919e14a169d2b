"""Chapter 07's pieces from a user's own training loop, not the shared one: the kernel's mesh,
parallelize_3d with plain arguments (Parallel3DConfig), a torch optimizer, 06's executor for the
step, clip_grad_norm_3d, optimizer.step. Trained this way the 3D model equals single-device
training (float64, 1e-10); the same loop clipping with torch's own clip_grad_norm_ over the local
shards (the mistake a copier makes) is rejected."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from common.kernel.mesh import build_mesh, mesh_shape
from common.kernel.model import LlamaConfig, build_model
from common.reference import TOLERANCE
from parallel3d import (
    Parallel3DConfig,
    activation_shape,
    clip_grad_norm_3d,
    gather_full,
    parallelize_3d,
    rank_inputs,
    shard_map,
)
from parallel3d.checkpoint.reshard import Region
from parallel3d.shards import assemble
from pipeline import PipelineExecutor, make_schedule
from tensor_parallel import vocab_parallel_loss
from tests.equivalence import RunRecord, TrainSpec, compare

CFG = LlamaConfig(dim=16, n_layers=4, n_heads=4, n_kv_heads=2, vocab_size=32, multiple_of=8)


def users_own_loop(spec: TrainSpec, sizes: tuple[int, int, int, int], config: Parallel3DConfig,
                   torch_clip: bool = False) -> RunRecord:
    """Every rank: a plain loop over the recipe's pieces, on the process group the pool holds."""
    dp, pp, cp, tp = sizes
    device = torch.device("cpu")
    mesh = build_mesh(mesh_shape(dist.get_world_size(), tp=tp, pp=pp, dp=dp, cp=cp))
    model = build_model(spec.cfg, dtype=torch.float64, device="meta")
    chunks, tp_specs = parallelize_3d(model, mesh, config, device)
    shards = shard_map(chunks, tp_specs, mesh)
    params = [p for chunk in chunks for p in chunk.parameters()]
    optimizer = torch.optim.SGD(params, lr=spec.lr, foreach=False)
    micro, per_rank = spec.micro_batch, spec.global_batch // dp
    schedule = make_schedule(config.schedule, pp, per_rank // micro, config.v)
    head = chunks[-1].module.output  # the vocab-parallel head, on the last stage
    executor = PipelineExecutor(schedule, mesh.pp_rank, chunks,
                                lambda logits, targets: vocab_parallel_loss(head, logits, targets),
                                activation_shape(spec.cfg, mesh, config, micro, spec.seq_len),
                                torch.float64, device, mesh.pp_group)
    losses, grads = [], []
    for step in range(spec.steps):
        rows = spec.data().global_batch(step, spec.global_batch).narrow(0, mesh.dp_rank * per_rank, per_rank)
        inputs, targets, positions = zip(*(rank_inputs(m, mesh) for m in rows.split(micro)), strict=True)
        loss = executor.run(inputs, targets, positions)
        losses.append(None if loss is None else loss.item())
        grads.append(gather_full(shards, lambda u: u.flat_param.grad))  # the check, before clipping
        if torch_clip:  # the bug: the norm of this rank's shards alone
            torch.nn.utils.clip_grad_norm_(params, spec.clip_grad, foreach=False)
        else:
            clip_grad_norm_3d(shards, spec.clip_grad)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    final = gather_full(shards, lambda u: u.flat_param)
    return RunRecord(losses, grads if dist.get_rank() == 0 else [], final or {})


def differences(pools, spec: TrainSpec, sizes, config: Parallel3DConfig, torch_clip: bool = False):
    records = pools.run(spec.world_size, users_own_loop, spec, sizes, config, torch_clip)
    losses = [sum(v) / len(v) for v in ([r.losses[s] for r in records if r.losses[s] is not None]
                                        for s in range(spec.steps))]
    return compare(RunRecord(losses, records[0].grads, records[0].params), spec)


SPEC = TrainSpec(cfg=CFG, world_size=8, dp=2, global_batch=8, micro_batch=1, seq_len=8, steps=2,
                 optimizer="sgd", clip_grad=1e-2)  # 1e-2 clips: SGD feels the coefficient


@pytest.mark.parametrize("sizes, config", [
    ((2, 2, 1, 2), Parallel3DConfig(schedule="1f1b", sequence_parallel=True, seed=SPEC.seed)),
    ((1, 2, 2, 2), Parallel3DConfig(schedule="interleaved", activation_checkpointing="selective",
                                    sharding_strategy="NO_SHARD", seed=SPEC.seed)),
])
def test_users_own_loop_over_the_recipe_equals_single_device(pools, sizes, config):
    spec = TrainSpec(**{**SPEC.__dict__, "dp": sizes[0], "global_batch": 4 * sizes[0]})
    diffs = differences(pools, spec, sizes, config)
    assert max(diffs.values()) <= TOLERANCE[spec.precision], diffs


def test_users_loop_clipping_each_shard_by_its_own_norm_is_rejected(pools):
    config = Parallel3DConfig(schedule="1f1b", sequence_parallel=True, seed=SPEC.seed)
    spec = TrainSpec(**{**SPEC.__dict__, "global_batch": 8})
    diffs = differences(pools, spec, (2, 2, 1, 2), config, torch_clip=True)
    assert diffs["param"] > 10 * TOLERANCE[spec.precision], diffs


def test_full_tensors_take_every_element_exactly_once():
    """--check's assembly (shards.assemble): a piece counted on two ranks, or on none, is an
    error, not a silently right-looking tensor."""
    full = torch.arange(12, dtype=torch.float64).view(3, 4)
    head, tail = Region((3, 4), (0, 0), (3, 4), 0, 7), Region((3, 4), (0, 0), (3, 4), 7, 5)
    pieces = [("w", head, full.view(-1)[:7]), ("w", tail, full.view(-1)[7:])]
    assert torch.equal(assemble(pieces)["w"], full)
    with pytest.raises(RuntimeError, match=r"w: the counted pieces cover 7 of its 12 elements"):
        assemble(pieces[:1])
    with pytest.raises(RuntimeError, match=r"cover 12 of its 12 elements with 19 copies"):
        assemble([*pieces, pieces[0]])
