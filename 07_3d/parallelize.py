"""The 3D recipe: one rank's part of LLaMA in five steps, each from its chapter, in torchtitan's
order (`parallelize_llama`): split into pipeline stages, tensor-parallelize, context-parallelize,
recompute, FSDP-wrap.

    model (meta) → this rank's v chunks (06) → TP pieces over the TP group (05)
                 → attention over the CP ring (05, cp > 1) → blocks wrapped for recomputation (07)
                 → flat shards over the DP × CP group (04: the CP ranks hold the same parameters)

Under CP a rank holds the zig-zag chunks cp_rank and 2·cp−1−cp_rank of each sequence (s/cp
tokens), so its RoPE tables are taken at those global positions.

Nothing is drawn before the last step: each FSDP unit generates, from the seed, the full tensors
that overlap this rank's shard, cuts their TP piece and keeps its 1/dp. `config`: the trainer's
flags (schedule, virtual_stages, sequence_parallel, activation_checkpointing, sharding_strategy,
mixed_precision, seed).
"""

from __future__ import annotations

import argparse
from functools import partial

import torch

from common.model import Llama, TransformerBlock, initializer, rope_cos_sin
from fsdp import FSDP, MixedPrecision, ModuleWrapPolicy, ShardingStrategy
from parallel3d.mesh import DeviceMesh3D
from parallel3d.recompute import CheckpointWrapper, apply_recompute, unwrapped_name
from pipeline import PipelineStage, split_model
from pipeline.schedules import virtual_stages
from tensor_parallel import (
    TPShard,
    local_piece,
    parallelize_blocks,
    parallelize_embedding,
    parallelize_head,
    tp_shard_specs,
    zigzag_positions,
)
from tensor_parallel import apply_context_parallel as context_parallel


def parallelize_3d(model: Llama, mesh: DeviceMesh3D, config: argparse.Namespace,
                   device: torch.device) -> tuple[list[FSDP], dict[str, TPShard]]:
    """This rank's FSDP-wrapped chunks, and the TPShard of every reference parameter they hold."""
    chunks = apply_pipeline_split(model, mesh, config)
    tp_specs = apply_tensor_parallel(chunks, mesh.tp_group, config.sequence_parallel)
    if mesh.cp > 1:
        apply_context_parallel(chunks, mesh.cp_group)
    for chunk in chunks:
        apply_recompute(chunk.layers, config.activation_checkpointing)
    init = initializer(model.cfg, config.seed)
    return apply_fsdp(chunks, mesh, config, tp_specs, init, device), tp_specs


def apply_pipeline_split(model: Llama, mesh: DeviceMesh3D, config: argparse.Namespace) -> list[PipelineStage]:
    """06: this rank's stages pp_rank, pp + pp_rank, … of the S = pp·v."""
    rope = partial(sequence_rope, model.cfg, mesh.tp if config.sequence_parallel else 1, mesh.cp,
                   mesh.cp_rank)
    v = virtual_stages(config.schedule, config.virtual_stages)
    return split_model(model, mesh.pp, v, mesh.pp_rank, rope=rope)


def sequence_rope(cfg, tp: int, cp: int, cp_rank: int, positions: torch.Tensor, dtype: torch.dtype):
    """RoPE's cos/sin for the s/cp tokens attention sees when activations carry s/(cp·tp) (SP):
    the global positions of this CP rank's zig-zag chunks (0 … s−1 when cp = 1)."""
    local = positions.numel() * tp
    if cp == 1:
        return rope_cos_sin(cfg, torch.arange(local, device=positions.device), dtype)
    return rope_cos_sin(cfg, zigzag_positions(local * cp, cp, cp_rank, device=positions.device), dtype)


def apply_context_parallel(chunks: list[PipelineStage], group) -> None:
    """05: every attention of every chunk attends over the CP ring (K/V blocks passed around
    `group`), on this rank's zig-zag chunks of the sequence."""
    for chunk in chunks:
        context_parallel(chunk, group)


def apply_tensor_parallel(chunks: list[PipelineStage], group, sp: bool) -> dict[str, TPShard]:
    """05: each chunk's embedding, blocks and head cut over the TP group, in place."""
    for chunk in chunks:
        if chunk.tok_embeddings is not None:
            chunk.tok_embeddings = parallelize_embedding(chunk.tok_embeddings, group, sp)
        parallelize_blocks(chunk.layers.values(), group, sp)
        if chunk.output is not None:
            chunk.norm, chunk.output = parallelize_head(chunk.norm, chunk.output, group, sp)
    return {name: spec for chunk in chunks for name, spec in tp_shard_specs(chunk, group).items()}


def apply_fsdp(chunks: list[PipelineStage], mesh: DeviceMesh3D, config: argparse.Namespace,
               tp_specs: dict[str, TPShard], init, device: torch.device) -> list[FSDP]:
    """04: one unit per block (its recompute wrapper under full recomputation), the rest of the
    chunk as the root unit, sharded over the DP × CP group (gradients averaged over its dp·cp
    ranks); each unit draws only the TP pieces that overlap this rank's shard."""
    unit = CheckpointWrapper if config.activation_checkpointing == "full" else TransformerBlock
    bf16 = config.mixed_precision == "bf16"
    mp = MixedPrecision(torch.bfloat16, torch.float32, torch.bfloat16) if bf16 else None
    sharding = ShardingStrategy[config.sharding_strategy]

    def tp_piece(name: str, _) -> torch.Tensor:
        return local_piece(init(unwrapped_name(name)), tp_specs[unwrapped_name(name)])

    return [FSDP(c, process_group=mesh.dp_cp_group, sharding_strategy=sharding, mixed_precision=mp,
                 auto_wrap_policy=ModuleWrapPolicy({unit}), device_id=device, shard_init_fn=tp_piece,
                 forward_prefetch=True)
            for c in chunks]
