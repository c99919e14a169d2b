"""Lab 06's properties: what `make lab-check N=6` runs on your lab.py (common/grader.py runs them).

First the pure checks, in the grader's process on what your functions return: the 1F1B order
(every F and B once per stage, the data dependencies, at most p − r micro-batches held on rank r),
its bubble under the chapter's unit-cost simulator, your messages, your groups (each receive
posted before its action, each send after it). Then the chapter's PipelineExecutor runs your order
and your groups on a small LLaMA cut into p stages: once without moving data (common.grader's
record_p2p_plan), what it posted replayed under NCCL's rules at p = 2, 3, 4 and m = 4, 8, so that
an order NCCL would hang on is reported as a deadlock before any real run; then for real on 2 and
3 ranks, float64, two AdamW steps: the loss, every stage's gradients (gathered) and the parameters
against one device (common/reference.py) at 1e-10.
"""

from __future__ import annotations

from functools import cache

import torch
import torch.distributed as dist

from common.data import SyntheticTokens, split_inputs_targets
from common.diagnosis import first_difference
from common.grader import Property
from common.model import build_model, get_config, loss_fn
from common.reference import make_optimizer, make_reference
from pipeline.executor import PipelineExecutor
from pipeline.p2p import Exchange, label
from pipeline.schedules import Action, Message, Schedule, one_f_one_b
from pipeline.simulator import bubble_fraction, closed_form_bubble, simulate
from pipeline.stage import layer_partition, split_model

TITLE = "1F1B as data, and its send/recv groups"
CFG = get_config("tiny", n_layers=4)
MICRO, SEQ, LR, STEPS, TOLERANCE = 1, 8, 1e-2, 2, 1e-10
FIRST = [(4, 8), (2, 4), (3, 4)]  # reported first when they fail: the README's picture, then small
SHAPES = FIRST + [(p, m) for p in range(1, 6) for m in range(1, 9) if (p, m) not in FIRST]


def as_schedule(actions, p: int, m: int) -> Schedule:
    return Schedule("1f1b", p, m, 1, False, tuple(tuple(order) for order in actions))


# --- the order: pure checks --------------------------------------------------------------------

def _needs(action: Action, r: int, p: int) -> tuple[str, int, int] | None:
    """What another stage must have run first: (kind, micro-batch, stage)."""
    if action.kind == "F":
        return ("F", action.microbatch, r - 1) if r > 0 else None
    return ("B", action.microbatch, r + 1) if r < p - 1 else None


def _stuck(actions, p: int) -> dict[int, Action]:
    """Run the ranks' lists against each other, in time: where each rank waits for good ({} if none)."""
    done, pos, progress = set(), [0] * p, True
    while progress:
        progress = False
        for r in range(p):
            while pos[r] < len(actions[r]):
                action = actions[r][pos[r]]
                if (need := _needs(action, r, p)) is not None and need not in done:
                    break
                done.add((action.kind, action.microbatch, r))
                pos[r], progress = pos[r] + 1, True
    return {r: actions[r][pos[r]] for r in range(p) if pos[r] < len(actions[r])}


def _ahead(order) -> int:
    """Forwards run before the first backward."""
    return next((k for k, a in enumerate(order) if a.kind == "B"), len(order))


