"""Chapter 06: pipeline schedules as data, the executor that runs them, and the bubble.

Schedule properties are pure Python over p 1-8, m 1-32, v 1-4; training properties run the
shared loop's steps on gloo rank pools against the single-device reference (float64, 1e-10)."""

from __future__ import annotations

import statistics
import time
from collections import Counter
from dataclasses import replace
from fractions import Fraction
from itertools import count, pairwise
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st

from common.data import SyntheticTokens, split_inputs_targets
from common.dist import init_distributed
from common.kernel.model import build_model, get_config, loss_fn
from common.memory import ActivationMeter
from common.reference import relative_diff
from common.training import train
from pipeline import train as pp_train
from pipeline.backward_split import backward_input, backward_weight
from pipeline.executor import PipelineExecutor
from pipeline.schedules import (
    SCHEDULES,
    Action,
    Schedule,
    make_schedule,
    messages,
    peak_in_flight,
    schedule_error,
)
from pipeline.simulator import DeadlockError, bubble_fraction, closed_form_bubble, simulate
from pipeline.stage import split_model
from pipeline.timeline import measured_bubble
from pipeline.train import PipelineStrategy
from tests.equivalence import (
    TrainSpec,
    check_strategy,
    check_strategy_rejected,
    reference_record,
    spec_run,
    tiny_configs,
)
from tests.harness import RankError, examples

# --- schedules as data (pure Python) ----------------------------------------------------------


@st.composite
def schedule_params(draw, names=tuple(SCHEDULES)):
    """Any schedule of the registry: p 1-8, v 1-4 where it is free, m the first admissible from a
    draw in 1-32 (interleaved: the next multiple of p; zb: at least p)."""
    name = draw(st.sampled_from(names))
    spec = SCHEDULES[name]
    p = draw(st.integers(1, 8))
    v = draw(st.integers(1, 4)) if spec.free_v else spec.default_v
    m = next(k for k in count(draw(st.integers(1, 32))) if schedule_error(name, p, k, v) is None)
    return make_schedule(name, p, m, v)


def test_schedule_examples_read_like_the_papers():
    assert make_schedule("gpipe", 2, 3).render() == ("rank 0: F0 F1 F2 B0 B1 B2\n"
                                                     "rank 1: F0 F1 F2 B0 B1 B2")
    assert make_schedule("1f1b", 3, 4).render() == ("rank 0: F0 F1 F2 B0 F3 B1 B2 B3\n"
                                                    "rank 1: F0 F1 B0 F2 B1 F3 B2 B3\n"
                                                    "rank 2: F0 B0 F1 B1 F2 B2 F3 B3")
    zb = make_schedule("zb", 2, 3)
    assert zb.render() == ("rank 0: F0 F1 B0 W0 F2 B1 W1 B2 W2\n"
                           "rank 1: F0 B0 F1 B1 W0 F2 B2 W1 W2")


@given(schedule=schedule_params())
def test_every_microbatch_runs_each_action_once_forward_before_backward(schedule: Schedule):
    kinds = ("F", "B", "W") if schedule.split_backward else ("F", "B")
    for rank, actions in enumerate(schedule.actions):
        assert Counter(actions) == Counter(Action(k, mb, c) for k in kinds
                                           for mb in range(schedule.m) for c in range(schedule.v))
        position = {a: i for i, a in enumerate(actions)}
        for mb in range(schedule.m):
            for c in range(schedule.v):
                order = [position[Action(k, mb, c)] for k in kinds]
                assert order == sorted(order), f"rank {rank}: {kinds} of mb {mb} chunk {c} out of order"


@given(schedule=schedule_params())
def test_forward_runs_in_stage_order_and_backward_in_reverse_without_deadlock(schedule: Schedule):
    """The simulator runs every rank's list against the data dependencies; it finishes (no
    deadlock) and each micro-batch visits the stages 0 → S-1 forward and S-1 → 0 backward."""
    end, start = {}, {}
    for i in simulate(schedule):
        key = (i.action.kind, i.action.microbatch, schedule.stage(i.rank, i.action.chunk))
        start[key], end[key] = i.start, i.end
    for mb in range(schedule.m):
        for s in range(schedule.n_stages - 1):
            assert end[("F", mb, s)] <= start[("F", mb, s + 1)]
            assert end[("B", mb, s + 1)] <= start[("B", mb, s)]
        assert end[("F", mb, schedule.n_stages - 1)] <= start[("B", mb, schedule.n_stages - 1)]


