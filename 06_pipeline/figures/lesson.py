"""Chapter 06's figures: the pipeline schedules, drawn from the schedules' own action lists.

Every timeline here is `simulator.simulate` run on `schedules.make_schedule`'s lists, the lists
`PipelineExecutor` executes; the bubble is `simulator.bubble_fraction` of that timeline beside
`closed_form_bubble`; the activations held are counted over the same lists
(`schedules.peak_in_flight`); the messages are `p2p.exchanges`, the groups the executor posts,
replayed by `common.kernel.p2p_plan.find_deadlock` under NCCL's rules.
"""

from __future__ import annotations

from dataclasses import replace
from fractions import Fraction

from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from common.figures import Figure, Source, draw
from common.kernel.p2p_plan import find_deadlock
from pipeline import p2p, simulator
from pipeline.schedules import SCHEDULES, make_schedule, peak_in_flight
from pipeline.simulator import bubble_fraction, closed_form_bubble, simulate


def lesson_schedules(v: int) -> list[tuple[str, int, str]]:
    """(name, virtual stages, title) of every schedule the registry draws, in its order; a
    schedule whose chunks per rank are free is drawn with `v`."""
    return [(name, v if spec.free_v else spec.default_v, spec.title(v))
            for name, spec in SCHEDULES.items() if spec.drawn]


KIND = {"F": "#56B4E9", "B": "#E69F00", "W": "#009E73"}  # forward, backward (B: input grad), weight grad
LIGHT = {"F": "#C6E6F7", "B": "#F6D9A3", "W": "#A6DCC8"}  # the same on a rank's second chunk


def timeline_data(name: str, p: int, m: int, v: int = 1) -> dict:
    """One schedule's simulated timeline: every action's [start, end) in unit time (a stage's
    forward = 1), the simulated bubble and the closed form."""
    schedule = make_schedule(name, p, m, v)
    intervals = simulate(schedule)
    closed = closed_form_bubble(name, p, m, v)
    return {"name": name, "p": p, "m": m, "v": schedule.v,
            "bars": [[i.rank, i.action.kind, i.action.microbatch, i.action.chunk, float(i.start),
                      float(i.end)] for i in intervals],
            "bubble": float(bubble_fraction(intervals, p)), "closed_form": float(closed),
            "closed_form_text": f"{closed.numerator}/{closed.denominator}",
            "formula": simulator.bubble_formula(name, schedule.v)}


def draw_timeline(ax, t: dict, title: str, legend: bool = True, label_mb: bool = True) -> None:
    bars = [draw.Bar(r, s, e, (LIGHT if c % 2 else KIND)[k], str(mb) if label_mb else "")
            for r, k, mb, c, s, e in t["bars"]]
    draw.timeline(ax, bars, [f"rank {r}" for r in range(t["p"])])
    ax.set_xlabel("time (a stage's forward = 1)")
    ax.set_title(f"{title}: bubble {t['bubble']:.3f} = {t['formula']} = {t['closed_form_text']}",
                 loc="left", fontsize=9)
    if legend:
        kinds = {b[1] for b in t["bars"]}
        names = {"F": "F forward", "B": "B input grad" if "W" in kinds else "B backward",
                 "W": "W weight grad"}
        handles = [Patch(facecolor=KIND[k], edgecolor="#333333", label=names[k]) for k in "FBW" if k in kinds]
        if any(b[3] % 2 for b in t["bars"]):
            handles.append(Patch(facecolor=LIGHT["F"], edgecolor="#333333", label="pale: chunk 1"))
        ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=draw.SMALL)


# --- the problem: one batch keeps one GPU busy; micro-batches fill the pipe -------------------------

def microbatching_data(p: int = 4, m: int = 8) -> dict:
    """The whole batch at once, and cut into m micro-batches that each cost 1/m of it (times in
    units of the whole batch's forward on one stage, so the two rows share one axis)."""
    many = timeline_data("gpipe", p, m)
    many["bars"] = [[r, k, mb, c, s / m, e / m] for r, k, mb, c, s, e in many["bars"]]
    return {"one": timeline_data("gpipe", p, 1), "many": many}


