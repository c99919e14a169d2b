"""Per-GPU memory and communication of one layout (tp, cp, pp, dp, ZeRO level, micro-batch), in
closed form: the planner's arithmetic, and the formulas the 3D trainer prints beside its ledger.

Model states of the parameters ψ a GPU holds (its pipeline stage, TP-sharded):

    weights ψ·w / (dp if ZeRO-3)    grads ψ·g / (dp if ZeRO ≥ 2)    optimizer ψ·o / (dp if ZeRO ≥ 1)

with bytes per parameter (w, g, o) = (2, 2, 4) in chapter 01's 8-byte reinterpretation of the
source article's budget (fp16 weights, gradients and Adam m, v: 7B → 14 + 14 + 28 GB; the
article's own words are read in 01_data_parallel/README.md), (2, 2, 12) in the mixed-precision recipe of the
ZeRO paper (bf16 weights and grads, fp32 master + m + v), (4, 4, 8) in plain fp32, (2, 4, 8) in
DeepSeek-V3's (fp32 gradients and master, Adam's m and v in bf16).

Activations saved for backward per block are chapter 05's itemized count (tensor_parallel.formulas:
e·(10h + 4F) + 2e + 4·a bytes per token without TP; TP splits the attention and MLP tensors, SP
also the norms' inputs, products and outputs, which the column layers save as their local s/t
tokens: with SP all of it is /t, this LLaMA's counterpart of Korthikanti et al.'s 34·sbh/t);
full recomputation keeps only the block input h, selective (the core attention rerun) keeps q, k,
v before the GQA repeat and drops the log-sum-exp (and eager attention's scores). A pipeline stage
holds them for the micro-batches in flight (1F1B: p - i on stage i), the last stage the head's
too. The 3D trainer's measured ledger checks these per rank (`tests/test_3d_planner.py`).

Context parallelism (cp ranks share each sequence, s/cp tokens each; ring attention) divides every
one of those terms by cp: each is linear in the tokens a rank holds (flash attention keeps no
s×s scores). Eager attention's scores, a·s² per sequence, fall by cp too, not cp²: a local query
still meets all s keys, (s/cp)·s per head. (Chapter 05's ring saves q in float32 and K/V before
the GQA repeat, `cp_activation_bytes`: within 3% of a TP 8 block's count at these shapes, 8% at
TP 1.) The parameters are replicated over cp, so ZeRO/FSDP shard over dp·cp and the gradients
are reduced over dp·cp; ring attention's bytes are `ring_bytes`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cache

from common.kernel.model import LlamaConfig
from pipeline.schedules import SCHEDULES
from tensor_parallel.formulas import Shape, layer_activation_terms, model_activation_terms

GB = 1e9  # the article's (and vendors') gigabyte
PRECISIONS: dict[str, tuple[int, int, int]] = {  # bytes per parameter: weights, grads, optimizer
    "article": (2, 2, 4),
    "mixed": (2, 2, 12),
    "fp32": (4, 4, 8),
    "bf16-moments": (2, 4, 8),  # DeepSeek-V3: fp32 grads and master, Adam's m, v in bf16
}
ACT_BYTES = {"article": 2, "mixed": 2, "fp32": 4, "bf16-moments": 2}


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
    cp: int = 1                 # context parallel: ranks sharing each sequence (mesh tp, cp, dp, pp)
    ep: int = 1                 # expert parallel: of the dp·cp ranks, how many split the experts
    schedule: str = "1f1b"      # the pipeline's: 1f1b (interleaved when v > 1) | dualpipe (planner)

    @property
    def gpus(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def shards(self) -> int:
        """Ranks holding the same parameters, over which ZeRO/FSDP shard and gradients reduce."""
        return self.dp * self.cp

    def describe(self) -> str:
        zero = "FSDP" if self.zero == 3 else (f"ZeRO-{self.zero}" if self.zero else "DDP")
        zero += f", EP {self.ep}" if self.ep > 1 else ""
        v = f" v{self.virtual_stages}" if self.virtual_stages > 1 else ""
        v += " DualPipe" if self.schedule == "dualpipe" else ""
        cp = f" × CP {self.cp}" if self.cp > 1 else ""
        return f"TP {self.tp}{cp} × PP {self.pp}{v} × DP {self.dp} ({zero}), " \
               f"mb {self.micro_batch}, AC {self.recompute}"


def attention_parameters(cfg: LlamaConfig) -> tuple[int, int]:
    """(TP-split, replicated) parameters of one block's attention. GQA: wq wk wv wo, all split
    by heads. MLA (cfg.mla): the up-projections W_qb [H·d_qk, q_lora], W_kvb [H·(d_nope + d_v),
    kv_lora] and wo [h, H·d_v] split by heads; the down-projections W_qa [q_lora, h], W_kva
    [kv_lora + d_rope, h] and the latents' two norms replicated (DeepSeek-V3: 187.1M a layer)."""
    h, H = cfg.dim, cfg.n_heads
    if not cfg.mla:
        return h * (2 * h + 2 * cfg.n_kv_heads * cfg.head_dim), 0
    q_in = cfg.q_lora_rank or h
    split = (q_in * H * cfg.qk_head_dim + cfg.kv_lora_rank * H * (cfg.qk_nope_head_dim + cfg.v_head_dim)
             + H * cfg.v_head_dim * h)
    down = (h * cfg.q_lora_rank + cfg.q_lora_rank if cfg.q_lora_rank else 0) + (
        h * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank)
    return split, down


