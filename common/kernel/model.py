"""LLaMA, architecturally exact, and nothing about parallelism.

    h   = x + Attention(RMSNorm(x))            RMSNorm(x) = x / sqrt(mean(x²) + eps) · g
    out = h + SwiGLU(RMSNorm(h))               SwiGLU(x)  = W2 (silu(W1 x) ⊙ W3 x)

Attention is causal grouped-query attention (n_kv_heads ≤ n_heads, each K/V head shared by
n_heads / n_kv_heads query heads) with rotary position embeddings on Q and K. With n_experts > 0
the SwiGLU of every block from `first_dense_layers` on is a mixture of experts (common/kernel/moe.py:
top-k routing, an optional shared expert, the load-balancing loss, capacity; the dispatcher seam
that expert parallelism replaces); n_experts = 0 is the dense model, unchanged. Every parallel
strategy in the course wraps or re-shards *this* model, so the single-device reference and the
parallel run execute the same code. Modules read their head counts from their weights' shapes, so
a tensor-parallel split of wq/wk/wv needs no change here.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

GATES = ("softmax", "sigmoid")  # a MoE router's gates (common/kernel/moe.py's route)


def routing_error(n_experts: int, top_k: int, n_groups: int, topk_groups: int) -> str | None:
    """Why group-limited routing cannot pick k experts, or None."""
    if n_groups < 1 or n_experts % n_groups:
        return f"n_expert_groups={n_groups}: use a divisor of n_experts={n_experts}"
    if not 1 <= topk_groups <= n_groups:
        return f"topk_groups={topk_groups}: use 1 … n_expert_groups={n_groups}"
    if topk_groups * (per := n_experts // n_groups) < top_k:
        return (f"topk_groups={topk_groups} of n_expert_groups={n_groups} hold {topk_groups} × {per} "
                f"experts < top_k={top_k}: raise topk_groups to {math.ceil(top_k / per)}")
    return None


@dataclass(frozen=True)
class LlamaConfig:
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    vocab_size: int
    multiple_of: int = 256
    ffn_dim_multiplier: float | None = None
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # LLaMA 3.1 stretches long wavelengths: (factor, low_freq_factor, high_freq_factor, original_ctx)
    rope_scaling: tuple[float, float, float, int] | None = None
    max_seq_len: int = 2048
    # Mixture of experts (common/kernel/moe.py); n_experts = 0: the dense LLaMA, and the rest is unused.
    n_experts: int = 0
    top_k: int = 2
    n_shared_experts: int = 0  # 0 or 1: an always-on SwiGLU of width moe_hidden_dim beside them
    moe_hidden_dim: int | None = None  # each expert's SwiGLU width (None: hidden_dim)
    gate: str = "softmax"  # "softmax" (Mixtral) | "sigmoid" (DeepSeek-V3): moe.route
    aux_loss_coef: float = 0.01  # α of the sequence-wise load-balancing loss
    capacity_factor: float | None = None  # None: dropless; else C = ceil(cf·T·k/E) per sequence
    first_dense_layers: int = 0  # layers 0 … first_dense_layers-1 keep the dense SwiGLU
    # DeepSeek-V3's router (moe.py): γ of the selection bias's update after each step (0: no bias); the
    # top-k among the experts of each token's top topk_groups of n_expert_groups groups (1: no groups)
    bias_update_rate: float = 0.0
    n_expert_groups: int = 1
    topk_groups: int = 1
    # MLA (DeepSeek-V2/V3; the planner prices it, `Llama` refuses it): Q = W_qb·norm(W_qa x) (q_lora_rank;
    # 0: W_q x), K/V = W_kvb·norm(c_kv), c_kv = W_kva x (kv_lora_rank, + a RoPE key qk_rope_head_dim wide);
    # a head's query and key are qk_nope_head_dim + qk_rope_head_dim wide, its value v_head_dim.
    q_lora_rank: int = 0
    kv_lora_rank: int = 0
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def qk_head_dim(self) -> int:  # one head's query/key width: head_dim, or MLA's nope + rope parts
        return self.qk_nope_head_dim + self.qk_rope_head_dim if self.mla else self.head_dim

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.mla else self.head_dim

    @property
    def hidden_dim(self) -> int:
        """LLaMA's FFN width: 2/3 of 4·dim, times ffn_dim_multiplier, rounded up to multiple_of."""
        hidden = int(2 * (4 * self.dim) / 3)
        if self.ffn_dim_multiplier is not None:
            hidden = int(self.ffn_dim_multiplier * hidden)
        return self.multiple_of * math.ceil(hidden / self.multiple_of)

    @property
    def expert_hidden_dim(self) -> int:
        return self.hidden_dim if self.moe_hidden_dim is None else self.moe_hidden_dim

    def is_moe_layer(self, layer_id: int) -> bool:
        return self.n_experts > 0 and layer_id >= self.first_dense_layers

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not divisible by n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")
        if self.mla and min(self.qk_rope_head_dim, self.v_head_dim, self.qk_nope_head_dim) <= 0:
            raise ValueError(f"MLA (kv_lora_rank={self.kv_lora_rank}) needs qk_nope_head_dim, "
                             "qk_rope_head_dim and v_head_dim > 0")
        if self.n_experts:
            checks = [(1 <= self.top_k <= self.n_experts, f"top_k={self.top_k}: use 1 … n_experts"),
                      (self.n_shared_experts in (0, 1), f"n_shared_experts={self.n_shared_experts}: 0 or 1"),
                      (self.gate in GATES, f"gate={self.gate!r}: use one of {', '.join(GATES)}"),
                      (self.expert_hidden_dim > 0, f"moe_hidden_dim={self.moe_hidden_dim}: use > 0"),
                      (self.aux_loss_coef >= 0, f"aux_loss_coef={self.aux_loss_coef}: use >= 0"),
                      (self.capacity_factor is None or self.capacity_factor > 0,
                       f"capacity_factor={self.capacity_factor}: use > 0, or None (dropless)"),
                      (0 <= self.first_dense_layers <= self.n_layers,
                       f"first_dense_layers={self.first_dense_layers}: use 0 … n_layers={self.n_layers}"),
                      (self.bias_update_rate >= 0, f"bias_update_rate={self.bias_update_rate}: use >= 0")]
            groups = routing_error(self.n_experts, self.top_k, self.n_expert_groups, self.topk_groups)
            for ok, message in [*checks, (groups is None, groups)]:
                if not ok:
                    raise ValueError(f"{message} (n_experts={self.n_experts})")
        elif self.n_experts < 0:
            raise ValueError(f"n_experts={self.n_experts}: use 0 (dense) or more")