def microbatching_draw(data: dict):
    one, many = data["one"], data["many"]
    fig, (a, b) = draw.figure(height=3.6, nrows=2, gridspec_kw={"height_ratios": [1, 1]})
    span = max(b_[5] for b_ in one["bars"] + many["bars"])
    draw_timeline(a, one, f"one batch through p = {one['p']} stages", label_mb=False)
    draw_timeline(b, many, f"the batch cut into m = {many['m']} micro-batches (GPipe), each 1/m of it")
    a.set_xlim(0, span)
    b.set_xlim(0, span)
    a.set_xlabel("")
    b.set_xlabel("time (the whole batch's forward on one stage = 1)")
    fig.suptitle("Pipeline parallelism: white is idle. Cutting the batch into micro-batches keeps "
                 "the stages busy at once", x=0.01, ha="left", fontsize=10, fontweight="bold")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return fig


# --- the four schedules -------------------------------------------------------------------------

def schedules_data(p: int = 4, m: int = 8, v: int = 2) -> dict:
    return {"p": p, "m": m, "timelines": [{**timeline_data(name, p, m, vv), "title": title}
                                         for name, vv, title in lesson_schedules(v)]}


def schedules_draw(data: dict):
    rows = data["timelines"]
    fig, axes = draw.figure(height=1.15 * data["p"] * len(rows) / 2 + 1.2, nrows=len(rows), sharex=True)
    for ax, t in zip(axes, rows, strict=True):
        draw_timeline(ax, t, t["title"], label_mb=data["m"] <= 16)
        ax.set_xlabel("")
    axes[-1].set_xlabel("time (a stage's forward = 1; F = 1, B = 2; ZB-H1: F = B = W = 1)")
    span = max(b[5] for t in rows for b in t["bars"])
    for ax in axes:
        ax.set_xlim(0, span)
    fig.suptitle(f"Four schedules of the same work, p = {data['p']}, m = {data['m']}: each bar one "
                 "micro-batch's action; the bubble is the white", x=0.01, ha="left", fontsize=10,
                 fontweight="bold")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return fig


# --- the bubble against m -----------------------------------------------------------------------

def bubble_data(p: int = 4, m_max: int = 32, v: int = 2) -> dict:
    """Simulated bubble of each schedule for m = p, 2p, … m_max (interleaved needs m % p == 0),
    with the closed form of each point."""
    ms = list(range(p, m_max + 1, p))
    curves = []
    for name, vv, title in lesson_schedules(v):
        points = []
        for m in ms:
            sim = bubble_fraction(simulate(make_schedule(name, p, m, vv)), p)
            points.append([m, float(sim), float(closed_form_bubble(name, p, m, vv))])
        curves.append({"name": name, "title": title, "points": points})
    return {"p": p, "v": v, "curves": curves}


def bubble_draw(data: dict):
    fig, (a, b) = draw.figure(height=3.4, ncols=2)
    p = data["p"]
    for c in data["curves"]:
        ms = [q[0] for q in c["points"]]
        sim = [q[1] for q in c["points"]]
        closed = [q[2] for q in c["points"]]
        style = {"color": SCHEDULES[c["name"]].color, "label": c["title"]}
        marker = "s" if c["name"] == "gpipe" else "o"
        size = 7 if c["name"] == "gpipe" else 4
        a.plot(ms, closed, "-", lw=0.8, color=style["color"])
        a.plot(ms, sim, marker, ms=size, mfc="none" if c["name"] == "gpipe" else style["color"], **style)
        b.plot(ms, [x / (1 - x) for x in closed], "-", lw=0.8, color=style["color"])
        b.plot(ms, [x / (1 - x) for x in sim], marker, ms=size,
               mfc="none" if c["name"] == "gpipe" else style["color"], **style)
    ms = [q[0] for q in data["curves"][0]["points"]]
    b.plot(ms, [(p - 1) / m for m in ms], ":", color="#333333", lw=1.2, label="(p−1)/m, the article's")
    a.set(xlabel="micro-batches m", ylabel="idle / total rank-time",
          title="bubble of the step: (p−1)/(k·m + p−1)")
    b.set(xlabel="micro-batches m", ylabel="idle / useful work", title="against the useful work: (p−1)/(k·m)")
    a.title.set_fontsize(9)
    b.title.set_fontsize(9)
    a.set_ylim(0, None)
    b.set_ylim(0, None)
    b.legend(fontsize=draw.SMALL)
    fig.suptitle(f"p = {p}: simulated points, closed forms as lines (k = 1; v for interleaved; 3 for "
                 "ZB-H1). GPipe = 1F1B", x=0.01, ha="left", fontsize=10, fontweight="bold")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return fig


