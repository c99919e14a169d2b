"""`make gpu-check`: every chapter on NCCL with `--check` (in float32 and in bf16 mixed precision;
the extra variants in float32), in one summary table that says what each row checked: DDP,
chapter 02's ring against NCCL's own all-reduce, ZeRO-3 with CPU offload, FSDP with forward and
backward prefetch, TP, context parallelism's ring attention, every pipeline schedule (GPipe,
1F1B, interleaved, ZB-H1: NCCL's P2P ordering is what gloo cannot show), the 3D mesh with 1F1B
and interleaved; each row's peak CUDA memory beside its memory formula; then a single-GPU bf16
throughput benchmark of the LLaMA model with its MFU. World size = the GPU count (the
interleaved pipeline: 4 or 2 stages, the small model's 8 layers in 2 chunks per rank); a row
that needs more GPUs than there are says so ("skipped: needs 2 GPUs"). Rows stop starting after
--budget-s, so that the whole check stays under 6 minutes; a row skipped for time is not a pass
(exit 1).

    MFU = achieved FLOP/s / peak FLOP/s,   FLOP per token ≈ 6·N + 12·L·d·T
(N = non-embedding parameters; the second term is attention's QKᵀ and AV, forward and backward).
Without CUDA it says so in one line and exits 2: a check that did not run must not look like a
pass. Works without the venv: `make gpu-check PY=python3` after
`python3 -m pip install --no-deps --no-build-isolation -e .`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from common.kernel.model import LlamaConfig, build_model, count_parameters, loss_fn

REPO_ROOT = Path(__file__).resolve().parent.parent
# Dense bf16 peak FLOP/s by device name (datasheet, SXM parts); `--peak-tflops` overrides.
PEAK_BF16_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10": 125.0,
                    "RTX 4090": 165.0, "RTX 3090": 71.0}
BENCH_CONFIG = LlamaConfig(dim=2048, n_layers=16, n_heads=16, n_kv_heads=4, vocab_size=32000,
                           multiple_of=256, max_seq_len=2048)
PRECISIONS = {"float32": [], "bf16-mixed": ["--mixed-precision", "bf16"]}


def chapter_dirs() -> list[Path]:
    return sorted(p.parent for p in REPO_ROOT.glob("0*_*/train.py"))


def mesh_3d(gpus: int) -> tuple[int, int, int]:
    """(dp, pp, tp) for chapter 07 on `gpus` ranks: TP first (≤ 2 here: the small model's 4
    kv-heads), then PP, then DP."""
    tp = 2 if gpus % 2 == 0 else 1
    pp = 2 if (gpus // tp) % 2 == 0 else 1
    return gpus // (tp * pp), pp, tp


def pipeline_flags(schedule: str) -> Callable[[int], list[str]]:
    return lambda ranks: ["--schedule", schedule, "--microbatches", str(max(4, 2 * ranks))]


def flags_3d(schedule: str) -> Callable[[int], list[str]]:
    def flags(ranks: int) -> list[str]:
        dp, pp, tp = mesh_3d(ranks)
        return ["--dp", str(dp), "--pp", str(pp), "--tp", str(tp), "--schedule", schedule,
                "--microbatches", str(max(4, 2 * pp))]
    return flags


def interleaved_ranks(gpus: int) -> int:
    """Stages for the interleaved schedule: p·v = p·2 chunks must divide the small model's 8 layers."""
    return 4 if gpus >= 4 else min(gpus, 2)


@dataclass(frozen=True)
class Check:
    """One row of the table: a chapter's train.py with `flags(ranks)` on `ranks(gpus)` GPUs."""
    label: str
    chapter: str
    checked: str  # what the row shows, printed in the table
    flags: Callable[[int], list[str]] = lambda ranks: []
    precisions: tuple[str, ...] = ("float32", "bf16-mixed")
    min_gpus: int = 1
    ranks: Callable[[int], int] = lambda gpus: gpus


