"""Pipeline schedules as data: (p, m[, v]) → for each rank, the ordered list of what it computes.

An `Action` is F (forward), B (backward) or W (weight gradient) of one micro-batch on one of the
rank's model chunks. Rank r's chunk c holds virtual stage s = c·p + r of the S = p·v stages
(Megatron's interleaved layout; v = 1 is the plain pipeline, stage s = rank r). Activations flow
s → s+1 and their gradients s+1 → s, always between neighbouring ranks (rank p-1's chunk c feeds
rank 0's chunk c+1).

    GPipe         F0 F1 … F(m-1)  B0 B1 … B(m-1)            holds m micro-batches' activations
    1F1B          (p-r-1) warm-up F, then F/B alternating, then the remaining B   holds ≤ p - r
    interleaved   Megatron's order over v chunks per rank (m divisible by p)       bubble ≈ / v
    ZB-H1         1F1B with B split into B (input grad, on the critical path) and W (weight
                  grad, deferred into the bubbles); activations freed after W: ≤ p per rank

With unit costs the bubble fraction (idle / total rank-time) is
    GPipe, 1F1B:    (p-1) / (m + p - 1)         F = 1, B = 2 (any F:B ratio gives the same)
    interleaved:    (p-1) / (v·m + p - 1)       each chunk costs 1/v of a stage
    ZB-H1:          (p-1) / (3m + p - 1)        F = B = W = 1 (bubble (p-1)(F+B-W) per rank)
which `simulator.py` reproduces by running the lists below against their data dependencies.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class Action:
    kind: str  # "F", "B" (the whole backward, or only the input gradient when split), "W"
    microbatch: int
    chunk: int = 0

    def __str__(self) -> str:
        return f"{self.kind}{self.microbatch}" + (f".{self.chunk}" if self.chunk else "")


@dataclass(frozen=True)
class Message:
    """One point-to-point transfer: an activation (stage s → s+1) or its gradient (s → s-1)."""

    kind: str  # "act" or "grad"
    microbatch: int
    src_stage: int
    src: int  # pipeline rank that sends
    dst: int  # pipeline rank that receives


@dataclass(frozen=True)
class Schedule:
    name: str
    p: int  # pipeline ranks
    m: int  # micro-batches per step
    v: int  # model chunks (virtual stages) per rank
    split_backward: bool  # True: B is the input gradient only and W the weight gradient
    actions: tuple[tuple[Action, ...], ...]  # actions[rank], in execution order

    @property
    def n_stages(self) -> int:
        return self.p * self.v

    def stage(self, rank: int, chunk: int) -> int:
        return chunk * self.p + rank

    def recv(self, rank: int, action: Action) -> Message | None:
        """What `action` must receive before it runs: the input activation of an F on any stage
        but the first, the output gradient of a B on any stage but the last."""
        s = self.stage(rank, action.chunk)
        if action.kind == "F" and s > 0:
            return Message("act", action.microbatch, s - 1, (s - 1) % self.p, rank)
        if action.kind == "B" and s < self.n_stages - 1:
            return Message("grad", action.microbatch, s + 1, (s + 1) % self.p, rank)
        return None

    def send(self, rank: int, action: Action) -> Message | None:
        """What `action` sends when it is done (the mirror image of `recv`)."""
        s = self.stage(rank, action.chunk)
        if action.kind == "F" and s < self.n_stages - 1:
            return Message("act", action.microbatch, s, rank, (s + 1) % self.p)
        if action.kind == "B" and s > 0:
            return Message("grad", action.microbatch, s, rank, (s - 1) % self.p)
        return None

    def render(self) -> str:
        return "\n".join(f"rank {r}: " + " ".join(map(str, acts)) for r, acts in enumerate(self.actions))


def gpipe(p: int, m: int) -> Schedule:
    """GPipe (Huang et al. 2018): every forward, then every backward."""
    rank_actions = [Action("F", i) for i in range(m)] + [Action("B", i) for i in range(m)]
    return Schedule("gpipe", p, m, 1, False, tuple(tuple(rank_actions) for _ in range(p)))


def one_f_one_b(p: int, m: int) -> Schedule:
    """PipeDream-Flush (Narayanan et al. 2020): rank r runs min(p-r-1, m) warm-up forwards, then
    alternates one forward and one backward, then drains the remaining backwards. A micro-batch's
    activations live from its F to its B, so rank r holds at most p - r of them (GPipe: m)."""
    actions = []
    for r in range(p):
        warmup = min(p - r - 1, m)
        acts = [Action("F", i) for i in range(warmup)]
        for i in range(m - warmup):
            acts += [Action("F", warmup + i), Action("B", i)]
        acts += [Action("B", i) for i in range(m - warmup, m)]
        actions.append(tuple(acts))
    return Schedule("1f1b", p, m, 1, False, tuple(actions))


def interleaved_1f1b(p: int, m: int, v: int) -> Schedule:
    """Megatron's interleaved 1F1B (Narayanan et al. 2021, §2.2): each rank holds v chunks and
    walks micro-batches in groups of p: forwards of group g on chunk 0, then chunk 1, …; backwards
    in the reverse chunk order. Rank r warms up with 2(p-r-1) + (v-1)·p forwards. Needs m % p == 0."""
    total = m * v

    def chunk_mb(k: int, forward: bool) -> tuple[int, int]:
        chunk = (k // p) % v
        return (chunk if forward else v - 1 - chunk), (k // (p * v)) * p + k % p

    actions = []
    for r in range(p):
        warmup = total if m == p else min(2 * (p - r - 1) + (v - 1) * p, total)
        fwd = [Action("F", mb, c) for c, mb in (chunk_mb(k, True) for k in range(total))]
        bwd = [Action("B", mb, c) for c, mb in (chunk_mb(k, False) for k in range(total))]
        acts = fwd[:warmup]
        for i in range(total - warmup):
            acts += [fwd[warmup + i], bwd[i]]
        acts += bwd[total - warmup:]
        actions.append(tuple(acts))
    return Schedule("interleaved", p, m, v, False, tuple(actions))


def zero_bubble_h1(p: int, m: int) -> Schedule:
    """ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism"): the backward is split into B
    (the gradient of the stage input, which the previous stage waits for) and W (the weight
    gradient, which nobody waits for). Rank r keeps 1F1B's order of F and B and runs W(k - r)
    right after B(k), the last r W's at the end: the later a rank, the further it defers its W's,
    so the B's race back up the pipeline and the deferred W's fill what would be 1F1B's cool-down
    bubble. Idle per rank drops from (p-1)(F+B+W) to (p-1)(F+B-W); at most p micro-batches are
    held at once on every rank (F done, W not), 1F1B's peak on rank 0. Needs m >= p."""
    actions = []
    for r, one_f_one_b_order in enumerate(one_f_one_b(p, m).actions):
        acts, w = [], 0
        for action in one_f_one_b_order:
            acts.append(action)
            if action.kind == "B" and action.microbatch >= r:
                acts.append(Action("W", w))
                w += 1
        acts += [Action("W", k) for k in range(w, m)]
        actions.append(tuple(acts))
    return Schedule("zb", p, m, 1, True, tuple(actions))


SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb")


def virtual_stages(name: str, v: int | None = None) -> int:
    """Model chunks per rank: `v` if given, else 2 for interleaved (the fewest that interleave), else 1."""
    return v if v is not None else (2 if name == "interleaved" else 1)


def schedule_error(name: str, p: int, m: int, v: int = 1) -> str | None:
    """Why (name, p, m, v) has no schedule, as a message naming the flag and the fix (or None)."""
    if name not in SCHEDULES:
        return f"--schedule {name!r} is unknown: use one of {', '.join(SCHEDULES)}"
    if p < 1 or m < 1 or v < 1:
        return f"stages {p}, --microbatches {m}, --virtual-stages {v}: all must be >= 1"
    if v > 1 and name != "interleaved":
        return f"--virtual-stages {v} with --schedule {name}: only 'interleaved' has virtual stages"
    if name == "interleaved" and m % p:
        return (f"--microbatches {m} with --schedule interleaved on {p} stages: Megatron's order walks "
                f"micro-batches in groups of p, use a multiple of {p} (e.g. {p * max(1, round(m / p))})")
    if name == "zb" and m < p:
        return (f"--microbatches {m} < {p} stages with --schedule zb: ZB-H1 needs m >= p to fill the "
                f"bubbles with W, use --microbatches {p} or more")
    return None


def make_schedule(name: str, p: int, m: int, v: int = 1) -> Schedule:
    if (error := schedule_error(name, p, m, v)) is not None:
        raise ValueError(error)
    if name == "gpipe":
        return gpipe(p, m)
    if name == "1f1b":
        return one_f_one_b(p, m)
    if name == "interleaved":
        return interleaved_1f1b(p, m, v)
    return zero_bubble_h1(p, m)


def messages(schedule: Schedule, rank: int) -> tuple[list[Message], list[Message]]:
    """(sends, receives) of `rank` in the order its actions issue them."""
    sends, recvs = [], []
    for action in schedule.actions[rank]:
        if (msg := schedule.recv(rank, action)) is not None:
            recvs.append(msg)
        if (msg := schedule.send(rank, action)) is not None:
            sends.append(msg)
    return sends, recvs


def peak_in_flight(schedule: Schedule, rank: int) -> int:
    """Most micro-batch·chunk activations held at once on `rank`: forwards whose backward (the W
    when split, whose weight gradient still needs the saved inputs) has not run yet."""
    release = "W" if schedule.split_backward else "B"
    live = peak = 0
    for action in schedule.actions[rank]:
        live += (action.kind == "F") - (action.kind == release)
        peak = max(peak, live)
    return peak
