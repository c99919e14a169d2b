"""The tensor-parallel plan as a table, applied by one function (torchtitan's split: the model
knows nothing of parallelism; a plan says which module is cut how).

    plan = {module name: style}      a `*` in a name stands for every child (each layer)
    apply_tp_plan(model, group, plan, sequence_parallel) -> {parameter name: TPShard}

swaps each named module for its parallel form in place, from the full weights it holds (every rank
the same), and keeps its name and its `forward`: common.kernel.model's Attention and FeedForward read
head counts and widths from their weights' shapes, so the same code runs on 1/t of the heads.
`LLAMA_TP_PLAN` is common.kernel.model's LLaMA; a model with other attribute names changes the names, not
the code (Hugging Face's LlamaForCausalLM: "model.layers.*.self_attn.q_proj", …, "lm_head"). The
styles are ours (torch's ColwiseParallel / parallelize_module work on DTensors, a different
contract): ColumnSplit, RowSplit, VocabSplit, MappedInput, SequenceNorm; a style with an
`apply(name, module, group, sequence_parallel)` method lives beside its module and is called as is
(moe_tensor_parallel.ExpertSplit: a MoE model's plan is `moe_tp_plan(model)`).

One block, t ranks (no SP)                         with sequence parallelism (SP)
    x ──RMSNorm──f──┬ wq ┐                          x_i[s/t] ──RMSNorm── AG ──┬ wq ┐
                    ├ wk ┼ attention(heads/t) ─ wo ─g─ + ─▶                   ├ wk ┼ attn ── wo ── RS ─ + ─▶
                    └ wv ┘                                                    └ wv ┘
    h ──RMSNorm──f──┬ w1 ┐ silu(w1 x) ⊙ w3 x ── w2 ─g─ + ─▶    (same, with AG before w1/w3, RS after w2)
                    └ w3 ┘
    column-parallel: wq, wk, wv, w1, w3 (split by heads / hidden units)
    row-parallel:    wo, w2 (then g = all-reduce; under SP, RS = reduce-scatter over the sequence)

Per block per micro-batch: no SP, 2 all-reduces of b·s·h forward (the g's) and 2 backward (the
f's); with SP, 2 all-gathers + 2 reduce-scatters of b·s·h in each direction (the same wire
bytes), plus 2 all-gathers in backward: the column layers save their input's s/t tokens, not
the gathered s, and gather them again (once for wq, wk, wv; once for w1, w3).
K/V heads are split when n_kv_heads is divisible by t, and each replicated on t/n_kv_heads ranks
when n_kv_heads < t (their gradients summed over the replicas: one more all-reduce each).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .cross_entropy import vocab_parallel_cross_entropy
from .layers import ColumnParallelLinear, RowParallelLinear, SequenceParallelRMSNorm, VocabParallelEmbedding
from .mappings import copy_to_tp_region, gather_for_column_parallel
from .sharding import TPShard, group_size, tp_shard_specs

# --- the styles: how one module is cut ----------------------------------------------------------


@dataclass(frozen=True)
class ColumnSplit:
    """nn.Linear → ColumnParallelLinear: the weight's rows (output features) split over the t ranks,
    the output stays split. `head_dim`: the parent module's attribute holding one head's width, so
    each rank gets whole heads; `replicate_heads`: fewer heads than ranks (GQA's K/V) puts each head
    on t/n consecutive ranks; `pad`: an output size t does not divide is zero-padded (the vocab of
    the head: its logits stay split, use `vocab_parallel_loss`). The input is mapped (f, or SP's
    all-gather) by a MappedInput above it in the plan, else by the layer itself."""

    head_dim: str | None = None
    replicate_heads: bool = False
    pad: bool = False


@dataclass(frozen=True)
class RowSplit:
    """nn.Linear → RowParallelLinear: the weight's columns split, the input is the split output of
    the column layers before it; then g (all-reduce), or SP's reduce-scatter over the sequence."""


@dataclass(frozen=True)
class VocabSplit:
    """nn.Embedding → VocabParallelEmbedding: rows by vocab id (padded to a multiple of t), the
    partial embeddings summed (SP: reduce-scattered over the sequence)."""


@dataclass(frozen=True)
class MappedInput:
    """A forward pre-hook mapping the module's first input once for all the column layers inside
    that read it (torchtitan's PrepareModuleInput): f, or SP's all-gather of the sequence."""


@dataclass(frozen=True)
class SequenceNorm:
    """Under SP, an RMSNorm (.weight, .eps) → SequenceParallelRMSNorm on this rank's s/t tokens
    (its weight's gradient summed over the group); without SP it stays as it is (replicated)."""


Style = ColumnSplit | RowSplit | VocabSplit | MappedInput | SequenceNorm

LLAMA_TP_PLAN: dict[str, Style] = {
    "tok_embeddings": VocabSplit(),
    "layers.*.attention_norm": SequenceNorm(),
    "layers.*.attention": MappedInput(),
    "layers.*.attention.wq": ColumnSplit(head_dim="head_dim"),
    "layers.*.attention.wk": ColumnSplit(head_dim="head_dim", replicate_heads=True),
    "layers.*.attention.wv": ColumnSplit(head_dim="head_dim", replicate_heads=True),
    "layers.*.attention.wo": RowSplit(),
    "layers.*.ffn_norm": SequenceNorm(),
    "layers.*.feed_forward": MappedInput(),
    "layers.*.feed_forward.w1": ColumnSplit(),
    "layers.*.feed_forward.w3": ColumnSplit(),
    "layers.*.feed_forward.w2": RowSplit(),
    "norm": SequenceNorm(),
    "output": ColumnSplit(pad=True),
}


# --- applying a plan ----------------------------------------------------------------------------


def apply_tp_plan(module: nn.Module, group, plan: dict[str, Style] = LLAMA_TP_PLAN,
                  sequence_parallel: bool = False) -> dict[str, TPShard]:
    """Cut every module the plan names, in place, from the full weights it holds now (the same on
    every rank of `group`); returns {parameter name: TPShard} (the reference's names). A name whose
    module is None is skipped (a pipeline chunk without the embedding or the head); a name that
    does not exist is an error. Under SP a block's input and output are this rank's s/t tokens
    [B, T/t, H]: pass those between pipeline stages."""
    mapped = [name for name, style in plan.items() if isinstance(style, MappedInput)]
    # every name is resolved before anything is cut, so a wrong one leaves the model untouched
    sites = [(style, site, any(pattern.startswith(f"{m}.") for m in mapped))
             for pattern, style in plan.items() for site in _resolve(module, pattern)]
    for style, (name, parent, attr, target), input_mapped in sites:
        new = _apply(style, name, parent, target, group, sequence_parallel, input_mapped)
        if new is not target:
            setattr(parent, attr, new)
    return tp_shard_specs(module, group)


MOE_NOT_SUPPORTED = ("a mixture-of-experts model: LLAMA_TP_PLAN has no entry for its experts; cut it "
                     "with moe_tensor_parallel.parallelize_moe_llama (each expert split like the dense "
                     "SwiGLU, the router whole on every rank)")


def parallelize_llama(model: nn.Module, tp_group, sequence_parallel: bool = False) -> dict[str, TPShard]:
    """common.kernel.model.Llama (or a pipeline chunk of it) → its TP form by LLAMA_TP_PLAN, in place."""
    if any(hasattr(m, "experts") for m in model.modules()):  # common.kernel.moe.MoEFeedForward
        raise ValueError(MOE_NOT_SUPPORTED)
    return apply_tp_plan(model, tp_group, LLAMA_TP_PLAN, sequence_parallel)


def _resolve(module: nn.Module, pattern: str):
    """(full name, parent, attribute, module) for every module `pattern` names; None modules are
    skipped, a missing attribute raises."""
    *path, last = pattern.split(".")
    parents = [("", module)]
    for part in path:
        parents = [(f"{n}.{c}" if n else c, child) for n, parent in parents
                   for c, child in (parent.named_children() if part == "*" else
                                    [(part, _child(parent, part, n, pattern))]) if child is not None]
    for n, parent in parents:
        target = _child(parent, last, n, pattern)
        if target is not None:
            yield (f"{n}.{last}" if n else last), parent, last, target


def _child(parent: nn.Module, attr: str, where: str, pattern: str) -> nn.Module | None:
    child = getattr(parent, attr, AttributeError)
    if child is AttributeError or not (child is None or isinstance(child, nn.Module)):
        raise ValueError(f"TP plan entry {pattern!r}: {where or 'the model'} has no submodule {attr!r} "
                         "(fix the name in the plan)")
    return child


def _linear(name: str, module: nn.Module, style: Style) -> nn.Linear:
    if not isinstance(module, nn.Linear):
        raise ValueError(f"{name}: {type(module).__name__} is not an nn.Linear for {style} (cut once, "
                         "from the full model)")
    return module


def _apply(style: Style, name: str, parent: nn.Module, module: nn.Module, group, sp: bool,
           input_mapped: bool) -> nn.Module:
    if hasattr(style, "apply"):  # a style defined beside its module (moe_tensor_parallel.ExpertSplit)
        return style.apply(name, module, group, sp)
    t = group_size(group)
    if isinstance(style, ColumnSplit):
        linear = _linear(name, module, style)
        shards = _column_shards(style, name, parent, linear, t)
        return ColumnParallelLinear.from_linear(linear, group, sequence_parallel=sp,
                                                input_is_mapped=input_mapped, num_shards=shards)
    if isinstance(style, RowSplit):
        linear = _linear(name, module, style)
        if linear.in_features % t:
            raise ValueError(f"{name}: {linear.in_features} input features are not divisible by "
                             f"the TP size {t}")
        return RowParallelLinear.from_linear(linear, group, sequence_parallel=sp)
    if isinstance(style, VocabSplit):
        if not isinstance(module, nn.Embedding):
            raise ValueError(f"{name}: {type(module).__name__} is not an nn.Embedding for {style}")
        return VocabParallelEmbedding.from_embedding(module, group, sequence_parallel=sp)
    if isinstance(style, MappedInput):
        module.register_forward_pre_hook(_map_input(group, sp))
        return module
    if isinstance(style, SequenceNorm):
        return SequenceParallelRMSNorm.from_norm(module, group) if sp else module
    raise TypeError(f"{name}: unknown style {style!r}")


def _column_shards(style: ColumnSplit, name: str, parent: nn.Module, linear: nn.Linear, t: int) -> int:
    """How many distinct pieces a ColumnSplit cuts `linear` into over t ranks (t, or the head
    count when fewer heads than ranks are replicated); raises naming what does not split."""
    out = linear.out_features
    if style.head_dim is not None:
        width = getattr(parent, style.head_dim, None)
        if not isinstance(width, int):
            raise ValueError(f"{name}: its parent has no integer attribute {style.head_dim!r} "
                             "(ColumnSplit's head_dim names the attribute holding one head's width)")
        heads = out // width
        if heads % t == 0:
            return t
        if style.replicate_heads and t % heads == 0:
            return heads  # each head on t/heads consecutive ranks
        also = f" or a multiple of {heads}" if style.replicate_heads else ""
        raise ValueError(f"{name}: {heads} heads do not split over the TP size {t}: each rank "
                         f"needs whole heads (use a TP size dividing {heads}{also})")
    if out % t and not style.pad:
        raise ValueError(f"{name}: {out} output features are not divisible by the TP size {t}")
    return t


def plan_table(module: nn.Module, tp: int, plan: dict[str, Style] = LLAMA_TP_PLAN,
               sequence_parallel: bool = False) -> list[dict]:
    """What `apply_tp_plan(module, group of tp ranks, plan, sequence_parallel)` does, as data, with
    no process group and nothing cut (a meta-device model will do): one row per module the plan
    names, in plan order: "name", "style" (its class name), "shape" (the weight's, torch's [out,
    in] for a linear; None without one), "dim" (the weight dim split over the ranks: 0 rows, 1
    columns; None: replicated), "shards" (distinct pieces; tp/shards consecutive ranks hold each),
    "comm" (the collective at the module's boundary: "f" or SP's "all-gather" on its input, "g" or
    SP's "reduce-scatter" on its output, "grad all-reduce" of an SP norm's weight, "" none). The
    same checks as apply_tp_plan raise the same errors."""
    sp = sequence_parallel
    mapped = [name for name, style in plan.items() if isinstance(style, MappedInput)]
    rows = []
    for pattern, style in plan.items():
        for name, parent, _, target in _resolve(module, pattern):
            weight = getattr(target, "weight", None)
            row = {"name": name, "style": type(style).__name__, "dim": None, "shards": 1, "comm": "",
                   "shape": None if weight is None else list(weight.shape)}
            if isinstance(style, ColumnSplit):
                linear = _linear(name, target, style)
                own_input = not any(pattern.startswith(f"{m}.") for m in mapped)
                row.update(dim=0, shards=_column_shards(style, name, parent, linear, tp),
                           comm=("all-gather" if sp else "f") if own_input else "")
            elif isinstance(style, RowSplit):
                if _linear(name, target, style).in_features % tp:
                    raise ValueError(f"{name}: {target.in_features} input features are not divisible "
                                     f"by the TP size {tp}")
                row.update(dim=1, shards=tp, comm="reduce-scatter" if sp else "g")
            elif isinstance(style, VocabSplit):
                row.update(dim=0, shards=tp, comm="reduce-scatter" if sp else "g")
            elif isinstance(style, MappedInput):
                row.update(comm="all-gather" if sp else "f")
            elif isinstance(style, SequenceNorm) and sp:
                row.update(comm="grad all-reduce")
            rows.append(row)
    return rows


def _map_input(group, sequence_parallel: bool):
    """The forward pre-hook of MappedInput: f, or SP's all-gather of the sequence (whose column
    layers save the local s/t tokens and gather them again in backward, once for all of them)."""

    def hook(module: nn.Module, args: tuple) -> tuple:
        x, *rest = args
        x = (gather_for_column_parallel(x, group) if sequence_parallel
             else copy_to_tp_region(x, group))
        return (x, *rest)

    return hook


# --- validation and the loss --------------------------------------------------------------------


def check_tp_sizes(tp: int, n_heads: int = 0, n_kv_heads: int = 0, hidden_dim: int = 0,
                   seq_len: int = 0, sequence_parallel: bool = False, expert_hidden_dim: int = 0) -> None:
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
    if expert_hidden_dim % tp:
        raise ValueError(f"the experts' hidden size {expert_hidden_dim} is not divisible by the TP "
                         f"size {tp} (each expert is cut like the dense SwiGLU)")
    if sequence_parallel and seq_len % tp:
        raise ValueError(f"sequence parallelism splits the {seq_len} tokens of a sequence over "
                         f"{tp} ranks: use a sequence length divisible by {tp}")


def vocab_parallel_loss(head: ColumnParallelLinear, logits: torch.Tensor,
                        targets: torch.Tensor) -> torch.Tensor:
    """common.kernel.model.loss_fn for the split logits of a vocab-parallel head (ColumnSplit(pad=True)):
    the mean over every position of vocab_parallel_cross_entropy."""
    return vocab_parallel_cross_entropy(logits, targets, head.group, head.output_offset,
                                        head.out_features).mean()