def layer_parameters(cfg: LlamaConfig) -> tuple[int, int]:
    """(TP-split, replicated) parameters of one block: the attention's (`attention_parameters`)
    and w1 w2 w3 | two RMSNorms."""
    split, replicated = attention_parameters(cfg)
    return split + 3 * cfg.dim * cfg.hidden_dim, replicated + 2 * cfg.dim


def attention_flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """The attention scores' model FLOPs per token, forward and backward: QKᵀ and softmax·V are
    2·H·d_qk·s and 2·H·d_v·s forward, ×3 with backward, every key counted (Megatron's and
    PaLM's convention, no causal halving): 6·L·H·(d_qk + d_v)·s = 12·L·h·s for MHA/GQA."""
    return 6 * cfg.n_layers * cfg.n_heads * (cfg.qk_head_dim + cfg.value_head_dim) * seq_len


def stage_layers(n_layers: int, pp: int) -> list[int]:
    """Blocks per pipeline stage, as even as possible (earlier stages take the remainder)."""
    base, extra = divmod(n_layers, pp)
    return [base + (i < extra) for i in range(pp)]


@cache
def stage_units(cfg: LlamaConfig, tp: int, pp: int) -> tuple[tuple[int, ...], ...]:
    """Per stage, the parameters one TP rank holds in each FSDP unit: one per block, then the root
    (the embedding on the first stage, the final norm + output on the last; the vocabulary padded
    to a multiple of t, RMSNorm weights whole on every TP rank)."""
    split, replicated = layer_parameters(cfg)
    vocab = math.ceil(cfg.vocab_size / tp) * cfg.dim
    units = []
    for i, n in enumerate(stage_layers(cfg.n_layers, pp)):
        root = (vocab if i == 0 else 0) + (vocab + cfg.dim if i == pp - 1 else 0)
        units.append((split // tp + replicated,) * n + ((root,) if root else ()))
    return tuple(units)


@cache
def parameters_per_gpu(cfg: LlamaConfig, tp: int, pp: int) -> int:
    """ψ: parameters on the GPU of the heaviest stage."""
    return max(sum(u) for u in stage_units(cfg, tp, pp))


def total_parameters(cfg: LlamaConfig) -> int:
    split, replicated = layer_parameters(cfg)
    return cfg.n_layers * (split + replicated) + 2 * cfg.vocab_size * cfg.dim + cfg.dim


def state_bytes(units: tuple[int, ...], dp: int, zero: int, precision: str) -> dict[str, float]:
    """Weights, gradients and optimizer state of a GPU holding `units` (parameters per flat
    tensor) under ZeRO stage `zero` over dp: a sharded unit keeps ⌈P_u/dp⌉ (the flat tensor
    padded to a multiple of dp); plus Adam's step count, one float32 per flat tensor."""
    w, g, o = PRECISIONS[precision]
    whole, sharded = sum(units), sum(-(-u // dp) for u in units)
    return {"weights": w * (sharded if zero >= 3 else whole),
            "grads": g * (sharded if zero >= 2 else whole),
            "optimizer": o * (sharded if zero >= 1 else whole) + 4 * len(units)}


# What the core attention saves beyond its output (chapter 05's names): selective recomputation
# keeps its inputs q, k, v instead (k, v before the GQA repeat) and reruns it.
CORE_ATTENTION_TERMS = ("q, k, v after RoPE + GQA repeat", "attention log-sum-exp")
HEAD_TERMS = ("final norm x, x·r, r", "head input (the final norm's output)",
              "loss: softmax over the local vocab, target ids, in-range mask")


def tp_shape(cfg: LlamaConfig, tokens: int, seq_len: int, tp: int, sequence_parallel: bool,
             elem: int) -> Shape:
    """Chapter 05's formula input for `tokens` = b·seq_len tokens on one TP rank."""
    if tokens % seq_len:
        raise ValueError(f"{tokens} tokens are not whole sequences of {seq_len}")
    return Shape(b=tokens // seq_len, s=seq_len, h=cfg.dim, a=cfg.n_heads, kv=cfg.n_kv_heads,
                 F=cfg.hidden_dim, L=cfg.n_layers, V=cfg.vocab_size, head_dim=cfg.head_dim, t=tp,
                 sequence_parallel=sequence_parallel, e=elem)


@cache
def layer_activation_bytes(cfg: LlamaConfig, tokens: int, seq_len: int, tp: int = 1,
                           sequence_parallel: bool = False, recompute: str = "none",
                           elem: int = 2, eager_attention: bool = False, cp: int = 1) -> float:
    """Bytes one block saves for backward for `tokens` tokens on one TP rank (sequences of
    `seq_len`, s/cp of each on this rank): chapter 05's itemized count
    (`tensor_parallel.formulas`); under selective recomputation the core attention keeps only
    its inputs q (h/t) and k, v (n_kv/t heads each, at least one) per token; only the block
    input (h/t under SP) under full; eager attention adds the scores and the softmax, 2·a·s·e/t
    per token (every local query meets all s keys), which selective drops. MLA (cfg.mla): q, k
    of H·d_qk and v, the output of H·d_v per token (/t), and the two latents as RMSNorm saves
    them (input, x·r, r) with their normed copy that the up-projection reads, on the tokens of
    the norm region (s/t under SP: the down-projections run before the gather, as Megatron's)."""
    if recompute == "full":
        return tokens * elem * cfg.dim / (tp if sequence_parallel else 1)
    terms = layer_activation_terms(tp_shape(cfg, tokens, seq_len // cp, tp, sequence_parallel,
                                            elem))
    if cfg.mla:
        local = tokens * elem / (tp if sequence_parallel else 1)
        terms |= {"q, k, v after RoPE + GQA repeat":
                  tokens * elem * cfg.n_heads * (2 * cfg.qk_head_dim + cfg.v_head_dim) / tp,
                  "attention output": tokens * elem * cfg.n_heads * cfg.v_head_dim / tp,
                  "MLA latents c_q, c_kv: input, x·r, r, normed": local * (
                      3 * (cfg.q_lora_rank + cfg.kv_lora_rank) + (2 if cfg.q_lora_rank else 1))}
    if recompute == "selective":
        kv_heads = cfg.n_heads // tp if cfg.mla else max(cfg.n_kv_heads // tp, 1)
        inputs = tokens * elem * (cfg.n_heads // tp * cfg.qk_head_dim
                                  + kv_heads * (cfg.qk_head_dim + cfg.value_head_dim))
        return sum(v for k, v in terms.items() if k not in CORE_ATTENTION_TERMS) + inputs
    scores = tokens * 2 * cfg.n_heads * seq_len / tp * elem if eager_attention else 0.0
    return sum(terms.values()) + scores


@cache
def head_activation_bytes(cfg: LlamaConfig, tokens: int, seq_len: int, tp: int = 1,
                          sequence_parallel: bool = False, elem: int = 2, cp: int = 1) -> float:
    """The last stage's final norm, head input and log-softmax over the local vocabulary
    (float32 or wider), chapter 05's terms: ≈ tokens·(3h·e + 4·V/t)."""
    terms = model_activation_terms(tp_shape(cfg, tokens, seq_len // cp, tp, sequence_parallel,
                                            elem))
    return sum(terms[k] for k in HEAD_TERMS)


def in_flight_microbatches(pp: int, microbatches: int, virtual_stages: int = 1,
                           schedule: str = "1f1b", stage: int = 0) -> float:
    """Micro-batches whose activations pipeline rank `stage` holds at once: chapter 06's count
    for the schedule (its SCHEDULES entry: m under GPipe, min(m, p - i) under 1F1B, Megatron's
    warm-up count in chunks of 1/v of the stage under interleaving, …); "1f1b" with v > 1 is the
    interleaved schedule. Without a pipeline, one micro-batch at a time."""
    if pp == 1:
        return 1
    name = "interleaved" if schedule == "1f1b" and virtual_stages > 1 else schedule
    if name not in SCHEDULES:
        raise ValueError(f"schedule {schedule!r}: chapter 06 knows {', '.join(SCHEDULES)}")
    return float(SCHEDULES[name].in_flight(pp, microbatches, virtual_stages, stage))


def local_tokens(layout: Layout, seq_len: int) -> int:
    """Tokens of one micro-batch on one rank: mb sequences, s/cp tokens of each."""
    if seq_len % layout.cp:
        raise ValueError(f"seq_len {seq_len} does not split over cp {layout.cp}")
    return layout.micro_batch * seq_len // layout.cp


def activation_bytes(cfg: LlamaConfig, layout: Layout, seq_len: int, microbatches: int,
                     elem: int = 2, eager_attention: bool = False, stage: int = 0) -> float:
    """Peak saved activations (what a saved-tensor ledger sees) on the GPU of pipeline stage
    `stage`: its blocks × the micro-batches it holds, the last stage's head for each of those."""
    tokens = local_tokens(layout, seq_len)
    per_layer = layer_activation_bytes(cfg, tokens, seq_len, layout.tp, layout.sequence_parallel,
                                       layout.recompute, elem, eager_attention, layout.cp)
    one = stage_layers(cfg.n_layers, layout.pp)[stage] * per_layer
    if stage == layout.pp - 1:
        one += head_activation_bytes(cfg, tokens, seq_len, layout.tp, layout.sequence_parallel,
                                     elem, layout.cp)
    return one * in_flight_microbatches(layout.pp, microbatches, layout.virtual_stages, layout.schedule,
                                        stage)


def recompute_transient_bytes(cfg: LlamaConfig, layout: Layout, seq_len: int, elem: int = 2,
                              eager_attention: bool = False) -> float:
    """One block's full activations while backward recomputes it (checkpoint keeps them in its
    own frame: a saved-tensor ledger does not see them), zero without recomputation."""
    if layout.recompute == "none":
        return 0.0
    return layer_activation_bytes(cfg, local_tokens(layout, seq_len), seq_len, layout.tp,
                                  layout.sequence_parallel, "none", elem, eager_attention, layout.cp)


def memory_per_gpu(cfg: LlamaConfig, layout: Layout, seq_len: int, microbatches: int,
                   precision: str = "mixed", eager_attention: bool = False,
                   stage: int | None = None) -> dict[str, float]:
    """{weights, grads, optimizer, activations, total} bytes on the GPU of pipeline stage `stage`
    (None: the busiest one, the first or the last; a middle stage holds no more than the first).
    Under ZeRO-3 the weights include two gathered blocks (the one computing and the one
    prefetched); activations include a recomputed block's transient."""
    if stage is None:
        stages = {0, layout.pp - 1}
        return max((memory_per_gpu(cfg, layout, seq_len, microbatches, precision, eager_attention, i)
                    for i in stages), key=lambda mem: mem["total"])
    units = stage_units(cfg, layout.tp, layout.pp)[stage]
    out = state_bytes(units, layout.shards, layout.zero, precision)
    if layout.zero >= 3 and layout.shards > 1:
        split, replicated = layer_parameters(cfg)
        out["weights"] += 2 * (split / layout.tp + replicated) * PRECISIONS[precision][0]
    elem = ACT_BYTES[precision]
    out["activations"] = (activation_bytes(cfg, layout, seq_len, microbatches, elem,
                                           eager_attention, stage)
                          + recompute_transient_bytes(cfg, layout, seq_len, elem, eager_attention))
    out["total"] = sum(out.values())
    return out


# Forward collectives a recomputed block runs again: (all-gathers or f's, reduce-scatters or g's).
# Non-reentrant torch.utils.checkpoint stops recomputing once every saved tensor is back, so the
# block's last row-parallel reduction (its output, the block's, is not saved) is not rerun: full
# recomputation adds 1 all-reduce (a g; f is the identity forward), or under SP 2 all-gathers and
# 1 reduce-scatter; selective reruns only the core attention, between the collectives.
RECOMPUTED = {"none": (0, 0), "selective": (0, 0), "full": (2, 1)}

def ring_bytes(cfg: LlamaConfig, layout: Layout, seq_len: int, elem: int) -> dict[str, float]:
    """Bytes one CP rank sends per block and micro-batch in each pass of ring attention (chapter
    05's `cp_comm_bytes`): cp - 1 K/V blocks of 2·mb·(kv/t)·(s/cp)·head_dim elements (GQA's
    smaller K/V) forward; backward the K/V again and the dK/dV accumulators home, in float32 or
    wider; recomputation (full or selective: both rerun attention) one more forward pass."""
    if layout.cp == 1:
        return {"forward": 0.0, "backward": 0.0, "recompute": 0.0}
    block = 2 * local_tokens(layout, seq_len) * cfg.n_kv_heads / layout.tp * cfg.head_dim
    forward = (layout.cp - 1) * block * elem
    return {"forward": forward, "backward": forward + (layout.cp - 1) * block * max(elem, 4),
            "recompute": forward if layout.recompute != "none" else 0.0}


def comm_bytes_per_gpu(cfg: LlamaConfig, layout: Layout, seq_len: int,
                       microbatches: int, precision: str = "mixed") -> dict[str, float]:
    """Bytes one GPU puts on the wire per optimizer step (nccl-tests conventions), per dimension.

    TP: 4 all-reduces (or all-gather + reduce-scatter pairs under SP: the same bytes) of the
        [b, s/cp, h] activations per block per micro-batch, 2(t-1)/t each; under SP + the 2
        all-gathers in backward that rebuild the column layers' saved s/t tokens ("tp_regather",
        included in "tp"); full recompute reruns `RECOMPUTED`: +1 all-reduce (SP: +2
        all-gathers + 1 reduce-scatter, (t-1)/t each).
    CP: ring attention's K/V blocks and dK/dV home, `ring_bytes` per block per micro-batch.
    PP: one activation forward and one gradient backward per micro-batch (interior stages).
    DP: all-reduce of the gradients 2(d-1)/d·ψ·g (DDP), or reduce-scatter of the gradients and
        all-gather of the updated weights. Sharded gradients (ZeRO-2, ZeRO-3) cannot accumulate
        over the m micro-batches of a step, so each micro-batch reduce-scatters its own (DeepSpeed
        refuses ZeRO-2 under a pipeline for this; Megatron's distributed optimizer is ZeRO-1):
        ZeRO-1 (g + w), ZeRO-2 (m·g + w), ZeRO-3 m·(2w + g) (a gather in forward and in backward
        of every micro-batch), each × (d-1)/d·ψ, with d = dp·cp (CP ranks hold the same
        parameters)."""
    w, g, _ = PRECISIONS[precision]
    elem = ACT_BYTES[precision]
    t, p, d, m = layout.tp, layout.pp, layout.shards, microbatches
    act = local_tokens(layout, seq_len) * cfg.dim * elem
    layers = math.ceil(cfg.n_layers / p)
    gathers, reductions = RECOMPUTED[layout.recompute]
    rerun = gathers + reductions if layout.sequence_parallel else 2 * reductions
    regather = 2 if layout.sequence_parallel else 0
    tp_bytes = (8 + regather + rerun) * layers * m * act * (t - 1) / t if t > 1 else 0.0
    cp_bytes = layers * m * sum(ring_bytes(cfg, layout, seq_len, elem).values())
    pp_bytes = 2 * m * act if p > 1 else 0.0
    psi = parameters_per_gpu(cfg, t, p)
    ring = (d - 1) / d if d > 1 else 0.0
    per_element = {0: 2 * g, 1: g + w, 2: m * g + w, 3: m * (2 * w + g)}[layout.zero]
    dp_bytes = per_element * ring * psi
    return {"tp": tp_bytes, "cp": cp_bytes, "pp": pp_bytes, "dp": dp_bytes,
            "tp_regather": tp_bytes * regather / (8 + regather + rerun)}
