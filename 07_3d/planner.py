"""Plan a layout: which (TP, CP, PP, DP, ZeRO level, micro-batch, recompute) fits a model on G GPUs
of M GB, what each GPU holds, what it sends, and which one to pick.

    python -m parallel3d.planner --model llama2-70b --gpus 64 --gpu-mem-gb 80
    python -m parallel3d.planner --model llama3.1-405b --gpus 16384 --seq-len 131072 \
        --global-batch 128                     # long context: where CP becomes necessary
    python -m parallel3d.planner --article      # the source article's numbers and table

Every candidate is priced by `memory_model` (per-GPU bytes) and a step-time model:

    t_step = C·(1 + (p-1)/(v·m)) + T_tp + T_cp + T_pp + max(0, T_dp - C)
    C      = (6·N + 12·L·h·s)·tokens·(1 + recompute) / (G · peak · efficiency)

the compute C stretched by the pipeline bubble (m micro-batches per replica, v virtual stages),
plus the TP collectives on NVLink (on the critical path), ring attention's K/V transfers beyond
the attention compute they overlap (T_cp), the PP sends, and the data-parallel
traffic beyond what hides behind compute (α·2(d-1) latency per ring collective included). With
the mesh order TP, CP, DP, PP a CP group spans t·cp consecutive GPUs and a DP group (gradients
reduced over dp·cp: CP ranks hold the same parameters) t·cp·dp: inside a node it runs on NVLink,
inside a pod on the full network, beyond it at 1/7 of that (the oversubscribed aggregation layer
of Llama 3's cluster, the reason its DP groups are kept small). TP stays inside a node (the
article's rule: TP needs NVLink). The recommendation is the simplest candidate within 5% of the
fastest that fits in `headroom`·M (`recommend`), CP counting as the least simple: the rule of
thumb, CP only when one sequence's activations outgrow a GPU (or it is more than 5% faster);
where its pipeline depth is not one the article's table names, `why_not` prices the article's
depth beside it, term by term.
"""

from __future__ import annotations

import argparse
import itertools
import math
from dataclasses import dataclass, field

from common.model import CONFIGS, LlamaConfig

from .memory_model import (
    ACT_BYTES,
    GB,
    PRECISIONS,
    Layout,
    comm_bytes_per_gpu,
    local_tokens,
    memory_per_gpu,
    parameters_per_gpu,
    ring_bytes,
    total_parameters,
)

# A LLaMA-shaped model for the article's 70B-200B row (GPT-3's width and depth, LLaMA's blocks).
PLANNING_SHAPES: dict[str, LlamaConfig] = {
    "llama-175b-shape": LlamaConfig(dim=12288, n_layers=96, n_heads=96, n_kv_heads=8,
                                    vocab_size=32000, multiple_of=4096, max_seq_len=4096),
}
MODELS = {**CONFIGS, **PLANNING_SHAPES}

# The source article's strategy-by-size table: (max params in B, GPUs, its advice, the pipeline
# depths it names).
ARTICLE_TABLE = [
    (7.5, "1-8", "FSDP or ZeRO-2; no TP, no PP", (1, 1)),
    (13.5, "4-16", "ZeRO-2/3 or FSDP; TP 2-4 optional", (1, 1)),
    (70.5, "16-64", "TP 4-8 inside the node + FSDP; PP if several nodes", (1, 64)),
    (200.0, "64-256", "TP 8 + PP 4-8 + FSDP; multi-node", (4, 8)),
    (math.inf, "1000+", "TP 8 + PP 16+ + FSDP", (16, 1 << 30)),
]


@dataclass(frozen=True)
class Hardware:
    peak_tflops: float = 989.0      # H100 SXM bf16 dense
    efficiency: float = 0.5         # achievable fraction of peak in the matmuls
    nvlink_gbps: float = 450.0      # per GPU, one direction, inside a node
    network_gbps: float = 50.0      # per GPU between nodes (400 Gb/s NIC per GPU)
    latency_us: float = 5.0         # α of one network hop
    gpus_per_node: int = 8
    pod_gpus: int = 3072            # GPUs under one aggregation layer (Llama 3's cluster) ...
    oversubscription: float = 7.0   # ... and the bandwidth division beyond it (1:7)

    def bandwidth(self, span: int) -> float:
        """Bytes/s per GPU of a collective whose ranks span `span` consecutive GPUs."""
        if span <= self.gpus_per_node:
            return self.nvlink_gbps * GB
        return self.network_gbps * GB / (1.0 if span <= self.pod_gpus else self.oversubscription)


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
    """PaLM's count: 6N for the matmuls forward and backward + 12·L·h·s for attention."""
    return 6 * total_parameters(cfg) + 12 * cfg.n_layers * cfg.dim * seq_len