CHECKS = (
    Check("01 DDP", "01_data_parallel", "bucketed all-reduce overlapped with backward"),
    Check("02 ring", "02_ring_allreduce", "ring (grouped P2P) vs NCCL all-reduce, 64 MiB busbw",
          lambda ranks: ["--bench-mb", "64"]),
    Check("03 ZeRO-3 offload", "03_zero", "ZeRO-3 sharding, AdamW on CPU (D2H, step, H2D)",
          lambda ranks: ["--stage", "3", "--offload"]),
    Check("04 FSDP", "04_fsdp", "FULL_SHARD, forward + backward prefetch",
          lambda ranks: ["--sharding-strategy", "FULL_SHARD"]),
    Check("05 TP", "05_tensor_parallel", "Megatron TP (DP over what 1, 2, 4, 8 leaves), vocab-parallel loss",
          lambda ranks: ["--tp", str(max(t for t in (1, 2, 4, 8) if ranks % t == 0))]),
    Check("05 CP ring", "05_tensor_parallel", "ring attention, zig-zag, cp = 1, 2, 4 or 8 dividing the "
          "GPUs (1 GPU: cp 1, no ring), P2P groups on NCCL",
          lambda ranks: ["--tp", "1", "--cp", str(max(c for c in (1, 2, 4, 8) if ranks % c == 0))]),
    Check("06 PP 1F1B", "06_pipeline", "1F1B schedule, one stage per GPU", pipeline_flags("1f1b")),
    Check("06 PP GPipe", "06_pipeline", "GPipe schedule: P2P groups on NCCL",
          pipeline_flags("gpipe"), ("float32",), 2),
    Check("06 PP interleaved", "06_pipeline", "interleaved 1F1B, v = 2: P2P groups on NCCL",
          pipeline_flags("interleaved"), ("float32",), 2, interleaved_ranks),
    Check("06 PP ZB-H1", "06_pipeline", "zero-bubble H1 (split B/W): P2P groups on NCCL",
          pipeline_flags("zb"), ("float32",), 2),
    Check("06 PP DualPipeV", "06_pipeline", "DualPipeV (V placement, split B/W): P2P groups on NCCL",
          pipeline_flags("dualpipev"), ("float32",), 2, interleaved_ranks),
    Check("07 3D 1F1B", "07_3d", "dp × pp × tp mesh, FSDP + TP + 1F1B", flags_3d("1f1b")),
    Check("07 3D interleaved", "07_3d", "dp × pp × tp mesh, interleaved pipeline",
          flags_3d("interleaved"), ("float32",), 4),
)


def row_argv(check: Check, precision: str, ranks: int) -> list[str]:
    """The row's train.py flags (after --check --log-every 0) on `ranks` processes."""
    return ["--model", "small", "--steps", "5", "--global-batch", str(8 * ranks),
            *PRECISIONS[precision], *check.flags(ranks)]


