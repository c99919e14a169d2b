"""Pipeline schedules as data: (p, m[, v]) → for each rank, the ordered list of what it computes.

An `Action` is F (forward), B (backward) or W (weight gradient) of one micro-batch on one of the
rank's model chunks. A schedule's `placement` says which rank holds each of the S = p·v stages;
rank r's chunk c is the c-th of its stages in model order. By default rank r's chunk c holds
virtual stage s = c·p + r (Megatron's interleaved layout; v = 1 is the plain pipeline, stage s =
rank r); DualPipeV's V puts stages r and 2p-1-r on rank r. Activations flow s → s+1 and their
gradients s+1 → s, always between neighbouring ranks (interleaved: rank p-1's chunk c feeds rank
0's chunk c+1; V: rank p-1 feeds itself at the turn).

    GPipe         F0 F1 … F(m-1)  B0 B1 … B(m-1)            holds m micro-batches' activations
    1F1B          (p-r-1) warm-up F, then F/B alternating, then the remaining B   holds ≤ p - r
    interleaved   Megatron's order over v chunks per rank (m divisible by p)       bubble ≈ / v
    ZB-H1         1F1B with B split into B (input grad, on the critical path) and W (weight
                  grad, deferred into the bubbles); activations freed after W: ≤ p per rank
    DualPipeV     2p stages in a V, B/W split; forwards of one leg paired with backwards of the
                  other (DeepSeek-V3's DualPipe cut in half, deepseek-ai/DualPipe's order)

With unit costs the bubble fraction (idle / total rank-time) is
    GPipe, 1F1B:    (p-1) / (m + p - 1)         F = 1, B = 2 (any F:B ratio gives the same)
    interleaved:    (p-1) / (v·m + p - 1)       each chunk costs 1/v of a stage
    ZB-H1:          (p-1) / (3m + p - 1)        F = B = W = 1 (bubble (p-1)(F+B-W) per rank)
    DualPipeV:      idle (PP/2-1)(F&B + B - 3W) per rank, PP = 2p stages (the DeepSeek-V3
                    report's Table 2; B the full backward, F&B a forward and a backward paired)
which `simulator.py` reproduces by running the lists below against their data dependencies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction


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
    placement: tuple[int, ...] = ()  # placement[s]: the rank holding stage s; (): s = c·p + r
    # posts[rank]: the schedule's own grouping of its messages (p2p.py), () for p2p.py's rule:
    # per group (actions in the segment after it, actions sent in it, actions received in it),
    # and a last group (0, the remaining sends, ())
    posts: tuple[tuple[tuple[int, tuple[Action, ...], tuple[Action, ...]], ...], ...] = ()

    @property
    def n_stages(self) -> int:
        return self.p * self.v

    def rank_of(self, stage: int) -> int:
        return self.placement[stage] if self.placement else stage % self.p

    def stages(self, rank: int) -> tuple[int, ...]:
        """The stages `rank` holds, chunk 0 first (in model order)."""
        return tuple(s for s in range(self.n_stages) if self.rank_of(s) == rank)

    def stage(self, rank: int, chunk: int) -> int:
        return self.stages(rank)[chunk] if self.placement else chunk * self.p + rank

    def recv(self, rank: int, action: Action) -> Message | None:
        """What `action` must receive before it runs: the input activation of an F on any stage
        but the first, the output gradient of a B on any stage but the last."""
        s = self.stage(rank, action.chunk)
        if action.kind == "F" and s > 0:
            return Message("act", action.microbatch, s - 1, self.rank_of(s - 1), rank)
        if action.kind == "B" and s < self.n_stages - 1:
            return Message("grad", action.microbatch, s + 1, self.rank_of(s + 1), rank)
        return None

    def send(self, rank: int, action: Action) -> Message | None:
        """What `action` sends when it is done (the mirror image of `recv`)."""
        s = self.stage(rank, action.chunk)
        if action.kind == "F" and s < self.n_stages - 1:
            return Message("act", action.microbatch, s, rank, self.rank_of(s + 1))
        if action.kind == "B" and s > 0:
            return Message("grad", action.microbatch, s, rank, self.rank_of(s - 1))
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


def _none(p: int, m: int, v: int) -> str | None:
    return None


def _interleaved_error(p: int, m: int, v: int) -> str | None:
    if m % p:
        return (f"--microbatches {m} with --schedule interleaved on {p} stages: Megatron's order walks "
                f"micro-batches in groups of p, use a multiple of {p} (e.g. {p * max(1, round(m / p))})")
    return None


def _zb_error(p: int, m: int, v: int) -> str | None:
    if m < p:
        return (f"--microbatches {m} < {p} stages with --schedule zb: ZB-H1 needs m >= p to fill the "
                f"bubbles with W, use --microbatches {p} or more")
    return None


def _interleaved_in_flight(p: int, m: int, v: int, r: int) -> Fraction:
    """Megatron's warm-up forwards plus the one in flight, in chunks of 1/v of a stage (all m·v
    when m = p: no steady state)."""
    chunks = m * v if m == p else min(m * v, 2 * (p - r - 1) + (v - 1) * p + 1)
    return Fraction(chunks, v)


@dataclass(frozen=True)
class ScheduleSpec:
    """Everything the course knows about one schedule, in one place: the simulator, the
    validation, the figures, the bench and chapter 07's memory model read it (a new schedule is
    one entry of SCHEDULES). Closed forms use the simulator's unit costs."""

    build: Callable[[int, int, int], Schedule]  # (p, m, v) -> the action lists
    label: str  # its name in figures; "{v}" is filled in
    bubble: Callable[[int, int, int], Fraction]  # (p, m, v) -> idle / total rank-time
    formula: str  # the bubble's formula as text; "{v}" is filled in
    in_flight: Callable[[int, int, int, int], Fraction]  # (p, m, v, rank) -> peak held, in whole stages
    error: Callable[[int, int, int], str | None] = _none  # (p, m, v) -> why not, beyond p, m, v >= 1
    default_v: int = 1  # model chunks per rank when --virtual-stages is not given
    free_v: bool = False  # True: any --virtual-stages; False: exactly default_v
    split_backward: bool = False  # B is the input gradient only, W the weight gradient
    color: str = "#999999"  # its colour in figures
    drawn: bool = True  # in the lesson's figures of every schedule
    placement: Callable[[int], tuple[int, ...]] | None = None  # p -> rank of each stage; None: c·p + r
    paper_idle: Callable[[int, float, float, float, float], float] | None = None  # published idle

    def title(self, v: int) -> str:
        return self.label.format(v=v)

    def formula_text(self, v: int) -> str:
        return self.formula.format(v=v)