_LLAMA31_ROPE = (8.0, 1.0, 4.0, 8192)
CONFIGS: dict[str, LlamaConfig] = {
    # Test and demo sizes: heads and kv-heads divisible by 4 (TP 4), layers by 8 (PP 4 × 2 virtual).
    "tiny": LlamaConfig(dim=32, n_layers=8, n_heads=4, n_kv_heads=4, vocab_size=256, multiple_of=16),
    "small": LlamaConfig(dim=256, n_layers=8, n_heads=8, n_kv_heads=4, vocab_size=256, multiple_of=64),
    # MoE demo: tiny's attention, 8 experts (EP 2, 4) of width 32, top-2, a shared one, layer 0 dense.
    "tiny-moe": LlamaConfig(dim=32, n_layers=8, n_heads=4, n_kv_heads=4, vocab_size=256, multiple_of=16,
                            n_experts=8, top_k=2, n_shared_experts=1, moe_hidden_dim=32,
                            first_dense_layers=1),
    # The real shapes (build them on the meta device to count parameters).
    "llama2-7b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, vocab_size=32000,
                             max_seq_len=4096),
    "llama2-13b": LlamaConfig(dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, vocab_size=32000,
                              max_seq_len=4096),
    "llama2-70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=32000,
                              multiple_of=4096, ffn_dim_multiplier=1.3, max_seq_len=4096),
    "llama3.1-8b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=128256,
                               multiple_of=1024, ffn_dim_multiplier=1.3, rope_theta=500000.0,
                               rope_scaling=_LLAMA31_ROPE, max_seq_len=131072),
    "llama3.1-70b": LlamaConfig(dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, vocab_size=128256,
                                multiple_of=4096, ffn_dim_multiplier=1.3, rope_theta=500000.0,
                                rope_scaling=_LLAMA31_ROPE, max_seq_len=131072),
    "llama3.1-405b": LlamaConfig(dim=16384, n_layers=126, n_heads=128, n_kv_heads=8, vocab_size=128256,
                                 multiple_of=4096, ffn_dim_multiplier=1.2, rope_theta=500000.0,
                                 rope_scaling=_LLAMA31_ROPE, max_seq_len=131072),
    # MoE real shapes (meta device). Mixtral 8x7B: 46.7B total, 12.9B active, as published.
    "mixtral-8x7b": LlamaConfig(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, vocab_size=32000,
                                rope_theta=1e6, max_seq_len=32768, n_experts=8, top_k=2,
                                moe_hidden_dim=14336, aux_loss_coef=0.02),
    # DeepSeek-V3 (its inference/configs/config_671B.json): MLA with 128 heads (query/key 128 + 64, value
    # 128; latents q 1536, kv 512: 187.1M weights a layer), 3 dense layers (18432), then 256 experts of 2048,
    # top-8 by sigmoid, 1 shared, in the top 4 of 8 groups, bias γ = 0.001 (paper §2.1.2, §4.2): 671.0B total,
    # 37.6B active; its MTP module (14B of the checkpoint's 685B) not counted.
    "deepseek-v3": LlamaConfig(dim=7168, n_layers=61, n_heads=128, n_kv_heads=128, vocab_size=129280,
                               multiple_of=1024, ffn_dim_multiplier=0.96, norm_eps=1e-6,
                               max_seq_len=4096, n_experts=256, top_k=8, n_shared_experts=1,
                               moe_hidden_dim=2048, gate="sigmoid", aux_loss_coef=1e-4,
                               bias_update_rate=1e-3, n_expert_groups=8, topk_groups=4,
                               first_dense_layers=3, q_lora_rank=1536, kv_lora_rank=512,
                               qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
}


