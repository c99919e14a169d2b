"""Chapter 05: Megatron-style tensor parallelism (TP) with sequence parallelism (SP).

Every function and layer takes the TP process `group` explicitly (never the world), so a 3D mesh
can pass one line of its TP dimension. Every rank of a TP group must feed the same data.

Public API. The core files import only torch and the common kernel (common/kernel/collectives.py);
what to copy for the TP layers and plan, and for ring attention: common/copy_sets.py (README.md's
"Copy it" section).

Operators (mappings.py), Megatron's f and g and their SP halves, autograd functions over `group`
(Megatron's names shortened tensor_model_parallel → tp; the sequence dim is 1 here, our [B, T, H]):
    copy_to_tp_region(x, group)          f: identity fwd, all-reduce bwd
    reduce_from_tp_region(x, group)      g: all-reduce fwd, identity bwd
    gather_from_tp_region / scatter_to_tp_region (last dim)
    gather_from_sequence_parallel_region(x, group, dim=1)        all-gather fwd, reduce-scatter bwd
    reduce_scatter_to_sequence_parallel_region(x, group, dim=1)  reduce-scatter fwd, all-gather bwd
    scatter_to_sequence_parallel_region(x, group, dim=1)         split fwd, all-gather bwd
    gather_for_column_parallel(x, group, dim=1)   the all-gather before column layers: they save
        x's s/t tokens, not the s gathered, and gather them again in backward (SequenceGather,
        layers.linear_with_sequence_gather), once per backward for all the layers reading it

Layers (layers.py), Megatron's names with Megatron's argument semantics (gather_output: all-gather
Y, else Y_i stays split; input_is_parallel: X is already split, else this rank's slice is taken;
sequence_parallel: all-gather the s/t tokens in / reduce-scatter them out). forward returns the
tensor (Megatron 1's contract; Megatron-core returns (output, bias) for its skip_bias_add fusion).
Each has `.from_linear(...)` / `.from_embedding(...)` / `.from_norm(...)` building the shard from
the full module's weights:
    ColumnParallelLinear(in, out, group, gather_output=False, sequence_parallel=False,
                         input_is_mapped=False, num_shards=None)
    RowParallelLinear(in, out, group, input_is_parallel=True, sequence_parallel=False)
    VocabParallelEmbedding(V, dim, group, sequence_parallel=False)   (V padded to a multiple of t)
    SequenceParallelRMSNorm(dim, eps, group)
    vocab_parallel_cross_entropy(logits, targets, group, vocab_start, vocab_size) -> per-token
        losses shaped like targets (Megatron's contract; cross_entropy.py)

The plan (parallelize.py): a table {module name (`*` = every child): style}, applied in place from
full weights identical on every rank of the group:
    LLAMA_TP_PLAN = {"tok_embeddings": VocabSplit(), "layers.*.attention": MappedInput(),
                     "layers.*.attention.wq": ColumnSplit(head_dim="head_dim"), …,
                     "layers.*.feed_forward.w2": RowSplit(), "layers.*.ffn_norm": SequenceNorm(),
                     "norm": SequenceNorm(), "output": ColumnSplit(pad=True)}
    apply_tp_plan(module, group, plan=LLAMA_TP_PLAN, sequence_parallel=False) -> {name: TPShard}
        (a None module, e.g. a pipeline chunk's missing head, is skipped; a wrong name raises)
    parallelize_llama(model_or_chunk, tp_group, sequence_parallel=False) = apply_tp_plan(LLAMA_TP_PLAN)
    vocab_parallel_loss(head, logits, targets)   the mean cross-entropy of the split logits
    check_tp_sizes(tp, n_heads, n_kv_heads, hidden_dim, seq_len, sequence_parallel)  ValueError
  Under SP a block's input/output is this rank's s/t tokens [B, T/t, H] (sequence dim 1), the
  embedding returns them and the head gathers them: pass [B, T/t, H] between pipeline stages.
  After backward every parameter's .grad is the gradient of its shard of the full model's loss
  (the SP norms' and replicated K/V heads' gradients are already summed over the TP group), so
  data parallelism/FSDP can treat the TP-local parameters like any others.

Sharding description (sharding.py), for gathering, checkpoints and clipping:
    TPShard(dim, num_shards, group, full_size): the full tensor is cut along `dim` into
        `num_shards` pieces (last one zero-padded up to full_size), rank r holds piece
        r // copies, copies = t / num_shards; dim=None: replicated (copies = t).
    tp_shard_specs(module, group, prefix="") -> {name: TPShard} for every parameter
    gather_tensor(local, spec) / gather_full({name: tensor}, specs) -> full tensors (collective)
    local_piece(full, spec) -> this rank's piece of a full tensor (no collective)
    TPShard.counted_here: this rank's piece enters a global norm (one rank of each piece's
        copies): pass those grads as common.kernel.clip.clip_grads_by_global_norm_'s `counted`,
        groups=(tp_group,)

Formulas (formulas.py): activation bytes per layer (itemized, this LLaMA, t, SP) and
communication per block; cp_comm_bytes / cp_activation_bytes for context parallelism.

Context parallelism (context_parallel.py), the sequence split over a CP `group` for attention too:
    zigzag_positions(seq_len, cp, rank) / contiguous_positions / sequence_positions(..., layout)
    shard_sequence(x, cp, rank, dim=1, layout="zigzag") / unshard_sequence(pieces, dim, layout)
    ring_attention(q, k, v, group, causal=True, layout="zigzag")      q [B,H,t,d], k/v [B,H_kv,t,d]
    all_gather_attention(q, k, v, group, causal=True, layout="zigzag")
    apply_context_parallel(module, group, variant="ring", layout="zigzag")   every Attention.attend
    check_cp_sizes(seq_len, cp, layout)  ValueError;  attention_work / load_balance;  ring_plan
"""

