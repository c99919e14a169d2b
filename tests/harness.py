"""The test session's rank pools: one RankPool (common/rank_pool.py) per world size, started on
first use and rebuilt when a test left it broken. A test sends a module-level function and its
arguments; every rank runs it and the results come back as a list indexed by rank; a rank that
hangs or dies fails the test within the timeout, naming the ranks.

The timeout is 60 s in the `ci` hypothesis profile (the default) and 180 s otherwise
(PFS_TEST_TIMEOUT overrides both). Inside a hypothesis property a hang poisons the rest of that
test: every later call fails at once, so the final replay of the failing example costs nothing and
a broken collective goes red in about one timeout, not one per example.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

from common.rank_pool import (  # noqa: F401 (re-exported: the tests import them from here)
    DEFAULT_TIMEOUT_S,
    RankError,
    RankPool,
    RankTimeoutError,
)


def _current_test() -> str:
    """pytest's id of the running test (without its phase), '' outside pytest."""
    return os.environ.get("PYTEST_CURRENT_TEST", "").rsplit(" (", 1)[0]


MAX_THREADS = 128  # a fresh rank has ~6 threads; each live gloo group adds ~3


def _thread_count(pid: int) -> int:
    """Threads of a process (Linux /proc); 0 where that cannot be read."""
    try:
        return len(os.listdir(f"/proc/{pid}/task"))
    except OSError:
        return 0


def _in_property() -> bool:
    from hypothesis.control import currently_in_test_context

    return currently_in_test_context()


class Pools:
    """World size → a live RankPool, rebuilt when a test left one broken."""

    def __init__(self) -> None:
        self._pools: dict[int, RankPool] = {}
        self.hung: tuple[str, str] | None = None  # (test id, message) of the last hang

    def __call__(self, world_size: int) -> RankPool:
        pool = self._pools.get(world_size)
        if pool is None or pool.broken:
            pool = self._pools[world_size] = RankPool(world_size)
        return pool

    def run(self, world_size: int, fn: Callable, *args, **kwargs) -> list[Any]:
        """Run fn on every rank; inside a hypothesis property that already hung, fail at once."""
        if self.hung is not None and self.hung[0] == _current_test() and _in_property():
            raise RankTimeoutError(f"not run: an earlier example of this property hung, and a "
                                   f"property stops at its first hang. {self.hung[1]}")
        try:
            results = self(world_size).run(fn, *args, **kwargs)
        except RankTimeoutError as error:
            self.hung = (_current_test(), str(error))
            raise
        self._recycle_if_crowded(world_size)
        return results

    def _recycle_if_crowded(self, world_size: int) -> None:
        """Close a pool whose ranks hold more than MAX_THREADS threads (it is rebuilt on next
        use). A gloo process group owns a TCP loop thread that wakes while idle, and groups that
        test code keeps referenced from C++ (hooks, pending work) outlive `_destroy_subgroups`:
        64 of them per rank of the 8-rank pool burned a third of the machine during later tests."""
        pool = self._pools[world_size]
        counts = [_thread_count(proc.pid) for proc in pool.procs]
        if max(counts) > MAX_THREADS:
            pool.close()
            del self._pools[world_size]

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()


def examples(ci: int) -> int:
    """The example count for a property that pins one (`@settings(max_examples=examples(4))`):
    `ci` in the ci profile, 1 in the fast one (every property still runs once), and at least the
    thorough profile's own count there, so that a pin never makes `make test-thorough` lighter."""
    from hypothesis import settings

    profile = os.environ.get("HYPOTHESIS_PROFILE", "ci")
    return 1 if profile == "fast" else ci if profile == "ci" else max(ci, settings.default.max_examples)
