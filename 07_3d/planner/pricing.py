"""The planner's pricing: every candidate layout (TP, CP, PP, DP, ZeRO level, micro-batch,
recompute) of a model on G GPUs, what each GPU holds and sends, its step time, and the pick.
Pure arithmetic over `memory_model`; the table and the article's comparison are report.py's.

Every candidate is priced by `memory_model` (per-GPU bytes) and a step-time model:

    t_step = C·(1 + (p-1)/(v·m)) + T_tp + T_cp + T_pp + T_dp,exposed + T_ep
    C      = F·tokens·(1 + recompute) / (G · peak · efficiency)

F the model FLOPs per token (`model_flops_per_token`: Megatron-LM's count, which MFU uses too),
the compute C stretched by the pipeline bubble (m micro-batches per replica, v virtual stages),
plus the TP collectives on NVLink (on the critical path, but SP's backward re-gathers, which
overlap the dx GEMMs), ring attention's K/V transfers beyond the attention compute they overlap
(T_cp), the PP sends, the data-parallel traffic beyond what hides behind compute (α·2(d-1)
latency per ring collective included), and an MoE's all-to-alls. With the mesh order TP, CP, DP,
PP a CP group spans t·cp consecutive GPUs and a DP group (gradients reduced over dp·cp: CP ranks
hold the same parameters) t·cp·dp with its ranks t apart: inside a node it runs on NVLink,
across nodes on the NICs of its members in each node (8/t of them: `Hardware.ring_bandwidth`),
beyond a pod at 1/7 of that (the oversubscribed aggregation layer of Llama 3's cluster, the
reason its DP groups are kept small). TP stays inside a node (the article's rule: TP needs
NVLink). The recommendation is the simplest candidate within 5% of the fastest that fits in
`headroom`·M (`recommend`), CP counting as the least simple: the rule of thumb, CP only when one
sequence's activations outgrow a GPU (or it is more than 5% faster). The candidates assume flash
attention and SP at TP > 1 unless told otherwise (`plan`).
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field, replace

from common.kernel.model import CONFIGS, LlamaConfig
from parallel3d.memory_model import (
    ACT_BYTES,
    GB,
    PRECISIONS,
    Layout,
    attention_flops_per_token,
    attention_parameters,
    comm_bytes_per_gpu,
    local_tokens,
    ring_bytes,
    total_parameters,
)
from parallel3d.planner import pipeline
from parallel3d.planner.hardware import Hardware
from parallel3d.planner.memory import dp_groups, memory_per_gpu
from parallel3d.planner.moe import (
    MoEShape,
    all_to_all_bytes,
    all_to_alls_per_step,
    moe_flops_per_token,
    moe_shape,
)
from parallel3d.planner.saved import recompute_flops_per_token

# A LLaMA-shaped model for the article's 70B-200B row (GPT-3's width and depth, LLaMA's blocks).
PLANNING_SHAPES: dict[str, LlamaConfig] = {
    "llama-175b-shape": LlamaConfig(dim=12288, n_layers=96, n_heads=96, n_kv_heads=8,
                                    vocab_size=32000, multiple_of=4096, max_seq_len=4096),
}
MODELS = {name: cfg for name, cfg in {**CONFIGS, **PLANNING_SHAPES}.items() if moe_shape(cfg) is None}
# Mixture-of-experts models: common/kernel/model.py's configs with MoE fields, read by `moe_shape` (the
# dense parts stay a LlamaConfig, the experts a MoEShape): Mixtral 8x7B (46.7B parameters, 12.9B
# active) and DeepSeek-V3 with its MLA (671.0B, 37.6B active; the report: 671B and 37B).
MOE_MODELS: dict[str, tuple[LlamaConfig, MoEShape]] = {
    name: (cfg, moe_shape(cfg)) for name, cfg in CONFIGS.items() if moe_shape(cfg) is not None}


@dataclass
class Plan:
    layout: Layout
    microbatches: int
    memory: dict[str, float]
    comm: dict[str, float]
    step_s: float
    mfu: float
    fits: bool
    times: dict[str, float] = field(default_factory=dict)


def model_flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """Model FLOPs per token, Megatron-LM's definition (its num_floating_point_operations): 6 per
    parameter of every matmul, forward and backward, the output layer included and the input
    embedding not (a lookup), + the attention scores' `attention_flops_per_token` (12·L·h·s for
    MHA/GQA; MLA's head widths); recomputation not counted. The step's compute and MFU both use
    it. (PaLM's 6N + 12·L·H·Q·T counts the embedding in N: +7.0% matmul FLOPs on Llama 3 8B.)"""
    return 6 * (total_parameters(cfg) - cfg.vocab_size * cfg.dim) + attention_flops_per_token(cfg, seq_len)


def recompute_fraction(cfg: LlamaConfig, recompute: str, seq_len: int,
                       flops_per_token: float | None = None) -> float:
    """Extra compute over forward+backward (= 3 forwards), `saved.recompute_flops_per_token` over
    the model FLOPs: a whole forward (1/3) for full; for selective the core attention's forward,
    QKᵀ and ·V: a third of `attention_flops_per_token` (4·L·h·s for MHA); torchtitan's op policy
    its even matmuls; DeepSeek-V3's the MLA up-projections."""
    work = flops_per_token or model_flops_per_token(cfg, seq_len)
    extra = recompute_flops_per_token(cfg, recompute, seq_len, attention_flops_per_token(cfg, seq_len),
                                      work)
    return extra / work


def model_of(name: str) -> tuple[LlamaConfig, MoEShape | None]:
    """A planner model by name: its config and, for a mixture of experts, its MoE shape."""
    if name in MOE_MODELS:
        return MOE_MODELS[name]
    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: use one of {', '.join([*MODELS, *MOE_MODELS])}")
    return MODELS[name], None


def price(cfg: LlamaConfig, layout: Layout, seq_len: int, global_batch: int, gpu_mem_gb: float,
          hw: Hardware, precision: str = "mixed", headroom: float = 0.9,
          eager_attention: bool = False, moe: MoEShape | None = None, skew: float = 1.0,
          act_bytes: float | None = None) -> Plan:
    """Memory, communication and estimated step time of one candidate; for a mixture of experts
    (`moe`), with skew = max/mean tokens per expert rank (moe.py); `act_bytes`: the bytes per
    element the linear layers cache their inputs in (None: the compute dtype's; 1: FP8)."""
    m = global_batch // (layout.dp * layout.micro_batch)
    d, t, c, p_ = layout.shards, layout.tp, layout.cp, layout.pp
    # torchtitan's op policy and DeepSeek-V3's rerun neither a collective nor the attention
    rerun = layout if layout.recompute in ("none", "selective", "full") else replace(layout, recompute="none")
    comm = comm_bytes_per_gpu(cfg, rerun, seq_len, m, precision)
    w, g, _ = PRECISIONS[precision]
    memory = memory_per_gpu(cfg, layout, seq_len, m, precision, eager_attention, moe, act_bytes)
    groups = dp_groups(cfg, moe, layout)
    per_element = {0: 2 * g, 1: g + w, 2: m * g + w, 3: m * (2 * w + g)}[layout.zero]
    comm["dp"] = sum(per_element * (n - 1) / n * psi for psi, n, _ in groups if n > 1)
    if moe is None:
        flops_token = model_flops = model_flops_per_token(cfg, seq_len)
        comm["ep"], a2a_count, passes = 0.0, 0, 4
    else:
        skew = skew if layout.ep > 1 else 1.0  # without EP every GPU runs every expert on its tokens
        flops_token = moe_flops_per_token(cfg, moe, seq_len, skew)  # the busiest expert rank's
        model_flops = moe_flops_per_token(cfg, moe, seq_len)  # on the active parameters
        comm["ep"] = all_to_all_bytes(cfg, moe, layout, seq_len, m, ACT_BYTES[precision], skew)
        a2a_count = all_to_alls_per_step(cfg, moe, layout, m)
        passes = 6 if layout.recompute == "full" else 4
    tokens = global_batch * seq_len
    flop_s = layout.gpus * hw.peak_tflops * 1e12 * hw.efficiency
    attention_share = attention_flops_per_token(cfg, seq_len) / flops_token
    work = flops_token * tokens / flop_s  # forward + backward, no recomputation
    compute = work * (1 + recompute_fraction(cfg, layout.recompute, seq_len, flops_token))
    # DP (over dp·cp) strides t, CP and EP stride t, PP strides t·cp·dp; DP's rings use the NICs
    # of their members in a node (hw.ring_bandwidth), the others one NIC per GPU
    cp_bw, pp_bw = hw.bandwidth(t * c), hw.bandwidth(layout.gpus)
    alpha = 0.0 if t * d <= hw.gpus_per_node else 2 * (d - 1) * hw.latency_us * 1e-6
    layers = math.ceil(cfg.n_layers / p_)
    units = layers + 1  # one collective per block (+ embedding/head)
    # Ring attention: each pass's transfer overlaps the causal attention of the blocks it carries
    # (half of the scores' forward, 4·h·s per token for MHA: the blocks above the diagonal are
    # skipped, split over t; backward twice that). Only a transfer that outlasts it is exposed.
    hop = 0.0 if t * c <= hw.gpus_per_node else (c - 1) * hw.latency_us * 1e-6
    attention = attention_flops_per_token(cfg, seq_len) / (6 * cfg.n_layers) * local_tokens(
        layout, seq_len) / t / (hw.peak_tflops * 1e12 * hw.efficiency)
    behind = {"forward": attention, "backward": 2 * attention, "recompute": attention}
    cp_exposed = layers * m * sum(max(0.0, sent / cp_bw + hop - behind[k]) for k, sent in
                                  ring_bytes(cfg, layout, seq_len, ACT_BYTES[precision]).items()
                                  if sent)
    per_mb = compute / m
    # Accumulated gradients (DDP, ZeRO-1) are final after the last micro-batch's backward: only
    # that backward (2/3 of its compute) hides their reduction; sharded ones (ZeRO-2/3) are
    # reduce-scattered by every micro-batch, behind its own backward. ZeRO-1/2's parameter
    # all-gather hides behind the next step's first forward (1/3); ZeRO-3 gathers twice in
    # every micro-batch, behind that micro-batch. An MoE's experts reduce over dp·cp/ep ranks.
    ring = sum((n - 1) / n * psi / hw.ring_bandwidth(n, stride) for psi, n, stride in groups
               if n > 1) if comm["dp"] else 0.0  # seconds per byte per parameter
    grad_s = ring * g * (2 if layout.zero == 0 else 1) + units * alpha
    gather_s = ring * w + units * alpha
    if layout.zero <= 1:
        exposed = max(0.0, grad_s - 2 / 3 * per_mb)
    elif layout.zero == 2:
        exposed = m * max(0.0, grad_s - 2 / 3 * per_mb)
    else:
        exposed = m * max(0.0, grad_s + 2 * gather_s - per_mb)
    if layout.zero in (1, 2):
        exposed += max(0.0, gather_s - per_mb / 3)
    # TP on the critical path, but SP's re-gathers of the column layers' saved inputs: each
    # overlaps the dx GEMM of the layers that read it (2·column weights/t FLOPs per token)
    split, _ = attention_parameters(cfg)
    column = split - cfg.n_heads * cfg.value_head_dim * cfg.dim + 2 * cfg.dim * cfg.hidden_dim
    dx_gemm = layers * m * 2 * column / t * local_tokens(layout, seq_len) / (
        hw.peak_tflops * 1e12 * hw.efficiency)
    nvlink = hw.nvlink_gbps * GB
    tp_s = (comm["tp"] - comm["tp_regather"]) / nvlink + max(0.0, comm["tp_regather"] / nvlink - dx_gemm)
    # EP: an EP group spans t·ep GPUs; each all-to-all pays one latency across nodes. Per
    # micro-batch on a stage: F = matmul/3 + attention/3, W = matmul/3, B = the rest (the
    # weight gradients W, the input gradients, the attention's backward, any recomputation),
    # a_F and a_B the forward's and the backward's all-to-alls. 1F1B runs them in turn, the
    # all-to-alls on the critical path; DualPipe pairs a forward with another micro-batch's
    # backward: F&B = max(F + B, a_F + a_B), each one's all-to-alls under the other's compute.
    a2a_hop = 0.0 if t * layout.ep <= hw.gpus_per_node else hw.latency_us * 1e-6
    ep_s = comm["ep"] / hw.bandwidth(t * layout.ep) + a2a_count * a2a_hop
    F = work / m * (1 - attention_share) / 3 + work / m * attention_share / 3
    W = work / m * (1 - attention_share) / 3
    B = per_mb - F
    a_F, a_B = ep_s / m * 2 / passes, ep_s / m * (passes - 2) / passes
    if layout.schedule == "dualpipe":
        FB = pipeline.pair_s(F + B, a_F + a_B)
        bubble = pipeline.bubble_s("dualpipe", p_, 1, F, B + a_B, W, FB)
        ep_exposed = m * FB - compute
    else:
        bubble = pipeline.bubble_s("1f1b", p_, layout.virtual_stages, F, B, W, F + B)
        ep_exposed = ep_s
    times = {
        "compute": compute + bubble,
        "bubble": bubble,
        "tp": tp_s,
        "cp_exposed": cp_exposed,
        "pp": comm["pp"] / pp_bw,
        "dp_exposed": exposed,
        "ep": ep_exposed,
        "ep_hidden": ep_s - ep_exposed,
    }
    step = (times["compute"] + times["tp"] + times["cp_exposed"] + times["pp"] + exposed
            + times["ep"])
    mfu = model_flops * tokens / (step * layout.gpus * hw.peak_tflops * 1e12)
    fits = memory["total"] <= headroom * gpu_mem_gb * GB
    return Plan(layout, m, memory, comm, step, mfu, fits, times)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg: LlamaConfig, gpus: int, global_batch: int, hw: Hardware, seq_len: int,
               micro_batches=(1, 2, 4, 8), zero_levels=(0, 1, 2, 3),
               recompute=("none", "selective", "full"),
               context_parallel=(1, 2, 4, 8, 16, 32), experts: int = 0,
               sequence_parallel: bool = True) -> list[Layout]:
    """Every layout the model and the cluster admit: TP inside a node dividing the heads, KV heads
    and vocabulary; PP at least one block per stage (uneven stages allowed, as Llama 3's 126
    layers on 16 stages) and at least p micro-batches to fill them (fewer leave a bubble
    (p-1)/m ≥ 1); CP whose 2·cp zig-zag chunks divide the sequence; the global batch divisible
    by dp·micro-batch; interleaving needs the micro-batch count divisible by p; with `experts`
    (an MoE), EP dividing both dp·cp and the experts; SP at every TP > 1 unless
    `sequence_parallel` is False (a framework without it)."""
    out = []
    for tp in divisors(min(gpus, hw.gpus_per_node)):
        if cfg.n_heads % tp or cfg.n_kv_heads % tp or cfg.vocab_size % tp:
            continue
        for pp in divisors(gpus // tp):
            if pp > cfg.n_layers:
                continue
            for cp in context_parallel:
                if (gpus // (tp * pp)) % cp or (cp > 1 and seq_len % (2 * cp)):
                    continue
                dp = gpus // (tp * pp * cp)
                for mb in micro_batches:
                    if global_batch % (dp * mb):
                        continue
                    m = global_batch // (dp * mb)
                    if m < pp:
                        continue
                    vs = [1] + [v for v in (2, 4, 8)
                                if pp > 1 and m % pp == 0 and pp * v <= cfg.n_layers]
                    eps = [e for e in divisors(dp * cp) if experts % e == 0] if experts else [1]
                    for v, zero, ac, ep in itertools.product(
                            vs, zero_levels if dp * cp > 1 else (0,), recompute, eps):
                        out.append(Layout(tp=tp, pp=pp, dp=dp, zero=zero, micro_batch=mb,
                                          virtual_stages=v, recompute=ac,
                                          sequence_parallel=sequence_parallel and tp > 1,
                                          cp=cp, ep=ep))
    return out


def plan(cfg: LlamaConfig, gpus: int, gpu_mem_gb: float, seq_len: int, global_batch: int,
         hw: Hardware | None = None, precision: str = "mixed", headroom: float = 0.9,
         eager_attention: bool = False, moe: MoEShape | None = None, skew: float = 1.0,
         **space) -> list[Plan]:
    """All candidates priced, the fitting ones first, fastest first (then smallest footprint);
    `space` narrows `candidates` (e.g. context_parallel=(1,), sequence_parallel=False). The
    defaults assume what a 2024 framework has: flash attention (no s×s scores kept;
    `eager_attention` keeps them) and sequence parallelism at TP > 1 (`sequence_parallel`)."""
    hw = hw or Hardware()
    layouts = candidates(cfg, gpus, global_batch, hw, seq_len, experts=moe.n_experts if moe else 0,
                         **space)
    plans = [price(cfg, layout, seq_len, global_batch, gpu_mem_gb, hw, precision, headroom,
                   eager_attention, moe, skew) for layout in layouts]
    return sorted(plans, key=lambda p: (not p.fits, round(p.step_s, 3), p.memory["total"]))


def complexity(layout: Layout) -> tuple:
    """What a layout costs in engineering, least first: no context parallelism (the rule of
    thumb: only when a sequence's activations outgrow a GPU), no expert parallelism (a token
    dispatcher and all-to-alls), no pipeline, no interleaving, no recomputation (it spends
    compute on memory: worth it only when nothing lighter fits), less TP, less EP, fewer stages,
    less CP."""
    ac = ("none", "selective", "full").index(layout.recompute)
    return (layout.cp > 1, layout.ep > 1, layout.pp > 1, layout.virtual_stages > 1, ac, layout.tp,
            layout.ep, layout.pp, layout.cp)


def recommend(plans: list[Plan], tolerance: float = 0.05) -> Plan | None:
    """The simplest fitting layout within `tolerance` of the fastest one's step time: a pipeline
    or a wider TP group must buy more than 5% to be worth its complexity; then the fastest, then
    the smallest footprint (ZeRO-2 over ZeRO-1: the same bytes on the wire, less memory).
    Context parallelism only when no layout fits without it (the rule of thumb: CP when a
    sequence's activations outgrow the GPU). The step-time model prices CP's ring as hidden
    behind attention, nearly free, so it would otherwise replace TP and recomputation at 4K;
    what it leaves out (attention kernels on s/2cp-token chunks, P2P traffic contending with the
    compute it hides behind, one more dimension to debug) is why practitioners wait for the
    sequence to outgrow memory. `fastest_with_cp` shows what the model says CP would buy."""
    fitting = [p for p in plans if p.fits]
    fitting = [p for p in fitting if p.layout.cp == 1] or fitting
    if not fitting:
        return None
    best = min(p.step_s for p in fitting)
    near = [p for p in fitting if p.step_s <= (1 + tolerance) * best]
    return min(near, key=lambda p: (complexity(p.layout), round(p.step_s, 2), p.memory["total"]))


def step_terms(p: Plan) -> dict[str, float]:
    """A plan's step time by term: work (compute and recomputation), bubble, TP, exposed CP, PP,
    exposed DP, EP's all-to-alls."""
    t = p.times
    return {"work": t["compute"] - t["bubble"], "bubble": t["bubble"], "TP": t["tp"],
            "CP": t["cp_exposed"], "PP": t["pp"], "DP": t["dp_exposed"], "EP": t["ep"]}


def fastest_with_cp(plans: list[Plan]) -> Plan | None:
    """The fastest fitting layout with context parallelism."""
    return min((p for p in plans if p.fits and p.layout.cp > 1), key=lambda p: p.step_s,
               default=None)


def fastest_with_mesh(plans: list[Plan], tp: int, cp: int, pp: int) -> Plan | None:
    """The fastest fitting way to run a given (tp, cp, pp) mesh."""
    return min((p for p in plans if p.fits and (p.layout.tp, p.layout.cp, p.layout.pp)
                == (tp, cp, pp)), key=lambda p: p.step_s, default=None)
