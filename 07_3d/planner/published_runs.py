"""Published training runs: the layout each source states and the throughput it measured.

Every number here is the source's (its table, its script, its config at the commit named) or
arithmetic on them (dp = GPUs / (tp·cp·pp), micro-batches from the batch); `assumed` names the
layout knobs the source does not state, which the planner prices at the value written here.
`figure` says what the published number is: the definitions are `published.FIGURES`.
Runs left out, and why: python -m parallel3d.planner --published prints them (LEFT_OUT).
"""

from __future__ import annotations

from dataclasses import dataclass

from common.kernel.model import LlamaConfig


@dataclass(frozen=True)
class Source:
    title: str
    year: int
    where: str   # the table or section, and where its numbers were read
    url: str


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: Source
    model: str                 # a key of SHAPES here or of the planner's models
    gpu: str                   # a key of hardware.GPUS
    gpus: int
    tp: int
    pp: int
    dp: int
    micro_batch: int
    global_batch: int          # sequences per optimizer step
    seq_len: int
    recompute: str             # none | selective | full
    zero: int                  # 0 DDP, 1/2 ZeRO-1/2, 3 FSDP
    figure: str                # a key of published.FIGURES
    value: float               # the published number, in that figure's unit
    cp: int = 1
    ep: int = 1
    virtual_stages: int = 1
    gpu_mem_gb: float = 80.0
    fp8: bool = False          # FP8 matmuls: outside what the planner prices (a bf16 peak)
    sequence_parallel: bool = True  # SP at TP > 1 (Megatron-LM from 2022, torchtitan)
    flash_attention: bool = True    # no s×s scores kept (FlashAttention, 2022)
    schedule: str = "1f1b"          # the pipeline's (interleaved when virtual_stages > 1) | dualpipe
    precision: str = "mixed"        # bytes per parameter: memory_model.PRECISIONS
    act_bytes: float | None = None  # what the linear layers cache their inputs in (1: FP8)
    memory_gib: float | None = None  # the peak memory per GPU the source measured, if it did
    assumed: tuple[str, ...] = ()
    note: str = ""


def gpt(dim: int, n_layers: int, n_heads: int, vocab_size: int) -> LlamaConfig:
    """A GPT block as a LLaMA one of the same FLOPs: MHA, and a SwiGLU of width 8h/3 (3·h·8h/3 =
    GPT's 2·h·4h MLP weights)."""
    return LlamaConfig(dim=dim, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_heads,
                       vocab_size=vocab_size, multiple_of=1)


MEGATRON_2021 = Source(
    "Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using "
    "Megatron-LM (SC21)", 2021,
    "Table 1 (figures: NVIDIA/Megatron-LM README, images/cases_april2021.png; layouts: "
    "examples/sc21/run_table_1.sh and CONFIG.sh at commit de7dc40f, 2021-08-10)",
    "https://arxiv.org/abs/2104.04473")
MEGATRON_CORE_2024 = Source(
    "NVIDIA Megatron-LM README, Training Speed and Scalability (Megatron-Core r0.8.0)", 2024,
    "images/model_table.png, commit f2e5db40 (2024-07-15): vocabulary 131,072, sequence 4096, "
    "--overlap-grad-reduce --overlap-param-gather (the distributed optimizer: ZeRO-1)",
    "https://github.com/NVIDIA/Megatron-LM")
LLAMA3 = Source(
    "Llama Team, AI @ Meta, The Llama 3 Herd of Models", 2024,
    "Table 4 (GPUs, TP, CP, PP, tokens per batch, TFLOPs/GPU; as shown again in Balaji, Herding "
    "Llamas, SC'24); sequence 8K, then 128K (section 3.4); section 3.3.2: FSDP not resharded after "
    "forward, one layer fewer on the first and last stages, no activation checkpointing at 8K",
    "https://arxiv.org/abs/2407.21783")
TORCHTITAN_2024 = Source(
    "TorchTitan performance benchmarks, Llama 3.1 on H100 (Grand Teton, 500 W, 96 GB HBM2e)",
    2024, "benchmarks/llama3_h100_202412_torchtitan.md, Tables 1, 3-5, TPS/GPU and Memory(GiB) "
    "(torchtitan 9dec370; seq_len 8192 and the PP defaults, m = pp and 2 stages per rank when "
    "looped, from that commit's train_configs and pipelining_utils.py; 'op' selective AC and no "
    "FSDP reshard under PP from parallelisms/parallelize_llama.py)",
    "https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md")
TORCHTITAN_DOCS = Source(
    "TorchTitan docs/performance.md (FSDP2 on 64 A100 80GB; 405B on 128 H100 95GB)", 2024,
    "docs/performance.md at commit 4d88a8a4 (2024-12-03): WPS per GPU, local batch 1 (405B: 2); "
    "seq_len 8192 from that commit's train_configs",
    "https://github.com/pytorch/torchtitan/blob/4d88a8a44/docs/performance.md")
