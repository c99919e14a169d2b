"""`make gpu-check`: every chapter on NCCL at world size = the GPU count with `--check` in float32
and in bf16 mixed precision, chapter 02's ring against NCCL's own all-reduce, each chapter's peak
CUDA memory beside its memory formula, and a single-GPU bf16 throughput benchmark of the LLaMA
model with its MFU, in one summary table (< 6 minutes on one GPU).

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
from pathlib import Path

import torch

from common.model import LlamaConfig, build_model, count_parameters, loss_fn

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


def chapter_flags(chapter: str, gpus: int) -> list[str]:
    """Each chapter's own flags for NPROC = gpus (the shared ones are added by the caller)."""
    dp, pp, tp = mesh_3d(gpus)
    return {
        "02_ring_allreduce": ["--bench-mb", "64"],
        "03_zero": ["--stage", "3", "--offload"],
        "04_fsdp": ["--sharding-strategy", "FULL_SHARD"],
        "05_tensor_parallel": ["--tp", str(gpus)],
        "06_pipeline": ["--schedule", "1f1b", "--microbatches", str(max(4, 2 * gpus))],
        "07_3d": ["--dp", str(dp), "--pp", str(pp), "--tp", str(tp), "--microbatches",
                  str(max(4, 2 * pp))],
    }.get(chapter, [])


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
    print(f"\n{'chapter':<20}{'precision':>11}{'ok':>4}{'world':>6}{'grad diff':>11}{'tol':>7}"
          f"{'comm/formula':>13}{'tokens/s':>10}{'cuda peak MiB':>14}{'state formula MiB':>18}{'s':>6}")
    for r in rows:
        if "error" in r:
            last = r["error"].splitlines()[-1] if r["error"] else ""
            print(f"{r['chapter']:<20}{r.get('precision', ''):>11}{'NO':>4}  {last[:150]}")
            continue
        mib = lambda b: None if b is None else b / 2**20  # noqa: E731
        print(f"{r['chapter']:<20}{r['precision']:>11}{'yes' if r['ok'] else 'NO':>4}{r['world']:>6}"
              f"{_fmt(r['max_grad_diff'], '.1e'):>11}{_fmt(r['tolerance'], '.0e'):>7}"
              f"{_fmt(r['comm_ratio'], '.4f'):>13}{r['tokens_per_s']:>10.0f}"
              f"{_fmt(mib(r['cuda_peak']), '.1f'):>14}{_fmt(mib(r['state_formula']), '.1f'):>18}"
              f"{r['seconds']:>6.1f}")
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
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device visible, nothing was checked; run it on a GPU machine "
              "(CPU runs: make test)")
        return 2
    nproc, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
    print(f"gpu-check: {nproc} × {name}, torch {torch.__version__}", flush=True)
    chapters = [c for c in chapter_dirs()
                if not args.chapters or c.name.startswith(tuple(args.chapters.split(",")))]
    rows = []
    for chapter in chapters:
        for precision, flags in PRECISIONS.items():
            shared = ["--model", "small", "--steps", "5", "--global-batch", str(8 * nproc)]
            row = run_chapter(chapter, nproc, [*shared, *flags, *chapter_flags(chapter.name, nproc)])
            row.setdefault("precision", precision)
            rows.append(row)
            print(f"  {chapter.name} {precision}: {'ok' if row.get('ok') else 'FAILED'}", flush=True)
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
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
