"""Closed forms for this LLaMA under tensor parallelism: the activations autograd saves per rank
(in the style of Korthikanti et al. 2022, §4) and the bytes each block communicates.

Activations per transformer block, per rank (b sequences of s tokens, width h, a query heads, FFN
width F, t ranks, e bytes per element), itemized from what autograd saves; under SP each term
marked (sp) holds this rank's s/t tokens instead of all s:

    RMSNorm (×2)  its input x, x·r (both b·s·h, sp), r = rsqrt(mean x² + ε) (b·s, sp)
    Q, K, V       the norm's output y (b·s·h; one storage read by wq, wk, wv), sp: the column
                  layers save y's local s/t tokens and all-gather them again in backward
    attention     q, k, v after RoPE and the GQA repeat (3·b·s·h/t), its output (b·s·h/t),
                  the log-sum-exp (b·(a/t)·s, float32 or better): the flash kernel keeps no s×s
    FFN           y (b·s·h, sp, as for Q, K, V); w1 x, w3 x, silu(w1 x), their product (4·b·s·F/t)
    (RoPE saves only its cos/sin tables, once for all blocks: a model-level term.)

    no SP:  s·b·h·e · (6 + 4/t + 4F/(h·t))  + s·b·(2e + (a/t)·max(e, 4))
    SP:     s·b·h·e · (10 + 4F/h) / t        + s·b·(2e + a·max(e, 4)) / t

Korthikanti et al. count s·b·h·(34 + 5as/h)/t bytes per GPT layer with SP (e = 2). Term by term,
theirs → ours (bytes, e = 2; everything /t under SP):

    LayerNorm inputs 4sbh              → RMSNorm inputs and x·r 8sbh (+ r: 4sb)
    QKV input 2sbh, Q and K 4sbh, V 2sbh → the same (q, k after RoPE; GQA's K/V repeated to a heads)
    softmax 2as²b + dropout mask as²b + dropout output 2as²b → log-sum-exp 4asb (flash)
    attention-output projection input 2sbh; its dropout mask sbh → 2sbh; no dropout
    MLP input 2sbh; GeLU input and output 8sbh + 8sbh; dropout mask sbh
                                       → 2sbh; w1 x, w3 x, silu, product 8sbF; no dropout
    total  sbh(34 + 5as/h)/t           → sbh(20 + 8F/h)/t + sb(4 + 4a)/t

With LLaMA's F ≈ 8h/3 that is ≈ 41.3·sbh/t: SwiGLU's four F-wide tensors (21.3) outweigh GPT's
two 4h-wide ones (16) and the unfused RMSNorm saves x·r beside x; the s×s terms are gone.
Before the column layers saved the local slice they saved the gathered norm outputs, 2·sbh·e per
block whatever t (at t = 8 about twice Megatron's activations); `tests/test_tensor_parallel.py`
holds the ledger to this count to the byte.

Communication per block per micro-batch (wire bytes per rank, nccl-tests convention):

    no SP: 2 all-reduces forward (g after wo, w2) + 2 backward (f before QKV, w1/w3) of b·s·h·e
           → 4 · 2(t-1)/t · b·s·h·e
    SP:    forward 2 all-gathers + 2 reduce-scatters; backward the same, plus the column layers'
           2 all-gathers of their saved s/t tokens → (6 + 4) · (t-1)/t · b·s·h·e (1.25× no SP;
           the gathers in backward overlap the dx GEMMs on a GPU), plus the norms' weight
           gradients: 2 all-reduces of h·e backward
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial


@dataclass(frozen=True)
class Shape:
    """What the formulas need: micro-batch b, sequence s, width h, query heads a, kv heads, FFN
    width F, layers L, vocab V, head_dim, t, sequence_parallel, e (compute bytes per element)."""

    b: int
    s: int
    h: int
    a: int
    kv: int
    F: int
    L: int
    V: int
    head_dim: int
    t: int
    sequence_parallel: bool
    e: int


def layer_activation_terms(x: Shape) -> dict[str, float]:
    """Bytes saved for backward by one block on one rank, by term."""
    b, s, h, t, e = x.b, x.s, x.h, x.t, x.e
    bsh = b * s * h * e
    local = 1 / t if x.sequence_parallel else 1  # the fraction of the tokens a norm region holds
    return {
        "norm inputs x, h (2)": 2 * bsh * local,
        "norm products x·r (2)": 2 * bsh * local,
        "norm rsqrt r (2)": 2 * b * s * e * local,
        "norm outputs, read by the column layers (2)": 2 * bsh * local,
        "q, k, v after RoPE + GQA repeat": 3 * bsh / t,
        "attention output": bsh / t,
        "attention log-sum-exp": b * (x.a // t) * s * max(e, 4),
        "w1 x, w3 x, silu(w1 x), product": 4 * b * s * x.F * e / t,
    }


def layer_activation_bytes(x: Shape) -> float:
    return sum(layer_activation_terms(x).values())


def model_activation_terms(x: Shape) -> dict[str, float]:
    """Bytes saved by the whole model for one micro-batch (the ledger's peak: backward only
    frees): L blocks plus the embedding, RoPE tables, final norm, head and vocab-parallel loss."""
    b, s, h, t, e = x.b, x.s, x.h, x.t, x.e
    local = 1 / t if x.sequence_parallel else 1
    rows = -(-x.V // t)  # the vocab per rank, padded
    return {
        "blocks": x.L * layer_activation_bytes(x),
        "embedding ids (int64) + out-of-range mask (bool)": b * s * (8 + 1),
        "RoPE cos, sin": s * x.head_dim * e,
        "final norm x, x·r, r": (2 * b * s * h + b * s) * e * local,
        "head input (the final norm's output)": b * s * h * e * local,
        "loss: softmax over the local vocab, target ids, in-range mask": b * s * (rows * max(e, 4) + 8 + 1),
    }


def model_activation_bytes(x: Shape) -> float:
    return sum(model_activation_terms(x).values())


def block_comm_terms(x: Shape) -> dict[str, tuple[str, float]]:
    """One block's forward + backward (one micro-batch): {purpose: (collective, wire bytes per
    rank)}, the collective by the meter's name."""
    t, bshe = x.t, x.b * x.s * x.h * x.e
    if t == 1:
        return {}
    one = (t - 1) / t * bshe
    if x.sequence_parallel:
        return {"forward: all-gathers before QKV, w1/w3": ("all_gather", 2 * one),
                "forward: reduce-scatters after wo, w2": ("reduce_scatter", 2 * one),
                "backward: their reduce-scatters": ("reduce_scatter", 2 * one),
                "backward: their all-gathers": ("all_gather", 2 * one),
                "backward: re-gathers of the saved s/t tokens": ("all_gather", 2 * one),
                "backward: the norms' weight gradients": ("all_reduce", 2 * 2 * (t - 1) / t * x.h * x.e)}
    return {"forward: g after wo, w2": ("all_reduce", 2 * 2 * one),
            "backward: f before QKV, w1/w3": ("all_reduce", 2 * 2 * one)}


