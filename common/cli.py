"""The flags every train.py shares, and the validation that runs before any collective.

Each rank parses the same argv, so each rank rejects bad input on its own, before
`init_process_group`: no rank is left waiting in a collective for a peer that already exited.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NamedTuple

import torch

from common.kernel.model import CONFIGS, LlamaConfig, get_config

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


class ConfigError(ValueError):
    """Bad input: the message names the flag, the value and the fix."""


class BatchLayout(NamedTuple):
    """global_batch = dp · grad_accum · micro_batch (sequences)."""

    micro_batch: int
    grad_accum: int


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--steps", type=int, default=20, help="optimizer steps")
    p.add_argument("--seed", type=int, default=0, help="init and data seed")
    p.add_argument("--dtype", choices=[*DTYPES, "float16"], default="float32",
                   help="parameter/compute dtype (float16: refused, use --mixed-precision fp16)")
    p.add_argument("--model", choices=CONFIGS, default="small", help="named LLaMA config")
    p.add_argument("--global-batch", type=int, default=16, help="sequences per optimizer step")
    p.add_argument("--micro-batch", type=int, default=None,
                   help="sequences per forward/backward (default: global / (dp · grad-accum))")
    p.add_argument("--grad-accum", type=int, default=None,
                   help="micro-batches per optimizer step per rank (default: derived, else 1)")
    p.add_argument("--seq-len", type=int, default=64, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=1e-3, help="learning rate")
    p.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    p.add_argument("--clip-grad", type=float, default=None, metavar="MAX_NORM",
                   help="clip gradients to this global L2 norm (torch.nn.utils.clip_grad_norm_)")
    p.add_argument("--mixed-precision", choices=("none", "bf16", "fp16"), default="none",
                   help="bf16: compute in bfloat16 with fp32 master weights, fp32 gradient reduction "
                        "and fp32 optimizer state (needs --dtype float32); fp16: the same in float16, "
                        "with dynamic loss scaling (chapters 01, 03 and 04)")
    p.add_argument("--log-every", type=int, default=1, metavar="K",
                   help="print a progress line every K steps on rank 0 (0: quiet)")
    p.add_argument("--data", default=None, metavar="FILE",
                   help="byte-level text file (default: this repo's .md/.py); 'synthetic' for random tokens")
    p.add_argument("--check", action="store_true",
                   help="also train the single-device reference; exit 1 if losses, gradients or "
                        "parameters differ beyond the dtype's tolerance")
    p.add_argument("--measure-activations", action=argparse.BooleanOptionalAction, default=None,
                   help="count autograd's saved tensors for activations_peak (hooks on every saved "
                        "tensor, every step); default: on, off on CUDA (see cuda_max_allocated)")
    p.add_argument("--report", default=None, metavar="PATH", help="write the JSON report here")
    p.add_argument("--observed-comm", action="store_true",
                   help="also print the bytes gloo wrote and on the loopback (always in the JSON)")
    p.add_argument("--profile", default=None, metavar="DIR",
                   help="write a torch.profiler trace per rank, DIR/rank{r}.json (Perfetto / "
                        "chrome://tracing), of the timed windows of two steps after a warm-up one; "
                        "draw it with `python -m common.profile DIR` (timings slow down meanwhile)")
    return p


def model_config(args: argparse.Namespace) -> LlamaConfig:
    """`args.cfg` when a test passes a drawn config, else the named `--model`."""
    return getattr(args, "cfg", None) or get_config(args.model)


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)


def batch_layout(global_batch: int, dp: int, micro_batch: int | None,
                 grad_accum: int | None) -> BatchLayout:
    """(micro_batch, grad_accum) with global_batch = dp · grad_accum · micro_batch."""
    require(global_batch > 0, f"--global-batch {global_batch}: must be positive")
    require(global_batch % dp == 0,
            f"--global-batch {global_batch} is not divisible by the data-parallel size {dp}: use a "
            f"multiple of {dp}, e.g. --global-batch {dp * max(1, round(global_batch / dp))}")
    per_rank = global_batch // dp
    for flag, value in (("--micro-batch", micro_batch), ("--grad-accum", grad_accum)):
        require(value is None or value > 0, f"{flag} {value}: must be positive")
    if micro_batch is None:
        grad_accum = grad_accum or 1
        require(per_rank % grad_accum == 0,
                f"--grad-accum {grad_accum} does not divide the {per_rank} sequences per rank "
                f"(--global-batch {global_batch} / dp {dp}): use a divisor of {per_rank}")
        return BatchLayout(per_rank // grad_accum, grad_accum)
    require(per_rank % micro_batch == 0,
            f"--micro-batch {micro_batch} does not divide the {per_rank} sequences per rank "
            f"(--global-batch {global_batch} / dp {dp}): use a divisor of {per_rank}")
    require(grad_accum is None or grad_accum * micro_batch == per_rank,
            f"--grad-accum {grad_accum} × --micro-batch {micro_batch} != {per_rank} sequences per "
            f"rank (--global-batch {global_batch} / dp {dp}): drop one of the two flags")
    return BatchLayout(micro_batch, per_rank // micro_batch)


# Where `--mixed-precision fp16` runs: the strategies whose step agrees the loss scaler's overflow
# flag over their data-parallel group (01's ddp, 03, 04's own FSDP). The others refuse it.
FP16_STRATEGIES = "01_data_parallel --strategy ddp, 03_zero, 04_fsdp --impl ours"


def validate_common(args: argparse.Namespace, loss_scaling: bool = False) -> None:
    """The shared flags' checks; `loss_scaling`: this chapter's strategy runs --mixed-precision fp16."""
    require(args.dtype != "float16",
            "--dtype float16: fp16 parameters lose every update below 2^-11 of a weight and fp16 "
            "gradients underflow; use --dtype float32 --mixed-precision fp16 (fp32 master weights, "
            "dynamic loss scaling)")
    require(getattr(args, "mixed_precision", "none") != "fp16" or loss_scaling,
            f"--mixed-precision fp16: this chapter's strategies do not run the loss scaler; fp16 "
            f"trains in {FP16_STRATEGIES}; here use --mixed-precision bf16 (fp32's range: no scaling)")
    require(getattr(args, "mixed_precision", "none") != "fp16" or not model_config(args).n_experts,
            f"--mixed-precision fp16 with --model {args.model}, a mixture of experts: its aux loss's "
            "gradient is not loss-scaled here; use --mixed-precision bf16")
    require(args.steps > 0, f"--steps {args.steps}: must be positive")
    require(args.seq_len > 0, f"--seq-len {args.seq_len}: must be positive")
    require(args.lr > 0, f"--lr {args.lr}: must be positive")
    clip = getattr(args, "clip_grad", None)
    require(clip is None or clip > 0, f"--clip-grad {clip}: must be > 0 (omit the flag to not clip)")
    require(getattr(args, "log_every", 0) >= 0, f"--log-every {args.log_every}: must be >= 0")
    require(getattr(args, "mixed_precision", "none") == "none" or args.dtype == "float32",
            f"--mixed-precision {getattr(args, 'mixed_precision', None)} with --dtype {args.dtype}: "
            "the master weights are float32, use --dtype float32")
    require(args.data in (None, "synthetic") or Path(args.data).is_file(),
            f"--data {args.data}: no such file; pass a text file, or 'synthetic' for random tokens")
    vocab = model_config(args).vocab_size
    require(args.data == "synthetic" or vocab >= 256,
            f"--model {args.model} has vocab {vocab} < 256 bytes: use --data synthetic")


def exit_on_config_error(rank: int | str, error: ConfigError) -> None:
    print(f"[rank {rank}] error: {error}", file=sys.stderr, flush=True)
    sys.exit(2)