# Builders are looked up by name when called (a test or a figure check may replace one).
SCHEDULES: dict[str, ScheduleSpec] = {
    "gpipe": ScheduleSpec(
        build=lambda p, m, v: gpipe(p, m), label="GPipe",
        bubble=lambda p, m, v: Fraction(p - 1, m + p - 1), formula="(p-1)/(m+p-1)",
        in_flight=lambda p, m, v, r: Fraction(m), color="#0072B2"),
    "1f1b": ScheduleSpec(
        build=lambda p, m, v: one_f_one_b(p, m), label="1F1B",
        bubble=lambda p, m, v: Fraction(p - 1, m + p - 1), formula="(p-1)/(m+p-1)",
        in_flight=lambda p, m, v, r: Fraction(min(m, p - r)), color="#56B4E9"),
    "interleaved": ScheduleSpec(
        build=lambda p, m, v: interleaved_1f1b(p, m, v), label="interleaved 1F1B, v = {v}",
        bubble=lambda p, m, v: Fraction(p - 1, v * m + p - 1), formula="(p-1)/(v·m+p-1), v={v}",
        in_flight=_interleaved_in_flight, error=_interleaved_error, default_v=2, free_v=True,
        color="#E69F00"),
    "zb": ScheduleSpec(
        build=lambda p, m, v: zero_bubble_h1(p, m), label="ZB-H1",
        bubble=lambda p, m, v: Fraction(p - 1, 3 * m + p - 1), formula="(p-1)/(3m+p-1)",
        in_flight=lambda p, m, v, r: Fraction(min(m, p)), error=_zb_error, split_backward=True,
        color="#009E73"),
}


def rank_stages(name: str, p: int, v: int, rank: int) -> tuple[int, ...]:
    """The stages schedule `name` places on `rank`, chunk 0 first (before any schedule is built:
    the model is split by it)."""
    if (place := SCHEDULES[name].placement) is not None:
        return tuple(s for s, r in enumerate(place(p)) if r == rank)
    return tuple(c * p + rank for c in range(v))


def virtual_stages(name: str, v: int | None = None) -> int:
    """Model chunks per rank: `v` if given, else the schedule's default (interleaved: 2, the
    fewest that interleave; else 1)."""
    return v if v is not None else (SCHEDULES[name].default_v if name in SCHEDULES else 1)


def schedule_error(name: str, p: int, m: int, v: int | None = None) -> str | None:
    """Why (name, p, m, v) has no schedule, as a message naming the flag and the fix (or None).
    v None: the schedule's default."""
    if name not in SCHEDULES:
        return f"--schedule {name!r} is unknown: use one of {', '.join(SCHEDULES)}"
    v = virtual_stages(name, v)
    if p < 1 or m < 1 or v < 1:
        return f"stages {p}, --microbatches {m}, --virtual-stages {v}: all must be >= 1"
    spec = SCHEDULES[name]
    if not spec.free_v and v != spec.default_v:
        free = " or ".join(repr(n) for n, s in SCHEDULES.items() if s.free_v)
        fixed = f" ({name} holds exactly {spec.default_v} stages per rank)" if spec.default_v > 1 else ""
        return f"--virtual-stages {v} with --schedule {name}: only {free} has virtual stages{fixed}"
    return spec.error(p, m, v)


def make_schedule(name: str, p: int, m: int, v: int | None = None) -> Schedule:
    """Schedule `name` for p ranks, m micro-batches, v chunks per rank (None: its default)."""
    if (error := schedule_error(name, p, m, v)) is not None:
        raise ValueError(error)
    return SCHEDULES[name].build(p, m, virtual_stages(name, v))


def messages(schedule: Schedule, rank: int) -> tuple[list[Message], list[Message]]:
    """(sends, receives) of `rank` in the order it posts them: its actions' order, or, where the
    schedule groups its own messages (`posts`), the order of those groups."""
    sends, recvs = [], []
    if schedule.posts:
        for _, sent, got in schedule.posts[rank]:
            sends += [m for a in sent if (m := schedule.send(rank, a)) is not None]
            recvs += [m for a in got if (m := schedule.recv(rank, a)) is not None]
        return sends, recvs
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
