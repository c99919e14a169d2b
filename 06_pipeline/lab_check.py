"""Lab 06's properties: what `make lab-check N=6` runs on your lab.py (common/labs/grader.py runs them).

First the pure checks, in the grader's process on what your functions return: the 1F1B order
(every F and B once per stage, the data dependencies, at most p − r micro-batches held on rank r),
its bubble under the chapter's unit-cost simulator, your messages, your groups (each receive
posted before its action, each send after it). Then the chapter's PipelineExecutor runs your order
and your groups on a small LLaMA cut into p stages: once without moving data (common.labs.rank's
record_p2p_plan), what it posted replayed under NCCL's rules at p = 2, 3, 4 and m = 4, 8, so that
an order NCCL would hang on is reported as a deadlock before any real run; then for real on 2 and
3 ranks, float64, two AdamW steps: the loss and every stage's gradients against one device
(common/reference.py) at 1e-10, and what 1F1B is for, measured: the saved activations each rank
holds at its peak (common/memory.ActivationMeter), in micro-batches, at most p − r.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from common.data import SyntheticTokens, split_inputs_targets
from common.kernel.model import build_model, get_config, loss_fn
from common.labs.diagnosis import explain, first_difference
from common.labs.grader import Fail, Property
from common.labs.rank import at
from common.labs.tools import one_device
from common.memory import ActivationMeter
from common.reference import make_optimizer
from pipeline.executor import PipelineExecutor
from pipeline.lab_hints import as_schedule, forwards_ahead, message_error, order_error, program_error
from pipeline.p2p import Exchange, label
from pipeline.schedules import one_f_one_b
from pipeline.simulator import bubble_fraction, closed_form_bubble, simulate
from pipeline.stage import layer_partition, split_model

TITLE = "1F1B as data, and its send/recv groups"
CFG = get_config("tiny", n_layers=4)
MICRO, SEQ, LR, STEPS = 1, 8, 1e-2, 2
FIRST = [(4, 8), (2, 4), (3, 4)]  # reported first when they fail: the README's picture, then small
SHAPES = FIRST + [(p, m) for p in range(1, 6) for m in range(1, 9) if (p, m) not in FIRST]


# --- the order, the messages, the groups: pure checks ------------------------------------------

def orders(lab, world: int) -> dict:
    return {(p, m): [list(order) for order in lab.one_f_one_b(p, m)] for p, m in SHAPES}


def check_order(runs) -> Fail | str:
    """one_f_one_b(p, m) for 40 (p, m) up to p = 5, m = 8: every F(i) and B(i) once per rank, each B
    after its F, each F after the previous stage's F, each B after the next stage's B (the ranks'
    lists run against each other), at most p − r micro-batches held on rank r."""
    for (p, m), actions in runs[0].ranks[0].items():
        if (error := order_error(actions, p, m)) is not None:
            return Fail(*error)
    return f"{len(SHAPES)} (p, m) with p ≤ 5, m ≤ 8: every dependency met, ≤ p − r held on rank r"


def check_bubble(runs) -> Fail | str:
    """The chapter's simulator (F = 1, B = 2, free messages) on your order gives 1F1B's bubble
    (p−1)/(m+p−1) exactly."""
    for (p, m), actions in runs[0].ranks[0].items():
        if order_error(actions, p, m, memory=False) is not None:
            return Fail(f"p={p} m={m}: not an order that can run yet", "the first property says where")
        intervals = simulate(as_schedule(actions, p, m))
        bubble, want = bubble_fraction(intervals, p), closed_form_bubble("1f1b", p, m)
        if bubble != want:
            span = max(i.end for i in intervals)
            late = [r for r, order in enumerate(actions) if forwards_ahead(order) < min(p - r, m)]
            hint = (f"rank {late[0]} runs only {forwards_ahead(actions[late[0]])} forward(s) before its "
                    "first backward, then waits for a gradient while it could run a forward" if late else
                    "some rank waits for data while it has work it could do")
            return Fail(f"p={p} m={m}: bubble {float(bubble):.3f} (the step takes {span} units), "
                        f"(p−1)/(m+p−1) = {float(want):.3f} ({3 * (m + p - 1)} units)", hint)
    return f"the simulated bubble is (p−1)/(m+p−1) at all {len(SHAPES)} (p, m)"


def all_messages(lab, world: int) -> dict:
    return {(p, r, a): tuple(lab.messages(p, r, a)) for p in (3, 2, 4, 1) for r in range(p)
            for a in one_f_one_b(p, 3).actions[r]}


def check_messages(runs) -> Fail | str:
    """messages(p, rank, action) for every action at p ≤ 4: what it receives and sends is what the
    data flow says (kind, micro-batch, source stage, source and destination ranks), or None."""
    for (p, r, a), (receive, send) in runs[0].ranks[0].items():
        schedule = one_f_one_b(p, 3)
        for what, got, want in (("receive", receive, schedule.recv(r, a)),
                                ("send", send, schedule.send(r, a))):
            if (error := message_error(p, r, a, what, got, want)) is not None:
                return Fail(*error)
    return f"{len(runs[0].ranks[0])} actions at p ≤ 4: every receive and send as the data flows"


def programs(lab, world: int) -> dict:
    return {(p, m): [list(lab.p2p_schedule(p, r, list(one_f_one_b(p, m).actions[r]))) for r in range(p)]
            for p, m in SHAPES if p <= 4}


def check_programs(runs) -> Fail | str:
    """p2p_schedule: the given actions in their order, each receive posted once in a group before
    its action, each send once in a group after it, nothing else."""
    for (p, m), ranks in runs[0].ranks[0].items():
        for r, program in enumerate(ranks):
            if (error := program_error(program, one_f_one_b(p, m), r)) is not None:
                return Fail(*error)
    return f"{len(runs[0].ranks[0])} (p, m), p ≤ 4: each message posted once, receives before, sends after"


# --- the chapter's executor runs your order and your groups ------------------------------------

def _pipeline(lab, p: int, m: int, rank: int) -> tuple[PipelineExecutor, list]:
    """PipelineExecutor on this rank's stage of a fresh model, running your order and your groups."""
    actions = [list(order) for order in lab.one_f_one_b(p, m)]
    if (error := order_error(actions, p, m, memory=False)) is not None:
        raise ValueError(f"one_f_one_b cannot run yet ({error[0]}): the first property says more")
    schedule = as_schedule(actions, p, m)
    program = list(lab.p2p_schedule(p, rank, list(schedule.actions[rank])))
    if (error := program_error(program, schedule, rank)) is not None:
        raise ValueError(f"p2p_schedule cannot run yet ({error[0]}): the groups property says more")
    executor, chunks = _executor(schedule, p, rank)
    segments, exchanges = [[]], [Exchange((), ())]  # the executor posts exchanges[k], runs segments[k]
    for item in program:
        if isinstance(item, Exchange):
            exchanges.append(item)
            segments.append([])
        else:
            segments[-1].append(item)
    executor.segments, executor.exchanges = [tuple(s) for s in segments], [*exchanges, Exchange((), ())]
    return executor, chunks


