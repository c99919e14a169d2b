"""The rank pool itself: results come back by rank, and a hung or dead rank fails fast with a
clear message and a rebuilt pool, never a stuck test session."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from hypothesis import Phase, given, settings
from hypothesis import strategies as st

from tests import harness
from tests.conftest import BUDGET_S, PROFILE, chapter_of
from tests.harness import RankError, RankTimeoutError


def rank_and_sum() -> tuple[int, float]:
    x = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(x)
    return dist.get_rank(), x.item()


def only_rank_0_waits() -> None:
    if dist.get_rank() == 0:
        dist.barrier()  # its peers never join


def rank_1_dies() -> None:
    if dist.get_rank() == 1:
        os._exit(3)


def rank_0_raises() -> None:
    if dist.get_rank() == 0:
        raise ValueError("bad value on rank 0")


def test_results_come_back_in_rank_order(pools):
    assert pools.run(3, rank_and_sum) == [(0, 3.0), (1, 3.0), (2, 3.0)]


def test_a_hung_collective_fails_within_the_timeout_and_the_pool_is_rebuilt(pools):
    message = r"ranks \[0\] of 2 did not finish only_rank_0_waits within 3 s"
    with pytest.raises(RankTimeoutError, match=message):
        pools.run(2, only_rank_0_waits, timeout=3)
    assert pools.run(2, rank_and_sum) == [(0, 1.0), (1, 1.0)]


def test_a_dead_rank_is_reported_by_number(pools):
    with pytest.raises(RankTimeoutError, match="rank 1 of 2 died"):
        pools.run(2, rank_1_dies, timeout=30)
    assert pools.run(2, rank_and_sum)[1] == (1, 1.0)


def test_an_exception_on_one_rank_carries_its_traceback(pools):
    with pytest.raises(RankError, match="bad value on rank 0") as info:
        pools.run(2, rank_0_raises)
    assert info.value.errors == {0: "ValueError: bad value on rank 0"}


def test_a_property_stops_at_its_first_hang(pools):
    """A hung example costs one timeout: hypothesis stops generating at the first failure (no
    shrinking in ci), and its final replay of the failing example fails at once, without waiting."""
    calls = []

    @settings(max_examples=5, phases=(Phase.generate,), database=None, derandomize=True)
    @given(st.integers(0, 100))
    def hangs(x):
        calls.append(x)
        pools.run(2, only_rank_0_waits, timeout=3)

    with pytest.raises(RankTimeoutError, match=r"a property stops at its first hang.*within 3 s"):
        hangs()
    assert len(calls) == 2, calls  # the example that hung, and the replay that did not wait
    assert pools.run(2, rank_and_sum)[0] == (0, 1.0)  # outside the property: a fresh pool


def test_ci_profile_does_not_shrink_and_times_out_sooner():
    if PROFILE != "ci":
        pytest.skip("the ci profile's settings")
    assert Phase.shrink not in settings.default.phases and settings.default.database is None
    override = os.environ.get("PFS_TEST_TIMEOUT")
    assert (float(override) if override else 60.0) == harness.DEFAULT_TIMEOUT_S


def test_every_test_file_belongs_to_a_chapter_budget():
    for name in sorted(p.name for p in Path(__file__).parent.glob("test_*.py")):
        assert chapter_of(name) in BUDGET_S, f"{name}: add it to conftest.BUDGET_S"
    assert chapter_of("test_zero.py") == "03 ZeRO" and chapter_of("test_3d_mesh.py") == "07 3D"
    assert sum(budget for _, budget in BUDGET_S.values()) <= 15 * 60
