"""`--profile DIR`: a torch.profiler trace per rank of a few training steps, and a per-rank
timeline picture drawn from those traces.

    trace    DIR/rank{r}.json: Chrome trace events, open it in https://ui.perfetto.dev (or
             chrome://tracing, or TensorBoard's profiler plugin); one file per rank
    picture  python -m common.profile DIR --out timeline.png [--title ...]

The trace runs from the first timed window (forward_backward) to the end of the last one (the
optimizer step) of up to PROFILED_STEPS steps, after one warm-up step when the run has two or
more. Each window is marked by a `record_function` span ("forward_backward 3", "optimizer step
3"); between them lie the wire meter's barriers and, on logged steps, the progress log's loss
all-reduce. `--check`'s gathers and reference step are left out (collection paused; torch then
warns "Toggling CPU activity ..." once per pause, harmless). CPU activities always; CUDA kernels
too on a GPU. The picture draws only what lies inside the windows.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

PROFILED_STEPS = 2
WINDOW_PREFIXES = ("forward_backward ", "optimizer step ")


def profiled_steps(first: int, end: int) -> range:
    """Steps [first, end) of the run → the ones to trace: skip `first` (warm-up: allocator,
    gloo's first-use set-up) when at least two steps run, then up to PROFILED_STEPS."""
    start = first + 1 if end - first >= 2 else first
    return range(start, min(end, start + PROFILED_STEPS))


class StepProfiler:
    """`with profiler.window(step, phase):` inside each timed window of the loop (the first traced
    one starts the profiler, the last one stops it); `with profiler.paused():` around work to
    leave out (`--check`); `finish()` writes `directory/rank{rank}.json`. No-op without a
    directory."""

    def __init__(self, directory: str | None, rank: int, device: torch.device, steps: range):
        self.path = Path(directory) / f"rank{rank}.json" if directory else None
        self.steps, self.device = steps, device
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self.profiler = profile(activities=activities) if self.path and steps else None
        self.active = False

    @contextmanager
    def window(self, step: int, phase: str) -> Iterator[None]:
        """`phase`: "forward_backward" or "step" (the optimizer step, the last window of a step)."""
        if self.profiler is None or step not in self.steps:
            yield
            return
        if not self.active:
            self.profiler.start()
            self.active = True
        name = "forward_backward" if phase == "forward_backward" else "optimizer step"
        with record_function(f"{name} {step + 1}"):
            yield
        if phase == "step" and step == self.steps[-1]:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the step's kernels, before collection ends
            self.profiler.stop()
            self.active = False

    def finish(self) -> None:
        """Write the trace: after the loop, outside its windows (the wire meter counts every byte
        this process writes in a window, a trace file included)."""
        if self.profiler is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.profiler.export_chrome_trace(str(self.path))

    @contextmanager
    def paused(self) -> Iterator[None]:
        if not self.active:
            yield
            return
        self.profiler.toggle_collection_dynamic(False, self.profiler.activities)
        try:
            yield
        finally:
            self.profiler.toggle_collection_dynamic(True, self.profiler.activities)


def profiler_or_nothing(directory: str | None, rank: int, device: torch.device, first: int,
                        end: int) -> StepProfiler:
    return StepProfiler(directory, rank, device, profiled_steps(first, end) if directory else range(0))


# --- the picture: one lane pair per rank, compute above, communication below ------------------

COMM_MARKERS = ("gloo:", "nccl:", "c10d::", "record_param_comms", "all_reduce", "allreduce",
                "all_gather", "allgather", "reduce_scatter", "broadcast", "send", "recv", "barrier")
COLOURS = {"forward": "#4C72B0", "backward": "#DD8452", "optimizer": "#55A868", "communication": "#C44E52"}
LABELS = {"forward": "forward and other ops", "backward": "backward (autograd engine)",
          "optimizer": "optimizer step", "communication": "collective / P2P (incl. waiting)"}


def load_events(path: Path) -> list[dict]:
    """Complete events ("ph": "X", with a duration) of one Chrome trace file."""
    trace = json.loads(Path(path).read_text())
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


P2P_PENDING = ("gloo:send", "gloo:recv")  # spans from the isend/irecv call to its wait(), not transfers


def is_communication(event: dict) -> bool:
    """A collective or P2P call (c10d::allreduce_, c10d::send on the calling thread) or a
    collective's run (gloo:all_reduce on gloo's worker thread, from pick-up to completion, waiting
    for peers included; nccl:* on a GPU)."""
    name = event["name"]
    return not name.startswith(WINDOW_PREFIXES) and any(m in name.lower() for m in COMM_MARKERS)


def compute_kind(event: dict, windows: list[tuple[float, float, str]]) -> str:
    """backward: run by autograd's engine; optimizer: in the optimizer step's window; forward:
    the rest (the forward pass, and the few ops a strategy runs outside both, e.g. FSDP's
    post-backward gradient handling)."""
    if event["name"].startswith("autograd::engine::evaluate_function"):
        return "backward"
    start = event["ts"]
    if any(a <= start < b and name.startswith("optimizer") for a, b, name in windows):
        return "optimizer"
    return "forward"


def outermost(events: list[dict]) -> list[dict]:
    """The events not nested inside another event of the same thread (the top of each stack)."""
    kept, by_thread = [], {}
    for e in sorted(events, key=lambda e: (e["ts"], -e["dur"])):
        end = by_thread.get(e["tid"], float("-inf"))
        if e["ts"] >= end:
            kept.append(e)
            by_thread[e["tid"]] = e["ts"] + e["dur"]
    return kept


def rank_lanes(events: list[dict]) -> tuple[list[tuple[float, float, str]], dict[str, list]]:
    """(the windows [start, end, name], {kind: [(start µs, duration µs)]}) of one rank's trace.
    Compute: the outermost CPU ops inside a window (GPU kernels where the trace has them), minus
    communication; communication: every collective / P2P event inside a window, gloo's worker
    threads included, except gloo's P2P spans (they run until the caller waits)."""
    windows = [(e["ts"], e["ts"] + e["dur"], e["name"]) for e in events
               if e.get("cat") == "user_annotation" and e["name"].startswith(WINDOW_PREFIXES)]
    inside = [e for e in events if any(a <= e["ts"] < b for a, b, _ in windows)]
    compute_cat = "kernel" if any(e.get("cat") == "kernel" for e in inside) else "cpu_op"
    compute = outermost([e for e in inside if e.get("cat") == compute_cat and not is_communication(e)])
    lanes: dict[str, list] = {k: [] for k in COLOURS}
    for e in compute:
        lanes[compute_kind(e, windows)].append((e["ts"], e["dur"]))
    lanes["communication"] = [(e["ts"], e["dur"]) for e in inside
                              if is_communication(e) and e["name"] not in P2P_PENDING]
    return windows, lanes


def merged(spans: list[tuple[float, float]], gap: float = 0.0) -> list[tuple[float, float]]:
    """The union of (start, duration) spans, also closing gaps shorter than `gap`."""
    out: list[list[float]] = []
    for start, dur in sorted(spans):
        if out and start <= out[-1][0] + out[-1][1] + gap:
            out[-1][1] = max(out[-1][1], start + dur - out[-1][0])
        else:
            out.append([start, dur])
    return [(a, d) for a, d in out]


GAP_FRACTION, THINNEST_FRACTION = 0.002, 0.001  # of the picture's width


def plot_timeline(directory: str | Path, out: str | Path, title: str = "") -> Path:
    """One PNG from DIR/rank*.json: per rank a compute lane (forward, backward, optimizer) and a
    communication lane, in ms from the first traced window of any rank (the ranks of one host
    share the clock). Gaps under 0.2% of the width between spans of one kind are closed, and
    spans are drawn at least 0.1% wide, so that a block of many small ops reads as one block and
    a 0.1 ms call stays visible."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    files = sorted(Path(directory).glob("rank*.json"), key=lambda p: int(p.stem[4:]))
    if not files:
        raise FileNotFoundError(f"no rank*.json in {directory}: run a train.py with --profile {directory}")
    ranks = [rank_lanes(load_events(f)) for f in files]
    t0 = min(w[0] for windows, _ in ranks for w in windows)
    width = max(w[1] for windows, _ in ranks for w in windows) - t0
    gap, thinnest = GAP_FRACTION * width, THINNEST_FRACTION * width
    fig, ax = plt.subplots(figsize=(12, 1.2 + 0.8 * len(ranks)))
    for r, (windows, lanes) in enumerate(ranks):
        y = (len(ranks) - 1 - r) * 2.0
        for a, _, name in windows:
            if name.startswith("forward_backward"):
                ax.text((a - t0) / 1e3, y + 1.55, f"step {name.split()[-1]}", fontsize=7, color="0.35")
        for kind, spans in lanes.items():
            lane_y = y + (0.05 if kind == "communication" else 0.8)
            ax.broken_barh([((s - t0) / 1e3, max(d, thinnest) / 1e3) for s, d in merged(spans, gap)],
                           (lane_y, 0.7),
                           facecolors=COLOURS[kind], linewidth=0)
    ax.set_yticks([(len(ranks) - 1 - r) * 2.0 + 0.8 for r in range(len(ranks))],
                  [f"rank {r}" for r in range(len(ranks))])
    ax.set_ylim(-0.2, 2.0 * len(ranks))
    ax.set_xlabel("time since the first traced window (ms)")
    ax.set_title(title or f"per-rank timeline from {directory}", fontsize=10)
    fig.legend(handles=[Patch(color=c, label=LABELS[k]) for k, c in COLOURS.items()], loc="lower center",
               ncol=4, fontsize=8, title="each rank: compute (upper lane), communication (lower lane)",
               title_fontsize=8)
    fig.tight_layout(rect=(0, 0.6 / fig.get_figheight(), 1, 1))
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return Path(out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="Draw DIR/rank*.json (from --profile DIR) as a "
                                                 "per-rank timeline PNG.")
    parser.add_argument("directory")
    parser.add_argument("--out", default=None, help="PNG path (default: DIR/timeline.png)")
    parser.add_argument("--title", default="")
    args = parser.parse_args(argv)
    print(plot_timeline(args.directory, args.out or Path(args.directory) / "timeline.png", args.title))


if __name__ == "__main__":
    main()