def _executor(schedule, p: int, rank: int) -> tuple[PipelineExecutor, list]:
    chunks = split_model(build_model(CFG, 0, torch.float64), p, 1, rank)
    return PipelineExecutor(schedule, rank, chunks, loss_fn, (MICRO, SEQ, CFG.dim), torch.float64,
                            torch.device("cpu")), chunks


def _batch(step: int, m: int) -> tuple[list, list, list]:
    inputs, targets = split_inputs_targets(SyntheticTokens(CFG.vocab_size, SEQ).global_batch(step, m * MICRO))
    return list(inputs.split(MICRO)), list(targets.split(MICRO)), [torch.arange(SEQ)] * m


def post_groups(lab, world: int, ms: tuple[int, ...]) -> list[list[tuple[str, int, str]]]:
    """One step per m in `ms`, one after the other (the grader records the sends and receives
    instead of moving data; a plan that completes step by step completes as a whole); returns
    what the executor posted, labelled, for the deadlock report."""
    posted = []
    for m in ms:
        executor, _ = _pipeline(lab, world, m, dist.get_rank())
        executor.run(*_batch(0, m))
        posted += [[("send", s.dst, f"{label(s)} [m={m}]") for s in ex.sends]
                   + [("recv", x.src, f"{label(x)} [m={m}]") for x in ex.recvs]
                   for ex in executor.exchanges if ex.sends or ex.recvs]
    return posted


def _peak(executor: PipelineExecutor, chunks: list, step: int, m: int) -> tuple[float | None, int]:
    with ActivationMeter([p for c in chunks for p in c.parameters()]) as meter:
        loss = executor.run(*_batch(step, m))
    return (None if loss is None else loss.item()), meter.peak_bytes


