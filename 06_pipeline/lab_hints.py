"""What a wrong order, message or group of lab 06 usually means (its checks call these;
lab_check.py says what runs).

`order_error` runs the ranks' action lists against each other in time (each F waits for the
previous stage's F, each B for the next stage's B) and names where they get stuck, what is run
twice or never, and how many micro-batches a rank holds at once (≤ p − r under 1F1B);
`message_error` names the wrong field of a Message; `program_error` walks a rank's list of
actions and Exchange groups as the executor would.
"""

from __future__ import annotations

from pipeline.p2p import Exchange, label
from pipeline.schedules import Action, Message, Schedule


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


def forwards_ahead(order) -> int:
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
        warmups = [forwards_ahead(order) for order in actions]
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
        ahead = forwards_ahead(order)
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