def order_error(actions, p: int, m: int, memory: bool = True) -> tuple[str, str] | None:
    """(where, hint) for the first thing wrong with `actions` as a 1F1B order of (p, m), or None."""
    at = f"p={p} m={m}"
    if len(actions) != p:
        return (f"{at}: one_f_one_b returned {len(actions)} lists",
                "one list per rank: actions[r] is what rank r (stage r) runs, in order")
    for r, order in enumerate(actions):
        done = set()
        for k, a in enumerate(order):
            if not (isinstance(a, Action) and a.kind in ("F", "B") and a.chunk == 0
                    and 0 <= a.microbatch < m):
                return (f"{at}, rank {r}: item {k} is {a!r}", "each item is Action('F', i) or "
                        "Action('B', i), 0 ≤ i < m (one stage per rank: chunk 0)")
            if (a.kind, a.microbatch) in done:
                return f"{at}, rank {r} (stage {r}) runs {a} twice", \
                    "each micro-batch goes forward once and backward once on every stage"
            if a.kind == "B" and ("F", a.microbatch) not in done:
                return f"{at}, rank {r} (stage {r}) runs {a} before F{a.microbatch}", \
                    "a backward needs the activations its forward saved: B(i) after F(i) on the same rank"
            done.add((a.kind, a.microbatch))
        missing = [Action(kind, i) for kind in "FB" for i in range(m) if (kind, i) not in done]
        if missing:
            tail = [Action("B", i) for i in range(m - len(missing), m)]
            hint = ("the cool-down stops short: after the steady state the rank still owes the backwards "
                    f"of the micro-batches it started last, up to B{m - 1}" if missing == tail else
                    "every micro-batch needs one F and one B on every rank")
            return f"{at}, rank {r} (stage {r}) never runs {' '.join(map(str, missing))}", hint
    if stuck := _stuck(actions, p):
        waits = "; ".join(f"rank {r} waits at {a} for {_needs(a, r, p)[0]}{a.microbatch} of stage "
                          f"{_needs(a, r, p)[2]}" for r, a in stuck.items())
        warmups = [_ahead(order) for order in actions]
        reversed_ = warmups == sorted(warmups) and warmups[0] < warmups[-1]
        hint = ("the warm-up grows with the rank, it should shrink: stage 0 is the farthest from the loss, "
                "so it waits longest for its first gradient" if reversed_ else
                "a rank waits for a backward that its neighbour can only run after a forward this rank "
                "has not run yet: run the forwards the next stage waits for before waiting for a gradient")
        return f"{at}: this order cannot finish: {waits}", hint
    return _memory_error(actions, p, m) if memory else None


def _memory_error(actions, p: int, m: int) -> tuple[str, str] | None:
    """Rank r holds a micro-batch's activations from its F to its B: at most p − r at once."""
    at = f"p={p} m={m}"
    for r, order in enumerate(actions):
        live = peak = top = 0
        for k, a in enumerate(order):
            live += 1 if a.kind == "F" else -1
            peak, top = (live, k) if live > peak else (peak, top)
        if peak <= min(p - r, m):
            continue
        ahead = _ahead(order)
        if ahead == m:
            hint = (f"rank {r} runs all {m} forwards before its first backward: that is GPipe's memory "
                    "(∝ m). 1F1B starts each backward as soon as its gradient can be back")
        elif ahead == p - r + 1:
            hint = ("one warm-up forward too many: that forward could wait for the first backward, "
                    "which arrives at the same time")
        else:
            hint = "fewer forwards ahead of the backwards: after the warm-up, one F then one B"
        return (f"{at}: rank {r} (stage {r}) holds {peak} micro-batches' activations at once "
                f"(after {order[top]}); 1F1B holds at most p − r = {p - r}", hint)
    return None


def orders(lab, world: int) -> dict[tuple[int, int], list[list[Action]]]:
    return {(p, m): [list(order) for order in lab.one_f_one_b(p, m)] for p, m in SHAPES}


def check_order(runs) -> tuple[bool, str, str]:
    for (p, m), actions in runs[0][1].items():
        if (error := order_error(actions, p, m)) is not None:
            return False, *error
    return True, f"{len(SHAPES)} (p, m) with p ≤ 5, m ≤ 8: every dependency met, ≤ p − r held on rank r", ""


