"""The labs' grader: a lab's properties run on the student's file, one verdict each.

    make lab-check N=1                    # grade 01_data_parallel/lab.py (the file you edit)
    make lab-check N=1 SOLUTION=1         # grade the reference, lab_solution.py: the grader is fair
    make lab-check N=5 LAB=expert         # a chapter's other lab: lab_expert.py, lab_expert_check.py
    python -m common.labs.grader 1 --file my_ddp.py --only no_sync

A lab's check module (`lab_check.py`, `lab_<name>_check.py`) lists its PROPERTIES. A property
runs a function on every rank of a gloo job (forked, ~0.1 s) with the student's module loaded
from its file, once per configuration (world sizes, groups, sizes; after a configuration that
some check fails on, the rest are not run), then runs its checks on what every rank of every
configuration brought back, in the grader's process:

    ✓ name                                   each check's deciding figure
    ✗ name                                   where it differs (step, world, rank, tensor, by how much)
        hint: what that symptom usually means
    ✗ name                                   rank r raised: the exception, the step, your function
    ⏱ name                                   no answer within the deadline, each rank's last call
    · (optional) name                        an extra part not written yet: reported, never failing

No run hangs: every job has a deadline; each rank writes every collective and send/recv it posts
to a trace file before posting it, so a hang is reported per rank; a rank that raises ends its
process (common/labs/rank.py) and its peers are stopped at once. Labs with point-to-point code
run the student's sends and receives once without moving data (a `plan` property) and replay
them under NCCL's rules (common/kernel/p2p_plan.find_deadlock) before any real run. A
`NotImplementedError`, a hang or a failed `gate` stops the grading, naming why. A property whose
failure an earlier failed property explains (`after`) says so instead of guessing a cause of its
own. The exit status is 1 when any verdict fails the lab.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from common.chapters import CHAPTERS, ROOT
from common.labs.failures import crash, replay, unformed
from common.labs.rank import _on_rank
from common.rank_pool import RankError, RankPool, RankTimeoutError

PACKAGES = {c.number: c.package for c in CHAPTERS}
TIMEOUT_S = float(os.environ.get("PFS_LAB_TIMEOUT", 20))
CLOSE_GRACE_S = 0.2  # a graded job's ranks are not reused: killed if still tearing down (~1 s each)
REPLAY = ("every rank's sends and receives, recorded without moving data, replay to the end under "
          "NCCL's rules (common/kernel/p2p_plan.find_deadlock)")


# --- a property, its runs and its verdict ------------------------------------------------------

@dataclass(frozen=True)
class Fail:
    """What a check returns when its claim does not hold: where, the symptom's usual cause, and
    the step it first fails at (0-based; None: before any step, or not about steps)."""

    detail: str
    hint: str = ""
    step: int | None = None


@dataclass
class ConfigRun:
    """One configuration of a property and what each rank's `run` returned, by rank (not
    common.run.Run, a training run's settings)."""

    config: dict
    ranks: list

    @property
    def world(self) -> int:
        return self.config["world"]


Check = Callable[[list[ConfigRun]], "Fail | str"]


@dataclass(frozen=True)
class Property:
    """`run(lab, **config)` runs on every rank of a job of `config["world"]` ranks, once per
    config; then every check gets every ConfigRun and returns a Fail or its deciding figure (a str).
    The Fail that comes first in time decides (the earliest step; at one step, the check listed
    first): a wrong update at step 1 explains wrong gradients at step 2. A check's docstring's
    first paragraph says what it grades (the lessons' lab-graded blocks are made of them:
    common/labs/docs.py).

    `plan`: `run` runs under record_p2p_plan (no data moves) and the property passes when what
    every rank posted replays to the end under NCCL's rules; list it before the real runs. There
    `run` may return what it posted, [[(kind, global peer, label), ...] per group], to name each
    op in a deadlock report. `gate`: a failure stops the grading (a plan always does). `optional`:
    an extra part; left unwritten (its NotImplementedError) it neither fails the lab nor stops
    the grading; list it last. `after`: names (or parts) of earlier properties whose failure
    would explain this one's."""

    name: str
    configs: Sequence[dict[str, Any]]
    run: Callable[..., Any]
    checks: Sequence[Check] = ()
    plan: bool = False
    gate: bool = False
    optional: bool = False
    after: Sequence[str] = ()
    timeout_s: float = TIMEOUT_S

    def descriptions(self) -> list[str]:
        """What each check grades: its docstring's first line."""
        return [REPLAY] if self.plan else [describe(check) for check in self.checks]


def check_name(check: Callable) -> str:
    return getattr(check, "__name__", type(check).__name__)


def describe(check: Callable) -> str:
    return " ".join((check.__doc__ or "").strip().split("\n\n")[0].split())