def recompute_fraction(cfg: LlamaConfig, recompute: str, seq_len: int) -> float:
    """Extra compute over forward+backward (= 3 forwards): a whole forward (1/3) for full
    recompute; for selective the core attention's forward, QKᵀ and ·V: 4·L·h·s per token."""
    if recompute == "full":
        return 1 / 3
    if recompute == "selective":
        return 4 * cfg.n_layers * cfg.dim * seq_len / model_flops_per_token(cfg, seq_len)
    return 0.0


def price(cfg: LlamaConfig, layout: Layout, seq_len: int, global_batch: int, gpu_mem_gb: float,
          hw: Hardware, precision: str = "mixed", headroom: float = 0.9,
          eager_attention: bool = False) -> Plan:
    """Memory, communication and estimated step time of one candidate."""
    m = global_batch // (layout.dp * layout.micro_batch)
    memory = memory_per_gpu(cfg, layout, seq_len, m, precision, eager_attention)
    comm = comm_bytes_per_gpu(cfg, layout, seq_len, m, precision)
    tokens = global_batch * seq_len
    flops = model_flops_per_token(cfg, seq_len) * tokens
    compute = flops * (1 + recompute_fraction(cfg, layout.recompute, seq_len)) / (
        layout.gpus * hw.peak_tflops * 1e12 * hw.efficiency)
    bubble = (layout.pp - 1) / (layout.virtual_stages * m)
    d, t, c, p_ = layout.shards, layout.tp, layout.cp, layout.pp
    # DP (over dp·cp) strides t, CP strides t, PP strides t·cp·dp
    dp_bw, cp_bw, pp_bw = hw.bandwidth(t * d), hw.bandwidth(t * c), hw.bandwidth(layout.gpus)
    ring = (d - 1) / d if d > 1 else 0.0
    alpha = 0.0 if t * d <= hw.gpus_per_node else 2 * (d - 1) * hw.latency_us * 1e-6
    layers = math.ceil(cfg.n_layers / p_)
    units = layers + 1  # one collective per block (+ embedding/head)
    # Ring attention: each pass's transfer overlaps the causal attention of the blocks it carries
    # (2·h·s FLOPs per local token forward, half of PaLM's 4·h·s: the blocks above the diagonal
    # are skipped, split over t; backward twice that). Only a transfer that outlasts it is exposed.
    hop = 0.0 if t * c <= hw.gpus_per_node else (c - 1) * hw.latency_us * 1e-6
    attention = 2 * cfg.dim * seq_len * local_tokens(layout, seq_len) / t / (
        hw.peak_tflops * 1e12 * hw.efficiency)
    behind = {"forward": attention, "backward": 2 * attention, "recompute": attention}
    cp_exposed = layers * m * sum(max(0.0, sent / cp_bw + hop - behind[k]) for k, sent in
                                  ring_bytes(cfg, layout, seq_len, ACT_BYTES[precision]).items()
                                  if sent)
    psi = comm["dp"] and parameters_per_gpu(cfg, t, p_)
    w, g, _ = PRECISIONS[precision]
    per_mb = compute / m
    # Accumulated gradients (DDP, ZeRO-1) are final after the last micro-batch's backward: only
    # that backward (2/3 of its compute) hides their reduction; sharded ones (ZeRO-2/3) are
    # reduce-scattered by every micro-batch, behind its own backward. ZeRO-1/2's parameter
    # all-gather hides behind the next step's first forward (1/3); ZeRO-3 gathers twice in
    # every micro-batch, behind that micro-batch.
    grad_s = (ring * psi * g * (2 if layout.zero == 0 else 1)) / dp_bw + units * alpha
    gather_s = ring * psi * w / dp_bw + units * alpha
    if layout.zero <= 1:
        exposed = max(0.0, grad_s - 2 / 3 * per_mb)
    elif layout.zero == 2:
        exposed = m * max(0.0, grad_s - 2 / 3 * per_mb)
    else:
        exposed = m * max(0.0, grad_s + 2 * gather_s - per_mb)
    if layout.zero in (1, 2):
        exposed += max(0.0, gather_s - per_mb / 3)
    times = {
        "compute": compute * (1 + bubble),
        "bubble": compute * bubble,
        "tp": comm["tp"] / (hw.nvlink_gbps * GB),
        "cp_exposed": cp_exposed,
        "pp": comm["pp"] / pp_bw,
        "dp_exposed": exposed,
    }
    step = times["compute"] + times["tp"] + times["cp_exposed"] + times["pp"] + exposed
    mfu = 6 * total_parameters(cfg) * tokens / (step * layout.gpus * hw.peak_tflops * 1e12)
    fits = memory["total"] <= headroom * gpu_mem_gb * GB
    return Plan(layout, m, memory, comm, step, mfu, fits, times)


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def candidates(cfg: LlamaConfig, gpus: int, global_batch: int, hw: Hardware, seq_len: int,
               micro_batches=(1, 2, 4, 8), zero_levels=(0, 1, 2, 3),
               recompute=("none", "selective", "full"),
               context_parallel=(1, 2, 4, 8, 16, 32)) -> list[Layout]:
    """Every layout the model and the cluster admit: TP inside a node dividing the heads, KV heads
    and vocabulary; PP at most one block per stage (uneven stages allowed, as Llama 3's 126
    layers on 16 stages) and at least p micro-batches to fill them (fewer leave a bubble
    (p-1)/m ≥ 1); CP whose 2·cp zig-zag chunks divide the sequence; the global batch divisible
    by dp·micro-batch; interleaving needs the micro-batch count divisible by p."""
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
                    for v, zero, ac in itertools.product(
                            vs, zero_levels if dp * cp > 1 else (0,), recompute):
                        out.append(Layout(tp=tp, pp=pp, dp=dp, zero=zero, micro_batch=mb,
                                          virtual_stages=v, recompute=ac,
                                          sequence_parallel=tp > 1, cp=cp))
    return out