# --- the activations each schedule holds --------------------------------------------------------

def memory_data(p: int = 4, m: int = 8, v: int = 2) -> dict:
    """Per schedule: the micro-batches whose activations rank 0 holds over the simulated step
    (+1 at a forward's start, −1 when the backward that frees them ends: B, or W when split), in
    whole stages (a chunk is 1/v of one), and `peak_in_flight` on every rank."""
    out = []
    for name, vv, title in lesson_schedules(v):
        schedule = make_schedule(name, p, m, vv)
        release = "W" if schedule.split_backward else "B"
        events = []
        for i in simulate(schedule):
            if i.rank == 0 and i.action.kind == "F":
                events.append((i.start, 1))
            elif i.rank == 0 and i.action.kind == release:
                events.append((i.end, -1))
        change: dict[Fraction, int] = {}
        for t, d in events:  # a forward starting as a backward ends: one step, no spike
            change[t] = change.get(t, 0) + d
        live, steps = Fraction(0), [[0.0, 0.0]]
        for t in sorted(change):
            live += Fraction(change[t], vv)
            steps.append([float(t), float(live)])
        out.append({"name": name, "title": title, "rank0": steps,
                    "peak": [float(Fraction(peak_in_flight(schedule, r), vv)) for r in range(p)]})
    return {"p": p, "m": m, "schedules": out}


def memory_draw(data: dict):
    fig, (a, b) = draw.figure(height=3.3, ncols=2, gridspec_kw={"width_ratios": [1.4, 1]})
    p, n = data["p"], len(data["schedules"])
    width = 0.8 / n
    for k, s in enumerate(data["schedules"]):
        color = SCHEDULES[s["name"]].color
        xs = [q[0] for q in s["rank0"]]
        ys = [q[1] for q in s["rank0"]]
        a.step(xs, ys, where="post", color=color, lw=1.6 - 0.25 * k, label=s["title"])
        b.bar([r + (k - (n - 1) / 2) * width for r in range(p)], s["peak"], width, color=color,
              label=s["title"])
    a.set(xlabel="time (a stage's forward = 1)", ylabel="stage activations held",
          title=f"rank 0 over one step (m = {data['m']})")
    b.set(xlabel="pipeline rank", ylabel="peak held", title="peak on each rank")
    b.set_xticks(range(p))
    a.title.set_fontsize(9)
    b.title.set_fontsize(9)
    a.legend(fontsize=draw.SMALL)
    fig.suptitle("Activation memory: GPipe holds all m micro-batches, 1F1B and ZB-H1 at most p "
                 "(1F1B: p − r on rank r)", x=0.01, ha="left", fontsize=10, fontweight="bold")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return fig


# --- the communication plan ---------------------------------------------------------------------

def p2p_data(schedule: str = "1f1b", p: int = 3, m: int = 4, v: int = 1) -> dict:
    """Each rank's actions (simulated times) and the groups it posts between them
    (`p2p.exchanges`: one batch_isend_irecv each), every message linked to its match, and the
    replay of `p2p.p2p_plan` under NCCL's rules."""
    name, schedule = schedule, make_schedule(schedule, p, m, v)
    intervals = simulate(schedule)
    by_action = {(i.rank, i.action): i for i in intervals}
    ranks = []
    for r in range(p):
        segs = p2p.segments(schedule, r)
        groups = []
        for k, ex in enumerate(p2p.exchanges(schedule, r)):
            if not ex.sends and not ex.recvs:
                continue
            at = by_action[(r, segs[k - 1][-1])].end if k else 0  # posted when the segment before ends
            groups.append({"index": k, "at": float(at),
                           "ops": [["send", mm.dst, mm.kind, mm.microbatch, mm.src_stage] for mm in ex.sends]
                           + [["recv", mm.src, mm.kind, mm.microbatch, mm.src_stage] for mm in ex.recvs]})
        ranks.append({"rank": r, "groups": groups,
                      "actions": [[i.action.kind, i.action.microbatch, i.action.chunk, float(i.start),
                                   float(i.end)] for i in intervals if i.rank == r]})
    stuck = find_deadlock(p2p.p2p_plan(schedule))
    return {"name": name, "p": p, "m": m, "v": schedule.v, "ranks": ranks,
            "deadlock": None if stuck is None else str(stuck)}


