"""`make gpu-check`: every chapter on NCCL at world size = the GPU count, then a single-GPU bf16
throughput benchmark of the LLaMA model with its MFU, in one summary table (< 6 minutes).

    MFU = achieved FLOP/s / peak FLOP/s,   FLOP per token ≈ 6·N + 12·L·d·T
(N = non-embedding parameters; the second term is attention's QKᵀ and AV, forward and backward).
Works without the venv: `make gpu-check PY=python3` after
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


def chapter_dirs() -> list[Path]:
    return sorted(p.parent for p in REPO_ROOT.glob("0*_*/train.py"))


def run_chapter(chapter: Path, nproc: int, extra: list[str], timeout_s: float = 120) -> dict:
    """torchrun the chapter with --check; returns the report's key numbers (or the error)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(nproc), str(chapter / "train.py"), "--check", *extra]
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
    return {"chapter": chapter.name, "ok": proc.returncode == 0, "backend": report["backend"],
            "world": report["world_size"], "dtype": report["dtype"],
            "max_param_diff": report.get("max_param_diff"), "tokens_per_s": report["tokens_per_s"],
            "comm_ratio": report["comm_bytes_per_rank"] / report["comm_bytes_formula"]
            if report.get("comm_bytes_formula") else None,
            "seconds": time.perf_counter() - start}


def flops_per_token(cfg: LlamaConfig, n_params: int, seq_len: int) -> float:
    non_embedding = n_params - cfg.vocab_size * cfg.dim
    return 6 * non_embedding + 12 * cfg.n_layers * cfg.dim * seq_len


def throughput(cfg: LlamaConfig, device: torch.device, batch: int, seq_len: int, steps: int,
               warmup: int = 3, dtype: torch.dtype = torch.bfloat16) -> dict:
    """Training steps (forward, backward, AdamW) of the model in `dtype`: tokens/s and FLOP/s."""
    model = build_model(cfg, seed=0, dtype=dtype, device=device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq_len + 1), device=device)

    def step() -> None:
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
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
            "flops_per_s": tokens_per_s * flops_per_token(cfg, n_params, seq_len)}


def peak_tflops(name: str) -> float | None:
    return next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peak-tflops", type=float, default=None, help="override the bf16 peak")
    parser.add_argument("--steps", type=int, default=10, help="measured throughput steps")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device visible; run it on a GPU machine (CPU runs: make test)")
        return 2
    nproc, name = torch.cuda.device_count(), torch.cuda.get_device_name(0)
    print(f"gpu-check: {nproc} × {name}, torch {torch.__version__}", flush=True)
    rows = [run_chapter(ch, nproc, ["--model", "small", "--steps", "5", "--global-batch",
                                    str(8 * nproc)]) for ch in chapter_dirs()]
    bench = throughput(BENCH_CONFIG, torch.device("cuda", 0), batch=8, seq_len=2048, steps=args.steps)
    peak = args.peak_tflops or peak_tflops(name)

    print(f"\n{'chapter':<22}{'ok':>4}{'backend':>9}{'world':>7}{'dtype':>10}{'max_param_diff':>16}"
          f"{'comm/formula':>14}{'tokens/s':>12}{'s':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['chapter']:<22}{'NO':>4}  {r['error'].splitlines()[-1] if r['error'] else ''}")
            continue
        diff = f"{r['max_param_diff']:.2e}" if r["max_param_diff"] is not None else "-"
        ratio = f"{r['comm_ratio']:.4f}" if r["comm_ratio"] is not None else "-"
        print(f"{r['chapter']:<22}{'yes' if r['ok'] else 'NO':>4}{r['backend']:>9}{r['world']:>7}"
              f"{r['dtype']:>10}{diff:>16}{ratio:>14}{r['tokens_per_s']:>12.0f}{r['seconds']:>7.1f}")
    mfu = f"{bench['flops_per_s'] / (peak * 1e12):.1%}" if peak else "unknown peak (--peak-tflops)"
    print(f"\nthroughput (1 GPU, bf16, {bench['params'] / 1e9:.2f}B params, batch 8 × 2048): "
          f"{bench['tokens_per_s']:.0f} tokens/s, {bench['flops_per_s'] / 1e12:.1f} TFLOP/s, MFU {mfu}")
    return 0 if all(r.get("ok") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