@dataclass
class Verdict:
    name: str
    status: str  # pass, fail, raised, died, hang, deadlock, todo (NotImplementedError), skipped
    detail: str = ""
    hint: str = ""
    seconds: float = 0.0
    notes: list[str] = field(default_factory=list)  # printed under the verdict (per rank, a plan)
    optional: bool = False
    check: str | None = None  # the check that failed
    checks: list[str] = field(default_factory=list)  # the checks that ran
    configs: list[dict] = field(default_factory=list)  # the configurations that ran
    runs: list[ConfigRun] = field(default_factory=list, repr=False)

    @property
    def passed(self) -> bool:
        return self.status == "pass"

    @property
    def failed(self) -> bool:
        """Fails the lab: anything but a pass, except an optional part left unwritten or not run."""
        return not self.passed and not (self.optional and self.status in ("todo", "skipped"))

    def lines(self) -> list[str]:
        quiet = self.status == "skipped" or (self.status == "todo" and self.optional)
        mark = "✓" if self.passed else "⏱" if self.status == "hang" else "·" if quiet else "✗"
        name = f"(optional) {self.name}" if self.optional else self.name
        out = [f"{mark} {name:<58} {self.detail}".rstrip()]
        out += [f"    {line}" for note in self.notes for line in note.splitlines()]
        if self.hint:
            out.append(f"    hint: {self.hint}")
        return out


# --- the labs: a chapter's lab.py, and its lab_<name>.py ---------------------------------------

def lab_names(chapter: int) -> list[str]:
    """The chapter's labs: "" for lab.py, then the name of each lab_<name>_check.py."""
    folder = next(ROOT.glob(f"0{chapter}_*"))
    found = (re.fullmatch(r"lab_(\w+)_check\.py", p.name) for p in folder.glob("lab_*_check.py"))
    named = sorted(m[1] for m in found if m)
    return [""] * (folder / "lab_check.py").exists() + named


def lab_module(chapter: int, lab: str = "") -> str:
    if lab not in lab_names(chapter):
        raise ValueError(f"chapter {chapter} has no lab {lab!r}: its labs are "
                         f"{[name or '(the main one)' for name in lab_names(chapter)]}")
    return f"{PACKAGES[chapter]}.lab_{lab}_check" if lab else f"{PACKAGES[chapter]}.lab_check"


def lab_path(chapter: int, lab: str = "", solution: bool = False) -> Path:
    folder = next(ROOT.glob(f"0{chapter}_*"))
    return folder / ("lab" + (f"_{lab}" if lab else "") + ("_solution" if solution else "") + ".py")


# --- the grader's side ------------------------------------------------------------------------

class Pools:
    """One job of each world size for a whole grading, reused property after property (a job
    costs ~1 s to start and stop on 2 cores); a job that failed is dropped and the next use starts
    a fresh one, so a broken or hung lab cannot leak into the next property."""

    def __init__(self) -> None:
        self.jobs: dict[int, RankPool] = {}

    def __call__(self, world: int) -> RankPool:
        if world not in self.jobs or self.jobs[world].broken:
            self.jobs[world] = RankPool(world)
        return self.jobs[world]

    def drop(self, world: int) -> None:
        if world in self.jobs:
            self.jobs.pop(world).close(grace_s=CLOSE_GRACE_S)

    def close(self) -> None:
        for world in list(self.jobs):
            self.drop(world)


def grade_property(module: str, prop: Property, path: str, pools: Pools | None = None) -> Verdict:
    """Run `prop` on every config (every rank's result kept), then its checks in order."""
    start, runs, own = time.perf_counter(), [], pools is None
    pools = pools or Pools()
    extra_hints = getattr(importlib.import_module(module), "ERROR_HINTS", ())

    def verdict(status: str, detail: str, hint: str = "", notes=(), check: str | None = None,
                checks=()) -> Verdict:
        return Verdict(prop.name, status, detail, hint, time.perf_counter() - start, list(notes),
                       prop.optional, check, list(checks), [r.config for r in runs], runs)

    try:
        for config in prop.configs:
            world = config["world"]
            for attempt in (1, 2):  # a gloo group that failed to form (a loaded machine) is retried once
                with tempfile.TemporaryDirectory(prefix="pfs-lab-") as trace_dir:
                    try:
                        results = pools(world).run(_on_rank, module, prop.name, path, config, trace_dir,
                                                   timeout=prop.timeout_s)
                        break
                    except (RankTimeoutError, RankError) as error:
                        pools.drop(world)
                        if attempt == 1 and unformed(trace_dir, world):
                            continue
                        label = f"world {world}" + (f" cut into groups {config['groups']}"
                                                    if config.get("groups") else "")
                        return verdict(*crash(error, trace_dir, world, label, extra_hints))
            runs.append(ConfigRun(dict(config), results))
            if prop.plan and (deadlock := replay(results, world)) is not None:
                return verdict(*deadlock, check="replay")
            if not prop.plan and config is not prop.configs[-1] and _fails(prop, runs[-1]):
                break  # the configurations after a failing one are not run: the checks below say why
    finally:
        if own:
            pools.close()
    if prop.plan:
        return verdict("pass", f"{len(runs)} plans (world {[r.world for r in runs]}) replay to the end",
                       checks=["replay"])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the one-device references are tiny: more threads only contend with the ranks
    figures, ran, fails = [], [], []
    try:
        for index, check in enumerate(prop.checks):  # every check runs, whatever the others say
            ran.append(check_name(check))
            try:
                outcome = check(runs)
            except Exception as error:  # a verdict, not a traceback
                frame = traceback.extract_tb(error.__traceback__)[-1]
                outcome = Fail(f"the grader could not read the results: {type(error).__name__}: {error} "
                               f"({frame.name}, {Path(frame.filename).name}:{frame.lineno})",
                               "some rank returned something of another kind than the others (a rank that "
                               "skipped a part, a wrong type or shape); if your code looks right, report it: "
                               "the grader should have said what differs")
            if isinstance(outcome, Fail):
                fails.append((-1 if outcome.step is None else outcome.step, index, outcome))
            else:
                figures.append(outcome)
    finally:
        torch.set_num_threads(threads)
    if fails:  # the first to go wrong in time explains the others: a step's gradients, then its update
        _, index, first = min(fails, key=lambda f: f[:2])
        return verdict("fail", first.detail, first.hint, check=ran[index], checks=ran)
    return verdict("pass", "; ".join(f for f in figures if f), checks=ran)