DEEPSEEK_V3 = Source(
    "DeepSeek-AI, DeepSeek-V3 Technical Report", 2024,
    "README (2.664M H800 GPU hours for pre-training on 14.8T tokens); report section 3.2 (PP 16, "
    "EP 64 over 8 nodes, ZeRO-1 DP, no TP, DualPipe and its Table 2; confirmed in deepseek-ai/DeepEP's "
    "issue tracker), 3.2.3 and 3.3.2 (recomputed RMSNorm and MLA up-projections, FP8 activations, "
    "bf16 Adam moments, fp32 gradients) and 4.2 (sequence 4K, batch 3072 → 15360 sequences)",
    "https://arxiv.org/abs/2412.19437")

SHAPES: dict[str, LlamaConfig] = {
    # Megatron-LM 2021 (run_table_1.sh: hidden, layers, heads; vocabulary 51,200)
    **{f"gpt-{n} (2021)": gpt(h, L, a, 51200) for n, h, L, a in [
        ("1.7b", 2304, 24, 24), ("3.6b", 3072, 30, 32), ("7.5b", 4096, 36, 32),
        ("18b", 6144, 40, 48), ("39b", 8192, 48, 64), ("76b", 10240, 60, 80),
        ("145b", 12288, 80, 96), ("310b", 16384, 96, 128), ("530b", 20480, 105, 128),
        ("1t", 25600, 128, 160)]},
    # Megatron-Core 2024 (model_table.png: heads, hidden, layers; vocabulary 131,072)
    **{f"gpt-{n} (2024)": gpt(h, L, a, 131072) for n, h, L, a in [
        ("1.7b", 2048, 24, 16), ("7.1b", 4096, 30, 32), ("16b", 6144, 32, 48),
        ("32b", 7168, 48, 56), ("70b", 8192, 84, 64), ("119b", 10240, 92, 80),
        ("177b", 12288, 96, 96), ("314b", 16384, 96, 128), ("462b", 18432, 112, 144)]},
}

_M21 = "megatron-2021 TFLOP/s"
_MC = "megatron-core TFLOP/s"
_UNSTATED_2024 = ("micro_batch", "virtual_stages", "recompute")