def plan(cfg: LlamaConfig, gpus: int, gpu_mem_gb: float, seq_len: int, global_batch: int,
         hw: Hardware | None = None, precision: str = "mixed", headroom: float = 0.9,
         eager_attention: bool = False) -> list[Plan]:
    """All candidates priced, the fitting ones first, fastest first (then smallest footprint)."""
    hw = hw or Hardware()
    plans = [price(cfg, layout, seq_len, global_batch, gpu_mem_gb, hw, precision, headroom,
                   eager_attention)
             for layout in candidates(cfg, gpus, global_batch, hw, seq_len)]
    return sorted(plans, key=lambda p: (not p.fits, round(p.step_s, 3), p.memory["total"]))


def complexity(layout: Layout) -> tuple:
    """What a layout costs in engineering, least first: no context parallelism (the rule of
    thumb: only when a sequence's activations outgrow a GPU), no pipeline, no interleaving, no
    recomputation (it spends compute on memory: worth it only when nothing lighter fits), less
    TP, fewer stages, less CP."""
    ac = ("none", "selective", "full").index(layout.recompute)
    return (layout.cp > 1, layout.pp > 1, layout.virtual_stages > 1, ac, layout.tp, layout.pp,
            layout.cp)


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


def article_row(n_params: float) -> tuple[str, str, tuple[int, int]]:
    """The article's (GPUs, advice, pipeline depths) for a model of `n_params` parameters."""
    for max_b, gpus, advice, pp_range in ARTICLE_TABLE:
        if n_params / 1e9 <= max_b:
            return gpus, advice, pp_range
    raise AssertionError


def article_alternative(plans: list[Plan], pp_range: tuple[int, int]) -> Plan | None:
    """The fastest fitting layout with a pipeline depth the article names (and, like the
    article's table, no context parallelism)."""
    lo, hi = pp_range
    return min((p for p in plans if p.fits and p.layout.cp == 1 and lo <= p.layout.pp <= hi),
               key=lambda p: p.step_s, default=None)


