"""The 3D recipe: one rank's part of LLaMA in six steps, each from its chapter, in torchtitan's
order (`parallelize_llama`): split into pipeline stages, tensor-parallelize, context-parallelize,
expert-parallelize (a MoE model), recompute, FSDP-wrap.

    model (meta) → this rank's v chunks (06) → TP pieces over the TP group (05; a MoE model: 05's
                   MoE plan, every expert cut like the SwiGLU, the router whole)
                 → attention over the CP ring (05, cp > 1)
                 → each MoE layer's experts of this rank's EP slice, all-to-all over the EP group,
                   an FSDP unit of their own (05, 04; experts_and_hybrid.md)
                 → blocks wrapped for recomputation (07)
                 → flat shards over the DP × CP group (04: the CP ranks hold the same parameters);
                   HSDP (HYBRID_SHARD, _HYBRID_SHARD_ZERO2): over dp_shard × cp, all-reduced
                   over dp_replicate
What only a MoE model needs (05's MoE plan and expert parallelism, the kernel's MoE layer) is
imported inside the two steps that use it, so a dense model's copy of this recipe leaves it out.

Under CP a rank holds the zig-zag chunks cp_rank and 2·cp−1−cp_rank of each sequence (s/cp
tokens): `rank_inputs` gives it those tokens of each micro-batch and their global positions, which
travel with the batch (the executor hands them to every chunk's forward for RoPE), as in chapter 05.

Nothing is drawn before the last step: each FSDP unit generates, from the seed, the full tensors
that overlap this rank's shard, cuts their TP piece and keeps its 1/dp. A user's own trainer:

    mesh = build_mesh(mesh_shape(world_size, tp=2, pp=2))           (common/kernel/mesh.py)
    config = Parallel3DConfig(schedule="1f1b", sequence_parallel=True)
    chunks, tp_specs = parallelize_3d(build_model(cfg, device="meta"), mesh, config, device)
    shards = shard_map(chunks, tp_specs, mesh)                        (shards.py)
    ... PipelineExecutor(...).run(...); clip_grad_norm_3d(shards, 1.0); optimizer.step()
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.kernel.mesh import ParallelMesh
from common.kernel.model import Llama, LlamaConfig, TransformerBlock, initializer
from fsdp.fully_sharded import FullyShardedDataParallel
from fsdp.wrap import HYBRID_STRATEGIES, MixedPrecision, ModuleWrapPolicy, ShardingStrategy
from parallel3d.recompute import MODES, Recomputed, apply_recompute, unwrapped_name
from pipeline.schedules import SCHEDULES, rank_stages, virtual_stages
from pipeline.stage import LlamaChunk, split_model
from tensor_parallel.context_layout import sequence_positions, shard_sequence
from tensor_parallel.context_parallel import apply_context_parallel as context_parallel
from tensor_parallel.parallelize import parallelize_llama
from tensor_parallel.sharding import TPShard, local_piece

STRATEGIES = tuple(s.name for s in ShardingStrategy)
HYBRID = tuple(s.name for s in HYBRID_STRATEGIES)  # HSDP: --dp-replicate R > 1


@dataclass(frozen=True)
class Parallel3DConfig:
    """The recipe's choices (train.py's flags of the same names). `virtual_stages` None: the
    schedule's default (2 for interleaved, else 1); `mixed_precision` "bf16": compute in bf16,
    fp32 master shards and gradient reduction; `seed`: the reference model's init."""

    schedule: str = "1f1b"
    virtual_stages: int | None = None
    sequence_parallel: bool = False
    activation_checkpointing: str = "none"  # none | selective | full
    sharding_strategy: str = "FULL_SHARD"  # FULL_SHARD | SHARD_GRAD_OP | NO_SHARD | HYBRID_SHARD | …
    mixed_precision: str = "none"  # none | bf16
    seed: int = 0

    def __post_init__(self):
        for field, value, allowed in (("schedule", self.schedule, SCHEDULES),
                                      ("activation_checkpointing", self.activation_checkpointing, MODES),
                                      ("sharding_strategy", self.sharding_strategy, STRATEGIES),
                                      ("mixed_precision", self.mixed_precision, ("none", "bf16"))):
            if value not in allowed:
                raise ValueError(f"Parallel3DConfig({field}={value!r}): use one of {', '.join(allowed)}")

    @property
    def v(self) -> int:
        """Model chunks per pipeline rank."""
        return virtual_stages(self.schedule, self.virtual_stages)