def check_bubble(runs) -> tuple[bool, str, str]:
    """The chapter's simulator (F = 1, B = 2, free messages) on your order: 1F1B's bubble exactly."""
    for (p, m), actions in runs[0][1].items():
        if order_error(actions, p, m, memory=False) is not None:
            return False, f"p={p} m={m}: not an order that can run yet", "the first property says where"
        intervals = simulate(as_schedule(actions, p, m))
        bubble, want = bubble_fraction(intervals, p), closed_form_bubble("1f1b", p, m)
        if bubble != want:
            span = max(i.end for i in intervals)
            late = [r for r, order in enumerate(actions) if _ahead(order) < min(p - r, m)]
            hint = (f"rank {late[0]} runs only {_ahead(actions[late[0]])} forward(s) before its first "
                    "backward, then waits for a gradient while it could run a forward" if late else
                    "some rank waits for data while it has work it could do")
            return False, (f"p={p} m={m}: bubble {float(bubble):.3f} (the step takes {span} units), "
                           f"(p−1)/(m+p−1) = {float(want):.3f} ({3 * (m + p - 1)} units)"), hint
    return True, f"the simulated bubble is (p−1)/(m+p−1) at all {len(SHAPES)} (p, m)", ""


# --- messages and groups: pure checks ----------------------------------------------------------

NONE_BECAUSE = {("F", "receive"): "stage 0 reads the tokens",
                ("F", "send"): "the last stage ends in the loss",
                ("B", "receive"): "the last stage's backward starts from the loss",
                ("B", "send"): "stage 0 has no stage before it"}
NEEDED_BECAUSE = {("F", "receive"): "an F on a later stage takes the previous stage's activation",
                  ("F", "send"): "an F's output goes on to the next stage",
                  ("B", "receive"): "a B starts from the gradient of its stage's output, from the next stage",
                  ("B", "send"): "a B's input gradient goes back to the previous stage"}
FIELD_HINT = {"kind": "activations ('act') go forward with F, their gradients ('grad') back with B",
              "microbatch": "a message carries its action's own micro-batch",
              "src_stage": "src_stage is the stage that sends (stage = rank here)",
              "src": "src is the rank that sends", "dst": "dst is the rank that receives"}


def message_error(p: int, r: int, action: Action, what: str, got, want: Message | None):
    where = f"messages(p={p}, rank={r}, {action})'s {what}"
    if got == want:
        return None
    if got is not None and not isinstance(got, Message):
        return f"{where} is {got!r}", "a Message(kind, microbatch, src_stage, src, dst) or None"
    if want is None:
        return f"{where} is {label(got)}", f"nothing: {NONE_BECAUSE[action.kind, what]}"
    if got is None:
        return f"{where} is None", NEEDED_BECAUSE[action.kind, what]
    wrong = [f for f in FIELD_HINT if getattr(got, f) != getattr(want, f)]
    return (f"{where} has {', '.join(f'{f}={getattr(got, f)!r}' for f in wrong)}",
            "; ".join(FIELD_HINT[f] for f in wrong))


def all_messages(lab, world: int) -> dict:
    return {(p, r, a): tuple(lab.messages(p, r, a)) for p in (3, 2, 4, 1) for r in range(p)
            for a in one_f_one_b(p, 3).actions[r]}


def check_messages(runs) -> tuple[bool, str, str]:
    for (p, r, a), (receive, send) in runs[0][1].items():
        schedule = one_f_one_b(p, 3)
        for what, got, want in (("receive", receive, schedule.recv(r, a)),
                                ("send", send, schedule.send(r, a))):
            if (error := message_error(p, r, a, what, got, want)) is not None:
                return False, *error
    return True, f"{len(runs[0][1])} actions at p ≤ 4: every receive and send as the data flows", ""