def train(lab, world: int, m: int) -> dict:
    """STEPS AdamW steps of the pipeline (this rank's stage); the first step's peak of saved
    activations, and one micro-batch's (the chapter's own schedule at m = 1) to count them in."""
    rank = dist.get_rank()
    _, one = _peak(*_executor(one_f_one_b(world, 1), world, rank), 0, 1)
    executor, chunks = _pipeline(lab, world, m, rank)
    named = {n: p for chunk in chunks for n, p in chunk.named_parameters()}
    optimizer = make_optimizer(named.values(), "adamw", LR)
    mine = {"losses": [], "grads": [], "peak": None, "one": one}
    for step in range(STEPS):
        at(step=step + 1, phase="executor.run")
        loss, peak = _peak(executor, chunks, step, m)
        mine["peak"] = mine["peak"] or peak
        mine["losses"].append(loss)
        mine["grads"].append({n: None if t.grad is None else t.grad.clone() for n, t in named.items()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return mine


def _stage(name: str, p: int) -> int:
    if not name.startswith("layers."):
        return 0 if name.startswith("tok_embeddings") else p - 1
    layer = int(name.split(".")[1])
    return next(s for s, layers in enumerate(layer_partition(CFG.n_layers, p)) if layer in layers)


def check_steps(runs) -> Fail | str:
    """Each step, the last stage's loss and every stage's gradients (joined over the ranks) equal
    one device's on the whole batch (float64, 1e-10)."""
    for run in runs:
        p, m = run.world, run.config["m"]
        want = one_device(CFG, STEPS, m * MICRO, SEQ, "adamw", LR)
        for s in range(STEPS):
            at_ = f"step {s + 1}, p={p} m={m}"
            loss = run.ranks[-1]["losses"][s]
            if abs(loss - want.losses[s]) > 1e-10 * abs(want.losses[s]):
                return Fail(f"{at_}: loss {loss:.10g}, one device {want.losses[s]:.10g}",
                            "a forward ran on the wrong input: an activation of another micro-batch, or a "
                            "buffer overwritten before its forward", step=s)
            got = {n: g for out in run.ranks for n, g in out["grads"][s].items()}
            if finding := first_difference(got, want.grads[s]):
                stage = _stage(finding.name, p)
                hint = ("right loss, wrong gradients: a received activation or gradient landing in a buffer "
                        "that an earlier micro-batch's graph still uses (README: a received tensor lands in "
                        "a fresh buffer), or a gradient sent back for another micro-batch"
                        if finding.rel > 1e-6 and not finding.zero else explain(finding, 1))
                return Fail(f"{at_}: grad of {finding} (stage {stage}, rank {stage})", hint, step=s)
    return f"loss and the gradients of every stage within 1e-10 at p = {[r.world for r in runs]}"


def check_in_flight(runs) -> Fail | str:
    """What 1F1B is for, measured: rank r's peak of saved activations is at most p − r
    micro-batches' (counted by common.memory.ActivationMeter, in units of one micro-batch's)."""
    figures = []
    for run in runs:
        p, m = run.world, run.config["m"]
        for r, out in enumerate(run.ranks):
            held = out["peak"] / out["one"]  # + a few bytes of tensors that live for one action
            if round(held) > min(p - r, m):
                return Fail(f"p={p} m={m}, rank {r}: held {held:.2f} micro-batches' activations at its peak "
                            f"(measured {out['peak']:,} B, one micro-batch {out['one']:,} B); 1F1B holds at "
                            f"most p − r = {min(p - r, m)}",
                            "more forwards ran before their backwards than 1F1B's warm-up: the order "
                            "property says where (GPipe's order holds all m)")
        figures.append(f"p={p}: {[round(o['peak'] / o['one'], 2) for o in run.ranks]}")
    return "micro-batches held at the peak, measured, rank by rank: " + "; ".join(figures)


PROPERTIES = [
    Property("one_f_one_b: dependencies met, at most p − r held on rank r", [{"world": 1}], orders,
             [check_order]),
    Property("one_f_one_b: the simulated bubble is (p−1)/(m+p−1)", [{"world": 1}], orders, [check_bubble]),
    Property("messages: what each F and B receives and sends", [{"world": 1}], all_messages,
             [check_messages]),
    Property("p2p_schedule: every receive before its action, every send after", [{"world": 1}], programs,
             [check_programs]),
    Property("the groups the executor posts replay under NCCL's rules (p = 2, 3, 4; m = 4, 8)",
             [{"world": p, "ms": (4, 8)} for p in (2, 3, 4)], post_groups, plan=True),
    Property("two AdamW steps on 2 ranks equal one device (m = 4, float64)", [{"world": 2, "m": 4}],
             train, [check_steps, check_in_flight]),
    Property("two AdamW steps on 3 ranks equal one device (m = 4, float64)", [{"world": 3, "m": 4}],
             train, [check_steps, check_in_flight]),
]
