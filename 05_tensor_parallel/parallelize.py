"""`parallelize_llama`: turn common.model's LLaMA into its tensor-parallel form, in place, from
its full weights (torchtitan's split: the model knows nothing of parallelism; this function swaps
its linears for parallel ones). The modules keep their names and their `forward`: common.model's
Attention and FeedForward read head counts and widths from their weights' shapes, so the same
code runs on 1/t of the heads.

One block, t ranks (no SP)                         with sequence parallelism (SP)
    x ──RMSNorm──f──┬ wq ┐                          x_i[s/t] ──RMSNorm── AG ──┬ wq ┐
                    ├ wk ┼ attention(heads/t) ─ wo ─g─ + ─▶                   ├ wk ┼ attn ── wo ── RS ─ + ─▶
                    └ wv ┘                                                    └ wv ┘
    h ──RMSNorm──f──┬ w1 ┐ silu(w1 x) ⊙ w3 x ── w2 ─g─ + ─▶    (same, with AG before w1/w3, RS after w2)
                    └ w3 ┘
    column-parallel: wq, wk, wv, w1, w3 (split by heads / hidden units)
    row-parallel:    wo, w2 (then g = all-reduce; under SP, RS = reduce-scatter over the sequence)

Per block per micro-batch: no SP, 2 all-reduces of b·s·h forward (the g's) and 2 backward (the
f's); with SP, 2 all-gathers + 2 reduce-scatters of b·s·h in each direction (same wire bytes).
K/V heads are split when n_kv_heads is divisible by t, and each replicated on t/n_kv_heads ranks
when n_kv_heads < t (their gradients summed over the replicas: one more all-reduce each).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, RowParallelLinear, SequenceParallelRMSNorm, VocabParallelEmbedding
from .mappings import copy_to_tp_region, gather_from_sequence_parallel_region
from .sharding import TPShard, group_size, tp_shard_specs


def check_tp_sizes(tp: int, n_heads: int = 0, n_kv_heads: int = 0, hidden_dim: int = 0,
                   seq_len: int = 0, sequence_parallel: bool = False) -> None:
    """Raise ValueError naming what does not split over `tp` ranks (before any collective; a
    size left at 0 is not checked). The vocab may be anything: it is padded to a multiple of tp."""
    if tp < 1:
        raise ValueError(f"tensor-parallel size {tp} must be >= 1")
    if n_heads % tp:
        raise ValueError(f"n_heads={n_heads} is not divisible by the TP size {tp}: each rank needs "
                         f"whole attention heads (use a TP size dividing {n_heads})")
    if n_kv_heads and n_kv_heads % tp and tp % n_kv_heads:
        raise ValueError(f"n_kv_heads={n_kv_heads} and the TP size {tp}: one must divide the other "
                         "(K/V heads are split when tp divides them, replicated when n_kv_heads < tp)")
    if hidden_dim % tp:
        raise ValueError(f"the FFN hidden size {hidden_dim} is not divisible by the TP size {tp}")
    if sequence_parallel and seq_len % tp:
        raise ValueError(f"sequence parallelism splits the {seq_len} tokens of a sequence over "
                         f"{tp} ranks: use a sequence length divisible by {tp}")


def _prepare_input(group, sequence_parallel: bool):
    """Forward pre-hook: map the block's input once for all the column layers reading it
    (torchtitan's PrepareModuleInput): f, or SP's all-gather of the sequence."""

    def hook(module: nn.Module, args: tuple) -> tuple:
        x, *rest = args
        x = (gather_from_sequence_parallel_region(x, group) if sequence_parallel
             else copy_to_tp_region(x, group))
        return (x, *rest)

    return hook


def parallelize_attention(attention: nn.Module, group, sequence_parallel: bool = False) -> None:
    """Q, K, V column-parallel by heads (n_heads/t each; K/V n_kv_heads/t, or one replicated head
    when n_kv_heads < t), output projection row-parallel. In place."""
    t, head_dim = group_size(group), attention.head_dim
    n_heads, n_kv = attention.wq.out_features // head_dim, attention.wk.out_features // head_dim
    check_tp_sizes(t, n_heads, n_kv)
    kv_shards = min(n_kv, t)
    attention.wq = ColumnParallelLinear.from_linear(attention.wq, group, input_is_mapped=True)
    attention.wk = ColumnParallelLinear.from_linear(attention.wk, group, input_is_mapped=True,
                                                    num_shards=kv_shards)
    attention.wv = ColumnParallelLinear.from_linear(attention.wv, group, input_is_mapped=True,
                                                    num_shards=kv_shards)
    attention.wo = RowParallelLinear.from_linear(attention.wo, group, sequence_parallel=sequence_parallel)
    attention.register_forward_pre_hook(_prepare_input(group, sequence_parallel))


def parallelize_feed_forward(feed_forward: nn.Module, group, sequence_parallel: bool = False) -> None:
    """SwiGLU W2(silu(W1 x) ⊙ W3 x): W1, W3 column-parallel (hidden/t units each, the product is
    element-wise so it stays local), W2 row-parallel: one all-reduce (or reduce-scatter). In place."""
    feed_forward.w1 = ColumnParallelLinear.from_linear(feed_forward.w1, group, input_is_mapped=True)
    feed_forward.w3 = ColumnParallelLinear.from_linear(feed_forward.w3, group, input_is_mapped=True)
    feed_forward.w2 = RowParallelLinear.from_linear(feed_forward.w2, group,
                                                    sequence_parallel=sequence_parallel)
    feed_forward.register_forward_pre_hook(_prepare_input(group, sequence_parallel))


def parallelize_block(block: nn.Module, group, sequence_parallel: bool = False) -> dict[str, TPShard]:
    """One TransformerBlock, in place, from its full weights. Under SP its input and output are
    this rank's s/t tokens [B, T/t, H] and its norms work on them. Returns its TPShard specs."""
    ff = block.feed_forward
    check_tp_sizes(group_size(group), hidden_dim=ff.w1.out_features)
    parallelize_attention(block.attention, group, sequence_parallel)
    parallelize_feed_forward(ff, group, sequence_parallel)
    if sequence_parallel:
        block.attention_norm = SequenceParallelRMSNorm.from_norm(block.attention_norm, group)
        block.ffn_norm = SequenceParallelRMSNorm.from_norm(block.ffn_norm, group)
    return tp_shard_specs(block, group)


def parallelize_blocks(blocks: Iterable[nn.Module], group, sequence_parallel: bool = False) -> None:
    """A pipeline stage's run of blocks, each in place."""
    for block in blocks:
        parallelize_block(block, group, sequence_parallel)


def parallelize_embedding(embedding: nn.Embedding, group,
                          sequence_parallel: bool = False) -> VocabParallelEmbedding:
    """The token embedding as a VocabParallelEmbedding (under SP its output is s/t tokens)."""
    return VocabParallelEmbedding.from_embedding(embedding, group, sequence_parallel=sequence_parallel)


def parallelize_head(norm: nn.Module, output: nn.Linear, group,
                     sequence_parallel: bool = False) -> tuple[nn.Module, ColumnParallelLinear]:
    """The final norm (SP: on s/t tokens) and the output head, column-parallel over the vocab
    (padded to a multiple of t); its logits stay split: use `vocab_parallel_loss`."""
    if sequence_parallel:
        norm = SequenceParallelRMSNorm.from_norm(norm, group)
    head = ColumnParallelLinear.from_linear(output, group, sequence_parallel=sequence_parallel)
    return norm, head


def parallelize_llama(model: nn.Module, tp_group, sequence_parallel: bool = False) -> dict[str, TPShard]:
    """common.model.Llama → its TP form, in place, from the full weights it holds now (every rank
    must hold the same ones). Returns {parameter name: TPShard} under the reference's names."""
    model.tok_embeddings = parallelize_embedding(model.tok_embeddings, tp_group, sequence_parallel)
    parallelize_blocks(model.layers, tp_group, sequence_parallel)
    model.norm, model.output = parallelize_head(model.norm, model.output, tp_group, sequence_parallel)
    return tp_shard_specs(model, tp_group)


def vocab_parallel_loss(head: ColumnParallelLinear, logits: torch.Tensor,
                        targets: torch.Tensor) -> torch.Tensor:
    """common.model.loss_fn for the split logits of a `parallelize_head` output head."""
    return vocab_parallel_cross_entropy(logits, targets, head.group, head.output_offset,
                                        head.out_features)