def parallelize_3d(model: Llama, mesh: ParallelMesh, config: Parallel3DConfig, device: torch.device
                   ) -> tuple[list[FullyShardedDataParallel], dict[str, TPShard]]:
    """This rank's FSDP-wrapped chunks, and the TPShard of every reference parameter they hold."""
    chunks = apply_pipeline_split(model, mesh, config)
    tp_specs = apply_tensor_parallel(chunks, mesh.tp_group, config.sequence_parallel)
    if mesh.cp > 1:
        apply_context_parallel(chunks, mesh.cp_group)
    if model.cfg.n_experts:
        apply_expert_parallel(chunks, tp_specs, mesh, config, device)
    for chunk in chunks:
        apply_recompute(chunk.layers, config.activation_checkpointing)
    init = initializer(model.cfg, config.seed)
    return apply_fsdp(chunks, mesh, config, tp_specs, init, device), tp_specs


def apply_pipeline_split(model: Llama, mesh: ParallelMesh, config: Parallel3DConfig) -> list[LlamaChunk]:
    """06: the stages the schedule places on this rank (pp_rank, pp + pp_rank, … of the S = pp·v;
    DualPipeV: pp_rank and 2·pp - 1 - pp_rank)."""
    return split_model(model, mesh.pp, config.v, mesh.pp_rank,
                       stages=rank_stages(config.schedule, mesh.pp, config.v, mesh.pp_rank))


def apply_context_parallel(chunks: list[LlamaChunk], group) -> None:
    """05: every attention of every chunk attends over the CP ring (K/V blocks passed around
    `group`), on this rank's zig-zag chunks of the sequence."""
    for chunk in chunks:
        context_parallel(chunk, group)


def apply_tensor_parallel(chunks: list[LlamaChunk], group, sp: bool) -> dict[str, TPShard]:
    """05: each chunk cut over the TP group by LLAMA_TP_PLAN, in place (the embedding and the head
    where the chunk holds them); a MoE model's by 05's MoE plan (each MoE layer's experts cut too)."""
    plan = parallelize_llama
    if chunks[0].cfg.n_experts:
        from tensor_parallel.moe_tensor_parallel import parallelize_moe_llama as plan
    return {name: spec for chunk in chunks for name, spec in plan(chunk, group, sp).items()}


def apply_expert_parallel(chunks: list[LlamaChunk], tp_specs: dict[str, TPShard], mesh: ParallelMesh,
                          config: Parallel3DConfig, device: torch.device) -> None:
    """05's expert parallelism on every MoE layer of this rank's chunks, in place (on the meta
    device, before recomputation and FSDP): the experts of its EP slice e = mesh.ep_rank,
    [e·E/ep, (e+1)·E/ep), dispatched by the counting all-to-all over the EP group, and its
    GroupedExperts an FSDP unit over dp_shard_mod_ep (HSDP: and dp_replicate) dividing its
    gradient by dp·cp (FSDP's own divisor, dp·cp/ep, would make it ep× too large). Each unit
    draws only the TP piece of its experts that overlaps this rank's shard."""
    from common.kernel.moe import MoEFeedForward
    from tensor_parallel.expert_parallel import CountingDispatcher, expert_parallel, expert_slice

    cfg = chunks[0].cfg
    init, mine = initializer(cfg, config.seed), expert_slice(mesh.ep_rank, mesh.ep, cfg.n_experts)
    for chunk in chunks:
        for prefix, layer in chunk.named_modules():
            if not isinstance(layer, MoEFeedForward):
                continue
            if mesh.ep > 1:  # else every expert here: the local dispatcher, no all-to-all
                expert_parallel(layer, mesh.ep_group, CountingDispatcher)

            def piece(name: str, _, prefix: str = prefix) -> torch.Tensor:
                full = f"{prefix}.experts.{name}"
                return local_piece(init(full), tp_specs[full])[mine]

            layer.experts = FullyShardedDataParallel(
                layer.experts, process_group=fsdp_groups(mesh, config.sharding_strategy, "dp_shard_mod_ep"),
                sharding_strategy=ShardingStrategy[config.sharding_strategy],
                mixed_precision=mixed_precision(config), device_id=device, shard_init_fn=piece)
            layer.experts.set_gradient_divide_factor(mesh.dp * mesh.cp)