def program_error(program, schedule: Schedule, r: int) -> tuple[str, str] | None:
    """(where, hint) for the first thing in rank r's list that the executor cannot run, or None."""
    at = f"p={schedule.p} m={schedule.m}, rank {r}"
    ran, posted = [], {}  # posted[(kind, message)] = how many actions had run when it was posted
    for item in program:
        if isinstance(item, Action):
            ran.append(item)
            continue
        if not isinstance(item, Exchange):
            return f"{at}: an item is {item!r}", "the list holds the given Actions and Exchange groups"
        for kind, group in (("send", item.sends), ("receive", item.recvs)):
            for message in group:
                if not isinstance(message, Message):
                    return f"{at}: an Exchange holds {message!r}", "an Exchange holds Messages"
                posted.setdefault((kind, message), []).append(len(ran))
    given = list(schedule.actions[r])
    if ran != given:
        k = next((k for k, (a, b) in enumerate(zip(ran, given, strict=False)) if a != b),
                 min(len(ran), len(given)))
        return (f"{at}: the list runs {' '.join(map(str, ran))}",
                f"run the given actions, all of them, in their order (first difference at action {k})")
    needed = set()
    for k, a in enumerate(given):
        for kind, message in (("receive", schedule.recv(r, a)), ("send", schedule.send(r, a))):
            if message is None:
                continue
            needed.add((kind, message))
            times = posted.get((kind, message), [])
            if not times and kind == "receive":
                return f"{at}: the receive of {label(message)}, which {a} needs, is never posted", \
                    "post each action's receive in a group before the action"
            if not times:
                return f"{at}: {label(message)}, which {a} computes, is never sent", (
                    "the last action's send needs a group after it: no later group carries it"
                    if k == len(given) - 1 else "post each send in a group after the action that computes it")
            if len(times) > 1:
                return f"{at}: the {kind} of {label(message)} is posted {len(times)} times", \
                    "post each message exactly once"
            if kind == "receive" and times[0] > k:
                return f"{at}: the receive of {label(message)} is posted after {a} ran", \
                    "the executor waits for an action's receive right before computing it: post it before"
            if kind == "send" and times[0] <= k:
                return f"{at}: {label(message)} is sent before {a} computed it", \
                    "a send goes in a group after its action: the output exists only once the action ran"
    if extra := [key for key in posted if key not in needed]:
        kind, message = extra[0]
        return f"{at}: posts a {kind} of {label(message)}, which none of its actions {kind}s", \
            "post exactly the messages that messages() gives for this rank's actions"
    return None


def programs(lab, world: int) -> dict:
    return {(p, m): [list(lab.p2p_schedule(p, r, list(one_f_one_b(p, m).actions[r]))) for r in range(p)]
            for p, m in SHAPES if p <= 4}


def check_programs(runs) -> tuple[bool, str, str]:
    for (p, m), ranks in runs[0][1].items():
        for r, program in enumerate(ranks):
            if (error := program_error(program, one_f_one_b(p, m), r)) is not None:
                return False, *error
    return True, f"{len(runs[0][1])} (p, m), p ≤ 4: each message posted once, receives before, sends " \
                 "after", ""


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
    chunks = split_model(build_model(CFG, 0, torch.float64), p, 1, rank)
    executor = PipelineExecutor(schedule, rank, chunks, loss_fn, (MICRO, SEQ, CFG.dim), torch.float64,
                                torch.device("cpu"))
    segments, exchanges = [[]], [Exchange((), ())]  # the executor posts exchanges[k], runs segments[k]
    for item in program:
        if isinstance(item, Exchange):
            exchanges.append(item)
            segments.append([])
        else:
            segments[-1].append(item)
    executor.segments, executor.exchanges = [tuple(s) for s in segments], [*exchanges, Exchange((), ())]
    return executor, chunks


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