def step_terms(p: Plan) -> dict[str, float]:
    """A plan's step time by term: work (compute and recomputation), bubble, TP, exposed CP, PP,
    exposed DP."""
    t = p.times
    return {"work": t["compute"] - t["bubble"], "bubble": t["bubble"], "TP": t["tp"],
            "CP": t["cp_exposed"], "PP": t["pp"], "DP": t["dp_exposed"]}


def why_not(pick: Plan, other: Plan) -> str:
    """Why the planner prefers `pick` to `other`: their step times term by term (what differs by
    more than 0.05 s), the bubbles (p-1)/(v·m), the memory per GPU."""
    a, b = step_terms(pick), step_terms(other)
    diff = ", ".join(f"{k} {b[k] - a[k]:+.2f} s" for k in a if abs(b[k] - a[k]) > 0.05)
    bubble = ", ".join(f"{(p.layout.pp - 1)}/({p.layout.virtual_stages}·{p.microbatches}) = "
                       f"{(p.layout.pp - 1) / (p.layout.virtual_stages * p.microbatches):.1%}"
                       for p in (other, pick))
    return (f"{other.layout.describe()}: {other.step_s:.2f} s, "
            f"{other.step_s / pick.step_s - 1:+.0%} against the pick ({diff or 'no term differs'}); "
            f"bubble {bubble}; {other.memory['total'] / GB:.1f} GB vs "
            f"{pick.memory['total'] / GB:.1f} GB per GPU")


def article_scenario(cfg: LlamaConfig, gpus: int, zero: int) -> dict[str, float]:
    """The article's 86 GB (one GPU) and 11 GB (ZeRO-3 on 8): fp16 weights, gradients and Adam
    m, v (8 bytes per parameter); a batch of 8 sequences of 512 tokens split over the GPUs;
    attention without flash (scores and softmax kept), no recomputation."""
    layout = Layout(tp=1, pp=1, dp=gpus, zero=zero, micro_batch=8 // gpus, recompute="none",
                    sequence_parallel=False)
    return memory_per_gpu(cfg, layout, seq_len=512, microbatches=1, precision="article",
                          eager_attention=True)


def format_plans(plans: list[Plan], top: int) -> str:
    head = (f"{'tp':>3}{'cp':>4}{'pp':>4}{'v':>3}{'dp':>6}{'zero':>6}{'mb':>4}{'m':>5}{'AC':>10} |"
            f"{'weights':>8}{'grads':>7}{'optim':>7}{'activ':>7}{'total':>7} GB |"
            f"{'TP':>8}{'CP':>7}{'PP':>7}{'DP':>8} GB/step |{'step s':>8}{'MFU':>6}  fits")
    lines = [head, "-" * len(head)]
    for p in plans[:top]:
        lo = p.layout
        mem, c = {k: v / GB for k, v in p.memory.items()}, {k: v / GB for k, v in p.comm.items()}
        lines.append(
            f"{lo.tp:>3}{lo.cp:>4}{lo.pp:>4}{lo.virtual_stages:>3}{lo.dp:>6}{lo.zero:>6}"
            f"{lo.micro_batch:>4}{p.microbatches:>5}{lo.recompute:>10} |{mem['weights']:>8.1f}"
            f"{mem['grads']:>7.1f}{mem['optimizer']:>7.1f}{mem['activations']:>7.1f}"
            f"{mem['total']:>7.1f}    |{c['tp']:>8.1f}{c['cp']:>7.1f}{c['pp']:>7.2f}{c['dp']:>8.1f}"
            f"         |{p.step_s:>8.2f}{p.mfu:>6.0%}  {'yes' if p.fits else 'no'}")
    return "\n".join([*lines, "", LEGEND])


