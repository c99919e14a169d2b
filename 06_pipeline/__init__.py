"""Chapter 06: pipeline parallelism. GPipe, 1F1B, interleaved 1F1B and ZB-H1 as data, one executor.

The core files import only torch and the common kernel (copy them out): the schedule and its
executor = common/copy_sets.py's set (README.md's "Copy it"; + common/kernel/p2p_plan.py to replay a
plan under NCCL's rules); the LLaMA split = stage.py + common/kernel/model.py.

    schedules.py   make_schedule(name, p, m, v=1) -> Schedule; SCHEDULES: {name: ScheduleSpec}
                   for "gpipe", "1f1b", "interleaved", "zb" (builder, default v, preconditions,
                   closed-form bubble and its text, figure label and colour, peak in-flight
                   count, split backward: everything read per schedule; dualpipe.py adds
                   "dualpipev"). Schedule.actions[rank] is the ordered
                   tuple of Action(kind "F"|"B"|"W", microbatch, chunk); rank r's chunk c is
                   virtual stage c·p + r. Schedule.recv/send(rank, action) -> Message | None say
                   what an action receives/sends; schedule_error(name, p, m, v) -> str | None is
                   the validation message (call it before any collective); messages(),
                   peak_in_flight() for the properties.
    stage.py       split_model(model, p, v, rank, partition=None) -> [LlamaChunk per chunk]:
                   tok_embeddings on stage 0, norm + output on stage p·v-1, layers in a
                   ModuleDict keyed by global index, so chunk.named_parameters() are the
                   reference model's names; chunk(x, positions) with RoPE's positions of the
                   tokens attention sees. (Not torch's PipelineStage, which wraps a stage's module
                   with its communication: here the executor communicates.) partition_error(
                   n_layers, p, v, partition) and layer_partition(n_layers, n_stages, partition)
                   for validation and accounting.
    executor.py    PipelineExecutor(schedule, rank, chunks, loss_fn, activation_shape, dtype,
                   device, pp_group=None, after_backward=None).run(inputs, targets,
                   positions=None) -> the batch-mean loss on the last stage's rank (a 0-dim
                   tensor: read it once per step), None elsewhere; positions[mb] (e.g. RoPE's,
                   computed once from the batch's layout) goes to every chunk's forward with its
                   input, never through the pipe. It posts exactly p2p.exchanges' groups. `rank`
                   is the rank in pp_group (peers are mapped to global ranks with get_global_rank);
                   loss_fn(output, targets) is any callable (e.g. a vocab-parallel loss); the
                   executor divides by m exactly once (scale_loss). Gradients accumulate through
                   plain autograd (hooks of wrappers like FSDP fire); after_backward(chunk, mb,
                   last) runs after each chunk backward (W for zb). .timeline holds the last
                   step's Intervals in seconds (host clock on CPU; CUDA events on a GPU, read
                   after one synchronize when .timeline is read).
    p2p.py         the communication plan as data: segments(schedule, rank), exchanges(schedule,
                   rank) (the groups the executor posts), p2p_plan(schedule, nbytes) -> {rank:
                   [[(kind, peer, nbytes, label), ...], ...]} for common/kernel/p2p_plan.find_deadlock.
    backward_split.py  backward_input(y, x, grad_y, params) -> (x_grad, state) and
                   backward_weight(state): zero-bubble's B and W without recomputation.
    simulator.py   simulate(schedule, costs=None) -> [Interval] with unit costs (F=1, B=2; ZB:
                   F=B=W=1; per chunk /v); bubble_fraction(intervals), closed_form_bubble(name,
                   p, m, v), bubble_formula(name, v).
    timeline.py    Interval, measured_bubble(intervals), render_text(intervals, width), plot(),
                   save_png({name: intervals}, path) (imports matplotlib lazily).

`train.py` (uses common/): PipelineStrategy for the shared loop, the comm formula; `bench.py`:
against torch.distributed.pipelining (on gloo its schedules need torch >= 2.8: bench.py says why).
"""

from . import dualpipe  # noqa: F401  (registers DualPipeV in SCHEDULES)
from .executor import PipelineExecutor
from .p2p import p2p_plan
from .schedules import SCHEDULES, Action, Message, Schedule, ScheduleSpec, make_schedule, schedule_error
from .simulator import bubble_formula, closed_form_bubble, simulate
from .stage import LlamaChunk, layer_partition, partition_error, split_model
from .timeline import Interval, measured_bubble, render_text, save_png

__all__ = [
    "SCHEDULES", "Action", "Interval", "LlamaChunk", "Message", "PipelineExecutor", "Schedule",
    "ScheduleSpec", "bubble_formula", "closed_form_bubble", "layer_partition", "make_schedule",
    "measured_bubble", "p2p_plan", "partition_error", "render_text", "save_png", "schedule_error",
    "simulate", "split_model",
]
