"""Mixture-of-experts pricing: what an MoE model holds per GPU, what it computes per token, and
what its expert parallelism (EP) sends. Pure arithmetic, like memory_model.py.

An MoE block replaces the SwiGLU with E routed experts (SwiGLU of width F_e each), of which a
router sends every token to k, and S shared experts every token passes through; blocks
0 … first_dense_layers-1 keep the dense SwiGLU (width H). With L_m = L - first_dense_layers:

    parameters   P = L·attn + first_dense·3hH + L_m·(h·E + (E + S)·3h·F_e) + 2Vh
    active       A = the same with E → k experts (the router's h·E still runs for every token)
    compute      6A + attention per token (pricing's model FLOPs on the active parameters);
                 with EP, the rank that receives the most tokens does skew × the mean expert
                 work, and the step waits
    memory       a GPU holds E/ep experts of each of its MoE blocks (TP-split like a dense FFN);
                 ZeRO shards them over the dp·cp/ep ranks holding the same experts, everything
                 else over dp·cp, as in a dense model; optimizer state likewise (memory.py)
    all-to-all   per MoE block and micro-batch, dispatch and combine, forward and backward: 4
                 all-to-alls of (ep-1)/ep · T·k·h·e bytes per rank (T tokens on the rank, balanced
                 routing); under skew the busiest rank's share, × skew (skew = max/mean tokens per
                 expert rank); full recomputation reruns the forward two

EP is a layout dimension that borrows ranks from data parallelism: ep divides dp·cp, the EP group
is ep consecutive ranks of the dp·cp dimension (mesh tp, cp, dp, pp; span t·ep GPUs), and the
experts' gradients are reduced over the dp·cp/ep ranks that hold the same experts.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

from common.kernel.fp8 import TILE
from common.kernel.model import LlamaConfig
from parallel3d.memory_model import (
    Layout,
    attention_flops_per_token,
    layer_parameters,
    local_tokens,
    stage_layers,
)


@dataclass(frozen=True)
class MoEShape:
    """The MoE fields the planner needs, with LlamaConfig's names (common/kernel/model.py)."""
    n_experts: int
    top_k: int
    moe_hidden_dim: int          # F_e: each expert's SwiGLU width
    n_shared_experts: int = 0    # S: experts every token passes through
    first_dense_layers: int = 0  # blocks that keep the dense SwiGLU

    def __post_init__(self) -> None:
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top_k={self.top_k}: use 1 … n_experts={self.n_experts}")
        if self.moe_hidden_dim <= 0 or self.n_shared_experts < 0 or self.first_dense_layers < 0:
            raise ValueError(f"{self}: widths must be positive, counts non-negative")


def moe_shape(cfg: LlamaConfig) -> MoEShape | None:
    """A config's MoE fields (n_experts, top_k, moe_hidden_dim (None: the dense width),
    n_shared_experts, first_dense_layers), or None for a dense model (n_experts 0 or absent)."""
    n = getattr(cfg, "n_experts", 0) or 0
    if not n:
        return None
    return MoEShape(n, cfg.top_k, getattr(cfg, "moe_hidden_dim", None) or cfg.hidden_dim,
                    getattr(cfg, "n_shared_experts", 0) or 0, getattr(cfg, "first_dense_layers", 0) or 0)


@dataclass(frozen=True)
class ExpertFFN(LlamaConfig):
    """A dense LLaMA whose SwiGLU is `ffn` wide: an MoE block as one token's activations see it
    (its k routed and S shared experts side by side), for chapter 05's per-token formulas."""
    ffn: int = 0

    @property
    def hidden_dim(self) -> int:
        return self.ffn


def moe_layers(cfg: LlamaConfig, moe: MoEShape) -> int:
    return cfg.n_layers - moe.first_dense_layers


def moe_parameters(cfg: LlamaConfig, moe: MoEShape, active: bool = False) -> int:
    """P (every expert) or A (the k routed experts a token meets): the module docstring's sums."""
    split, replicated = layer_parameters(cfg)
    ffn = 3 * cfg.dim * cfg.hidden_dim
    experts = (moe.top_k if active else moe.n_experts) + moe.n_shared_experts
    moe_ffn = cfg.dim * moe.n_experts + experts * 3 * cfg.dim * moe.moe_hidden_dim
    return (cfg.n_layers * (split - ffn + replicated) + moe.first_dense_layers * ffn
            + moe_layers(cfg, moe) * moe_ffn + 2 * cfg.vocab_size * cfg.dim + cfg.dim)