def _fails(prop: Property, run: ConfigRun) -> bool:
    """Whether some check fails on this one configuration alone (an exception counts)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for check in prop.checks:
            try:
                if isinstance(check([run]), Fail):
                    return True
            except Exception:  # reported by the checks on every run
                return True
        return False
    finally:
        torch.set_num_threads(threads)


def grade_module(module: str, path: str | Path, only: str | Sequence[str] | None = None,
                 out: Callable[[str], None] = print) -> list[Verdict]:
    """Grade the lab file `path` with the properties of check module `module`."""
    torch.set_num_threads(1)  # the reference runs here, beside the ranks: one core's worth each
    properties = importlib.import_module(module).PROPERTIES
    wanted = [only] if isinstance(only, str) else only
    verdicts, stop, failed, pools = [], "", [], Pools()
    try:
        for prop in properties:
            if wanted is not None and not any(w in prop.name for w in wanted):
                continue
            verdict = (Verdict(prop.name, "skipped", stop, optional=prop.optional) if stop
                       else grade_property(module, prop, str(path), pools))
            cause = next((name for name in failed for part in prop.after if part in name), None)
            if verdict.failed and verdict.status != "skipped" and cause:
                verdict.hint = (f"probably the same cause as ✗ {cause!r} above: mend that first"
                                + (f"; if this still fails then: {verdict.hint}" if verdict.hint else ""))
            if verdict.failed and not prop.optional:
                failed.append(prop.name)
            if not stop and verdict.status == "todo" and not prop.optional:
                stop = "not run: write what is not implemented first"
            elif not stop and (verdict.status in ("deadlock", "hang") or (prop.gate and verdict.failed)):
                why = "it hung" if verdict.status == "hang" else "on NCCL it would hang"
                stop = f"not run: mend {prop.name!r} above first ({why})"
            verdicts.append(verdict)
            for line in verdict.lines():
                out(line)
    finally:
        pools.close()
    passed = sum(v.passed for v in verdicts if not v.optional)
    extra = [v for v in verdicts if v.optional]
    extras = f"; optional: {sum(v.passed for v in extra)}/{len(extra)} pass" if extra else ""
    seconds = sum(v.seconds for v in verdicts)
    out(f"{passed}/{len(verdicts) - len(extra)} properties pass{extras} ({seconds:.1f} s)")
    return verdicts


def grade(chapter: int, path: str | Path | None = None, solution: bool = False,
          only: str | Sequence[str] | None = None, out: Callable[[str], None] = print,
          lab: str = "") -> list[Verdict]:
    """Grade chapter `chapter`'s lab `lab` ("" for lab.py; "expert" for lab_expert.py): `path`,
    else the lab file, or with `solution=True` its reference. Prints a verdict per property."""
    module = lab_module(chapter, lab)
    path = Path(path) if path else lab_path(chapter, lab, solution)
    title = importlib.import_module(module).TITLE
    out(f"lab {chapter:02d}{' ' + lab if lab else ''} · {title} · grading {os.path.relpath(path)}")
    return grade_module(module, path, only, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("chapter", type=int, choices=sorted(PACKAGES))
    parser.add_argument("--lab", default="", help="a chapter's other lab (e.g. expert: lab_expert.py)")
    parser.add_argument("--solution", action="store_true", help="grade the reference (lab_solution.py)")
    parser.add_argument("--file", default=None, help="grade this file instead of the chapter's lab.py")
    parser.add_argument("--only", default=None, help="only the properties whose name contains this")
    args = parser.parse_args(argv)
    try:
        verdicts = grade(args.chapter, args.file, args.solution, args.only, lab=args.lab)
    except ValueError as error:  # a lab the chapter has not
        print(error, file=sys.stderr)
        return 2
    return 0 if verdicts and not any(v.failed for v in verdicts) else 1


if __name__ == "__main__":  # run as the imported module: the labs' checks use its Fail and Property
    from common.labs.grader import main as imported_main

    sys.exit(imported_main())
