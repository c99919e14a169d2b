"""Per-GPU memory and communication of one 3D layout (tp, pp, dp, ZeRO level, micro-batch), in
closed form: the planner's arithmetic, and the formulas the 3D trainer prints beside its ledger.

Model states of the parameters ψ a GPU holds (its heaviest pipeline stage, TP-sharded):

    weights ψ·w / (dp if ZeRO-3)    grads ψ·g / (dp if ZeRO ≥ 2)    optimizer ψ·o / (dp if ZeRO ≥ 1)

with bytes per parameter (w, g, o) = (2, 2, 4) in the source article's arithmetic (fp16 weights,
gradients and Adam m, v: 7B → 14 + 14 + 28 GB), (2, 2, 12) in the mixed-precision recipe of the
ZeRO paper (bf16 weights and grads, fp32 master + m + v), (4, 4, 8) in plain fp32.

Activations saved for backward by common.model's LLaMA, per layer and token (measured on the
ledger, `tests/test_3d_planner.py`): e·(10h + 4F) + 4·a bytes (e = bytes per element, h = dim,
F = FFN width, a = heads: the fp32 log-sum-exp of SDPA); eager attention also keeps the scores and
the softmax, 2·a·s·e. Under TP the 4h + 4F inside attention and MLP are split t ways while the 6h
of the two RMSNorms stay whole; sequence parallelism splits their inputs and products (4h/t) but
the column layers keep the all-gathered norm outputs (2h; Megatron re-gathers them in backward to
reach 34/t in GPT). Full recomputation keeps only the block input h; selective (the attention
sub-layer) drops its 4h.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from common.model import LlamaConfig

GB = 1e9  # the article's (and vendors') gigabyte
PRECISIONS: dict[str, tuple[int, int, int]] = {  # bytes per parameter: weights, grads, optimizer
    "article": (2, 2, 4),
    "mixed": (2, 2, 12),
    "fp32": (4, 4, 8),
}
ACT_BYTES = {"article": 2, "mixed": 2, "fp32": 4}


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero: int = 0               # 0: DDP, 1/2: ZeRO-1/2, 3: ZeRO-3 = FSDP FULL_SHARD
    micro_batch: int = 1        # sequences per micro-batch per GPU
    virtual_stages: int = 1     # interleaved 1F1B when > 1
    recompute: str = "none"     # none | selective | full
    sequence_parallel: bool = True

    @property
    def gpus(self) -> int:
        return self.tp * self.pp * self.dp

    def describe(self) -> str:
        zero = "FSDP" if self.zero == 3 else (f"ZeRO-{self.zero}" if self.zero else "DDP")
        v = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        return f"TP {self.tp} × PP {self.pp}{v} × DP {self.dp} ({zero}), mb {self.micro_batch}, " \
               f"AC {self.recompute}"


def layer_parameters(cfg: LlamaConfig) -> tuple[int, int]:
    """(TP-split, replicated) parameters of one block: wq wk wv wo w1 w2 w3 | two RMSNorms."""
    kv = cfg.n_kv_heads * cfg.head_dim
    split = cfg.dim * (2 * cfg.dim + 2 * kv) + 3 * cfg.dim * cfg.hidden_dim
    return split, 2 * cfg.dim


def stage_layers(n_layers: int, pp: int) -> list[int]:
    """Blocks per pipeline stage, as even as possible (earlier stages take the remainder)."""
    base, extra = divmod(n_layers, pp)
    return [base + (i < extra) for i in range(pp)]


def parameters_per_gpu(cfg: LlamaConfig, tp: int, pp: int) -> int:
    """ψ: parameters on the GPU of the heaviest stage (embedding on the first, norm + output on
    the last; the vocabulary is split t ways, RMSNorm weights are whole on every TP rank)."""
    split, replicated = layer_parameters(cfg)
    vocab = math.ceil(cfg.vocab_size / tp) * cfg.dim
    per_stage = []
    for i, n in enumerate(stage_layers(cfg.n_layers, pp)):
        p = n * (split // tp + replicated)
        p += vocab if i == 0 else 0
        p += vocab + cfg.dim if i == pp - 1 else 0
        per_stage.append(p)
    return max(per_stage)


def total_parameters(cfg: LlamaConfig) -> int:
    split, replicated = layer_parameters(cfg)
    return cfg.n_layers * (split + replicated) + 2 * cfg.vocab_size * cfg.dim + cfg.dim


def state_bytes(psi: int, dp: int, zero: int, precision: str) -> dict[str, float]:
    """Weights, gradients and optimizer state for ψ parameters under ZeRO stage `zero` over dp."""
    w, g, o = PRECISIONS[precision]
    return {"weights": psi * w / (dp if zero >= 3 else 1),
            "grads": psi * g / (dp if zero >= 2 else 1),
            "optimizer": psi * o / (dp if zero >= 1 else 1)}


def layer_activation_bytes(cfg: LlamaConfig, tokens: int, seq_len: int, tp: int = 1,
                           sequence_parallel: bool = False, recompute: str = "none",
                           elem: int = 2, eager_attention: bool = False) -> float:
    """Bytes one block saves for backward for `tokens` tokens on one TP rank (see module doc)."""
    h, F, a = cfg.dim, cfg.hidden_dim, cfg.n_heads
    # two RMSNorms: x, x·r, y each; under SP x and x·r are s/t tokens, the all-gathered y whole
    whole = (4 * h / tp + 2 * h) if sequence_parallel else 6 * h
    inner = (4 * h + 4 * F) / tp                              # q k v out | w1x w3x silu product
    lse = 4 * a / tp / elem + 2 / (tp if sequence_parallel else 1)  # fp32 lse, the norms' r
    scores = 2 * a * seq_len / tp if eager_attention else 0.0
    if recompute == "full":
        return tokens * elem * h / (tp if sequence_parallel else 1)
    if recompute == "selective":
        inner, scores, lse = 4 * F / tp, 0.0, 2 / (tp if sequence_parallel else 1)
    return tokens * elem * (whole + inner + lse + scores)


def head_activation_bytes(cfg: LlamaConfig, tokens: int, tp: int = 1, elem: int = 2) -> float:
    """The last stage's norm (3h·e) and the log-softmax of the logits (V/t, float32 or wider),
    per token."""
    return tokens * (3 * cfg.dim * elem + max(4, elem) * cfg.vocab_size / tp)


def in_flight_microbatches(pp: int, microbatches: int, virtual_stages: int = 1,
                           schedule: str = "1f1b") -> float:
    """Micro-batches whose activations the first stage holds at once: m (GPipe), min(m, p)
    (1F1B), p·(1 + (p-1)/(p·v)) (interleaved, Megatron's count)."""
    if schedule == "gpipe" or pp == 1:
        return microbatches if pp > 1 else 1
    if virtual_stages > 1:
        return min(microbatches * virtual_stages, pp * virtual_stages + pp - 1) / virtual_stages
    return min(microbatches, pp)


def activation_bytes(cfg: LlamaConfig, layout: Layout, seq_len: int, microbatches: int,
                     elem: int = 2, eager_attention: bool = False) -> float:
    """Peak saved activations on the first stage's GPU (it holds the most micro-batches)."""
    tokens = layout.micro_batch * seq_len
    layers = math.ceil(cfg.n_layers / layout.pp)
    per_layer = layer_activation_bytes(cfg, tokens, seq_len, layout.tp, layout.sequence_parallel,
                                       layout.recompute, elem, eager_attention)
    held = layers * per_layer * in_flight_microbatches(layout.pp, microbatches, layout.virtual_stages)
    if layout.recompute != "none":  # one block's activations while it is recomputed (the
        # ledger's saved-tensor hooks do not see these: checkpoint keeps them in its own frame)
        held += layer_activation_bytes(cfg, tokens, seq_len, layout.tp, layout.sequence_parallel,
                                       "none", elem, eager_attention)
    if layout.pp == 1:
        held += head_activation_bytes(cfg, tokens, layout.tp, elem)
    return held


def memory_per_gpu(cfg: LlamaConfig, layout: Layout, seq_len: int, microbatches: int,
                   precision: str = "mixed", eager_attention: bool = False) -> dict[str, float]:
    """{weights, grads, optimizer, activations, total} bytes on the busiest GPU. Under ZeRO-3 the
    weights include two gathered blocks (the one computing and the one prefetched)."""
    psi = parameters_per_gpu(cfg, layout.tp, layout.pp)
    out = state_bytes(psi, layout.dp, layout.zero, precision)
    if layout.zero >= 3 and layout.dp > 1:
        split, replicated = layer_parameters(cfg)
        out["weights"] += 2 * (split / layout.tp + replicated) * PRECISIONS[precision][0]
    out["activations"] = activation_bytes(cfg, layout, seq_len, microbatches, ACT_BYTES[precision],
                                          eager_attention)
    out["total"] = sum(out.values())
    return out


def comm_bytes_per_gpu(cfg: LlamaConfig, layout: Layout, seq_len: int,
                       microbatches: int, precision: str = "mixed") -> dict[str, float]:
    """Bytes one GPU puts on the wire per optimizer step (nccl-tests conventions), per dimension.

    TP: 4 all-reduces (or all-gather + reduce-scatter pairs under SP: the same bytes) of the
        [b, s, h] activations per block per micro-batch, 2(t-1)/t each; full recompute adds 2.
    PP: one activation forward and one gradient backward per micro-batch (interior stages).
    DP: all-reduce of the gradients 2(d-1)/d·ψ·g (ZeRO-1/2: reduce-scatter of the gradients and
        all-gather of the updated weights, (d-1)/d·ψ·(g + w));
        ZeRO-3 gathers the weights in forward and in backward of every micro-batch and
        reduce-scatters the gradients once: (2m + 1)·(d-1)/d·ψ·w."""
    w, g, _ = PRECISIONS[precision]
    elem = ACT_BYTES[precision]
    t, p, d, m = layout.tp, layout.pp, layout.dp, microbatches
    act = layout.micro_batch * seq_len * cfg.dim * elem
    layers = math.ceil(cfg.n_layers / p)
    collectives = 4 + (2 if layout.recompute == "full" else 0)
    tp_bytes = collectives * layers * m * act * 2 * (t - 1) / t if t > 1 else 0.0
    pp_bytes = 2 * m * act if p > 1 else 0.0
    psi = parameters_per_gpu(cfg, t, p)
    ring = (d - 1) / d if d > 1 else 0.0
    if layout.zero >= 3:
        dp_bytes = (2 * m * w + g) * ring * psi
    elif layout.zero:
        dp_bytes = (g + w) * ring * psi
    else:
        dp_bytes = 2 * ring * psi * g
    return {"tp": tp_bytes, "pp": pp_bytes, "dp": dp_bytes}
