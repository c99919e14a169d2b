"""One training loop for every chapter, and the small interface a chapter implements.

The loop owns the step (micro-batch loop, clipping, optimizer) and all around it: data, timing,
comm meter, memory ledger, progress, `--check` against the single-device reference, the verdict
broadcast, the run report. A chapter owns how its model is wrapped (torchtitan's split between a
model and its `parallelize_*`): it fills `Strategy`'s hooks; a pipeline replaces `forward_backward`.

    step s:  tokens = data.global_batch(s)                       [global_batch, seq_len + 1]
             micro  = rows [r·B/dp, (r+1)·B/dp) of tokens, cut into k = grad_accum micro-batches
             forward_backward(micro):                             timed window, comm meter
                 m.aux_loss_scale = 1/k  for m in model.modules()  MoE: each aux loss / k, like the loss
                 for i < k:  with no_sync() unless i = k-1:  (micro_batch_loss(micro[i]) / k).backward()
                 after_backward()
             (check) full_gradients(), full_parameters()          outside both, to rank 0
             step(): clip_grad_norm_(max_norm) if clip_grad; optimizer.step(); masters → model;
             zero_grad()                                          timed window, comm meter
fp16 (common/loss_scaler.py): backward from s·loss, unscale at the end of forward_backward, step()
agrees the overflow flag over `scaler_group` and skips or steps, then updates s (GradScaler's rule).

A chapter's train.py is `run_main(parse_args, validate, build, chapter=N)`. `parse_args(argv)`
gives the flags as typed. `validate(args, world_size)` runs on every rank before any collective
(bad input: ConfigError naming flag, value and fix) and returns the frozen `common.run.Run`:
every value derived once (model, mesh shape, batch layout, dtypes, the chapter's options); the
namespace goes no further. `build(run, ctx)` builds the strategy from it, and the loop and the
report read only it. `--profile DIR`: common/profile.py.

TP and PP ranks of one data-parallel replica share `dp_rank`, so they take the same rows. A step's
reported loss is the mean over the ranks that have one (PP: the last stage; TP: every rank of the
group, the same value): the global-batch mean, as every data-parallel shard has as many ranks.

On a GPU the figures follow three rules. Time: each timed window starts and ends with
`torch.cuda.synchronize()` (kernels run after `forward_backward` returns, and a non-last pipeline
stage never waits for them). Host reads: the loop reads no loss inside a step; a strategy returns
its loss as a device tensor, which is copied into a [steps, 2] device buffer, and read on logged
steps (`--log-every`) and once at the end. Memory: `cuda_max_allocated` is the allocator's peak
over the timed windows only, each window starting from a reset (`common.memory.CudaPeakMeter`):
building the model and the `--check` gathers happen outside them, and the `--check` reference
(a full model and its optimizer state, resident on rank 0's device) is subtracted from it. The
saved-tensor activation meter runs on every saved tensor, so on CUDA it is off unless
`--measure-activations` asks (then `activations_peak` is None, "-" in the table).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch
import torch.distributed as dist
from torch import nn

from common.cli import ConfigError, exit_on_config_error
from common.comm import CommMeter
from common.data import local_micro_batches, make_data, split_inputs_targets
from common.dist import (
    DistContext,
    LaunchError,
    env_world_size,
    init_distributed,
    seed_everything,
    shutdown,
    synchronize,
)
from common.kernel.clip import clip_grads_by_global_norm_
from common.kernel.model import loss_fn
from common.loss_scaler import DynamicLossScaler
from common.memory import ActivationMeter, CudaPeakMeter, model_state_bytes
from common.mixed_precision import MasterWeights
from common.profile import profiler_or_nothing
from common.reference import LockstepReference
from common.report import comm_convention, emit_report
from common.run import Run
from common.wire import WireMeter


class Strategy:
    """What a chapter implements. The step is the loop's (`forward_backward`, `step`, `zero_grad`);
    a chapter fills its hooks, whose defaults fit DDP: a whole model on every rank, wrapped so that
    its backward averages the gradients, and an ordinary `self.optimizer`. Attributes: `name`
    (report's "strategy"; its "mesh" is the run's), `dp_rank` / `dp_size` (the data shard this rank
    takes), `model` (what a micro-batch runs through: the wrapper, e.g. DDP),
    `optimizer`, `clip_grad` (max norm; None: no clipping), `weights` (fp32 masters of a bf16
    model, copied into it after each step)."""

    name: str = "?"
    dp_rank: int = 0
    dp_size: int = 1
    start_step: int = 0  # > 0 when the strategy resumed from a checkpoint
    model: nn.Module
    optimizer: torch.optim.Optimizer | None = None
    clip_grad: float | None = None
    weights: MasterWeights | None = None
    scaler: DynamicLossScaler | None = None  # fp16: dynamic loss scaling (else None)
    scaler_group: object = None  # the ranks that agree the scaler's overflow flag (None: the world)
    comm_groups: tuple[tuple[str, object], ...] = ()  # (label, group): report's comm_bytes_<label>

    # --- the step, the same for every strategy (a pipeline overrides forward_backward) ----------
    def forward_backward(self, micro_batches: list[torch.Tensor]) -> torch.Tensor | float | None:
        """Forward and backward over this rank's k micro-batches (token rows [mb, seq_len + 1], on
        the device): the gradient of the *global* batch's mean loss. Returns their mean loss as a
        detached 0-dim device tensor (no host sync), or None on a rank without one (a pipeline stage)."""
        k, losses = len(micro_batches), []
        for m in (m for m in self.model.modules() if hasattr(m, "aux_loss_scale")):
            m.aux_loss_scale = 1 / k  # a module's own loss term (common/kernel/moe.py's aux loss) / k too
        for i, tokens in enumerate(micro_batches):
            with self.no_sync() if i < k - 1 else nullcontext():
                loss = self.micro_batch_loss(tokens) / k
                (loss if self.scaler is None else self.scaler.scale_loss(loss)).backward()
            losses.append(loss.detach())
        self.after_backward()
        if self.scaler is not None:
            self.scaler.unscale_(self.local_gradients())
        return torch.stack(losses).sum(dtype=torch.float64)

    def step(self) -> None:
        """Clip (if asked) by the global norm, apply the optimizer; in mixed precision copy the
        fp32 masters back into the bf16/fp16 model. fp16: every rank skips the step if any rank
        of `scaler_group` found an inf or nan (one all-reduce of the flag, one host read)."""
        if self.scaler is not None and self.scaler.skip_step(self.scaler_group):
            self.scaler.update()
            return
        if self.clip_grad is not None:
            self.clip_grad_norm_(self.clip_grad)
        self.optimizer.step()
        if self.weights is not None:
            self.weights.copy_to_model()
        if self.scaler is not None:
            self.scaler.update()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    # --- the hooks ------------------------------------------------------------------------------
    def micro_batch_loss(self, tokens: torch.Tensor) -> torch.Tensor:
        """Forward of one micro-batch through `self.model`: its mean loss (autograd attached)."""
        inputs, targets = split_inputs_targets(tokens)
        return loss_fn(self.model(inputs), targets)

    def no_sync(self) -> AbstractContextManager:
        """Entered around every micro-batch but the last: accumulate the gradients locally, no
        reduction. Default: the model's own `no_sync()` where it has one (DDP's), else nothing."""
        return self.model.no_sync() if hasattr(self.model, "no_sync") else nullcontext()

    def after_backward(self) -> None:
        """After the last micro-batch's backward: the averaging the model's hooks did not do (a
        naive DP, TP's data-parallel group), gradients into fp32 masters. Default: nothing."""

    def local_gradients(self) -> list[torch.Tensor]:
        """What this rank's optimizer steps (the loss scaler unscales them): param groups' grads."""
        return [p.grad for g in self.optimizer.param_groups for p in g["params"] if p.grad is not None]

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """Scale every gradient by min(1, max_norm / ‖g‖), ‖g‖ the norm of the *whole* model's
        gradient (common/kernel/clip.py). Default: every rank holds the whole averaged gradient of what
        the optimizer steps, so the local norm is the global one."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        return clip_grads_by_global_norm_([p.grad for p in params], max_norm)

    # --- --check, accounting, the report ---------------------------------------------------------
    def full_gradients(self) -> dict[str, torch.Tensor] | None:
        """For `--check`: this step's gradients (before clipping), full shape, the reference's
        names. A collective: every rank calls it; rank 0 gets the dict, the others may get None."""
        return {n: p.grad.detach() for n, p in self.model.named_parameters()}

    def full_parameters(self) -> dict[str, torch.Tensor] | None:
        """Like `full_gradients`, for the parameters (the fp32 master copy in mixed precision)."""
        return {n: p.detach() for n, p in self.model.named_parameters()}

    def memory(self) -> dict[str, int]:
        """Bytes of params, grads and optimizer state this rank holds now (after the last step)."""
        return model_state_bytes(self.model.parameters(), self.optimizer)

    def activation_meter(self) -> ActivationMeter:
        """The saved-tensor meter for `activations_peak` (used where `measure_activations`)."""
        return ActivationMeter(self.model.parameters())

    def formulas(self, steps: int) -> tuple[float, dict[str, float]]:
        """Closed forms per rank: (comm bytes over `steps` steps, {params, grads, optimizer})."""
        raise NotImplementedError

    def report_extras(self) -> dict:
        """Chapter-specific keys for the report (e.g. bubble_fraction)."""
        return {}

    def after_step(self, done: int) -> None:
        """After `done` steps, on every rank, outside timing and meter (e.g. save a checkpoint)."""


def rank_micro_batches(strategy: Strategy, tokens: torch.Tensor, micro_batch: int,
                       device: torch.device) -> list[torch.Tensor]:
    """This rank's micro-batches of a global batch: its data-parallel shard, cut, on `device`."""
    return [m.to(device) for m in
            local_micro_batches(tokens, strategy.dp_rank, strategy.dp_size, micro_batch)]


def measure_activations(asked: bool | None, device: torch.device) -> bool:
    """`--measure-activations` if given, else on everywhere but CUDA (the allocator's peak)."""
    return device.type != "cuda" if asked is None else asked


def record_loss(row: torch.Tensor, loss: torch.Tensor | float | None) -> None:
    """Write a step's loss into its row [loss, 1] of the loss buffer (a device copy; None: [0, 0])."""
    if loss is not None:
        with torch.no_grad():
            row[0], row[1] = loss, 1


def loss_value(loss: torch.Tensor | float | None) -> float | None:
    """A `forward_backward` result as a float (one host read), for callers outside the loop."""
    return loss.item() if isinstance(loss, torch.Tensor) else loss


def global_loss(rows: torch.Tensor) -> list[float]:
    """Mean of the per-step losses over the ranks that have one, from this rank's [k, 2] rows of
    [loss, has_loss]: one all-reduce and one host read."""
    values = rows.clone()
    dist.all_reduce(values, op=dist.ReduceOp.SUM)
    values = values.tolist()
    if any(count == 0 for _, count in values):
        raise RuntimeError("no rank reported a loss for some step: forward_backward must return "
                           "the loss on at least one rank (the last pipeline stage)")
    return [total / count for total, count in values]


class ProgressLog:
    """One line per `every` steps on rank 0: step k/N, global-batch loss, tokens/s, elapsed, ETA.
    Every rank calls it (the loss of a logged step takes one small all-reduce and one host read,
    outside the meter and the timing; other steps read nothing)."""

    def __init__(self, steps: int, tokens_per_step: int, every: int, device: torch.device,
                 first_step: int = 0):
        self.steps, self.tokens_per_step, self.every, self.device = steps, tokens_per_step, every, device
        self.first_step, self.start = first_step, time.perf_counter()

    def __call__(self, step: int, row: torch.Tensor) -> None:
        """`row`: the step's [1, 2] rows of the loss buffer."""
        done = step + 1
        if self.every <= 0 or (done % self.every and done != self.steps):
            return
        loss = global_loss(row)[0]
        if dist.get_rank() != 0:
            return
        elapsed, ran = time.perf_counter() - self.start, done - self.first_step
        eta = elapsed / ran * (self.steps - done)
        print(f"step {done:>{len(str(self.steps))}}/{self.steps}  loss {loss:.4f}  "
              f"{ran * self.tokens_per_step / elapsed:,.0f} tokens/s  "
              f"elapsed {elapsed:.1f}s  eta {eta:.1f}s", flush=True)


class Instruments:
    """What the loop measures a strategy with, around each of its two timed windows per step:
    the comm meter, the wire meter (bytes observed on gloo), the CUDA peak (windows only), the
    saved-tensor activation meter (forward_backward only, where measured), and the time between
    two `synchronize`s."""

    def __init__(self, run: Run, ctx: DistContext, strategy: Strategy):
        self.device, self.seconds = ctx.device, 0.0
        self.comm, self.peak = CommMeter(), CudaPeakMeter(ctx.device)
        measured = measure_activations(run.measure_activations, ctx.device)
        self.activations = strategy.activation_meter() if measured else None
        self.wire = WireMeter(ctx.backend, ctx.device, ctx.world_size)
        self.wire.calibrate()

    @contextmanager
    def measure(self, phase: str) -> Iterator[None]:
        """One timed window: `phase` is "forward_backward" or "step"."""
        activations = self.activations if phase == "forward_backward" else None
        self.wire.open()
        synchronize(self.device)
        start = time.perf_counter()
        with self.comm, activations or nullcontext(), self.peak:
            yield
        synchronize(self.device)
        self.seconds += time.perf_counter() - start
        self.wire.close()


def train(run: Run, ctx: DistContext, strategy: Strategy, chapter: int) -> dict:
    """Train `strategy` for run.steps steps; return the run report (with --check, the verdict
    too, the same on every rank)."""
    seed_everything(run.seed)
    data = make_data(run.data, run.model.vocab_size, run.seq_len, run.seed, ctx.device)
    measured = Instruments(run, ctx, strategy)
    with measured.peak.exclude():  # the reference stays resident on rank 0 but is not the strategy's
        reference = (LockstepReference(run.model, run.seed, run.dtype, run.optimizer, run.lr, ctx.device,
                                       clip_grad=run.clip_grad, mixed_precision=run.mixed_precision,
                                       loss_scaling=run.loss_scaling)
                     if run.check and ctx.is_main else None)
    log = ProgressLog(run.steps, run.global_batch * run.seq_len, run.log_every, ctx.device,
                      strategy.start_step)
    ran = run.steps - strategy.start_step  # a resumed run reports the steps it ran
    local_losses = torch.zeros(ran, 2, dtype=torch.float64, device=ctx.device)  # [loss, has one]
    profiler = profiler_or_nothing(run.profile, ctx.rank, ctx.device, strategy.start_step, run.steps)
    memory, scaler = {}, strategy.scaler  # scaler: fp16 only
    for i, step in enumerate(range(strategy.start_step, run.steps)):
        tokens = data.global_batch(step, run.global_batch)
        micro = rank_micro_batches(strategy, tokens, run.micro_batch, ctx.device)
        with measured.measure("forward_backward"), profiler.window(step, "forward_backward"):
            loss = strategy.forward_backward(micro)
        record_loss(local_losses[i], loss)
        del loss
        if run.check:
            with profiler.paused():
                grads, params = strategy.full_gradients(), strategy.full_parameters()
                if reference is not None:
                    with measured.peak.exclude():
                        reference.step(tokens, grads, params, scaler and scaler.state_dict())
            del grads, params  # rank 0's gathered copies must not stay into the next window
        with measured.measure("step"), profiler.window(step, "step"):
            strategy.step()
            if step == run.steps - 1:
                memory = strategy.memory()
            strategy.zero_grad()
        log(step, local_losses[i : i + 1])
        strategy.after_step(step + 1)
    profiler.finish()
    report = run_report(run, ctx, strategy, chapter, measured, global_loss(local_losses), memory)
    if run.check:
        report.update(check_verdict(ctx, strategy, reference, report["losses"]))
    return report


def run_report(run: Run, ctx: DistContext, strategy: Strategy, chapter: int, measured: Instruments,
               losses: list[float], memory: dict) -> dict:
    """The run report's keys (outside the meter and the timing)."""
    ran, comm = len(losses), measured.comm
    comm_formula, memory_formula = strategy.formulas(ran)
    memory["activations_peak"] = getattr(measured.activations, "peak_bytes", None)
    if measured.peak.bytes is not None:
        memory["cuda_max_allocated"] = measured.peak.bytes
    return {
        "chapter": chapter, "strategy": strategy.name, "world_size": ctx.world_size,
        "mesh": run.mesh.as_dict(), "backend": ctx.backend, "device": str(ctx.device),
        "dtype": run.dtype_name, "mixed_precision": run.mixed_precision,
        "steps": ran, "losses": losses, "micro_batch": run.micro_batch, "grad_accum": run.grad_accum,
        "tokens_per_s": ran * run.global_batch * run.seq_len / measured.seconds,
        "comm": comm.as_dict(), "comm_bytes_per_rank": comm.bytes_sent,
        "comm_bytes_formula": comm_formula, "comm_convention": comm_convention(comm.as_dict()),
        **measured.wire.report(comm.bytes_sent),
        **{f"comm_bytes_{label}": comm.bytes_over(g) for label, g in strategy.comm_groups},
        "memory": memory, "memory_formula": memory_formula, **strategy.report_extras(),
        **({} if strategy.scaler is None else {"loss_scale": strategy.scaler.get_scale(),
                                                "skipped_steps": strategy.scaler.skipped_steps}),
    }


def check_verdict(ctx: DistContext, strategy: Strategy, reference: LockstepReference | None,
                  losses: list[float]) -> dict:
    """`--check`'s keys: rank 0 compares the final parameters and broadcasts its verdict, so
    every rank returns (and exits with) the same `check_passed`."""
    params = strategy.full_parameters()
    verdict, passed = {}, torch.tensor([1], device=ctx.device)
    if reference is not None:
        verdict = reference.finish(losses, params, strategy.scaler and strategy.scaler.state_dict())
        passed.fill_(int(verdict["check_passed"]))
    dist.broadcast(passed, src=0)
    return verdict | {"check_passed": bool(passed.item())}


Build = Callable[[Run, DistContext], Strategy]
BeforeTraining = Callable[[Run, DistContext], dict]


def build_and_train(run: Run, ctx: DistContext, build: Build, chapter: int,
                    before_training: BeforeTraining | None = None) -> dict:
    """Run `before_training` (its dict joins the report), build the strategy, train; the report.
    The tests call this inside the rank pool; `launch` is the same with parsing and exit."""
    extras = before_training(run, ctx) if before_training else {}
    report = train(run, ctx, build(run, ctx), chapter)
    report.update(extras)
    return report


def launch(parse_args: Callable[[list[str] | None], argparse.Namespace],
           validate: Callable[[argparse.Namespace, int], Run], build: Build, chapter: int,
           argv: list[str] | None = None, before_training: BeforeTraining | None = None) -> int:
    """A chapter's `main`: parse and validate on every rank before any collective (a bad flag
    exits 2 with one line), join the job, `run`, print the report on rank 0. Exit status 1 when
    `--check` failed or an entry of `before_training`'s dict says {"passed": False}."""
    try:
        run = validate(parse_args(argv), env_world_size())
    except (ConfigError, LaunchError) as error:
        exit_on_config_error(os.environ.get("RANK", "?"), error)
    ctx = init_distributed()
    report = build_and_train(run, ctx, build, chapter, before_training)
    if ctx.is_main:
        emit_report(report, run.report, run.observed_comm)
    extra_ok = all(v.get("passed", True) for v in report.values() if isinstance(v, dict))
    status = 0 if report.get("check_passed", True) and extra_ok else 1
    shutdown()
    return status


def run_main(*launch_args, **launch_kwargs) -> None:
    sys.exit(launch(*launch_args, **launch_kwargs))