@given(schedule=schedule_params())
def test_every_send_has_the_matching_receive_in_the_same_order(schedule: Schedule):
    """On every directed pair of ranks, the sender's messages (in its action order) are exactly
    the receiver's (in its action order): p2p matching by order can never pair the wrong
    activation with a micro-batch, nor wait for a message that comes later."""
    sends = {r: messages(schedule, r)[0] for r in range(schedule.p)}
    recvs = {r: messages(schedule, r)[1] for r in range(schedule.p)}
    for a in range(schedule.p):
        for b in range(schedule.p):
            assert [x for x in sends[a] if x.dst == b] == [x for x in recvs[b] if x.src == a], (a, b)


def test_a_wrong_schedule_order_is_caught_by_both_checks():
    """Negative control: swap two forwards on rank 1 of 1F1B; the receives no longer match the
    sends, and a backward placed before its forward's gradient can arrive deadlocks."""
    good = make_schedule("1f1b", 3, 4)
    acts = list(good.actions[1])
    acts[0], acts[1] = acts[1], acts[0]  # F1 before F0 on rank 1
    swapped = replace(good, actions=(good.actions[0], tuple(acts), good.actions[2]))
    received = [x for x in messages(swapped, 1)[1] if x.src == 0]
    assert received != [x for x in messages(swapped, 0)[0] if x.dst == 1]
    last = list(good.actions[2])
    last[0], last[1] = Action("B", 0), Action("F", 0)  # B0 before F0 on the last stage
    with pytest.raises(DeadlockError, match="deadlocks"):
        simulate(replace(good, actions=(*good.actions[:2], tuple(last))))


@given(schedule=schedule_params())
def test_simulated_bubble_equals_the_closed_form(schedule: Schedule):
    """GPipe and 1F1B: (p-1)/(m+p-1); interleaved: (p-1)/(v·m+p-1); ZB-H1: (p-1)/(3m+p-1)."""
    assert bubble_fraction(simulate(schedule), schedule.p) == closed_form_bubble(
        schedule.name, schedule.p, schedule.m, schedule.v)


@given(p=st.integers(1, 8), m=st.integers(1, 32))
def test_1f1b_holds_at_most_p_microbatches_on_stage_0_where_gpipe_holds_m(p, m):
    assert peak_in_flight(make_schedule("gpipe", p, m), 0) == m
    assert peak_in_flight(make_schedule("1f1b", p, m), 0) == min(p, m)
    for r in range(p):
        assert peak_in_flight(make_schedule("1f1b", p, m), r) == min(p - r, m)
    if m >= p:  # ZB-H1 defers W's on later ranks but keeps 1F1B's peak of p everywhere
        assert max(peak_in_flight(make_schedule("zb", p, m), r) for r in range(p)) == p


def test_interleaving_divides_the_bubble_by_v():
    assert closed_form_bubble("1f1b", 4, 8) == Fraction(3, 11)
    assert bubble_fraction(simulate(make_schedule("interleaved", 4, 8, 2)), 4) == Fraction(3, 19)
    assert bubble_fraction(simulate(make_schedule("zb", 4, 8)), 4) == Fraction(3, 27)


@pytest.mark.parametrize("name, p, m, v, message", [
    ("interleaved", 4, 6, 2, r"--microbatches 6 .* multiple of 4"),
    ("zb", 4, 2, 1, r"--microbatches 2 < 4 stages"),
    ("1f1b", 4, 8, 2, r"--virtual-stages 2 with --schedule 1f1b"),
    ("pipedream", 2, 4, 1, r"--schedule 'pipedream' is unknown"),
    ("dualpipev", 2, 3, None, r"--microbatches 3 < 2·2 = 4 with --schedule dualpipev"),
    ("dualpipev", 2, 4, 1, r"dualpipev holds exactly 2 stages per rank"),
])
def test_impossible_schedules_are_refused_with_the_fix(name, p, m, v, message):
    with pytest.raises(ValueError, match=message):
        make_schedule(name, p, m, v)


