"""One run: everything a chapter's `validate` resolved from the flags, frozen, and all that the
strategy, the shared loop and the report read. The argparse namespace stops at validation.

    flags (argparse) ──validate(args, world_size)──▶ Run ──build(run, ctx)──▶ Strategy
                                                      └──train(run, ctx, strategy, chapter)──▶ report

Each value is derived once, in validation: the model config, the mesh shape (common/kernel/mesh.py), the
batch layout (global_batch = dp · grad_accum · micro_batch), the dtypes, and the chapter's own
resolved options (`options`: a frozen dataclass of the chapter, e.g. 06's schedule with its
virtual stages and partition, 03's ZeroConfig merged from the flags and a DeepSpeed file).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any

import torch

from common.cli import DTYPES, BatchLayout, model_config
from common.kernel.mesh import MeshShape
from common.kernel.model import LlamaConfig
from common.loss_scaler import LossScaling

COMPUTE_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}  # --mixed-precision → compute dtype


@dataclass(frozen=True)
class Run:
    model: LlamaConfig
    mesh: MeshShape
    options: Any  # the chapter's resolved options (a frozen dataclass), or None
    steps: int
    seed: int
    dtype: torch.dtype  # parameters, gradients' masters, optimizer state (float32 under mixed precision)
    mixed_precision: str  # "none" | "bf16" | "fp16": bf16/fp16 compute, fp32 masters, fp32 reduction
    optimizer: str  # adamw | sgd
    lr: float
    clip_grad: float | None  # the max global norm; None: no clipping
    global_batch: int  # sequences per optimizer step
    micro_batch: int  # sequences per forward/backward
    grad_accum: int  # micro-batches per step per data-parallel rank
    seq_len: int
    data: str | None  # a text file, None (this repository's text) or "synthetic"
    # how the loop runs and reports (the shared flags of the same names)
    check: bool = False
    log_every: int = 0
    measure_activations: bool | None = None
    profile: str | None = None
    report: str | None = None
    observed_comm: bool = False
    loss_scaling: LossScaling = field(default_factory=LossScaling)  # fp16's (torch GradScaler's defaults)

    @property
    def mixed(self) -> bool:
        return self.mixed_precision in COMPUTE_DTYPES

    @property
    def compute_dtype(self) -> torch.dtype:
        """What forward and backward run in: bf16/fp16 under mixed precision, else the parameters' dtype."""
        return COMPUTE_DTYPES.get(self.mixed_precision, self.dtype)

    @property
    def dtype_name(self) -> str:
        return str(self.dtype).removeprefix("torch.")


def resolve_run(args: argparse.Namespace, mesh: MeshShape, layout: BatchLayout, options: Any = None,
                **resolved) -> Run:
    """The Run of checked flags (common.cli.validate_common and the chapter's checks ran first):
    the shared flags as typed, the chapter's mesh, layout and options, and `resolved` in place of
    a shared flag the chapter resolved otherwise (03: clip_grad, mixed_precision and global_batch
    from its DeepSpeed file). fp16's loss scaling has no flag (GradScaler's defaults); a test's
    namespace may carry `loss_scaling`, as it carries a drawn `cfg`."""
    shared = dict(
        model=model_config(args), mesh=mesh, options=options, steps=args.steps, seed=args.seed,
        dtype=DTYPES[args.dtype], mixed_precision=args.mixed_precision, optimizer=args.optimizer,
        lr=args.lr, clip_grad=args.clip_grad, global_batch=args.global_batch,
        micro_batch=layout.micro_batch, grad_accum=layout.grad_accum, seq_len=args.seq_len,
        data=args.data, check=args.check, log_every=args.log_every,
        measure_activations=args.measure_activations, profile=args.profile, report=args.report,
        observed_comm=args.observed_comm, loss_scaling=getattr(args, "loss_scaling", None) or LossScaling())
    return Run(**(shared | resolved))