def mixed_precision(config: Parallel3DConfig) -> MixedPrecision | None:
    """bf16 compute, fp32 master shards and gradient reduction (04's MixedPrecision), or None."""
    bf16 = config.mixed_precision == "bf16"
    return MixedPrecision(torch.bfloat16, torch.float32, torch.bfloat16) if bf16 else None


def fsdp_groups(mesh: ParallelMesh, sharding_strategy: str, shard: str = "dp_shard_cp"):
    """FSDP's process_group: the mesh's `shard` group, and under HSDP the pair (shard group,
    dp_replicate group). Without HSDP dp_replicate is 1 and dp_shard_cp is all of dp × cp."""
    if sharding_strategy in HYBRID:
        return mesh.group(shard), mesh.group("dp_replicate")
    return mesh.dp_cp_group if shard == "dp_shard_cp" else mesh.group(shard)


def apply_fsdp(chunks: list[LlamaChunk], mesh: ParallelMesh, config: Parallel3DConfig,
               tp_specs: dict[str, TPShard], init, device: torch.device) -> list[FullyShardedDataParallel]:
    """04: one unit per block (its recompute wrapper under full recomputation), the rest of the
    chunk as the root unit, sharded over the DP × CP group (gradients averaged over its dp·cp
    ranks; HSDP: sharded over dp_shard × cp, all-reduced over dp_replicate); each unit draws only
    the TP pieces that overlap this rank's shard. Units already made (experts) are kept."""
    unit = Recomputed if config.activation_checkpointing == "full" else TransformerBlock

    def tp_piece(name: str, _) -> torch.Tensor:
        return local_piece(init(unwrapped_name(name)), tp_specs[unwrapped_name(name)])

    return [FullyShardedDataParallel(c, process_group=fsdp_groups(mesh, config.sharding_strategy),
                                     sharding_strategy=ShardingStrategy[config.sharding_strategy],
                                     mixed_precision=mixed_precision(config),
                                     auto_wrap_policy=ModuleWrapPolicy({unit}),
                                     device_id=device, shard_init_fn=tp_piece, forward_prefetch=True)
            for c in chunks]


# --- what the chunks take: the pipeline's message shape, this rank's tokens ---------------------

def activation_shape(cfg: LlamaConfig, mesh: ParallelMesh, config: Parallel3DConfig, micro_batch: int,
                     seq_len: int) -> tuple[int, int, int]:
    """The [b, s/cp (/tp under SP), h] activation a pipeline stage sends to the next."""
    return micro_batch, seq_len // mesh.cp // (mesh.tp if config.sequence_parallel else 1), cfg.dim


def rank_inputs(tokens: torch.Tensor, mesh: ParallelMesh) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs, targets and RoPE positions of a micro-batch of token rows [mb, s + 1]; under CP
    this rank's zig-zag chunks of both (the same positions: the target of token i stays beside it)
    and their global positions, which every chunk's attention uses (under SP too: it sees them all)."""
    inputs, targets = tokens[:, :-1], tokens[:, 1:]
    s = inputs.shape[1]
    if mesh.cp == 1:
        return inputs, targets, torch.arange(s, device=inputs.device)
    return (shard_sequence(inputs, mesh.cp, mesh.cp_rank, dim=1),
            shard_sequence(targets, mesh.cp, mesh.cp_rank, dim=1),
            sequence_positions(s, mesh.cp, mesh.cp_rank, device=inputs.device))
