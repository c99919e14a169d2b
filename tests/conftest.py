"""Session fixtures: the rank-process pools, the hypothesis profiles, the time budget per chapter.

HYPOTHESIS_PROFILE=ci (default): a few fixed examples per property, so CI is fast and repeatable;
no shrinking and no example database, so a failing (or hanging) property reports its first
failing example once and stops; the rank pool's per-call timeout is 60 s (tests/harness.py). At
the end it prints the seconds each chapter's test files took against the chapter's budget.
HYPOTHESIS_PROFILE=thorough (`make test-thorough`): many random examples, shrinking, 180 s.
HYPOTHESIS_PROFILE=fast (`make test-fast`): one example per property, for a contributor's minutes.
PFS_CHAPTER=N (`make test-N`, N = 1..7, or common / checkpoints / notebooks / benches): only that
chapter's test files (the groups of BUDGET_S below).
"""

from __future__ import annotations

import os
from collections import defaultdict
from fnmatch import fnmatch
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, settings

from tests.harness import Pools

PROFILE = os.environ.get("HYPOTHESIS_PROFILE", "ci")
settings.register_profile("ci", max_examples=3, deadline=None, derandomize=True, database=None,
                          phases=(Phase.explicit, Phase.generate),
                          suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("fast", max_examples=1, deadline=None, derandomize=True, database=None,
                          phases=(Phase.explicit, Phase.generate),
                          suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("thorough", max_examples=60, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.load_profile(PROFILE)

torch.set_num_threads(1)

# Seconds per chapter in the ci profile: about 1.8× a run on the 2-core machine this was measured
# on (2026-12-07: 1508 tests, 306.5 s by these groups, 311 s of pytest; 401 s before the lesson
# notebooks ran two at a time), the margin a slower CI box needs; together under the 10 minutes
# that `make test` may take with its install (~90 s). A rank pool's start-up is paid by the first
# file that uses its world size.
BUDGET_S: dict[str, tuple[tuple[str, ...], float]] = {
    "common (model, harness, loop)": (("test_common.py", "test_model.py", "test_harness.py",
                                      "test_gpu_check.py", "test_training_loop.py",
                                      "test_construction.py", "test_copy_sets.py", "test_figures.py",
                                      "test_figures_legible.py",
                                      "test_clip.py", "test_torch_names.py", "test_mesh.py",
                                      "test_patch.py", "test_floors.py"), 65),
    "01 data parallel": (("test_data_parallel*.py", "test_ddp_mechanics.py"), 15),
    "02 ring all-reduce": (("test_ring_allreduce*.py",), 22),
    "03 ZeRO": (("test_zero*.py", "test_state_subgroup.py"), 20),
    "04 FSDP": (("test_fsdp*.py",), 15),
    "05 tensor parallel": (("test_tensor_parallel*.py", "test_context_parallel*.py", "test_sp_live_order.py"),
                           25),
    "06 pipeline": (("test_pipeline*.py", "test_p2p_plan.py", "test_schedule_registry.py"), 30),
    "07 3D": (("test_3d*.py", "test_parallel3d*.py", "test_bytes_recompute_experts.py"), 90),
    "checkpoints": (("test_checkpoint*.py",), 42),
    "notebooks (lessons, exercises)": (("test_notebooks.py", "test_exercises.py", "test_lessons.py",
                                        "test_lesson_numbers.py", "test_sittings.py"), 130),
    "labs (the grader on each lab)": (("test_lab_*.py",), 100),
    "benches (each exits)": (("test_benches.py",), 15),
    "moe (the layer, its training, expert parallelism)": (("test_moe*.py", "test_expert_parallel.py"), 20),
    "precision (fp16 loss scaling, numerics, fp8)": (("test_loss_scal*.py", "test_numerics*.py",
                                                      "test_fp8.py"), 12),
}
_seconds: dict[str, float] = defaultdict(float)


def chapter_of(test_file: str) -> str:
    return next((name for name, (patterns, _) in BUDGET_S.items()
                 if any(fnmatch(test_file, p) for p in patterns)), "other")


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _seconds[Path(report.nodeid.split("::")[0]).name] += report.duration


def pytest_terminal_summary(terminalreporter) -> None:
    """The ci profile's budget report: seconds per chapter (setup + call + teardown of its
    tests) against its budget; over budget is flagged, not failed (machines differ)."""
    if PROFILE != "ci" or not _seconds:
        return
    per_chapter: dict[str, float] = defaultdict(float)
    for test_file, seconds in _seconds.items():
        per_chapter[chapter_of(test_file)] += seconds
    write = terminalreporter.write_line
    terminalreporter.section("time per chapter (ci profile) against its budget")
    for name in [*BUDGET_S, "other"]:
        if name in per_chapter:
            budget = BUDGET_S[name][1] if name in BUDGET_S else 0.0
            flag = "over budget" if per_chapter[name] > budget else "ok"
            write(f"{name:<32}{per_chapter[name]:>8.1f} s   budget {budget:>5.0f} s   {flag}")
    total, budget = sum(per_chapter.values()), sum(b for _, b in BUDGET_S.values())
    write(f"{'total':<32}{total:>8.1f} s   budget {budget:>5.0f} s   "
          f"{'over budget' if total > budget else 'ok'} (budgets assume an idle 2-core machine)")


# Files whose tests launch their own processes (torchrun, Jupyter kernels) run last, each after
# closing the rank pools (`closed_pools`): a session's pools hold gloo threads that wake while
# idle, and the 01 notebook ran 64 s beside them against 54 s alone.
RUN_LAST = ("test_benches.py", "test_notebooks.py")


def launches_torchrun(item: pytest.Item) -> bool:
    return "torchrun" in item.name or "run_chapter" in item.name  # gpu_check.run_chapter: torchrun


def selected_chapter(chapter: str) -> str:
    """The BUDGET_S group of `make test-N`: "3" → "03 ZeRO", "checkpoints" → "checkpoints"."""
    names = [n for n in BUDGET_S if n.split()[0] in (chapter, f"0{chapter}")]
    if len(names) != 1:
        choices = ", ".join(n.split()[0].lstrip("0") for n in BUDGET_S)
        raise pytest.UsageError(f"PFS_CHAPTER={chapter!r}: use one of {choices}")
    return names[0]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """PFS_CHAPTER keeps one chapter's tests. Tests that launch their own processes run last,
    after the rank pools are closed (01's torchrun test took 16.6 s among open pools, 8.4 s after
    them; idle pools use no measurable CPU, so the cost is their memory and threads, not their
    work)."""
    if chapter := os.environ.get("PFS_CHAPTER"):
        keep = selected_chapter(chapter)
        dropped = [item for item in items if chapter_of(item.path.name) != keep]
        items[:] = [item for item in items if chapter_of(item.path.name) == keep]
        config.hook.pytest_deselected(items=dropped)
    def order(item: pytest.Item) -> float:
        if item.path.name in RUN_LAST:
            return RUN_LAST.index(item.path.name) + 1
        return 0.5 if launches_torchrun(item) else 0
    items.sort(key=order)


@pytest.fixture(scope="session")
def pools():
    pools = Pools()
    yield pools
    pools.close()


@pytest.fixture(autouse=True)
def _pools_closed_under_torchrun(request):
    if launches_torchrun(request.node):
        request.getfixturevalue("pools").close()


@pytest.fixture(scope="module")
def closed_pools(pools):
    """Close every rank pool before a module of subprocess tests (a test that needs one restarts it)."""
    pools.close()
    return pools