def test_dualpipev_runs_each_action_once_in_order_and_empties_its_weight_queue():
    """p ∈ {2, 4}, every m from 2p to 4p: on the V (rank r holds stages r and 2p-1-r) each
    (micro-batch, stage) has one F, B, W, each after its data (simulated without deadlock); every
    W that does not follow its B at once leaves a first-in-first-out queue of deferred W's, which
    is empty at the end; the P2P plan replays under NCCL's rules without deadlock."""
    from common.kernel.p2p_plan import find_deadlock
    from pipeline.p2p import p2p_plan

    for p in (2, 4):
        for m in range(2 * p, 4 * p + 1):
            schedule = make_schedule("dualpipev", p, m)
            assert [schedule.stages(r) for r in range(p)] == [(r, 2 * p - 1 - r) for r in range(p)]
            seen = Counter((i.action.kind, i.action.microbatch, schedule.stage(i.rank, i.action.chunk))
                           for i in simulate(schedule))
            assert seen == Counter((k, mb, s) for k in "FBW" for mb in range(m) for s in range(2 * p))
            for acts in schedule.actions:
                queue = []
                for prev, a in zip((None, *acts), acts, strict=False):
                    own_w = prev and Action("W", prev.microbatch, prev.chunk)
                    if prev is not None and prev.kind == "B" and a != own_w:
                        queue.append(own_w)
                    if a.kind == "W" and a != own_w:
                        assert queue and queue.pop(0) == a, (p, m, a)
                assert acts[-1].kind == "W" and not queue
            assert find_deadlock(p2p_plan(schedule)) is None, (p, m)


def test_dualpipev_simulated_idle_is_half_of_table_2_at_unit_costs():
    """The registry's closed form (p-1)/(6m+p-1) is the simulated one; Table 2's idle
    (PP/2-1)(F&B + B - 3W), PP = 2p, chunk costs F = B = W = 1/2 and F&B = F + B + W run back to
    back, is p - 1 per rank; the simulated order idles (p-1)/2: the table is a bound here."""
    from pipeline.schedules import SCHEDULES

    spec = SCHEDULES["dualpipev"]
    for p, m in [(2, 4), (3, 7), (4, 8)]:
        intervals = simulate(make_schedule("dualpipev", p, m))
        end = max(i.end for i in intervals)
        idle = {end - sum(i.end - i.start for i in intervals if i.rank == r) for r in range(p)}
        half = Fraction(1, 2)
        assert idle == {Fraction(p - 1, 2)}
        assert spec.paper_idle(2 * p, half, 2 * half, half, 3 * half) == 2 * Fraction(p - 1, 2)
        assert bubble_fraction(intervals, p) == closed_form_bubble("dualpipev", p, m)
        assert closed_form_bubble("dualpipev", p, m) == Fraction(p - 1, 6 * m + p - 1)


# --- training through the shared loop: equal to one device ------------------------------------


def pipeline_strategy(spec: TrainSpec, schedule: str, v: int = 1, partition: str | None = None,
                      strategy_class: type[PipelineStrategy] = PipelineStrategy) -> PipelineStrategy:
    run = spec_run(spec, pp_train.validate, schedule=schedule, microbatches=spec.grad_accum,
                   virtual_stages=v, partition=partition, timeline_png=None)
    return strategy_class(run, init_distributed())


