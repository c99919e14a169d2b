"""One executor for every schedule: walk this rank's action list, compute, and pass activations
and gradients to the neighbouring ranks.

    F(mb, c)   x = received activation (or the tokens on stage 0);  y = chunk_c(x[, positions[mb]])
               last stage: y = loss_fn(y, targets[mb]) / m          ← the 1/m, exactly once
               (a module's own loss term, on any stage: / m too, through its `aux_loss_scale`)
               send y to the next stage
    B(mb, c)   g = received gradient of y (nothing on the last stage: y is the loss)
               backward through chunk_c: x.grad to the previous stage, parameter grads accumulate
               (split schedules: B computes only x.grad, W(mb, c) later the parameter grads,
               from the output gradients B caught at the layers' GEMMs: backward_split.py)

Σ_mb ∂(loss_mb / m)/∂θ is the gradient of the mean loss over the whole batch, so a pipeline step
leaves the same gradients as one big batch on one device. Communication is point-to-point between
pipeline neighbours (ranks of `pp_group`, addressed by group rank and posted with global ranks):
shapes are known up front (every message is [micro_batch, seq_len, dim]), so there is no shape
handshake. The executor posts exactly the groups of `p2p.exchanges` (one `batch_isend_irecv`
before each segment: the previous segment's sends with this segment's receives; a forward and
the backward right after it form one segment in the interleaved steady state, Megatron's
send_forward_backward_recv_forward_backward) and nothing else, so the plan the suite replays under
NCCL's rules is the code's. Why it cannot deadlock (p2p.py has the details): under NCCL a send
finishes only when the peer's receive runs in the peer's current group; a steady-state group also
receives from each neighbour it sends to, so neighbouring groups finish together, where the old
pairing left send-only groups that waited on a neighbour blocked the other way round (every
interleaved steady state deadlocked); tests/test_p2p_plan.py replays all 524 schedule × p ≤ 8 ×
m ≤ 16 × v ≤ 4 plans and the groups real runs post, and finds no deadlock. Each receive is waited
for right before the action that needs it, sends by the end of the step. A received tensor always
lands in a fresh buffer: autograd keeps the stage input of micro-batch k for its backward, so
receiving micro-batch k+1 into the same memory would silently change k's gradients.

The executor does not look inside a chunk (but for the `aux_loss_scale` of a module with a loss
term of its own): any module mapping the previous stage's output to the next stage's input works
(tensor-parallel layers, FSDP units). What every stage needs besides its
input travels with the batch, not through the pipe: `run(inputs, targets, positions)` hands
micro-batch mb's positions (RoPE's, computed once from the batch's layout) to every chunk's
forward, so the messages stay the activations alone. Parameter gradients accumulate
with the ordinary autograd machinery, so hooks a wrapper registers on them (FSDP's reduce-scatter)
fire as usual; `after_backward(chunk, microbatch, last)` runs after each backward (B, or W when
split) of a chunk, `last` = True on the chunk's final one of the step. The loss is summed as a
tensor (no host sync per micro-batch); `timeline` times each action with CUDA events on the
compute stream on a GPU (read once, after the step), with the host clock on CPU.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist
from torch import nn

from .backward_split import backward_input, backward_weight
from .p2p import Exchange, exchanges, segments
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
        self.segments, self.exchanges = segments(schedule, rank), exchanges(schedule, rank)
        self._timeline: list[Interval] = []
        self._cuda_events = device.type == "cuda"  # time actions with events, not the host clock
        self._events: tuple | None = None  # CUDA: (host origin, origin event, [(action, start, end)])
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

    def _post(self, exchange: Exchange, outbox: dict[Message, torch.Tensor],
              inbox: dict[Message, tuple[torch.Tensor, object]]) -> None:
        """Post one group of the plan: its sends (taken from `outbox`, where the actions left
        them) and its receives (fresh buffers, into `inbox` with the work to wait for)."""
        sends = [outbox.pop(m) for m in exchange.sends]
        buffers = [self.new_buffer(m) for m in exchange.recvs]
        ops = ([dist.P2POp(dist.isend, t, self._peer(m.dst), self.group)
                for m, t in zip(exchange.sends, sends, strict=True)]
               + [dist.P2POp(dist.irecv, b, self._peer(m.src), self.group)
                  for m, b in zip(exchange.recvs, buffers, strict=True)])
        if not ops:
            return
        works = dist.batch_isend_irecv(ops)
        if len(works) != len(ops):  # NCCL coalesces the group into one work
            works = works[:1] * len(ops)
        for message, buffer, work in zip(exchange.recvs, buffers, works[len(sends):], strict=True):
            inbox[message] = (buffer, work)
        self._send_works = [(w, t) for w, t in self._send_works if not w.is_completed()]
        self._send_works += list(zip(works[:len(sends)], sends, strict=True))

    def _receive(self, message: Message | None, inbox: dict, local: dict) -> torch.Tensor | None:
        if message is None:
            return None
        if message.src == self.rank:  # chunk c → c+1 on this rank (p = 1): no communication
            return local.pop(message)
        buffer, work = inbox.pop(message)
        work.wait()
        return buffer

    def _deliver(self, message: Message, tensor: torch.Tensor, outbox: dict, local: dict) -> None:
        if message.dst == self.rank:
            local[message] = self.new_buffer(message).copy_(tensor)
        else:
            outbox[message] = tensor.contiguous()

    # --- timing ------------------------------------------------------------------------------
    @property
    def timeline(self) -> list[Interval]:
        """This rank's actions of the last step, in seconds. CPU: the host clock around each
        action. CUDA: kernels run after the host launched them, so the host clock would time
        launches; each action is bracketed by events on the compute stream instead, and read here
        (one synchronize on the last event) as host-clock seconds: the step-start host time plus
        the events' elapsed time from the step-start event (ranks that start together after a
        barrier share an origin)."""
        if self._events is not None:
            origin_s, origin, recorded = self._events
            if recorded:
                recorded[-1][2].synchronize()
            self._timeline = [Interval(self.rank, a, origin_s + origin.elapsed_time(s) / 1e3,
                                       origin_s + origin.elapsed_time(e) / 1e3) for a, s, e in recorded]
            self._events = None
        return self._timeline

    def _clock(self):
        if self._cuda_events:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    # --- one step ----------------------------------------------------------------------------
    def run(self, inputs: Sequence[torch.Tensor], targets: Sequence[torch.Tensor],
            positions: Sequence[torch.Tensor] | None = None) -> torch.Tensor | None:
        """One pipeline step over m micro-batches (inputs are used on stage 0, targets on the
        last stage; positions[mb], when given, by every chunk: chunk(x, positions[mb])). Leaves
        the gradients of the batch-mean loss in the chunks' parameters; returns the batch-mean
        loss (a 0-dim tensor, not synchronized) on the rank holding the last stage, None
        elsewhere."""
        m = self.schedule.m
        if len(inputs) != m or len(targets) != m or (positions is not None and len(positions) != m):
            given = "" if positions is None else f" and {len(positions)} position"
            raise ValueError(f"{len(inputs)} input, {len(targets)} target{given} micro-batches for "
                             f"a schedule of m = {m}")
        self._positions = positions
        for module in (mod for chunk in self.chunks for mod in chunk.modules()):
            if hasattr(module, "aux_loss_scale"):  # a MoE layer's aux loss (common/kernel/moe.py): / m too
                module.aux_loss_scale = 1 / m
        cuda = self._cuda_events
        self._send_works, recorded, self._timeline = [], [], []
        self._events = (time.perf_counter(), self._clock(), recorded) if cuda else None
        outbox: dict[Message, torch.Tensor] = {}
        inbox: dict[Message, tuple[torch.Tensor, object]] = {}
        local: dict[Message, torch.Tensor] = {}
        self._saved: dict[str, dict] = {"in": {}, "out": {}, "grad": {}, "weight": {}}
        loss_sum = None
        for exchange, segment in zip(self.exchanges, self.segments, strict=False):
            self._post(exchange, outbox, inbox)
            for action in segment:
                received = self._receive(self.schedule.recv(self.rank, action), inbox, local)
                start = self._clock()
                sent, loss = self._compute(action, received, inputs, targets)
                if loss is not None:
                    loss_sum = loss if loss_sum is None else loss_sum + loss
                if sent is not None:
                    self._deliver(self.schedule.send(self.rank, action), sent, outbox, local)
                end = self._clock()
                if cuda:
                    recorded.append((action, start, end))
                else:
                    self._timeline.append(Interval(self.rank, action, start, end))
        self._post(self.exchanges[-1], outbox, inbox)
        if outbox or inbox or local:
            raise RuntimeError(f"the executor and its plan (p2p.py) disagree: {outbox, inbox, local}")
        for work, _ in self._send_works:
            work.wait()
        self._send_works = []
        return None if loss_sum is None else loss_sum / m

    def _compute(self, action: Action, received: torch.Tensor | None, inputs, targets
                 ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Run one action: (the tensor it sends or None, the micro-batch's loss on the last stage)."""
        key, chunk = (action.microbatch, action.chunk), self.chunks[action.chunk]
        stage = self.schedule.stage(self.rank, action.chunk)
        is_last = stage == self.schedule.n_stages - 1
        saved = self._saved
        if action.kind == "F":
            x = inputs[action.microbatch] if stage == 0 else received.requires_grad_()
            y = chunk(x) if self._positions is None else chunk(x, self._positions[action.microbatch])
            loss = None
            if is_last:
                loss = self.loss_fn(y, targets[action.microbatch])
                y = self.scale_loss(loss)
                loss = loss.detach()
            saved["in"][key], saved["out"][key] = x, y
            return (None if is_last else y.detach()), loss
        if action.kind == "B":
            saved["grad"][key] = None if is_last else received
            x, y = saved["in"][key], saved["out"][key]
            if self.schedule.split_backward:  # input gradient only; W later from its state
                x_grad = None
                if stage > 0:  # W differentiates the graph's leaves (FSDP: gathered tensors)
                    x_grad, saved["weight"][key] = backward_input(y, x, saved["grad"][key])
            else:
                torch.autograd.backward(y, saved["grad"][key])
                x_grad = x.grad if stage > 0 else None
                self._release(action)
            return x_grad, None
        # W: the parameter gradients of a split backward (all of it on stage 0)
        if key in saved["weight"]:
            backward_weight(saved["weight"][key])
        else:  # stage 0: no input gradient, so the whole backward is W's
            torch.autograd.backward(saved["out"][key], saved["grad"][key])
        self._release(action)
        return None, None

    def _release(self, action: Action) -> None:
        """Drop the micro-batch's graph (its activations) and run the caller's hook."""
        key = (action.microbatch, action.chunk)
        for d in self._saved.values():
            d.pop(key, None)
        if self.after_backward is not None:
            self.after_backward(action.chunk, action.microbatch,
                                self._last_backward[action.chunk] == action.microbatch)