def block_comm_bytes(x: Shape) -> dict[str, float]:
    """`block_comm_terms` summed by collective."""
    out: dict[str, float] = {}
    for op, value in block_comm_terms(x).values():
        out[op] = out.get(op, 0.0) + value
    return out


def local_parameter_count(x: Shape) -> tuple[int, int]:
    """(elements, tensors) of one rank's parameters: the vocab padded to a multiple of t, K/V
    heads split (n_kv/t each) or one replicated head per rank when n_kv < t, norms replicated."""
    rows, t, h = -(-x.V // x.t), x.t, x.h
    kv_local = x.kv // t if x.kv >= t else 1
    block = 2 * h * h // t + 2 * kv_local * x.head_dim * h + 3 * x.F // t * h + 2 * h
    return 2 * rows * h + x.L * block + h, 3 + 9 * x.L


def microbatch_comm_bytes(x: Shape, embedding: bool = True, head: bool = True) -> float:
    """Wire bytes per rank of one micro-batch's forward + backward through x.L blocks (with the
    replicated K/V heads' gradient sums), the embedding's boundary if held (g, or SP's
    reduce-scatter + all-gather: the same bytes) and the head's (f, or SP's all-gather +
    reduce-scatter + the re-gather of its saved s/t tokens + the final norm's weight gradient)
    with the vocab-parallel loss."""
    t, bshe, ar = x.t, x.b * x.s * x.h * x.e, 2 * (x.t - 1) / x.t
    total = x.L * sum(block_comm_bytes(x).values())
    if x.kv < t:  # wk, wv gradients summed over the replicas of each K/V head
        total += x.L * 2 * ar * x.kv * x.head_dim * x.h * x.e
    if embedding:
        total += ar * bshe
    if head:  # + the loss: MAX of N, SUM of [sum-exp, target logit]
        sp = (ar / 2 * bshe + ar * x.h * x.e) if x.sequence_parallel else 0
        total += ar * bshe + sp + ar * 3 * x.b * x.s * max(x.e, 4)
    return total


def step_comm_bytes(x: Shape, micro_batches: int, dp: int = 1, reduce_bytes: int | None = None,
                    clip: bool = False) -> float:
    """Wire bytes per rank per optimizer step: the blocks, the embedding and head boundaries,
    the replicated K/V heads' gradient sums, the vocab-parallel loss, then the data-parallel
    gradient all-reduce (reduce_bytes per element) and the clipping norm's all-reduce."""
    ar = 2 * (x.t - 1) / x.t
    per_micro = microbatch_comm_bytes(x)
    elements, _ = local_parameter_count(x)
    data_parallel = 2 * (dp - 1) / dp * elements * (reduce_bytes or x.e)
    clip_bytes = 8 if (reduce_bytes or x.e) == 8 else 4  # the clip norm: float64, else float32
    return micro_batches * per_micro + data_parallel + (ar * clip_bytes if clip else 0)


# --- context parallelism (context_parallel.py) --------------------------------------------------
#
# A K/V block is one rank's keys and values: 2·b·H_kv·(s/cp)·d elements (H_kv: the K/V heads this
# rank holds, n_kv/t under TP). dK/dV travel in float32 or better (e_grad = max(e, 4)).
#
#     ring:       forward (cp-1) K/V blocks; backward (cp-1) K/V blocks + (cp-1) dK/dV blocks
#     all-gather: (cp-1)/cp of the whole K/V forward; (cp-1)/cp of the whole dK/dV backward


def cp_comm_bytes(b: int, s: int, kv_heads: int, head_dim: int, cp: int, e: int,
                  variant: str = "ring") -> dict[str, float]:
    """Wire bytes one rank sends for one attention layer's forward + backward (one micro-batch)."""
    if cp == 1:
        return {}
    block, grad_e = 2 * b * kv_heads * (s // cp) * head_dim, max(e, 4)
    if variant == "ring":
        return {"forward K/V": (cp - 1) * block * e, "backward K/V": (cp - 1) * block * e,
                "backward dK/dV": (cp - 1) * block * grad_e}
    return {"all-gather K/V": (cp - 1) * block * e, "reduce-scatter dK/dV": (cp - 1) * block * grad_e}


def cp_activation_bytes(b: int, s: int, heads: int, kv_heads: int, head_dim: int, cp: int, e: int,
                        variant: str = "ring") -> float:
    """Bytes the CP attention of one layer saves for backward on one rank (t = s/cp tokens, c =
    the compute bytes max(e, 4)): q (b·H·t·d·c), the output (b·H·t·d·e), the log-sum-exp
    (b·H·t·c) and the K/V block (2·b·H_kv·t·d·e; all-gather: every rank's, cp times that).
    In place of formulas' three attention terms; falls as 1/cp (all-gather: not its K/V)."""
    t, c = s // cp, max(e, 4)
    kv = 2 * b * kv_heads * t * head_dim * e * (cp if variant == "all_gather" else 1)
    return b * heads * t * head_dim * (c + e) + b * heads * t * c + kv


SDPA_TERMS = ("q, k, v after RoPE + GQA repeat", "attention output", "attention log-sum-exp")


def cp_model_activation_terms(x: Shape, cp: int, variant: str = "ring") -> dict[str, float]:
    """model_activation_terms of one CP rank (x.s: its s/cp tokens), each block's three SDPA
    terms replaced by the CP attention's saved bytes (`cp_activation_bytes`, Ulysses':
    `ulysses_activation_bytes`)."""
    layer = layer_activation_terms(x)
    kv = x.kv // x.t if x.kv >= x.t else 1  # the K/V heads one TP rank holds
    saved = (ulysses_activation_bytes if variant == "ulysses"
             else partial(cp_activation_bytes, variant=variant))
    attention = saved(x.b, x.s * cp, x.a // x.t, kv, x.head_dim, cp, x.e)
    block = sum(v for k, v in layer.items() if k not in SDPA_TERMS) + attention
    return model_activation_terms(x) | {"blocks": x.L * block}


# --- Ulysses (ulysses.py) ------------------------------------------------------------------------
#
# Two even all-to-alls forward (q, k, v packed out; the output back), their adjoints backward (dout
# out; dq, dk, dv back), each sending (cp-1)/cp of its input; H, H_kv the heads this rank holds,
# H_kv' = max(H_kv, cp) after the repeat:  (cp-1)/cp · b·(s/cp)·d·(2H + 2H_kv')·e  each way.
# Hybrid (u × r): the all-to-alls over u, then the ring over r on H/u, H_kv'/u heads of s tokens.


def ulysses_comm_bytes(b: int, s: int, heads: int, kv_heads: int, head_dim: int, cp: int,
                       e: int) -> dict[str, float]:
    """Wire bytes one rank sends for one attention layer's forward + backward under Ulysses."""
    if cp == 1:
        return {}
    one_way = (cp - 1) / cp * b * (s // cp) * head_dim * (2 * heads + 2 * max(kv_heads, cp)) * e
    return {"forward q, k, v out + output back": one_way, "backward dout out + dq, dk, dv back": one_way}


def ulysses_activation_bytes(b: int, s: int, heads: int, kv_heads: int, head_dim: int, cp: int,
                             e: int) -> float:
    """Bytes Ulysses attention saves for backward on one rank (H/cp heads of all s tokens, c = max(e,
    4)): the gathered q, k, v buffer (b·s·d·(H + 2H_kv')/cp·e), SDPA's K/V repeated to H/cp heads
    and its output (3·b·s·d·H/cp·e), the log-sum-exp (b·s·H/cp·c), the int64 token orders that
    put the gathered tokens in sequence order and back (2 · 8·s), and the output back on its
    s/cp tokens, wo's input (b·(s/cp)·H·d·e)."""
    hq, hk = heads // cp, max(kv_heads, cp) // cp
    gathered, sdpa = b * s * head_dim * (hq + 2 * hk) * e, 3 * b * s * head_dim * hq * e
    return gathered + sdpa + b * s * hq * max(e, 4) + 16 * s + b * (s // cp) * heads * head_dim * e


def hybrid_comm_bytes(b: int, s: int, heads: int, kv_heads: int, head_dim: int, ulysses: int,
                      ring: int, e: int) -> dict[str, float]:
    """Ulysses over `ulysses` ranks (s/ring tokens each all-to-all gathers) + the ring over `ring`
    ranks on H/u query and H_kv'/u K/V heads: one layer, forward + backward, per rank."""
    kv = max(kv_heads, ulysses)
    inner = ulysses_comm_bytes(b, s // ring, heads, kv_heads, head_dim, ulysses, e)
    outer = cp_comm_bytes(b, s, kv // ulysses, head_dim, ring, e)
    return {f"ulysses {k}": v for k, v in inner.items()} | {f"ring {k}": v for k, v in outer.items()}