@st.composite
def pipeline_specs(draw, schedule: str):
    """p 1-4 ranks (world = p, dp = 1), m 1-8 micro-batches (interleaved: a multiple of p; zb:
    m >= p), v 1-2 for interleaved; layers an even multiple of p·v there, any count >= p (even
    split or a drawn --partition) elsewhere."""
    p = draw(st.integers(1, 4))
    v = draw(st.integers(1, 2)) if schedule == "interleaved" else 1
    m = (p * draw(st.integers(1, 8 // p)) if schedule == "interleaved"
         else draw(st.integers(p if schedule == "zb" else 1, 8)))
    cfg = draw(tiny_configs(layers_multiple_of=p * v))
    partition = None
    if v == 1:
        cfg = replace(cfg, n_layers=draw(st.integers(p, p + 2)))
        if p > 1 and draw(st.booleans()):
            cuts = sorted(draw(st.sets(st.integers(1, cfg.n_layers - 1), min_size=p - 1, max_size=p - 1)))
            partition = ",".join(str(b - a) for a, b in zip([0, *cuts], [*cuts, cfg.n_layers], strict=True))
    micro = draw(st.integers(1, 2))
    spec = TrainSpec(cfg=cfg, world_size=p, dp=1, global_batch=m * micro, micro_batch=micro,
                     seq_len=draw(st.integers(2, 6)), steps=draw(st.integers(1, 2)),
                     optimizer=draw(st.sampled_from(["adamw", "sgd"])), seed=draw(st.integers(0, 2**16)),
                     clip_grad=draw(st.sampled_from([None, 1e-2])))
    return spec, v, partition


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved", "zb"])
@settings(max_examples=examples(4))
@given(data=st.data())
def test_every_schedule_equals_single_device_training_float64(pools, schedule, data):
    spec, v, partition = data.draw(pipeline_specs(schedule))
    check_strategy(pools, spec, pipeline_strategy, schedule, v, partition)


class AliasedReceiveExecutor(PipelineExecutor):
    """The published bug: one receive buffer, reused for every message."""

    def new_buffer(self, message):
        if not hasattr(self, "_buffer"):
            self._buffer = super().new_buffer(message)
        return self._buffer


class LossNotDividedExecutor(PipelineExecutor):
    """Forgets the 1/m: every gradient m times too large."""

    def scale_loss(self, loss):
        return loss


class AliasedReceiveStrategy(PipelineStrategy):
    executor_class = AliasedReceiveExecutor


class LossNotDividedStrategy(PipelineStrategy):
    executor_class = LossNotDividedExecutor


NEGATIVE = TrainSpec(cfg=get_config("tiny", n_layers=2), world_size=2, dp=1, global_batch=4,
                     micro_batch=1, seq_len=6, steps=2)


def test_dualpipev_equals_single_device_float64(pools):
    """The V on 2 ranks (4 stages, 4 layers), m = 5: loss, gradients and parameters of two
    steps equal one device at 1e-10."""
    spec = replace(NEGATIVE, cfg=get_config("tiny", n_layers=4), global_batch=5)
    check_strategy(pools, spec, pipeline_strategy, "dualpipev", 2)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_reusing_the_receive_buffer_is_rejected(pools, schedule):
    """Stage 1 keeps micro-batch k's received activation for k's backward; receiving k+1 into the
    same buffer changes it underneath autograd (no error, just wrong gradients)."""
    check_strategy(pools, NEGATIVE, pipeline_strategy, schedule)
    check_strategy_rejected(pools, NEGATIVE, pipeline_strategy, schedule, 1, None, AliasedReceiveStrategy)


@pytest.mark.parametrize("optimizer", ["sgd", "adamw"])
def test_loss_not_divided_by_m_is_rejected_even_with_adamw(pools, optimizer):
    """AdamW barely notices gradients m× too large in the loss and parameters; the per-step
    gradient comparison does."""
    spec = replace(NEGATIVE, optimizer=optimizer)
    diffs = check_strategy_rejected(pools, spec, pipeline_strategy, "1f1b", 1, None, LossNotDividedStrategy)
    assert diffs["grad"] > 0.5  # m = 4: every gradient off by 300%


# --- memory: GPipe holds m micro-batches' activations, 1F1B at most p ---------------------------


def stage0_activation_peaks(schedule: str, ms: list[int]) -> list[int] | None:
    """Rank 0's peak saved-activation bytes (common.memory's ledger) for one step per m."""
    cfg, p, rank = get_config("tiny", n_layers=4), dist.get_world_size(), dist.get_rank()
    chunks = split_model(build_model(cfg, 0, torch.float64), p, 1, rank)
    peaks = []
    for m in ms:
        executor = PipelineExecutor(make_schedule(schedule, p, m), rank, chunks, loss_fn,
                                    (1, 8, cfg.dim), torch.float64, torch.device("cpu"))
        tokens = SyntheticTokens(cfg.vocab_size, 8).global_batch(0, m)
        inputs, targets = split_inputs_targets(tokens)
        with ActivationMeter(chunks[0].parameters()) as meter:
            executor.run(list(inputs.split(1)), list(targets.split(1)), [torch.arange(8)] * m)
        peaks.append(meter.peak_bytes)
    return peaks if rank == 0 else None


def test_activation_memory_grows_with_m_for_gpipe_and_with_p_for_1f1b(pools):
    ms = [4, 8, 16]
    gpipe = pools.run(2, stage0_activation_peaks, "gpipe", ms)[0]
    one_f_one_b = pools.run(2, stage0_activation_peaks, "1f1b", ms)[0]
    per_microbatch = gpipe[0] / ms[0]
    assert gpipe == pytest.approx([m * per_microbatch for m in ms], rel=0.02)  # ∝ m
    assert one_f_one_b == pytest.approx([2 * per_microbatch] * len(ms), rel=0.02)  # ∝ p = 2


def split_backward_of_one_microbatch(chunk: torch.nn.Module, x: torch.Tensor, targets: torch.Tensor,
                                     meter: ActivationMeter) -> int:
    """B then W on a last stage's chunk; the ledger's bytes while the graph waits for W."""
    x.requires_grad_()
    _, state = backward_input(loss_fn(chunk(x, torch.arange(x.shape[1])), targets), x, None)
    waiting = meter.current_bytes
    backward_weight(state)
    return waiting


def test_zb_split_backward_leaves_no_graph_alive_after_w_leak():
    """B retains the graph for W, so a saved tensor lives exactly as long as its graph: once W
    ran and the micro-batch is dropped, the ledger is back to zero, micro-batch after micro-batch
    (the ledger once held each saved output with its grad_fn, a cycle through C++ that gc cannot
    break: the graphs of every step stayed alive)."""
    cfg = get_config("tiny", n_layers=2)
    chunk = split_model(build_model(cfg, 0, torch.float64), 2, 1, 1)[0]  # stage 1 of 2
    tokens = SyntheticTokens(cfg.vocab_size, 4).global_batch(0, 3)
    generator = torch.Generator().manual_seed(0)
    with ActivationMeter(chunk.parameters()) as meter:
        for k in range(3):
            x = torch.randn(1, 4, cfg.dim, dtype=torch.float64, generator=generator)
            assert split_backward_of_one_microbatch(chunk, x, tokens[k : k + 1, 1:], meter) > 0
            assert meter.current_bytes == 0, (k, meter.current_bytes)
    assert all(p.grad is not None for p in chunk.parameters())


# --- the measured bubble --------------------------------------------------------------------------


class Sleep(torch.autograd.Function):
    """A stand-in for a GPU kernel: takes wall time, not CPU (so 4 ranks on a loaded 2-core
    machine each still 'compute' for exactly that long). y = x·w; backward sleeps twice as long."""

    @staticmethod
    def forward(ctx, x, w, seconds):
        time.sleep(seconds)
        ctx.save_for_backward(x, w)
        ctx.seconds = seconds
        return x * w

    @staticmethod
    def backward(ctx, grad):
        time.sleep(2 * ctx.seconds)
        x, w = ctx.saved_tensors
        return grad * w, (grad * x).sum(), None


class SleepStage(torch.nn.Module):
    def __init__(self, first: bool, seconds: float, dim: int = 8):
        super().__init__()
        self.embed = torch.nn.Embedding(dim, dim) if first else None
        self.w = torch.nn.Parameter(torch.ones(()))
        self.seconds = seconds

    def forward(self, x):
        return Sleep.apply(self.embed(x) if self.embed is not None else x, self.w, self.seconds)


def measured_bubbles(schedule: str, m: int, seconds: float, steps: int = 3) -> list[float] | None:
    """Run `steps` steps of stages that cost F = `seconds`, B = 2·`seconds` of wall time; rank 0
    gets the measured bubble of each step."""
    p, rank = dist.get_world_size(), dist.get_rank()
    executor = PipelineExecutor(make_schedule(schedule, p, m), rank, [SleepStage(rank == 0, seconds)],
                                loss_fn, (1, 4, 8), torch.float32, torch.device("cpu"))
    tokens = torch.randint(0, 8, (m, 5), generator=torch.Generator().manual_seed(0))
    bubbles = []
    for _ in range(steps):
        dist.barrier()
        executor.run(list(tokens[:, :-1].split(1)), list(tokens[:, 1:].split(1)))
        gathered = [None] * p
        dist.all_gather_object(gathered, executor.timeline)
        bubbles.append(measured_bubble([i for g in gathered for i in g], p))
    return bubbles if rank == 0 else None


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p, m", [(2, 4), (4, 8)])
def test_measured_bubble_is_within_0_1_of_the_simulated_one(pools, schedule, p, m):
    """Stages whose actions take fixed wall time (sleep, like a GPU kernel) rather than CPU: on
    this shared 2-core machine real CPU compute of 4 ranks is time-sliced by the OS, and the
    measured bubble then reflects the contention, not the schedule (see the README)."""
    simulated = float(bubble_fraction(simulate(make_schedule(schedule, p, m)), p))
    bubbles = pools.run(p, measured_bubbles, schedule, m, 0.03)[0]
    assert abs(statistics.median(bubbles) - simulated) < 0.1, (bubbles, simulated)


class FakeCudaEvent:
    """torch.cuda.Event on a CPU: `record` notes the host clock, `elapsed_time` is in ms."""

    synchronized = 0

    def __init__(self, enable_timing: bool = False):
        assert enable_timing
        self.t = None

    def record(self) -> None:
        self.t = time.perf_counter()

    def elapsed_time(self, end: FakeCudaEvent) -> float:
        assert self.t is not None and end.t is not None, "read before both events were recorded"
        return (end.t - self.t) * 1e3

    def synchronize(self) -> None:
        FakeCudaEvent.synchronized += 1


def test_gpu_timeline_uses_events_read_once_and_the_loss_stays_a_tensor():
    """On CUDA the executor brackets each action with events on the compute stream and converts
    them when the timeline is read, after one synchronize (here: events faked on CPU, one rank,
    p = 1 with v = 2, so no process group). The loss comes back as a 0-dim tensor (no .item() in
    the step) equal to the mean of the micro-batches' losses."""
    cfg = get_config("tiny", n_layers=2)
    chunks = split_model(build_model(cfg, 0, torch.float64), 1, 2, 0)
    executor = PipelineExecutor(make_schedule("interleaved", 1, 3, 2), 0, chunks, loss_fn,
                                (1, 4, cfg.dim), torch.float64, torch.device("cpu"))
    executor._cuda_events = True
    tokens = SyntheticTokens(cfg.vocab_size, 4).global_batch(0, 3)
    inputs, targets = split_inputs_targets(tokens)
    FakeCudaEvent.synchronized = 0
    with mock.patch("torch.cuda.Event", FakeCudaEvent):
        before = time.perf_counter()
        loss = executor.run(list(inputs.split(1)), list(targets.split(1)), [torch.arange(4)] * 3)
        after = time.perf_counter()
        assert FakeCudaEvent.synchronized == 0  # nothing waits inside the step
        timeline = executor.timeline
    assert FakeCudaEvent.synchronized == 1 and executor.timeline == timeline
    assert [i.action for i in timeline] == list(executor.schedule.actions[0])
    assert all(before <= i.start <= i.end <= after + 1e-3 for i in timeline)
    assert all(a.end <= b.start + 1e-6 for a, b in pairwise(timeline))
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0 and not loss.requires_grad
    model = build_model(cfg, 0, torch.float64)
    expected = sum(loss_fn(model(x), y) for x, y in zip(inputs.split(1), targets.split(1), strict=True)) / 3
    assert abs(loss.item() - expected.item()) < 1e-12


def test_rope_positions_travel_with_each_micro_batch_to_every_chunk():
    """The executor hands micro-batch k's positions to every chunk's forward (p = 1, v = 2: two
    chunks, no process group): the loss is the reference model's at those positions (a CP rank's
    zig-zag ones, an offset window), not at 0 … s-1, which a chunk reading its input's length
    would use (and which is wrong whenever a stage holds s/t or zig-zag tokens)."""
    cfg = get_config("tiny", n_layers=2)
    model = build_model(cfg, 0, torch.float64)
    executor = PipelineExecutor(make_schedule("interleaved", 1, 2, 2), 0, split_model(model, 1, 2, 0),
                                loss_fn, (1, 4, cfg.dim), torch.float64, torch.device("cpu"))
    inputs, targets = (list(t.split(1)) for t in split_inputs_targets(
        SyntheticTokens(cfg.vocab_size, 4).global_batch(0, 2)))
    positions = [torch.tensor([0, 1, 6, 7]), torch.arange(9, 13)]
    loss = executor.run(inputs, targets, positions)
    with torch.no_grad():
        expected = sum(loss_fn(model(x, q), y)
                       for x, y, q in zip(inputs, targets, positions, strict=True)) / 2
        from_zero = sum(loss_fn(model(x), y) for x, y in zip(inputs, targets, strict=True)) / 2
    assert abs(loss.item() - expected.item()) < 1e-12
    assert abs(from_zero.item() - expected.item()) > 1e-6  # the positions do matter here
    with pytest.raises(ValueError, match=r"2 input, 2 target and 1 position micro-batches for .* m = 2"):
        executor.run(inputs, targets, positions[:1])


# --- the yardstick of bench.py: torch's schedules, and the torch they need on gloo ---------------


def test_torch_yardstick_is_refused_on_gloo_where_torch_waits_on_one_work_per_group(monkeypatch, capsys):
    """torch 2.6 / 2.7's pipelining waits on the last work of each batch_isend_irecv group only
    (gloo returns one per op: the ranks hang); the bench tests for the fix and refuses, before any
    collective, with exit 2 and one line naming the torch it needs. NCCL (one work per group) is
    never refused. Emulated here by the old `_batch_p2p`, then by the old version number."""
    from torch.torch_version import TorchVersion

    from pipeline import bench

    assert bench.torch_yardstick_error("gloo") is None  # the torch installed here has the fix

    def old_batch_p2p(ops, desc=None):  # torch 2.6 / 2.7: a single work, None for no ops
        return dist.batch_isend_irecv(ops).pop() if ops else None

    monkeypatch.setattr(bench.tpp_schedules, "_batch_p2p", old_batch_p2p)
    assert bench.torch_yardstick_error("nccl") is None
    error = bench.torch_yardstick_error("gloo")
    assert error is not None and "needs torch >= 2.8 on gloo" in error and "\n" not in error
    monkeypatch.setenv("PFS_BACKEND", "gloo")
    with pytest.raises(SystemExit) as exited:
        bench.main(["--schedules", "1f1b"])
    assert exited.value.code == 2
    assert capsys.readouterr().err.splitlines() == [f"error: {error}"]
    monkeypatch.delattr(bench.tpp_schedules, "_batch_p2p")  # a later torch renames the helper
    assert bench.torch_yardstick_error("gloo") is None
    monkeypatch.setattr(torch, "__version__", TorchVersion("2.7.1"))
    assert "needs torch >= 2.8" in bench.torch_yardstick_error("gloo")


# --- bad input: refused on every rank before any send -------------------------------------------


def validate_argv(argv: list[str], n_layers: int | None = None):
    args = pp_train.parse_args(argv)
    if n_layers is not None:
        args.cfg = get_config("tiny", n_layers=n_layers)
    return pp_train.validate(args, dist.get_world_size())


@pytest.mark.parametrize("argv, n_layers, message", [
    (["--schedule", "gpipe"], 2, r"4 stages × 1 virtual stages = 4 > the model's 2 layers"),
    (["--schedule", "interleaved", "--virtual-stages", "2"], 12,
     r"--virtual-stages 2 on 4 stages: the model's 12 layers are not divisible by p·v = 8"),
    (["--schedule", "interleaved", "--virtual-stages", "4"], None, r"16 > the model's 8 layers"),
    (["--schedule", "zb", "--microbatches", "2"], None, r"--microbatches 2 < 4 stages with --schedule zb"),
    (["--schedule", "interleaved", "--microbatches", "6", "--global-batch", "12"], None,
     r"--microbatches 6 .* multiple of 4"),
    (["--schedule", "1f1b", "--microbatches", "6"], None,
     r"--global-batch 16 is not divisible by --microbatches 6"),
    (["--schedule", "1f1b", "--virtual-stages", "2"], None, r"only 'interleaved' has virtual stages"),
    (["--schedule", "gpipe", "--partition", "4,4,1,0"], None, r"each stage needs >= 1 layer"),
    (["--schedule", "gpipe", "--partition", "4,4"], None, r"has 2 entries for 4 stages"),
    (["--schedule", "gpipe", "--micro-batch", "4"], None,
     r"--micro-batch 4 != --global-batch 16 / --microbatches 8"),
    (["--schedule", "fast"], None, r"--schedule 'fast' is unknown"),
])
def test_bad_input_fails_on_every_rank_before_any_send(pools, argv, n_layers, message):
    with pytest.raises(RankError, match=message) as info:
        pools.run(4, validate_argv, argv, n_layers)
    assert sorted(info.value.errors) == [0, 1, 2, 3]
    pools.run(4, dist.barrier)  # nobody was left inside a send or a collective


# --- the demo through the shared loop -------------------------------------------------------------


def train_cli(argv: list[str]) -> dict:
    args = pp_train.parse_args(argv)
    run = pp_train.validate(args, dist.get_world_size())
    ctx = init_distributed()
    return train(run, ctx, pp_train.build(run, ctx), chapter=6)


@pytest.mark.parametrize("schedule, extra", [("1f1b", []), ("interleaved", ["--clip-grad", "1e-3"]),
                                             ("zb", ["--dtype", "float32", "--mixed-precision", "bf16"])])
def test_train_check_passes_and_report_matches_formulas(pools, schedule, extra):
    argv = ["--model", "tiny", "--dtype", "float64", "--steps", "2", "--global-batch", "8",
            "--seq-len", "8", "--check", "--data", "synthetic", "--log-every", "0",
            "--schedule", schedule, "--microbatches", "4", *extra]
    reports = pools.run(2, train_cli, argv)
    assert all(r["check_passed"] for r in reports)
    for rank, report in enumerate(reports):
        assert report["comm_bytes_per_rank"] == pytest.approx(report["comm_bytes_formula"], rel=1e-12)
        for key in ("params", "grads", "optimizer"):
            assert report["memory"][key] == report["memory_formula"][key], (rank, key)
    report = reports[0]
    assert 0 <= report["bubble_fraction"] < 1
    assert report["bubble_formula"] == pytest.approx(report["bubble_simulated"])
    assert report["mesh"] == {"dp": 1, "pp": 2}


# --- for chapter 07: a pipeline over a sub-group, and the after-backward hook ------------------


def two_pipelines(schedule: str) -> tuple[float, list]:
    """Ranks {0, 2} and {1, 3} form two 2-stage pipelines (as a PP × DP mesh would); each trains
    one step on the same batch. Group rank 0 of each compares the gathered gradients with the
    single-device reference; every rank reports the after_backward calls it saw."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]  # every rank creates every group
    group = groups[dist.get_rank() % 2]
    spec = replace(NEGATIVE, world_size=2, steps=1, clip_grad=1e-2)
    run = spec_run(spec, pp_train.validate, schedule=schedule, microbatches=spec.grad_accum,
                   virtual_stages=1, partition=None, timeline_png=None)
    strategy = PipelineStrategy(run, init_distributed(), pp_group=group)
    calls = []
    strategy.executor.after_backward = lambda chunk, mb, last: calls.append((chunk, mb, last))
    tokens = spec.data().global_batch(0, spec.global_batch)
    strategy.forward_backward(list(tokens.split(spec.micro_batch)))
    grads = strategy.full_gradients()
    strategy.step()
    diff = 0.0
    if grads is not None:
        reference = reference_record(spec)
        diff = relative_diff(grads, reference.grads[0])
    return diff, calls


@pytest.mark.parametrize("schedule", ["1f1b", "zb"])
def test_pipelines_over_sub_groups_equal_one_device_and_call_after_backward(pools, schedule):
    results = pools.run(4, two_pipelines, schedule)
    assert max(diff for diff, _ in results) < 1e-10
    for _, calls in results:  # m = 4 micro-batches, one chunk: 4 backwards, the last one flagged
        assert [mb for _, mb, _ in calls] == [0, 1, 2, 3]
        assert [last for *_, last in calls] == [False, False, False, True]