from .context_layout import (
    attention_work,
    check_cp_sizes,
    contiguous_positions,
    load_balance,
    ring_plan,
    sequence_positions,
    shard_sequence,
    unshard_sequence,
    zigzag_positions,
)
from .context_parallel import all_gather_attention, apply_context_parallel, ring_attention
from .cross_entropy import vocab_parallel_cross_entropy
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    SequenceParallelRMSNorm,
    VocabParallelEmbedding,
    linear_with_sequence_gather,
)
from .mappings import (
    SequenceGather,
    copy_to_tp_region,
    gather_for_column_parallel,
    gather_from_sequence_parallel_region,
    gather_from_tp_region,
    reduce_from_tp_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
    scatter_to_tp_region,
)
from .parallelize import (
    LLAMA_TP_PLAN,
    ColumnSplit,
    MappedInput,
    RowSplit,
    SequenceNorm,
    VocabSplit,
    apply_tp_plan,
    check_tp_sizes,
    parallelize_llama,
    vocab_parallel_loss,
)
from .sharding import (
    TPShard,
    gather_full,
    gather_tensor,
    local_piece,
    tp_shard_specs,
)

__all__ = [
    "LLAMA_TP_PLAN",
    "ColumnParallelLinear",
    "ColumnSplit",
    "MappedInput",
    "RowParallelLinear",
    "RowSplit",
    "SequenceGather",
    "SequenceNorm",
    "SequenceParallelRMSNorm",
    "TPShard",
    "VocabParallelEmbedding",
    "VocabSplit",
    "all_gather_attention",
    "apply_context_parallel",
    "apply_tp_plan",
    "attention_work",
    "check_cp_sizes",
    "check_tp_sizes",
    "contiguous_positions",
    "copy_to_tp_region",
    "gather_for_column_parallel",
    "gather_from_sequence_parallel_region",
    "gather_from_tp_region",
    "gather_full",
    "gather_tensor",
    "linear_with_sequence_gather",
    "load_balance",
    "local_piece",
    "parallelize_llama",
    "reduce_from_tp_region",
    "reduce_scatter_to_sequence_parallel_region",
    "ring_attention",
    "ring_plan",
    "scatter_to_sequence_parallel_region",
    "scatter_to_tp_region",
    "sequence_positions",
    "shard_sequence",
    "tp_shard_specs",
    "unshard_sequence",
    "vocab_parallel_cross_entropy",
    "vocab_parallel_loss",
    "zigzag_positions",
]
