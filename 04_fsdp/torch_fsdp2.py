"""torch's own FSDP2 (`torch.distributed.fsdp.fully_shard`) as a yardstick for chapter 04.

The same units as ours (each TransformerBlock, then the root) under the shared Strategy interface,
so `train.py --impl torch-fsdp2 --check` holds torch's implementation to the same single-device
reference as ours, and bench.py times both. On CPU it needs torch >= 2.7 (`fsdp2_unavailable`).

FSDP2 shards every parameter along dim 0 (a DTensor per parameter, each padded to a multiple of
N rows) instead of one flat parameter per unit; the bytes it gathers and reduces are the same up
to that padding, which the formulas below count:

    padded(p) = ⌈rows/N⌉·N · numel/rows        comm/step = (N-1)/N · (gathers·b_param + reduces·b_reduce)

FSDP2 picks its reduce op by dtype: float64 reduces with SUM and divides by N itself; float32 and
bf16 ask for ReduceOp.AVG. On torch 2.13 gloo computes that AVG correctly (checked: the gradient
norm matches one device); CONTRIBUTING.md's rule of the NCCL path (older gloo returns the SUM
for an AVG reduce-scatter) is why the course's own code never uses AVG, and `--check`'s gradient comparison
is what would show it (a loss curve under AdamW barely does).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import nn

from common.dist import DistContext
from common.kernel.model import build_model, initializer
from common.kernel.optimizer_bytes import optimizer_state_bytes
from common.memory import ActivationMeter, optimizer_state_tensors, storage_bytes
from common.reference import make_optimizer
from common.run import Run
from common.training import Strategy


def fsdp2_unavailable(device_type: str) -> str | None:
    """Why torch's FSDP2 cannot run here, or None. A feature test, not a version test: FSDP2 calls
    `record_event()` on the device's streams, which torch's CPU stream gained in 2.7 (pytorch#145935);
    on 2.6 a CPU run fails with an AttributeError."""
    stream = getattr(getattr(torch, device_type, None), "Stream", None)
    if stream is None or not hasattr(stream, "record_event"):
        return (f"torch {torch.__version__}'s {device_type} stream has no record_event(), which torch's "
                f"FSDP2 (fully_shard) needs: use torch >= 2.7 on {device_type.upper()}")
    return None


def local(t: torch.Tensor) -> torch.Tensor:
    """The rank's own part of a DTensor."""
    return t.to_local() if hasattr(t, "to_local") else t


def padded_numel(p: torch.Tensor, n: int) -> int:
    """FSDP2 pads dim 0 to a multiple of n."""
    rows = p.shape[0] if p.dim() else 1
    return -(-rows // n) * n * (p.numel() // max(rows, 1))


def fully_shard_llama(model: nn.Module, device: torch.device, reshard: bool,
                      param_dtype: torch.dtype | None = None) -> nn.Module:
    """torch's FSDP2 with our units: each block, then the root, which stays gathered from forward
    to backward as ours; `param_dtype` bf16 → MixedPrecisionPolicy(bf16, reduce fp32)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=param_dtype,
                                  reduce_dtype=torch.float32 if param_dtype is not None else None)
    for block in model.layers:
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, mp_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=False, mp_policy=policy)
    return model


class TorchFSDP2Strategy(Strategy):
    """`train.py --impl torch-fsdp2`: torch's fully_shard under the shared Strategy interface."""

    def __init__(self, run: Run, ctx: DistContext):
        self.run, self.mixed, self.grad_accum = run, run.mixed, run.grad_accum
        model = build_model(run.model, dtype=run.dtype, device="meta")
        self.sizes = ([[padded_numel(p, ctx.world_size) for p in b.parameters()] for b in model.layers],
                      [padded_numel(p, ctx.world_size) for n, p in model.named_parameters()
                       if not n.startswith("layers.")])
        fully_shard_llama(model, ctx.device, run.options.sharding_strategy == "FULL_SHARD",
                          torch.bfloat16 if self.mixed else None)
        model.to_empty(device=ctx.device)  # this rank's dim-0 chunk of each parameter, uninitialized
        init = initializer(run.model, run.seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                chunks = init(name).chunk(ctx.world_size)  # FSDP2's layout: torch.chunk on dim 0
                if ctx.rank < len(chunks):
                    p.to_local().copy_(chunks[ctx.rank])
        self.model = model
        self.optimizer = make_optimizer(model.parameters(), run.optimizer, run.lr)
        self.name = f"torch-fsdp2-{run.options.sharding_strategy.lower()}"
        self.dp_rank, self.dp_size = ctx.rank, ctx.world_size
        self.clip_grad = run.clip_grad

    @contextmanager
    def no_sync(self) -> Iterator[None]:
        """--no-sync: FSDP2's set_requires_gradient_sync(False), no reduce-scatter until the last."""
        self.model.set_requires_gradient_sync(not self.run.options.no_sync)
        try:
            yield
        finally:
            self.model.set_requires_gradient_sync(True)

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """torch's own, on the DTensor gradients (it all-reduces the sharded norm itself)."""
        return torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm, foreach=False)

    def _full(self, grads: bool) -> dict[str, torch.Tensor] | None:
        out = {n: (p.grad if grads else p).full_tensor().detach() for n, p in self.model.named_parameters()}
        return out if dist.get_rank() == 0 else None

    def full_gradients(self) -> dict[str, torch.Tensor] | None:
        return self._full(grads=True)

    def full_parameters(self) -> dict[str, torch.Tensor] | None:
        return self._full(grads=False)

    def memory(self) -> dict[str, int]:
        params = [local(p) for p in self.model.parameters()]
        return {"params": storage_bytes(params),
                "grads": storage_bytes(local(p.grad) for p in self.model.parameters() if p.grad is not None),
                "optimizer": storage_bytes(local(t) for t in optimizer_state_tensors(self.optimizer))}

    def activation_meter(self) -> ActivationMeter:
        return ActivationMeter(local(p) for p in self.model.parameters())

    def formulas(self, steps: int) -> tuple[float, dict[str, float]]:
        """Our FSDP's formulas with FSDP2's per-parameter dim-0 padding: the root gathered once
        per micro-batch, each block twice (FULL_SHARD) or once (SHARD_GRAD_OP), one reduce-
        scatter per micro-batch; the state is each parameter's padded 1/N shard. Clipping's norm
        all-reduce runs through DTensor's functional collectives, which the meter does not see,
        so it is not counted here either."""
        n = self.dp_size
        blocks, root = self.sizes
        accum = self.grad_accum
        b_param = 2 if self.mixed else self.run.dtype.itemsize
        b_reduce = 4 if self.mixed else b_param
        b = self.run.dtype.itemsize
        total = sum(map(sum, blocks)) + sum(root)
        per_block = 2 if self.run.options.sharding_strategy == "FULL_SHARD" else 1
        gathers = sum(root) + sum(map(sum, blocks)) * per_block
        reduces = 1 if self.run.options.no_sync else accum
        comm = steps * (n - 1) / n * (accum * gathers * b_param + reduces * total * b_reduce)
        shard = total // n * b
        opt = optimizer_state_bytes(self.run.optimizer, total // n, b, len(list(self.model.parameters())))
        return comm, {"params": shard, "grads": shard, "optimizer": opt}

    def report_extras(self) -> dict:
        return {"impl": "torch-fsdp2", "torch": torch.__version__,
                "sharding_strategy": self.run.options.sharding_strategy}