LEGEND = """\
tp, cp, pp, dp: tensor-, context-, pipeline- and data-parallel degrees (GPUs = tp·cp·pp·dp; mesh
  order tp, cp, dp, pp, innermost first); v: virtual stages per GPU (interleaved 1F1B when > 1,
  "v8" in a layout's name); zero: 0 DDP, 1 and 2 ZeRO-1/2, 3 FSDP (ZeRO-3), sharded over dp·cp;
  mb: sequences per micro-batch (s/cp tokens of each on a GPU); m: micro-batches per replica
  per step; AC: activation recomputation ("AC none": every block keeps its activations;
  selective: the core attention (QKᵀ, softmax, ·V) is rerun, see recompute.py; full: a block
  keeps only its input).
GB: per GPU of the busiest pipeline stage (weights, grads, optimizer state, saved activations);
  GB/step: bytes each GPU sends per step along each dimension; step s: the modelled step time
  (compute + bubble + TP + exposed CP, PP, DP); MFU: 6N·tokens / (step·GPUs·peak), attention's
  FLOPs not counted (at 128K they outweigh 6N); fits: total ≤ headroom × GPU memory."""


def fastest_with_cp(plans: list[Plan]) -> Plan | None:
    """The fastest fitting layout with context parallelism."""
    return min((p for p in plans if p.fits and p.layout.cp > 1), key=lambda p: p.step_s,
               default=None)


def cp_verdict(plans: list[Plan], best: Plan | None) -> str:
    """Why the pick has (or lacks) context parallelism: the smallest CP-less footprint when
    nothing fits without CP, else what the model says CP would buy."""
    if best is None:
        return "CP: nothing fits even with it"
    if best.layout.cp > 1:
        without = [p for p in plans if p.layout.cp == 1]
        if not without:
            return ("CP: needed: without it no layout gives each pipeline replica at least p "
                    "micro-batches (too few sequences per step for the GPUs)")
        small = min(without, key=lambda p: p.memory["total"])
        return (f"CP: needed: the smallest CP-less footprint, {small.layout.describe()}, holds "
                f"{small.memory['total'] / GB:.1f} GB per GPU, "
                f"{small.memory['activations'] / GB:.1f} GB of them activations: more than fits")
    other = fastest_with_cp(plans)
    if other is None or other.step_s >= best.step_s:
        return "CP: not needed, and no faster with it"
    return (f"CP: not needed (a layout fits without it); the fastest with CP, "
            f"{other.layout.describe()}, is priced {1 - other.step_s / best.step_s:.0%} faster: "
            f"the model hides the ring behind attention and leaves out its costs (`recommend`)")


def fastest_with_mesh(plans: list[Plan], tp: int, cp: int, pp: int) -> Plan | None:
    """The fastest fitting way to run a given (tp, cp, pp) mesh."""
    return min((p for p in plans if p.fits and (p.layout.tp, p.layout.cp, p.layout.pp)
                == (tp, cp, pp)), key=lambda p: p.step_s, default=None)


def article_report() -> str:
    """The source article's numbers, recomputed, and its table against the planner's picks."""
    cfg = MODELS["llama2-7b"]
    one, eight = article_scenario(cfg, 1, 0), article_scenario(cfg, 8, 3)
    lines = [f"llama2-7b ({total_parameters(cfg) / 1e9:.2f}B), the article's arithmetic "
             "(fp16 weights + grads + Adam m, v; 8 × 512 tokens; attention without flash):",
             "  one GPU:        " + ", ".join(f"{k} {v / GB:.1f} GB" for k, v in one.items()),
             "  ZeRO-3 on 8:    " + ", ".join(f"{k} {v / GB:.1f} GB" for k, v in eight.items()),
             "", "strategy by size (planner's pick, mixed precision, 4M tokens per step):"]
    for name, gpus, seq, batch in TABLE_SCENARIOS:
        cfg = MODELS[name]
        plans = plan(cfg, gpus, 80, seq, batch)
        best = recommend(plans)
        rows, advice, pp_range = article_row(total_parameters(cfg))
        pick = best.layout.describe() if best else "nothing fits"
        lines.append(f"  {name:<17} {gpus:>6} GPUs: {pick:<52} | article ({rows} GPUs): {advice}")
        other = article_alternative(plans, pp_range)
        if best and other and not pp_range[0] <= best.layout.pp <= pp_range[1]:
            lines.append(f"    the article's depth, priced: {why_not(best, other)}")
    name, gpus, seq, batch, mesh = LONG_CONTEXT
    plans = plan(MODELS[name], gpus, 80, seq, batch)
    best = recommend(plans)
    lines += ["", f"long context (not in the article): {name}, {gpus} GPUs, {batch} × {seq} "
              f"tokens per step: {best.layout.describe() if best else 'nothing fits'}",
              f"  {cp_verdict(plans, best)}"]
    llama3 = fastest_with_mesh(plans, *mesh)
    if best and llama3:
        lines.append(f"  Llama 3's TP {mesh[0]} × CP {mesh[1]} × PP {mesh[2]}, priced: "
                     f"{why_not(best, llama3)}")
    return "\n".join(lines)