RUNS: tuple[PublishedRun, ...] = (
    # name, h, L from SHAPES; (TP, PP, MBS, GBS, layers per virtual stage → v, GPUs, TFLOP/s);
    # fp16 with full (uniform) recomputation in every row: 2021 had neither sequence
    # parallelism nor flash attention (both 2022), so nothing lighter fit.
    *(PublishedRun(f"Megatron-LM GPT {n}", MEGATRON_2021, f"gpt-{n} (2021)", "A100", g, tp, pp,
                   g // (tp * pp), mb, gb, 2048, "full", 0, _M21, tf, virtual_stages=v,
                   sequence_parallel=False, flash_attention=False)
      for n, tp, pp, mb, gb, v, g, tf in [
          ("1.7b", 1, 1, 16, 512, 1, 32, 137), ("3.6b", 2, 1, 16, 512, 1, 64, 138),
          ("7.5b", 4, 1, 16, 512, 1, 128, 142), ("18b", 8, 1, 8, 1024, 1, 256, 135),
          ("39b", 8, 2, 4, 1536, 1, 512, 138), ("76b", 8, 4, 2, 1792, 3, 1024, 140),
          ("145b", 8, 8, 2, 2304, 2, 1536, 148), ("310b", 8, 16, 1, 2160, 2, 1920, 155),
          ("530b", 8, 35, 1, 2520, 3, 2520, 163), ("1t", 8, 64, 1, 3072, 1, 3072, 163)]),
    # (TP, PP, DP, batch, TFLOP/s per GPU; the table's MFU is that / 989)
    *(PublishedRun(f"Megatron-Core GPT {n}", MEGATRON_CORE_2024, f"gpt-{n} (2024)",
                   "H100-superpod",
                   tp * pp * dp, tp, pp, dp, 1, gb, 4096, "none", 1, _MC, tf,
                   assumed=_UNSTATED_2024)
      for n, tp, pp, dp, gb, tf in [
          ("1.7b", 1, 1, 48, 192, 408.8), ("7.1b", 2, 1, 48, 192, 465.9),
          ("16b", 4, 1, 48, 192, 489.1), ("32b", 8, 1, 48, 192, 459.6),
          ("70b", 8, 2, 48, 384, 419.7), ("119b", 8, 4, 48, 768, 420.5),
          ("177b", 8, 6, 48, 1152, 432.8), ("314b", 8, 8, 48, 1536, 474.4),
          ("462b", 8, 16, 48, 3072, 459.9)]),
    # 16M tokens per step; no recomputation at 8K (§3.3.2: "without activation
    # checkpointing"; the 128K stage is not said: priced the same); interleaved with one layer
    # per chunk (§3.3.2: the first and last stages drop a layer so that their first and last
    # chunks hold only the embedding and the head: 126 + 2 = 16 stages × 8 chunks); FSDP
    # that does not reshard the weights after forward (§3.3.2): ZeRO-2.
    *(PublishedRun(f"Llama 3 405B, {g // 1024}K GPUs, {s // 1024}K", LLAMA3, "llama3.1-405b", "H100",
                   g, 8, 16, g // (8 * cp * 16), 1, 16 * 2**20 // s, s, "none", 2,
                   "palm TFLOP/s", tf, cp=cp, virtual_stages=8,
                   assumed=("micro_batch",) + (("recompute",) if cp > 1 else ()))
      for g, cp, s, tf in [(8192, 1, 8192, 430), (16384, 1, 8192, 400), (16384, 16, 131072, 380)]),
    # "selective" in torchtitan's tables is its per-op policy ('op': selective_ac_option in
    # that commit's train_configs/llama3_8b.toml): recompute "op"; Memory(GiB) as measured.
    PublishedRun("torchtitan 8B FSDP, 8 GPUs", TORCHTITAN_2024, "llama3.1-8b", "H100-500W", 8, 1, 1, 8,
                 2, 16, 8192, "op", 3, "tokens/s", 5762, gpu_mem_gb=96, memory_gib=82.4),
    PublishedRun("torchtitan 8B FSDP, 128 GPUs", TORCHTITAN_2024, "llama3.1-8b", "H100-500W", 128, 1, 1,
                 128, 2, 256, 8192, "op", 3, "tokens/s", 5605, gpu_mem_gb=96, memory_gib=67.0),
    PublishedRun("torchtitan 70B FSDP 32 × TP 8", TORCHTITAN_2024, "llama3.1-70b", "H100-500W", 256, 8,
                 1, 32, 16, 512, 8192, "full", 3, "tokens/s", 829, gpu_mem_gb=96, fp8=True,
                 memory_gib=71.9),
    *(PublishedRun(f"torchtitan 405B 3D, {sched}", TORCHTITAN_2024, "llama3.1-405b", "H100-500W", 512,
                   8, 8, 8, 4, 256, 8192, "full", 2, "tokens/s", tps, virtual_stages=v,
                   gpu_mem_gb=96, fp8=True, memory_gib=gib)
      for sched, v, tps, gib in [("1F1B", 1, 100, 82.5), ("interleaved", 2, 128, 72.7)]),
    PublishedRun("torchtitan 8B FSDP, 64 A100", TORCHTITAN_DOCS, "llama3.1-8b", "A100", 64, 1, 1,
                 64, 1, 64, 8192, "op", 3, "tokens/s", 2973, note="docs MFU 58.2%"),
    PublishedRun("torchtitan 70B FSDP, 64 A100", TORCHTITAN_DOCS, "llama3.1-70b", "A100", 64, 1, 1,
                 64, 1, 64, 8192, "full", 3, "tokens/s", 331, note="docs MFU 51.7%"),
    PublishedRun("torchtitan 405B FSDP 16 × TP 8", TORCHTITAN_DOCS, "llama3.1-405b", "H100-500W", 128, 8,
                 1, 16, 2, 32, 8192, "full", 3, "tokens/s", 109, gpu_mem_gb=95,
                 note="docs MFU 29.0% (against the SXM peak; its GPUs run below it)"),
    # 14.8T tokens / (2.664M GPU hours · 3600 s): the whole pre-training, restarts included.
    # DualPipe (§3.2.1); recomputation of every RMSNorm and the MLA up-projections, the SwiGLU
    # inputs cached and its output rerun (§3.2.3, §3.3.2); the linear layers' inputs cached in
    # FP8 (§3.3.2); fp32 gradients and master weights, Adam's moments in bf16 (§3.3.2).
    PublishedRun("DeepSeek-V3 pre-training", DEEPSEEK_V3, "deepseek-v3", "H800", 2048, 1, 16, 128,
                 1, 15360, 4096, "deepseek", 1, "tokens/s", 14.8e12 / (2.664e6 * 3600), ep=64,
                 fp8=True, schedule="dualpipe", precision="bf16-moments", act_bytes=1,
                 assumed=("micro_batch",)),
)

# Published runs not in RUNS, and why.
LEFT_OUT = (
    "Llama 3's micro-batch and its 128K stage's recomputation: not in the paper (priced as mb 1, "
    "none)",
    "Megatron-LM 2022 MFU/HFU table (22B-1T, README): its layouts are in the paper's Table 3, "
    "which could not be read here",
    "torchtitan Tables 2 and 6 (CP 1-8 at 32K-256K): Float8, and the sequence sweep adds nothing "
    "the 128K Llama 3 row does not",
    "DeepSeek-V3's MFU: not published; its GPU hours give tokens/s per GPU only",
    "DeepSeek-V3's node-limited routing, FP8 dispatch, multi-token-prediction block and the SMs "
    "its all-to-alls take: not priced; its FP8 matmuls priced at the bf16 peak",
    "fp32 gradient reduction (Llama 3, torchtitan's default reduce dtype): priced in bf16",
    "Llama 3's interleaved schedule with a tunable N (§3.3.2): priced with Megatron's N = p, "
    "which puts its 8K-GPU stage at 84 GB of 80",
)
