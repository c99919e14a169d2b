"""What a production framework saves for backward per block, and what each recomputation reruns:
the planner's activation count. Pure arithmetic, per token on one TP rank.

Chapter 05 measures what *this* LLaMA saves (`tensor_parallel.formulas`, the 3D trainer's
ledger: `memory_model.layer_activation_bytes`). The frameworks of the published runs keep three
things less, each from its kernels' own save lists:

    K/V unrepeated   flash attention (and SDPA with enable_gqa) reads GQA's n_kv heads as they
                     are: q, k, v are (1 + 2·n_kv/n_h)·h/t per token, not the repeated 3·h/t
                     (≈ 8% of Llama 3 405B's SP block at t = 8)
    fused RMSNorm    saves its input and 1/rms (Apex, Transformer Engine), not x·r beside them
    fused SwiGLU     saves its two inputs w1 x, w3 x; its output is w2's saved input: 3F, not 4F

Per token, e the compute bytes, c the bytes the linear layers cache their inputs in
(`act_bytes`: e, or 1 for FP8 caching), local = 1/t under SP (the norm regions' tokens):

    none        norm inputs 2h·local·e + 1/rms 2·local·e + norm outputs 2h·local·c (the column
                layers' input) + q, k, v (above) + attention output h_v/t·c' (wo's input;
                c' = 1.5 bytes, E5M6, when c is FP8: DeepSeek-V3 §3.3.2) + log-sum-exp (a/t)·4
                + SwiGLU inputs 2F/t·e + its output F/t·c; MLA adds its latents (input, 1/rms,
                normed); an MoE block its k dispatched copies k·h·c; eager attention the s×s
                scores and softmax 2·a·s/t·e (and repeated K/V)
    selective   the core attention rerun (Korthikanti et al.): none less the log-sum-exp and
                the scores (with flash attention its inputs q, k, v are all it saved anyway)
    op          torchtitan's per-op policy (`_apply_ac_to_transformer_block`, 'op' mode):
                the block input, the outputs of every other matmul (wq, wv, w1, w2), the
                attention's output and log-sum-exp; everything else rerun
    deepseek    DeepSeek-V3 (report §3.2.3, §3.3.2): every RMSNorm and the MLA up-projections
                rerun (the norm inputs and latents kept), the SwiGLU inputs cached in FP8 and
                its output rerun, the dispatched copies in FP8 (c = 1 for the run)
    full        the block input only, h·local·e
"""

from __future__ import annotations

from common.kernel.model import LlamaConfig

RECOMPUTE = ("none", "selective", "op", "deepseek", "full")


def _check(cfg: LlamaConfig, recompute: str, routed: int) -> None:
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute {recompute!r}: use one of {', '.join(RECOMPUTE)}")
    if recompute == "op" and (cfg.mla or routed):
        raise ValueError("recompute 'op' is torchtitan's policy for its dense GQA LLaMA: no MLA "
                         "or experts (use selective, deepseek or full)")


def block_saved_terms(cfg: LlamaConfig, seq_len: int, tp: int = 1, sequence_parallel: bool = False,
                      recompute: str = "none", elem: float = 2, act_bytes: float | None = None,
                      eager_attention: bool = False, routed: int = 0) -> dict[str, float]:
    """Bytes one block saves per token on one TP rank, by term (the module docstring): `cfg`'s
    hidden_dim is the SwiGLU width a token meets (an MoE block's k routed + S shared experts),
    `routed` the k dispatched copies of an MoE block (0: dense), `seq_len` the keys a local
    query meets (eager attention's scores)."""
    _check(cfg, recompute, routed)
    h, a, F, t = cfg.dim, cfg.n_heads, cfg.hidden_dim, tp
    e, c = elem, elem if act_bytes is None else act_bytes
    local, f32 = (1 / t if sequence_parallel else 1), max(e, 4)
    if recompute == "full":
        return {"block input": h * local * e}
    head_v = a * cfg.value_head_dim / t
    out = {"attention output (wo's input)": head_v * (max(c, 1.5) if c < e else c),
           "attention log-sum-exp": a / t * f32}
    if recompute == "op":  # torchtitan: mm outputs 1, 3, 5, 7 of wq wk wv wo w1 w3 w2 kept
        kv = max(cfg.n_kv_heads // t, 1) * cfg.head_dim
        rows = {"w2 output (partial sums)": h * e}
        if sequence_parallel and t > 1:
            rows["w2 output reduce-scattered"] = h / t * e
        return {"block input": h * local * e, "wq output": h / t * e, "wv output": kv * e,
                "w1 output": F / t * e, **rows, **out}
    terms = {"norm inputs x, h (2)": 2 * h * local * e}
    if cfg.mla:
        latents = cfg.q_lora_rank + cfg.kv_lora_rank
        terms["MLA latents c_q, c_kv (norm inputs)"] = latents * local * e
    if recompute == "deepseek":
        terms |= out | {"SwiGLU inputs w1 x, w3 x (cached)": 2 * F / t * c}
        return terms | ({"dispatched copies (experts' input)": routed * h * c} if routed else {})
    rms = 2 + (2 if cfg.q_lora_rank else 1 if cfg.mla else 0)
    terms |= {"norm 1/rms": rms * local * e, "norm outputs (column layers' input)": 2 * h * local * c}
    if cfg.mla:
        terms["MLA latents normed (up-projections' input)"] = latents * local * c
        qkv = a * (2 * cfg.qk_head_dim + cfg.value_head_dim) / t
    elif eager_attention and recompute == "none":  # an eager kernel repeats K/V for its matmuls
        qkv = 3 * h / t
    else:
        qkv = (a // t + 2 * max(cfg.n_kv_heads // t, 1)) * cfg.head_dim
    terms["q, k, v (K/V unrepeated)"] = qkv * e
    terms |= out if recompute == "none" else {k: v for k, v in out.items() if "log-sum-exp" not in k}
    if eager_attention and recompute == "none":
        terms["scores and softmax"] = 2 * a * seq_len / t * e
    terms |= {"SwiGLU inputs w1 x, w3 x": 2 * F / t * e, "SwiGLU output (w2's input)": F / t * c}
    return terms | ({"dispatched copies (experts' input)": routed * h * c} if routed else {})


def recompute_flops_per_token(cfg: LlamaConfig, recompute: str, seq_len: int, attention: float,
                              work: float) -> float:
    """Forward FLOPs per token a recomputation reruns in backward, the model's L blocks: full a
    third of the work (one forward), selective the core attention (a third of `attention`, the
    scores' forward and backward), op the even matmuls wk, wo, w3 (2·h·(n_kv·d + H·d_v + F) per
    block), deepseek the MLA up-projections (2·(q_lora·H·d_qk + kv_lora·H·(d_nope + d_v)); a
    GQA model's wq, wk, wv); norms and SwiGLU reruns are elementwise, no matmul FLOPs."""
    L, h, a = cfg.n_layers, cfg.dim, cfg.n_heads
    if recompute == "full":
        return work / 3
    if recompute == "selective":
        return attention / 3
    if recompute == "op":
        return 2 * L * h * (cfg.n_kv_heads * cfg.head_dim + a * cfg.value_head_dim + cfg.hidden_dim)
    if recompute == "deepseek":
        if cfg.mla:
            q_in = cfg.q_lora_rank or h
            return 2 * L * a * (q_in * cfg.qk_head_dim
                                + cfg.kv_lora_rank * (cfg.qk_nope_head_dim + cfg.v_head_dim))
        return 2 * L * h * (h + 2 * cfg.n_kv_heads * cfg.head_dim)
    return 0.0
