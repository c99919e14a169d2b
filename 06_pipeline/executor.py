"""One executor for every schedule: walk this rank's action list, compute, and pass activations
and gradients to the neighbouring ranks.

    F(mb, c)   x = received activation (or the tokens on stage 0);  y = chunk_c(x)
               last stage: y = loss_fn(y, targets[mb]) / m          ← the 1/m, exactly once
               send y to the next stage
    B(mb, c)   g = received gradient of y (nothing on the last stage: y is the loss)
               backward through chunk_c: x.grad to the previous stage, parameter grads accumulate
               (split schedules: B computes only x.grad, W(mb, c) later the parameter grads,
               from the output gradients B caught at the layers' GEMMs: backward_split.py)

Σ_mb ∂(loss_mb / m)/∂θ is the gradient of the mean loss over the whole batch, so a pipeline step
leaves the same gradients as one big batch on one device. Communication is point-to-point with
`isend`/`irecv` between pipeline neighbours (ranks of `pp_group`, addressed by group rank): shapes
are known up front (every message is [micro_batch, seq_len, dim]), so there is no shape handshake.
Each action's sends are posted together with the next action's receive in one
`batch_isend_irecv` (Megatron's send_forward_recv_backward pairing). A received tensor always
lands in a fresh buffer: autograd keeps the stage input of micro-batch k for its backward, so
receiving micro-batch k+1 into the same memory would silently change k's gradients.

The executor does not look inside a chunk: any module mapping the previous stage's output to the
next stage's input works (tensor-parallel layers, FSDP units). Parameter gradients accumulate
with the ordinary autograd machinery, so hooks a wrapper registers on them (FSDP's reduce-scatter)
fire as usual; `after_backward(chunk, microbatch, last)` runs after each backward (B, or W when
split) of a chunk, `last` = True on the chunk's final one of the step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .backward_split import WeightGradState, backward_input, backward_weight
from .schedules import Action, Message, Schedule
from .timeline import Interval

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


class PipelineExecutor:
    """Runs `schedule`'s actions of pipeline rank `rank` (its rank in `pp_group`) on `chunks`
    (chunk c = virtual stage c·p + rank). `activation_shape`/`dtype`: every message's shape and
    dtype. `loss_fn(output, targets) -> mean loss of the micro-batch` runs on the last stage."""

    def __init__(self, schedule: Schedule, rank: int, chunks: Sequence[nn.Module], loss_fn: LossFn,
                 activation_shape: Sequence[int], dtype: torch.dtype, device: torch.device,
                 pp_group: dist.ProcessGroup | None = None,
                 after_backward: Callable[[int, int, bool], None] | None = None):
        if len(chunks) != schedule.v:
            raise ValueError(f"{len(chunks)} chunks for a schedule with v = {schedule.v}")
        self.schedule, self.rank, self.chunks, self.loss_fn = schedule, rank, list(chunks), loss_fn
        self.shape, self.dtype, self.device = tuple(activation_shape), dtype, device
        self.group, self.after_backward = pp_group, after_backward
        self.timeline: list[Interval] = []  # this rank's actions of the last step (perf_counter s)
        self._last_backward = {}
        release = "W" if schedule.split_backward else "B"
        for action in schedule.actions[rank]:
            if action.kind == release:
                self._last_backward[action.chunk] = action.microbatch

    # --- the pieces a broken variant (tests) may override ----------------------------------
    def new_buffer(self, message: Message) -> torch.Tensor:
        """Where a received activation or gradient lands: a fresh tensor, every time."""
        return torch.empty(self.shape, dtype=self.dtype, device=self.device)

    def scale_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """The micro-batch's share of the batch-mean loss."""
        return loss / self.schedule.m

    # --- communication ---------------------------------------------------------------------
    def _peer(self, pipeline_rank: int) -> int:
        return pipeline_rank if self.group is None else dist.get_global_rank(self.group, pipeline_rank)

    def _exchange(self, sends: list[tuple[Message, torch.Tensor]],
                  recv: Message | None) -> torch.Tensor | None:
        """Post `sends` and the receive of `recv` as one batch; wait for the receive only (the
        sends complete in the background and are waited for by the end of the step)."""
        ops = [dist.P2POp(dist.isend, t.contiguous(), self._peer(m.dst), self.group) for m, t in sends]
        buffer = None
        if recv is not None:
            buffer = self.new_buffer(recv)
            ops.append(dist.P2POp(dist.irecv, buffer, self._peer(recv.src), self.group))
        if not ops:
            return None
        works = dist.batch_isend_irecv(ops)
        if recv is not None:
            works[-1].wait()
        self._send_works += [(w, t) for w, (_, t) in zip(works, sends, strict=False)]
        self._send_works = [(w, t) for w, t in self._send_works if not w.is_completed()]
        return buffer

    # --- one step ----------------------------------------------------------------------------
    def run(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor]) -> float | None:
        """One pipeline step over m micro-batches (inputs are used on stage 0, targets on the
        last stage). Leaves the gradients of the batch-mean loss in the chunks' parameters;
        returns the batch-mean loss on the rank holding the last stage, None elsewhere."""
        m = self.schedule.m
        if len(inputs) != m or len(targets) != m:
            raise ValueError(f"{len(inputs)} input and {len(targets)} target micro-batches for a "
                             f"schedule of m = {m}")
        self.timeline, self._send_works = [], []
        stage_in: dict[tuple[int, int], torch.Tensor] = {}
        stage_out: dict[tuple[int, int], torch.Tensor] = {}
        grads_out: dict[tuple[int, int], torch.Tensor | None] = {}
        weight_state: dict[tuple[int, int], WeightGradState] = {}
        pending: list[tuple[Message, torch.Tensor]] = []
        losses: list[float] = []
        for action in self.schedule.actions[self.rank]:
            received = self._exchange(pending, self.schedule.recv(self.rank, action))
            pending = []
            start = time.perf_counter()
            key, chunk = (action.microbatch, action.chunk), self.chunks[action.chunk]
            stage = self.schedule.stage(self.rank, action.chunk)
            is_last = stage == self.schedule.n_stages - 1
            if action.kind == "F":
                x = inputs[action.microbatch] if stage == 0 else received.requires_grad_()
                y = chunk(x)
                if is_last:
                    loss = self.loss_fn(y, targets[action.microbatch])
                    losses.append(loss.item())
                    y = self.scale_loss(loss)
                stage_in[key], stage_out[key] = x, y
            elif action.kind == "B":
                grads_out[key] = None if is_last else received
                x, y = stage_in[key], stage_out[key]
                if self.schedule.split_backward:  # input gradient only; W later from its state
                    x_grad = None
                    if stage > 0:  # W differentiates the graph's leaves (FSDP: gathered tensors)
                        x_grad, weight_state[key] = backward_input(y, x, grads_out[key])
                else:
                    torch.autograd.backward(y, grads_out[key])
                    x_grad = x.grad if stage > 0 else None
                    self._release(action, stage_in, stage_out, grads_out)
                if stage > 0:
                    pending.append((self.schedule.send(self.rank, action), x_grad))
            else:  # W: the parameter gradients of a split backward (all of it on stage 0)
                if key in weight_state:
                    backward_weight(weight_state[key])
                else:  # stage 0: no input gradient, so the whole backward is W's
                    torch.autograd.backward(stage_out[key], grads_out[key])
                self._release(action, stage_in, stage_out, grads_out, weight_state)
            if action.kind == "F" and not is_last:
                pending.append((self.schedule.send(self.rank, action), y.detach()))
            self.timeline.append(Interval(self.rank, action, start, time.perf_counter()))
        self._exchange(pending, None)
        for work, _ in self._send_works:
            work.wait()
        self._send_works = []
        return sum(losses) / m if losses else None

    def _release(self, action: Action, *saved: dict) -> None:
        """Drop the micro-batch's graph (its activations) and run the caller's hook."""
        key = (action.microbatch, action.chunk)
        for d in saved:
            d.pop(key, None)
        if self.after_backward is not None:
            self.after_backward(action.chunk, action.microbatch,
                                self._last_backward[action.chunk] == action.microbatch)
