"""DualPipeV as data: the V placement's order of F, B and W, and the groups its messages travel in.

DeepSeek-V3's DualPipe (report §3.2.1) cut in half (Sea AI Lab's "cut-in-half"; the order of
deepseek-ai/DualPipe's dualpipev.py, re-derived here as action lists): p ranks hold 2p stages in
a V, rank r stage r on the way down (chunk 0) and stage 2p-1-r on the way back (chunk 1). Each
backward is split into B and W like ZB-H1's; a forward of one leg runs beside a backward of the
other (DualPipe overlaps their compute with each other's communication; the simulator runs them
back to back). Per rank, the report's Table 2: idle (PP/2-1)(F&B + B - 3W) with PP = 2p stages,
2p + 1 chunks' activations at the peak (PP + 1), 2× the parameters of one stage. Needs m >= 2p.
The file registers DualPipeV in schedules.SCHEDULES (its last lines); the package imports it.
"""

from __future__ import annotations

from fractions import Fraction

from .schedules import SCHEDULES, Action, Schedule, ScheduleSpec


def dualpipe_v(p: int, m: int) -> Schedule:
    """DualPipeV (DeepSeek-V3 report §3.2.1, DualPipe "cut in half"; the order of
    deepseek-ai/DualPipe's dualpipev.py): p ranks, 2p stages in a V, rank r holds stage r (chunk 0,
    the way down) and stage 2p-1-r (chunk 1, the way back), so the last rank turns the V on
    itself and both ends are on rank 0. In its eight steps rank r runs 2(p-r-1) forwards down,
    r+1 pairs of a forward down and one back, p-r-1 of (B back, its W, F back), then the steady
    state: pairs F down + B back, F back + B down (DualPipe overlaps each pair's compute with the
    other's communication), and drains. A B runs with its W right behind it (a whole backward)
    except where the order defers W (zero bubble): those W's queue first in, first out and fill
    the cool-down, so the queue is empty at the end. Holds at most 2p + 1 chunks' activations
    (PP + 1 in the report's Table 2). Needs m >= 2p."""
    actions, posts = zip(*(_dualpipe_v_rank(p, m, r) for r in range(p)), strict=True)
    return Schedule("dualpipev", p, m, 2, True, actions, v_placement(p), posts)


Post = tuple[int, tuple[Action, ...], tuple[Action, ...]]