def run_chapter(chapter: Path, nproc: int, extra: list[str], timeout_s: float = 120) -> dict:
    """torchrun the chapter with --check; returns the report's key numbers (or the error)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), str(chapter / "train.py"), "--check", "--log-every", "0", *extra]
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout_s,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
    except subprocess.TimeoutExpired:
        return {"chapter": chapter.name, "ok": False, "error": f"timed out after {timeout_s:.0f} s"}
    lines = proc.stdout.strip().splitlines()
    try:
        report = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        return {"chapter": chapter.name, "ok": False, "error": proc.stderr.strip()[-400:]}
    memory, formula = report.get("memory", {}), report.get("memory_formula", {})
    bandwidth = report.get("bandwidth") or {}
    return {"chapter": chapter.name, "ok": proc.returncode == 0, "backend": report["backend"],
            "world": report["world_size"], "precision":
                "bf16-mixed" if report.get("mixed_precision") == "bf16" else report["dtype"],
            "max_grad_diff": report.get("max_grad_diff"), "tolerance": report.get("tolerance"),
            "tokens_per_s": report["tokens_per_s"],
            "comm_ratio": report["comm_bytes_per_rank"] / report["comm_bytes_formula"]
            if report.get("comm_bytes_formula") else None,
            "cuda_peak": memory.get("cuda_max_allocated"),
            "state_formula": sum(formula.get(k, 0) for k in ("params", "grads", "optimizer")),
            "ring_over_nccl": bandwidth["ring"]["busbw_GBps"] / bandwidth["builtin"]["busbw_GBps"]
            if {"ring", "builtin"} <= bandwidth.keys() and bandwidth["builtin"]["busbw_GBps"] else None,
            "seconds": time.perf_counter() - start}


def flops_per_token(cfg: LlamaConfig, n_params: int, seq_len: int) -> float:
    non_embedding = n_params - cfg.vocab_size * cfg.dim
    return 6 * non_embedding + 12 * cfg.n_layers * cfg.dim * seq_len


def throughput(cfg: LlamaConfig, device: torch.device, batch: int, seq_len: int, steps: int,
               warmup: int = 3, dtype: torch.dtype = torch.bfloat16, compile: bool = False) -> dict:
    """Training steps (forward, backward, AdamW, fused on CUDA) of the model in `dtype`: tokens/s
    and FLOP/s. SDPA picks its flash / cuDNN kernel for bf16 on CUDA by itself."""
    model = build_model(cfg, seed=0, dtype=dtype, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), device=device)
    forward = torch.compile(model) if compile else model

    def step() -> None:
        loss_fn(forward(tokens[:, :-1]), tokens[:, 1:]).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    for _ in range(warmup):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / steps
    n_params = count_parameters(model)
    tokens_per_s = batch * seq_len / seconds
    return {"params": n_params, "tokens_per_s": tokens_per_s,
            "flops_per_token": flops_per_token(cfg, n_params, seq_len),
            "flops_per_s": tokens_per_s * flops_per_token(cfg, n_params, seq_len)}


def peak_tflops(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict], gpus: int) -> None:
    print(f"\n{'check':<19}{'precision':>11}{'ok':>4}{'world':>6}{'grad diff':>10}{'tol':>7}"
          f"{'comm/formula':>13}{'tokens/s':>10}{'cuda peak MiB':>14}{'state formula MiB':>18}{'s':>6}"
          "  checked")
    for r in rows:
        head = f"{r['label']:<19}{r.get('precision', ''):>11}"
        if "skipped" in r:
            print(f"{head}{'-':>4}  skipped: {r['skipped']}  ({r['checked']})")
            continue
        if "error" in r:
            last = r["error"].splitlines()[-1] if r["error"] else ""
            print(f"{head}{'NO':>4}  {r['checked']}: {last[:150]}")
            continue
        mib = lambda b: None if b is None else b / 2**20  # noqa: E731
        print(f"{head}{'yes' if r['ok'] else 'NO':>4}{r['world']:>6}"
              f"{_fmt(r['max_grad_diff'], '.1e'):>10}{_fmt(r['tolerance'], '.0e'):>7}"
              f"{_fmt(r['comm_ratio'], '.4f'):>13}{r['tokens_per_s']:>10.0f}"
              f"{_fmt(mib(r['cuda_peak']), '.1f'):>14}{_fmt(mib(r['state_formula']), '.1f'):>18}"
              f"{r['seconds']:>6.1f}  {r['checked']}")
    ring = [r["ring_over_nccl"] for r in rows if r.get("ring_over_nccl") is not None]
    if ring:
        note = (" (one GPU: no peer, both are a local copy, so the ratio says nothing about the ring)"
                if gpus == 1 else "")
        print(f"\nchapter 02, 64 MiB all-reduce: ring busbw / NCCL busbw = {max(ring):.2f}{note}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak-tflops", type=float, default=None, help="override the bf16 peak")
    parser.add_argument("--steps", type=int, default=10, help="measured throughput steps")
    parser.add_argument("--compile", action="store_true", help="torch.compile the throughput model")
    parser.add_argument("--chapters", default=None, help="comma-separated directory prefixes (01,05)")
    parser.add_argument("--budget-s", type=float, default=230.0,
                        help="start no row after this many seconds (the throughput run follows)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device visible, nothing was checked; run it on a GPU machine "
              "(CPU runs: make test)")
        return 2
    nproc, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
    print(f"gpu-check: {nproc} × {name}, torch {torch.__version__}", flush=True)
    checks = [c for c in CHECKS if not args.chapters or c.chapter.startswith(tuple(args.chapters.split(",")))]
    rows, start = [], time.perf_counter()
    for check in checks:
        for precision in check.precisions:
            row = {"label": check.label, "precision": precision, "checked": check.checked}
            if nproc < check.min_gpus:
                row["skipped"] = f"needs {check.min_gpus} GPUs"
            elif time.perf_counter() - start > args.budget_s:
                row["skipped"] = f"time budget ({args.budget_s:.0f} s) spent, not checked"
            else:
                ranks = check.ranks(nproc)
                row |= run_chapter(REPO_ROOT / check.chapter, ranks, row_argv(check, precision, ranks),
                                   timeout_s=90)
                row["precision"] = precision
            rows.append(row)
            state = row.get("skipped") or ("ok" if row.get("ok") else "FAILED")
            print(f"  {check.label} {precision}: {state}", flush=True)
    bench = throughput(BENCH_CONFIG, torch.device("cuda", 0), batch=8, seq_len=2048,
                       steps=args.steps, compile=args.compile)
    peak = args.peak_tflops or peak_tflops(name)
    print_table(rows, nproc)
    mfu = f"{bench['flops_per_s'] / (peak * 1e12):.1%} of {peak:.0f}" if peak else \
        "unknown peak (--peak-tflops)"
    print(f"\nthroughput (1 GPU, bf16, {bench['params'] / 1e9:.2f}B params, batch 8 × 2048, fused "
          f"AdamW{', compiled' if args.compile else ''}): {bench['tokens_per_s']:.0f} tokens/s, "
          f"{bench['flops_per_token'] / 1e9:.2f} GFLOP/token (6N + 12·L·d·T), "
          f"{bench['flops_per_s'] / 1e12:.1f} TFLOP/s, MFU {mfu} TFLOP/s")
    return 0 if all(r.get("ok") or "needs" in r.get("skipped", "") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
