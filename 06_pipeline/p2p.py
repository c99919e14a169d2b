"""The communication plan as data: which point-to-point groups each pipeline rank posts, in order.

A rank's actions are cut into *segments*, and before each segment the rank posts one group
(one `batch_isend_irecv`): the sends of the segment before it and the receives of this segment.
A last group after the final segment carries the final sends. A segment is one action, except in
the steady state of an interleaved schedule (v > 1 and m > p), where a forward directly followed
by a backward is one segment (Megatron's send_forward_backward_recv_forward_backward):

    plain (every schedule but interleaved with m > p)  [sends of action i-1, receive of action i]
    interleaved steady state    [send act of F_k, send grad of B_k, receive F_k+1's act,
                                 receive B_k+1's grad]  (warm-up and cool-down: as plain)

A W (zero bubble's weight gradient) sends and receives nothing, so the group before it holds
only the input gradient B just computed: it leaves before W runs, as zero bubble needs. A message
a rank sends to itself (p = 1, v > 1: chunk c feeds chunk c+1) is handed over locally
and is not in the plan. Groups are non-empty; inside a group the sends come first.

Why the grouping matters: under NCCL a rank's groups run one after another, and a send completes
only when the peer's matching receive runs in the peer's *current* group (gloo buffers sends, so
any grouping passes on CPU). The plain pairing posts a send-only group whenever the next action
receives nothing (rank 0's chunk-0 forwards, the last stage's backwards); in the interleaved
steady state such a group waits for a neighbour that is itself blocked sending a gradient this
rank receives only later (p = 2, m = 4, v = 2 deadlocks: rank 0 waits in [send grad] for rank 1's
next group while rank 1 waits in [send grad, recv act] for rank 0's next group). With both
directions of an F/B pair in one group, a steady-state group never sends alone: it also receives
from the neighbours it sends to, so the neighbours' groups complete together instead of each
waiting for the other's next one; warm-up and cool-down move data one way and keep the plain
pairing. That is the reason, not the proof: the proof is exhaustive, `tests/test_p2p_plan.py`
replays every schedule × p ≤ 8 × m ≤ 16 × v ≤ 4 (524 plans) under NCCL's rules
(common/kernel/p2p_plan.py) and finds no deadlock, with the plain pairing for interleaved (57 of 57
steady-state configurations deadlock) as its negative control.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import pairwise

from .schedules import Action, Message, Schedule


@dataclass(frozen=True)
class Exchange:
    """One group: what a rank sends and receives in one `batch_isend_irecv` (either may be empty)."""

    sends: tuple[Message, ...]
    recvs: tuple[Message, ...]


def pairs_forward_with_backward(schedule: Schedule) -> bool:
    """True when F/B pairs form one segment: the steady state of interleaved 1F1B (m > p; with
    m = p every rank runs all forwards, then all backwards, and has no steady state)."""
    return schedule.v > 1 and schedule.m > schedule.p


def segments(schedule: Schedule, rank: int) -> list[tuple[Action, ...]]:
    """Rank `rank`'s actions cut into the segments of the module docstring (or of the
    schedule's own `posts`)."""
    actions, pair = schedule.actions[rank], pairs_forward_with_backward(schedule)
    if schedule.posts:
        bounds = [0]
        for n, _, _ in schedule.posts[rank][:-1]:
            bounds.append(bounds[-1] + n)
        return [actions[a:b] for a, b in pairwise(bounds)]
    out: list[list[Action]] = []
    i = 0
    while i < len(actions):
        action = actions[i]
        if pair and action.kind == "F" and i + 1 < len(actions) and actions[i + 1].kind == "B":
            out.append([action, actions[i + 1]])
            i += 1
        else:
            out.append([action])
        i += 1
    return [tuple(s) for s in out]


def exchanges(schedule: Schedule, rank: int) -> list[Exchange]:
    """The group posted before each segment of `segments(schedule, rank)`, and one after the
    last: len(segments) + 1 Exchanges (some empty), messages to itself left out. A schedule
    with its own `posts` (DualPipeV: inputs received a unit early, outputs sent a unit late,
    as deepseek-ai/DualPipe posts them) gives them here."""
    if schedule.posts:
        return [Exchange(
            tuple(m for a in sent if (m := schedule.send(rank, a)) is not None and m.dst != rank),
            tuple(m for a in got if (m := schedule.recv(rank, a)) is not None and m.src != rank))
            for _, sent, got in schedule.posts[rank]]
    out, sends = [], ()
    for segment in segments(schedule, rank):
        recvs = tuple(m for a in segment if (m := schedule.recv(rank, a)) is not None and m.src != rank)
        out.append(Exchange(sends, recvs))
        sends = tuple(m for a in segment if (m := schedule.send(rank, a)) is not None and m.dst != rank)
    out.append(Exchange(sends, ()))
    return out


def label(message: Message) -> str:
    to = message.src_stage + (1 if message.kind == "act" else -1)
    return f"{message.kind} mb{message.microbatch} stage {message.src_stage}→{to}"


def p2p_plan(schedule: Schedule, nbytes: int = 1) -> dict[int, list[list[tuple[str, int, int, str]]]]:
    """Every pipeline rank's non-empty groups, in order, as (kind, peer, nbytes, label) tuples
    (peer: pipeline rank; nbytes: every message's size, 1 = count messages). This is exactly what
    PipelineExecutor posts; common/kernel/p2p_plan.find_deadlock replays it under NCCL's rules."""
    plan = {}
    for rank in range(schedule.p):
        groups = []
        for ex in exchanges(schedule, rank):
            group = ([("send", m.dst, nbytes, label(m)) for m in ex.sends]
                     + [("recv", m.src, nbytes, label(m)) for m in ex.recvs])
            if group:
                groups.append(group)
        plan[rank] = groups
    return plan