# (model, GPUs, seq_len, global batch in sequences): one scenario per row of the article's table.
TABLE_SCENARIOS = [
    ("llama2-7b", 8, 4096, 1024),
    ("llama2-13b", 16, 4096, 1024),
    ("llama2-70b", 64, 4096, 1024),
    ("llama-175b-shape", 256, 4096, 1024),
    ("llama3.1-405b", 16384, 8192, 2048),
]
# Llama 3 405B's long-context stage (Llama 3 paper, Table 4): 16,384 GPUs, 16M tokens per step
# of 128K-token sequences, on a TP 8 × CP 16 × PP 16 mesh.
LONG_CONTEXT = ("llama3.1-405b", 16384, 131072, 128, (8, 16, 16))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", choices=MODELS, default="llama2-70b")
    p.add_argument("--gpus", type=int, default=64)
    p.add_argument("--gpu-mem-gb", type=float, default=80.0)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--global-batch", type=int, default=None,
                   help="sequences per optimizer step (default: 4M tokens)")
    p.add_argument("--precision", choices=PRECISIONS, default="mixed",
                   help="bytes per parameter: article (2+2+4), mixed (2+2+12), fp32 (4+4+8)")
    p.add_argument("--eager-attention", action="store_true", help="keep the s×s scores (no flash)")
    p.add_argument("--headroom", type=float, default=0.9, help="usable fraction of GPU memory")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--top", type=int, default=12, help="candidates to print")
    p.add_argument("--article", action="store_true", help="print the article's numbers and table")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.article:
        print(article_report())
        return 0
    cfg = MODELS[args.model]
    batch = args.global_batch or max(1, 4 * 2**20 // args.seq_len)
    problems = [msg for ok, msg in [
        (args.gpus > 0, f"--gpus {args.gpus}: must be positive"),
        (args.gpu_mem_gb > 0, f"--gpu-mem-gb {args.gpu_mem_gb}: must be positive"),
        (args.seq_len > 0, f"--seq-len {args.seq_len}: must be positive"),
        (batch > 0, f"--global-batch {batch}: must be positive"),
        (0 < args.headroom <= 1, f"--headroom {args.headroom}: must be in (0, 1]"),
    ] if not ok]
    if problems:
        print("error: " + "; ".join(problems))
        return 2
    hw = Hardware(gpus_per_node=args.gpus_per_node)
    plans = plan(cfg, args.gpus, args.gpu_mem_gb, args.seq_len, batch, hw, args.precision,
                 args.headroom, args.eager_attention)
    n = total_parameters(cfg)
    print(f"{args.model}: {n / 1e9:.2f}B parameters, {args.gpus} × {args.gpu_mem_gb:g} GB GPUs, "
          f"{batch} × {args.seq_len} tokens per step, {args.precision} precision "
          f"({sum(PRECISIONS[args.precision])} bytes/parameter of model states)")
    print(f"{len(plans)} candidates, {sum(p.fits for p in plans)} fit in "
          f"{args.headroom:.0%} of {args.gpu_mem_gb:g} GB\n")
    print(format_plans(plans, args.top))
    best = recommend(plans)
    rows, advice, pp_range = article_row(n)
    print(f"\nrecommended: {best.layout.describe() if best else 'nothing fits: add GPUs'}")
    if best:
        print(f"  {best.memory['total'] / GB:.1f} GB per GPU, step ≈ {best.step_s:.2f} s, "
              f"MFU ≈ {best.mfu:.0%}")
    print(cp_verdict(plans, best))
    print(f"the article's table for this size ({rows} GPUs): {advice}")
    other = article_alternative(plans, pp_range)
    if best and other and not pp_range[0] <= best.layout.pp <= pp_range[1]:
        print(f"  its pipeline depth, priced: {why_not(best, other)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