def get_config(name: str, **overrides) -> LlamaConfig:
    if name not in CONFIGS:
        raise ValueError(f"unknown model {name!r}: choose one of {', '.join(CONFIGS)}")
    return replace(CONFIGS[name], **overrides)


def rope_frequencies(cfg: LlamaConfig) -> torch.Tensor:
    """θ_i = theta^(-2i/head_dim), i < head_dim/2 (float64), with LLaMA 3.1's scaling when set:
    wavelengths above original_ctx/low_freq_factor are divided by `factor`, those below
    original_ctx/high_freq_factor are kept, and the band between is interpolated smoothly."""
    freqs = cfg.rope_theta ** -(torch.arange(0, cfg.head_dim, 2, dtype=torch.float64) / cfg.head_dim)
    if cfg.rope_scaling is None:
        return freqs
    factor, low, high, ctx = cfg.rope_scaling
    wavelen = 2 * math.pi / freqs
    smooth = ((ctx / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    return (1 - smooth) * freqs / factor + smooth * freqs


def rope_cos_sin(cfg: LlamaConfig, positions: torch.Tensor, dtype: torch.dtype):
    """cos and sin of m·θ_i for each position m: shape [T, head_dim/2]."""
    angles = positions.to(torch.float64)[:, None] * rope_frequencies(cfg).to(positions.device)[None]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate each pair (x[2i], x[2i+1]) of x: [B, T, H, D] by the angle m·θ_i (Meta's layout)."""
    x0, x1 = x.unflatten(-1, (-1, 2)).unbind(-1)
    cos, sin = cos[:, None, :], sin[:, None, :]
    return torch.stack((x0 * cos - x1 * sin, x0 * sin + x1 * cos), dim=-1).flatten(-2)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        if not isinstance(dim, int):  # torch's nn.RMSNorm also takes a shape: it normalizes over all of it
            raise TypeError(f"RMSNorm(dim={dim!r}, eps): dim is the size of the last dimension, the one "
                            "normalized; for several, use torch.nn.RMSNorm(normalized_shape, eps)")
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float16:  # rsqrt(v)'s backward, v^(-3/2)/2, is ~1e5 > 65504 for v ~ 4e-4:
            y = x.float()             # fp16 normalizes in fp32 (Meta's LLaMA does for every dtype)
            return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """softmax(Q Kᵀ / sqrt(d) + causal mask) V on [B, H, T, d], each of the H_kv K/V heads of k, v
    [B, H_kv, T, d] repeated for its group of H / H_kv query heads."""
    group = q.shape[1] // k.shape[1]
    k, v = (x.transpose(1, 2).repeat_interleave(group, dim=2).transpose(1, 2) for x in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class Attention(nn.Module):
    """softmax(Q Kᵀ / sqrt(d) + causal mask) V, with RoPE on Q, K and each K/V head repeated for
    its group of query heads."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.head_dim = cfg.head_dim
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)
        # q [B, H, T, d], k/v [B, H_kv, T, d] after RoPE → [B, H, T, d]; context parallelism swaps it
        self.attend: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor] = causal_attention

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, -1, self.head_dim)
        k = self.wk(x).view(B, T, -1, self.head_dim)
        v = self.wv(x).view(B, T, -1, self.head_dim)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = self.attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    """SwiGLU: W2 (silu(W1 x) ⊙ W3 x)."""

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


def feed_forward(cfg: LlamaConfig, layer_id: int) -> nn.Module:
    """Layer `layer_id`'s SwiGLU: dense (FeedForward), or MoEFeedForward from first_dense_layers on."""
    if not cfg.is_moe_layer(layer_id):
        return FeedForward(cfg.dim, cfg.hidden_dim)
    from common.kernel.moe import (
        MoEFeedForward,  # only a MoE model needs common/kernel/moe.py (a dense copy: not)
    )

    shared = FeedForward(cfg.dim, cfg.expert_hidden_dim) if cfg.n_shared_experts else None
    return MoEFeedForward(cfg.dim, cfg.expert_hidden_dim, cfg.n_experts, cfg.top_k, cfg.gate,
                          cfg.aux_loss_coef, cfg.capacity_factor, shared, cfg.bias_update_rate,
                          cfg.n_expert_groups, cfg.topk_groups)


class TransformerBlock(nn.Module):
    """One layer; the unit that FSDP shards and that a pipeline stage holds a run of."""

    def __init__(self, cfg: LlamaConfig, layer_id: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = feed_forward(cfg, layer_id)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """tokens [B, T] → logits [B, T, vocab]; the output head is not tied to the embedding."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        if cfg.mla:
            raise ValueError("multi-head latent attention (kv_lora_rank > 0) is a shape for the planner "
                             "(parallel3d.planner) to price; this model builds grouped-query attention")
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(TransformerBlock(cfg, i) for i in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """`positions`: each token's place in the whole sequence, for RoPE (default 0 … T-1; a
        context-parallel rank passes the global positions of the tokens it holds)."""
        h = self.tok_embeddings(tokens)
        if positions is None:
            positions = torch.arange(tokens.shape[1], device=tokens.device)
        cos, sin = rope_cos_sin(self.cfg, positions, h.dtype)
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def init_std(name: str, n_layers: int) -> float | None:
    """The init of parameter `name`: None for norms (ones), else the std of its normal draw:
    0.02/sqrt(2·n_layers) for the projections into the residual stream (wo, w2, the experts' w2),
    0.02 otherwise (the router included)."""
    if name.endswith("norm.weight"):
        return None
    residual = name.endswith(("wo.weight", "w2.weight", "experts.w2"))
    return 0.02 / math.sqrt(2 * n_layers) if residual else 0.02


def init_parameter(name: str, shape: Sequence[int], seed: int, n_layers: int) -> torch.Tensor:
    """Parameter `name`'s initial values (its full-model name, e.g. "layers.3.attention.wq.weight"),
    float64 on CPU. Each parameter draws from its own generator, seeded by crc32("seed/name") (32
    bits: the CPU generator keeps only those): any rank can compute any parameter, or only the
    ones it holds, in any order, and get the same numbers. Ones for norms, N(0, init_std²) else."""
    std = init_std(name, n_layers)
    if std is None:
        return torch.ones(tuple(shape), dtype=torch.float64)
    gen = torch.Generator().manual_seed(zlib.crc32(f"{seed}/{name}".encode()))
    return torch.empty(tuple(shape), dtype=torch.float64).normal_(0.0, std, generator=gen)


def initializer(cfg: LlamaConfig, seed: int) -> Callable[[str], torch.Tensor]:
    """full-model name → that parameter's initial values (`init_parameter`, float64 on CPU); the
    shapes are read from a meta model, so nothing else is allocated."""
    with torch.device("meta"):
        shapes = {n: p.shape for n, p in Llama(cfg).named_parameters()}
    return lambda name: init_parameter(name, shapes[name], seed, cfg.n_layers)


def materialize(module: nn.Module, init: Callable[[str], torch.Tensor], device: torch.device | str,
                local: Callable[[str, torch.Tensor], torch.Tensor] = lambda name, full: full) -> None:
    """Give each meta parameter of `module` (a model, a pipeline stage, a tensor-parallel split
    of either) its initial values on `device`, in its own dtype, one parameter at a time: `init`
    draws the full tensor on CPU, `local(name, full)` keeps the part this rank holds (default:
    all of it), and only that part is copied to the device."""
    for prefix, sub in module.named_modules():
        for attr, p in list(sub._parameters.items()):
            if p is not None and p.is_meta:
                name = f"{prefix}.{attr}" if prefix else attr
                values = local(name, init(name)).to(device=device, dtype=p.dtype, copy=True)
                if values.shape != p.shape:
                    raise ValueError(f"{name}: the local piece has shape {tuple(values.shape)}, the "
                                     f"module expects {tuple(p.shape)}")
                sub._parameters[attr] = nn.Parameter(values, requires_grad=p.requires_grad)


def build_model(cfg: LlamaConfig, seed: int = 0, dtype: torch.dtype = torch.float32,
                device: torch.device | str = "cpu") -> Llama:
    """The model every strategy starts from, built on the meta device and materialized one
    parameter at a time on `device` (never a full float64 copy). On the meta device nothing is
    allocated: count the parameters of the real shapes, or split the model, then `materialize`
    only this rank's part."""
    with torch.device("meta"):
        model = Llama(cfg).to(dtype)
    if torch.device(device).type != "meta":
        materialize(model, initializer(cfg, seed), device)
    return model


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy over every position of the batch (computed in float32 or
    better, whatever the model's dtype)."""
    logits = logits.flatten(0, 1)
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    return F.cross_entropy(logits, targets.flatten())