def moe_flops_per_token(cfg: LlamaConfig, moe: MoEShape, seq_len: int, skew: float = 1.0) -> float:
    """The dense model's definition (pricing.model_flops_per_token) on the active parameters:
    6A + the attention scores (A without the input embedding, a lookup), the routed experts'
    share × skew: the busiest expert rank's work, which the step waits for (skew 1: the model
    FLOPs that MFU counts)."""
    routed = moe_layers(cfg, moe) * moe.top_k * 3 * cfg.dim * moe.moe_hidden_dim
    matmul = moe_parameters(cfg, moe, active=True) - cfg.vocab_size * cfg.dim + (skew - 1) * routed
    return 6 * matmul + attention_flops_per_token(cfg, seq_len)


@cache
def moe_stage_units(cfg: LlamaConfig, moe: MoEShape, tp: int, pp: int, ep: int
                    ) -> tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]:
    """Per pipeline stage, what one GPU holds: (the units sharded over dp·cp: one per block, then
    the root, as `stage_units`; the units sharded over dp·cp/ep: the E/ep experts of each MoE
    block). TP splits attention, FFNs and experts; norms and the router stay whole."""
    split, replicated = layer_parameters(cfg)
    ffn = 3 * cfg.dim * cfg.hidden_dim
    shared = moe.n_shared_experts * 3 * cfg.dim * moe.moe_hidden_dim
    dense_block = split // tp + replicated
    moe_block = (split - ffn + shared) // tp + replicated + cfg.dim * moe.n_experts
    experts = moe.n_experts // ep * 3 * cfg.dim * moe.moe_hidden_dim // tp
    vocab = math.ceil(cfg.vocab_size / tp) * cfg.dim
    out, start = [], 0
    for i, n in enumerate(stage_layers(cfg.n_layers, pp)):
        blocks = range(start, start + n)
        start += n
        root = (vocab if i == 0 else 0) + (vocab + cfg.dim if i == pp - 1 else 0)
        units = tuple(dense_block if b < moe.first_dense_layers else moe_block for b in blocks)
        out.append((units + ((root,) if root else ()),
                    tuple(experts for b in blocks if b >= moe.first_dense_layers)))
    return tuple(out)

FP8_ROW_BYTES = 1 + 4 / TILE  # bytes per element of an FP8 row: the payload and its tiles' fp32 scales


def check_ep(moe: MoEShape, layout: Layout) -> None:
    if layout.shards % layout.ep or moe.n_experts % layout.ep:
        raise ValueError(f"ep={layout.ep} must divide dp·cp={layout.shards} and n_experts="
                         f"{moe.n_experts}: EP borrows its ranks from data parallelism")


def all_to_all_bytes(cfg: LlamaConfig, moe: MoEShape, layout: Layout, seq_len: int,
                     microbatches: int, elem: int = 2, skew: float = 1.0, fp8_dispatch: bool = False
                     ) -> float:
    """Bytes the busiest EP rank sends per step: its stage's MoE blocks × m micro-batches × 4
    all-to-alls (6 under full recomputation: assumed, until an EP meter says, that the gate
    product after the combine saves its input, so the rerun goes through both) of
    (ep-1)/ep · T·k·h·e, × skew. `fp8_dispatch` (DeepSeek-V3 §3.3.2): the half of them that
    carry rows into the experts (the dispatch, the combine's backward) send FP8 rows with an
    fp32 scale per 1 × 128 tile, e = 1 + 4/128; the combine and the dispatch's backward stay e."""
    if layout.ep == 1:
        return 0.0
    stages = moe_stage_units(cfg, moe, layout.tp, layout.pp, layout.ep)
    blocks = max(len(experts) for _, experts in stages)
    passes = 4 + (2 if layout.recompute == "full" else 0)
    e = (elem + FP8_ROW_BYTES) / 2 if fp8_dispatch else elem
    one = (layout.ep - 1) / layout.ep * local_tokens(layout, seq_len) * moe.top_k * cfg.dim * e
    return blocks * microbatches * passes * one * skew


def all_to_alls_per_step(cfg: LlamaConfig, moe: MoEShape, layout: Layout, microbatches: int) -> int:
    """How many all-to-alls the busiest EP rank runs per step (each pays one network latency)."""
    if layout.ep == 1:
        return 0
    stages = moe_stage_units(cfg, moe, layout.tp, layout.pp, layout.ep)
    return (max(len(e) for _, e in stages) * microbatches
            * (4 + (2 if layout.recompute == "full" else 0)))
