"""Lab 06, the reference: 1F1B as data and the send/recv groups that carry it.

`make lab-check N=6 SOLUTION=1` grades this file with the same properties as your lab.py. Read it
after you have passed them, or when you are stuck for good.
"""

from __future__ import annotations

from pipeline.p2p import Exchange
from pipeline.schedules import Action, Message


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """Rank r is p − r − 1 stages from the loss: it can run that many forwards before the first
    gradient can come back (warm-up); then each backward frees one micro-batch's activations and
    one forward takes its place (steady state, p − r held); then the backwards still owed."""
    actions = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        order = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            order += [Action("F", warmup + i), Action("B", i)]
        order += [Action("B", i) for i in range(m - warmup, m)]
        actions.append(order)
    return actions


def messages(p: int, rank: int, action: Action) -> tuple[Message | None, Message | None]:
    """(what `action` receives before it runs, what it sends when done); stage = rank here."""
    i, first, last = action.microbatch, rank == 0, rank == p - 1
    if action.kind == "F":
        receive = None if first else Message("act", i, rank - 1, rank - 1, rank)
        send = None if last else Message("act", i, rank, rank, rank + 1)
    else:
        receive = None if last else Message("grad", i, rank + 1, rank + 1, rank)
        send = None if first else Message("grad", i, rank, rank, rank - 1)
    return receive, send


def p2p_schedule(p: int, rank: int, actions: list[Action]) -> list[Action | Exchange]:
    """Before each action one group: the previous action's send with this action's receive
    (Megatron's send_forward_recv_backward and friends), so that no send waits alone for a peer
    that is itself waiting in a send; the last action's send in a group of its own."""
    program: list[Action | Exchange] = []
    sends: tuple[Message, ...] = ()
    for action in actions:
        receive, send = messages(p, rank, action)
        recvs = () if receive is None else (receive,)
        if sends or recvs:
            program.append(Exchange(sends, recvs))
        program.append(action)
        sends = () if send is None else (send,)
    if sends:
        program.append(Exchange(sends, ()))
    return program