def train(lab, world: int, m: int) -> dict | None:
    """STEPS AdamW steps of the pipeline; rank 0 gathers every stage's gradients and parameters."""
    rank = dist.get_rank()
    executor, chunks = _pipeline(lab, world, m, rank)
    named = {n: p for chunk in chunks for n, p in chunk.named_parameters()}
    optimizer = make_optimizer(named.values(), "adamw", LR)
    mine = {"losses": [], "grads": []}
    for step in range(STEPS):
        loss = executor.run(*_batch(step, m))
        mine["losses"].append(None if loss is None else loss.item())
        mine["grads"].append({n: None if t.grad is None else t.grad.clone() for n, t in named.items()})
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    mine["params"] = {n: p.detach().clone() for n, p in named.items()}
    everyone = [None] * world if rank == 0 else None
    dist.gather_object(mine, everyone, dst=0)
    if rank:
        return None
    return {"losses": everyone[-1]["losses"],
            "grads": [{n: g for d in everyone for n, g in d["grads"][s].items()} for s in range(STEPS)],
            "params": {n: t for d in everyone for n, t in d["params"].items()}}


@cache
def reference(m: int) -> dict:
    trainer = make_reference(CFG, 0, torch.float64, "adamw", LR)
    data = SyntheticTokens(CFG.vocab_size, SEQ)
    steps = [trainer.step(data.global_batch(step, m * MICRO)) for step in range(STEPS)]
    return {"losses": [loss for loss, _ in steps], "grads": [grads for _, grads in steps],
            "params": {n: t.clone() for n, t in trainer.parameters().items()}}


def _stage(name: str, p: int) -> int:
    if not name.startswith("layers."):
        return 0 if name.startswith("tok_embeddings") else p - 1
    layer = int(name.split(".")[1])
    return next(s for s, layers in enumerate(layer_partition(CFG.n_layers, p)) if layer in layers)


def check_equal(runs) -> tuple[bool, str, str]:
    for config, got in runs:
        p, m = config["world"], config["m"]
        want = reference(m)
        for s in range(STEPS):
            at = f"step {s + 1}, p={p} m={m}"
            rel = abs(got["losses"][s] - want["losses"][s]) / abs(want["losses"][s])
            if rel > TOLERANCE:
                return False, f"{at}: loss {got['losses'][s]:.10g}, one device {want['losses'][s]:.10g} " \
                              f"(rel diff {rel:.2g})", \
                    "a forward ran on the wrong input: an activation of another micro-batch, or a buffer " \
                    "overwritten before its forward"
            if finding := first_difference(got["grads"][s], want["grads"][s], TOLERANCE):
                stage = _stage(finding.name, p)
                hint = ("zero gradients: this stage's backwards never ran" if finding.zero else
                        "right loss, wrong gradients: a received activation or gradient landing in a buffer "
                        "that an earlier micro-batch's graph still uses (README: a received tensor lands in "
                        "a fresh buffer), or a gradient sent back for another micro-batch")
                return False, f"{at}: grad of {finding} (stage {stage}, rank {stage})", hint
        if finding := first_difference(got["params"], want["params"], TOLERANCE):
            return False, f"after {STEPS} steps, p={p}: parameter {finding}", \
                "the gradients were right: is every stage's optimizer stepped once per step?"
    return True, f"loss, gradients of every stage and parameters within {TOLERANCE:g} at p = " \
                 f"{sorted(c['world'] for c, _ in runs)}", ""


PROPERTIES = [
    Property("one_f_one_b: dependencies met, at most p − r held on rank r", [{"world": 1}], orders,
             check_order),
    Property("one_f_one_b: the simulated bubble is (p−1)/(m+p−1)", [{"world": 1}], orders, check_bubble),
    Property("messages: what each F and B receives and sends", [{"world": 1}], all_messages, check_messages),
    Property("p2p_schedule: every receive before its action, every send after", [{"world": 1}], programs,
             check_programs),
    Property("the groups the executor posts replay under NCCL's rules (p = 2, 3, 4; m = 4, 8)",
             [{"world": p, "ms": (4, 8)} for p in (2, 3, 4)], post_groups, plan=True),
    Property("two AdamW steps on 2 ranks equal one device (m = 4, float64)", [{"world": 2, "m": 4}],
             train, check_equal),
    Property("two AdamW steps on 3 ranks equal one device (m = 4, float64)", [{"world": 3, "m": 4}],
             train, check_equal),
]