def p2p_draw(data: dict):
    p = data["p"]
    fig, ax = draw.figure(height=0.95 * p + 1.3)
    bars = [draw.Bar(r["rank"], s, e, (LIGHT if c % 2 else KIND)[k], f"{k}{mb}")
            for r in data["ranks"] for k, mb, c, s, e in r["actions"]]
    draw.timeline(ax, bars, [f"rank {r}" for r in range(p)])
    # each group a tick at the time the rank posts it (when the action before it ends); each
    # message an arrow at the time it completes: when both its group and its match's are posted
    posted: dict[tuple, float] = {}
    for r in data["ranks"]:
        for g in r["groups"]:
            for kind, peer, what, mb, stage in g["ops"]:
                src, dst = (r["rank"], peer) if kind == "send" else (peer, r["rank"])
                posted[(kind, src, dst, what, mb, stage)] = g["at"]
    for r in data["ranks"]:
        for g in r["groups"]:
            ax.plot([g["at"]] * 2, [r["rank"] - 0.47, r["rank"] + 0.47], color="#333333", lw=1.6)
    for (kind, src, dst, what, mb, stage), at in posted.items():
        if kind != "send" or ("recv", src, dst, what, mb, stage) not in posted:
            continue
        late = max(at, posted[("recv", src, dst, what, mb, stage)])
        color = KIND["F"] if what == "act" else "#D55E00"
        down = 1 if src < dst else -1
        for rank, t in ((src, at), (dst, posted[("recv", src, dst, what, mb, stage)])):
            if t < late:  # the group waits for its peer's
                ax.plot([t, late], [rank + 0.44 * (down if rank == src else -down)] * 2, ":",
                        color=color, lw=1.0)
        ax.annotate("", xy=(late, dst - 0.44 * down), xytext=(late, src + 0.44 * down),
                    arrowprops={"arrowstyle": "-|>", "color": color, "lw": 1.0, "shrinkA": 0, "shrinkB": 0})
    ax.set_xlabel("time (a stage's forward = 1).  | one batch_isend_irecv group, posted when the action "
                  "before it ends;\n··· the group waits for its peer's;  ↕ a message completes once both "
                  "groups are posted")
    verdict = "no deadlock" if data["deadlock"] is None else "DEADLOCK"
    v = f", v = {data['v']}" if data["v"] > 1 else ""
    ax.set_title(f"{data['name']}, p = {p}, m = {data['m']}{v}: the groups of p2p.exchanges and what they "
                 f"carry; replayed under NCCL's rules: {verdict}", loc="left", fontsize=9)
    ax.legend(handles=[Line2D([], [], color=KIND["F"], label="activation"),
                       Line2D([], [], color="#D55E00", label="gradient")],
              loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize=draw.SMALL)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return fig


# --- zero bubble: W fills the cool-down ---------------------------------------------------------

def zero_bubble_data(p: int = 4, m: int = 8) -> dict:
    """1F1B and ZB-H1 with the same work per micro-batch and stage (F = 1, B + W = 2), and each
    rank's idle time: (p−1)(F+B+W) against (p−1)(F+B−W)."""
    out = []
    for name in ("1f1b", "zb"):
        t = timeline_data(name, p, m)
        end = max(b[5] for b in t["bars"])
        t["idle"] = [end - sum(b[5] - b[4] for b in t["bars"] if b[0] == r) for r in range(p)]
        out.append(t)
    return {"p": p, "m": m, "timelines": out}


def zero_bubble_draw(data: dict):
    fig, axes = draw.figure(height=1.0 * data["p"] + 1.6, nrows=2, sharex=True)
    titles = ("1F1B: the backward whole (B = 2)", "ZB-H1: B = input gradient, W = weight gradient, deferred")
    span = max(b[5] for t in data["timelines"] for b in t["bars"])
    for ax, t, title in zip(axes, data["timelines"], titles, strict=True):
        draw_timeline(ax, t, title)
        ax.set_xlabel("")
        ax.set_xlim(0, span + 3.5)
        for r, idle in enumerate(t["idle"]):
            ax.text(span + 0.4, r, f"idle {idle:g}", va="center", fontsize=draw.SMALL)
    axes[-1].set_xlabel("time (a stage's forward = 1)")
    fig.suptitle(f"p = {data['p']}, m = {data['m']}: ZB-H1 sends B up the pipe first and fills the "
                 "cool-down with the W's nobody waits for", x=0.01, ha="left", fontsize=10, fontweight="bold")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    return fig