def _dualpipe_v_rank(p: int, m: int, r: int) -> tuple[tuple[Action, ...], tuple[Post, ...]]:
    """Rank r's DualPipeV order (the eight steps of `dualpipe_v`, micro-batches in order on each
    chunk, deferred W's first in, first out) and its groups: DualPipe posts, before each unit of
    compute (an F, a B, an F&B pair, a W), one batch of the sends and receives queued since the
    last one, receiving some inputs a unit early and sending some outputs a unit late; each
    group is (actions in the unit, actions whose outputs it sends, actions whose inputs it
    receives)."""
    acts: list[Action] = []
    posts: list[Post] = []
    sends: list[Action] = []
    recvs: list[Action] = []
    done = {k: [0, 0] for k in ("F", "B", "recvF", "recvB", "sendF", "sendB")}
    deferred: list[Action] = []

    def next_of(kind: str, chunk: int, counter: str | None = None) -> Action:
        k = counter or kind
        done[k][chunk] += 1
        return Action(kind, done[k][chunk] - 1, chunk)

    def unit(*work: tuple[str, int, bool]) -> None:  # post the queued ops, then compute
        posts.append((0, tuple(sends), tuple(recvs)))
        sends.clear()
        recvs.clear()
        for kind, chunk, defer_w in work:
            if kind == "W":
                acts.append(deferred.pop(0))
            else:
                acts.append(action := next_of(kind, chunk))
                if kind == "B":
                    (deferred if defer_w else acts).append(Action("W", action.microbatch, chunk))
        _, out, inn = posts[-1]
        posts[-1] = (len(acts) - sum(k for k, _, _ in posts[:-1]), out, inn)

    def recv(kind: str, chunk: int) -> None:
        recvs.append(next_of(kind, chunk, "recv" + kind))

    def send(kind: str, chunk: int) -> None:
        sends.append(next_of(kind, chunk, "send" + kind))

    def forward(c: int, rcv: bool = True, snd: bool = True) -> None:
        if rcv:
            recv("F", c)
        unit(("F", c, False))
        if snd:
            send("F", c)

    def backward(c: int, defer_w: bool = False, snd: bool = True) -> None:
        recv("B", c)
        unit(("B", c, defer_w))
        if snd:
            send("B", c)

    def pair(f: int, b: int, rcv_f: bool = True) -> None:  # F on chunk f with B on chunk b
        if rcv_f:
            recv("F", f)
        recv("B", b)
        unit(("F", f, False), ("B", b, False))
        send("F", f)
        send("B", b)

    for _ in range(2 * (p - r - 1)):  # 1: forwards down
        forward(0)
    recv("F", 0)
    for i in range(r + 1):  # 2: a forward down, one back
        forward(0, rcv=False, snd=False)
        recv("F", 0)
        forward(1, snd=r < p - 1 or i < r)
        send("F", 0)
    for _ in range(p - r - 1):  # 3: B back, its W, F back
        backward(1, defer_w=True)
        recv("F", 1)
        unit(("W", 0, False))
        forward(1, rcv=False)
    for i in range(m - 2 * p + r + 1):  # 4: the steady state, two pairs
        if i == 0 and r == p - 1:  # the turn: F down and B back, not overlapped
            unit(("F", 0, False))
            send("F", 1)
            recv("B", 1)
            unit(("B", 1, False))
            send("F", 0)
            send("B", 1)
        else:
            pair(0, 1, rcv_f=i > 0)
        pair(1, 0)
    for _ in range(p - r - 1):  # 5: B back, then a pair F back + B down
        backward(1)
        pair(1, 0)
    defer = False
    for i in range(r + 1):  # 6: backwards only; the second half defers its W's
        defer = defer or (i == (r + 1) // 2 and r % 2 == 1)
        backward(1, defer)
        defer = defer or i == (r + 1) // 2
        backward(0, defer)
    for _ in range(p - r - 1):  # 7: a deferred W, then B down
        unit(("W", 0, False))
        backward(0, defer_w=True)
    for _ in range(r + 1):  # 8: the W's still queued
        unit(("W", 0, False))
    posts.append((0, tuple(sends), tuple(recvs)))
    return tuple(acts), tuple(posts)


def v_placement(p: int) -> tuple[int, ...]:
    """The V: stage s on rank s on the way down, on rank 2p-1-s on the way back."""
    return tuple(s if s < p else 2 * p - 1 - s for s in range(2 * p))


def _dualpipev_error(p: int, m: int, v: int) -> str | None:
    if m < 2 * p:
        return (f"--microbatches {m} < 2·{p} = {2 * p} with --schedule dualpipev: its steady state "
                f"pairs a forward of each of the 2p stages with a backward, use --microbatches {2 * p} "
                "or more")
    return None


def table2_idle(stages: int, F: float, B: float, W: float, FB: float) -> float:
    """DualPipe's and DualPipeV's idle time per rank, the DeepSeek-V3 report's Table 2:
    (PP/2 - 1)(F&B + B - 3W) for PP stages, in one stage's (chunk's) F, full backward B, weight
    gradient W and overlapped forward-and-backward pair F&B."""
    return (stages / 2 - 1) * (FB + B - 3 * W)


# Its entry in chapter 06's registry (the package imports this file, so the entry is there for
# any `pipeline` import). Table 2's (PP/2-1)(F&B+B-3W) with PP = 2p and the simulator's chunk
# costs F = B = W = 1/2, F&B = F + B + W (run back to back), is p - 1 per rank; the simulated
# idle is (p-1)/2, hence (p-1)/(6m+p-1): the table bounds what the order reaches without overlap.
SCHEDULES["dualpipev"] = ScheduleSpec(
    build=lambda p, m, v: dualpipe_v(p, m), label="DualPipeV",
    bubble=lambda p, m, v: Fraction(p - 1, 6 * m + p - 1), formula="(p-1)/(6m+p-1)",
    in_flight=lambda p, m, v, r: Fraction(2 * p + 1, 2), error=_dualpipev_error, default_v=2,
    split_backward=True, color="#CC79A7", drawn=False, placement=v_placement, paper_idle=table2_idle)