# --- perturbations: the bugs the test plants ------------------------------------------------------

def drop_last_microbatch(schedule):
    """Every rank skips the last micro-batch (the cool-down stops short; m = 1: unchanged)."""
    if schedule.m == 1:
        return schedule
    last = schedule.m - 1
    return replace(schedule, actions=tuple(tuple(a for a in acts if a.microbatch != last)
                                           for acts in schedule.actions))


def rank0_late(intervals):
    """Rank 0 starts everything one unit late (a stage slower than the simulator thinks)."""
    return [replace(i, start=i.start + 1, end=i.end + 1) if i.rank == 0 else i for i in intervals]


def sends_one_group_late(exchanges):
    """Each group carries the sends of the group before it (and the last sends are lost)."""
    return [p2p.Exchange(exchanges[k - 1].sends if k else (), ex.recvs) for k, ex in enumerate(exchanges)]


SCHEDULE_SOURCES = (Source("pipeline.schedules:make_schedule", drop_last_microbatch),
                    Source("pipeline.simulator:simulate", rank0_late))

FIGURES = [
    Figure(name="pipeline_microbatching", path="06_pipeline/figures/pipeline_microbatching.svg",
           data=microbatching_data, draw=microbatching_draw, sizes={"p": 4, "m": 8},
           sources=SCHEDULE_SOURCES,
           alt="GPipe with one batch and with 8 micro-batches, simulated from the schedule's action lists"),
    Figure(name="pipeline_schedules", path="06_pipeline/figures/pipeline_schedules.svg",
           data=schedules_data, draw=schedules_draw, sizes={"p": 4, "m": 8, "v": 2},
           sources=(*SCHEDULE_SOURCES,
                    Source("pipeline.simulator:closed_form_bubble", lambda f: f + Fraction(1, 100))),
           alt="GPipe, 1F1B, interleaved 1F1B and ZB-H1 timelines simulated from make_schedule"),
    Figure(name="pipeline_bubble", path="06_pipeline/figures/pipeline_bubble.svg",
           data=bubble_data, draw=bubble_draw, sizes={"p": 4, "m_max": 32, "v": 2},
           sources=(Source("pipeline.simulator:simulate", rank0_late),
                    Source("pipeline.simulator:closed_form_bubble", lambda f: f + Fraction(1, 100))),
           alt="the bubble against m for each schedule: simulated points on the closed forms"),
    Figure(name="pipeline_memory", path="06_pipeline/figures/pipeline_memory.svg",
           data=memory_data, draw=memory_draw, sizes={"p": 4, "m": 8, "v": 2},
           sources=(Source("pipeline.schedules:make_schedule", drop_last_microbatch),
                    Source("pipeline.simulator:simulate", rank0_late),
                    Source("pipeline.schedules:peak_in_flight", lambda n: n + 1)),
           alt="activations held on rank 0 over a step and the peak on every rank, per schedule"),
    Figure(name="pipeline_p2p", path="06_pipeline/figures/pipeline_p2p.svg",
           data=p2p_data, draw=p2p_draw, sizes={"schedule": "1f1b", "p": 3, "m": 4, "v": 1},
           sources=(Source("pipeline.p2p:exchanges", sends_one_group_late),
                    Source("common.kernel.p2p_plan:find_deadlock", lambda d: "stuck" if d is None else None),
                    Source("pipeline.simulator:simulate", rank0_late)),
           alt="each rank's batch_isend_irecv groups between its actions, every message to its match"),
    Figure(name="zero_bubble", path="06_pipeline/figures/zero_bubble.svg",
           data=zero_bubble_data, draw=zero_bubble_draw, sizes={"p": 4, "m": 8},
           sources=(Source("pipeline.schedules:zero_bubble_h1", drop_last_microbatch),
                    Source("pipeline.schedules:make_schedule", drop_last_microbatch),
                    Source("pipeline.simulator:simulate", rank0_late)),
           alt="1F1B against ZB-H1 with the same work: the W's fill the cool-down"),
]

