"""A pool of rank processes joined in one gloo process group: send a function, get every rank's result.

Spawning a torch process costs seconds, so a pool's n processes live long: forked from a server
with torch imported (common/forkrun.py), joined once, then each call sends a module-level function
and its arguments to every rank and gathers the results as a list indexed by rank. A rank that
raises reports its traceback (RankError); a rank that hangs (a collective waiting for a peer) or
dies fails the call within `timeout` seconds with a message naming the ranks (RankTimeoutError),
and the pool is torn down. Used by the test suite (tests/harness.py) and by the labs' grader
(common/labs/grader.py).
"""

from __future__ import annotations

import os
import pickle
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from common.forkrun import forkserver_context, free_port

CI_TIMEOUT_S, THOROUGH_TIMEOUT_S = 60.0, 180.0
DEFAULT_TIMEOUT_S = float(os.environ.get("PFS_TEST_TIMEOUT") or (
    CI_TIMEOUT_S if os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci" else THOROUGH_TIMEOUT_S))
STARTUP_TIMEOUT_S = 120.0
GRACE_S = 15.0  # after one rank fails, how long the others get to report before the pool is killed


class RankError(AssertionError):
    """One or more ranks raised; the message carries their tracebacks."""

    def __init__(self, message: str, errors: dict[int, str]):
        super().__init__(message)
        self.errors = errors  # rank → the exception's last line


class RankTimeoutError(AssertionError):
    """Some rank did not answer in time (a hung collective or a dead process). `errors`: what the
    ranks that did answer raised (rank → the exception's last line): often why the others wait."""

    def __init__(self, message: str, errors: dict[int, str] | None = None):
        super().__init__(message)
        self.errors = errors or {}


def _send(conn, obj) -> None:
    """Plain pickle, so tensors travel by value: torch's multiprocessing pickler would share each
    tensor through a file descriptor, and a test returning hundreds of them runs out of them."""
    conn.send_bytes(pickle.dumps(obj))


def _recv(conn):
    return pickle.loads(conn.recv_bytes())


def _worker(rank: int, world_size: int, port: int, conn) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), PFS_BACKEND="gloo")
    import gc

    import torch
    import torch.distributed as dist

    gc.freeze()  # the imported heap out of the collector's way: a collection takes ms, not ~0.4 s
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=DEFAULT_TIMEOUT_S))
    _send(conn, ("ready", None))
    while True:
        message = _recv(conn)
        if message is None:
            break
        fn, args, kwargs = message
        try:
            _send(conn, ("ok", fn(*args, **kwargs)))
        except BaseException as error:  # SystemExit too: a rank that exits must still report
            last = f"{type(error).__name__}: {error}"
            _send(conn, ("error", (last, traceback.format_exc())))
        _destroy_subgroups()
    dist.destroy_process_group()


def _destroy_subgroups() -> None:
    """Destroy the process groups a test function made (meshes, subgroups): each gloo group
    keeps a TCP loop thread that wakes up while idle, and a pool that lives for the whole session
    would otherwise collect hundreds of them (measured: 64 per rank of the 8-rank pool, burning a
    third of the machine while later tests ran)."""
    import gc

    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    gc.collect()  # what still holds a group (a strategy in a reference cycle) lets it go first
    for group in list(c10d._world.pg_map):
        if group is not dist.group.WORLD:
            dist.destroy_process_group(group)
    gc.collect()
    gc.freeze()  # what survived (the modules the call imported) out of the next call's collections


class RankPool:
    def __init__(self, world_size: int):
        self.world_size = world_size
        self.broken = False
        context = forkserver_context()  # ranks forked with torch already imported: ~0.1 s, not ~2.5 s each
        port = free_port()
        self.conns, self.procs = [], []
        for rank in range(world_size):
            parent, child = context.Pipe()
            proc = context.Process(target=_worker, args=(rank, world_size, port, child), daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)
        replies = self._collect(STARTUP_TIMEOUT_S, what="start the process group")
        assert all(kind == "ready" for kind, _ in replies.values())

    def _collect(self, timeout: float, what: str) -> dict[int, tuple[str, Any]]:
        deadline, replies = time.monotonic() + timeout, {}
        while len(replies) < self.world_size:
            now = time.monotonic()
            if any(kind == "error" for kind, _ in replies.values()):
                deadline = min(deadline, now + GRACE_S)
            for rank, conn in enumerate(self.conns):
                if rank in replies:
                    continue
                try:
                    if conn.poll(0.01):
                        replies[rank] = _recv(conn)
                        continue
                except EOFError:
                    pass
                if not self.procs[rank].is_alive():
                    self.close(grace_s=1.0)
                    raise RankTimeoutError(f"rank {rank} of {self.world_size} died while trying to {what}")
            if len(replies) < self.world_size and time.monotonic() > deadline:
                silent = sorted(set(range(self.world_size)) - replies.keys())
                errors = {r: v[0] for r, (k, v) in replies.items() if k == "error"}
                self.close(grace_s=1.0)
                raise RankTimeoutError(
                    f"ranks {silent} of {self.world_size} did not {what} within "
                    f"{timeout if not errors else GRACE_S:.0f} s (a hung collective?); other "
                    f"ranks' errors: {errors or 'none'}. The pool was killed and will be rebuilt.",
                    errors,
                )
        return replies

    def run(self, fn: Callable, *args, timeout: float | None = None, **kwargs) -> list[Any]:
        timeout = DEFAULT_TIMEOUT_S if timeout is None else timeout
        if self.broken:
            raise RuntimeError("this pool was closed")
        for conn in self.conns:
            _send(conn, (fn, args, kwargs))
        replies = self._collect(timeout, what=f"finish {fn.__name__}")
        errors = {r: v for r, (kind, v) in replies.items() if kind == "error"}
        if errors:
            first = min(errors)
            raise RankError(
                f"{len(errors)} of {self.world_size} ranks raised in {fn.__name__}; rank {first}:\n"
                f"{errors[first][1]}",
                {r: v[0] for r, v in errors.items()},
            )
        return [replies[r][1] for r in range(self.world_size)]

    def close(self, grace_s: float = 5.0) -> None:
        """Ask every rank to leave; after `grace_s` seconds in all (a hung rank never reads the
        request), kill what is left."""
        self.broken = True
        for conn, proc in zip(self.conns, self.procs, strict=True):
            try:
                if proc.is_alive():
                    _send(conn, None)
            except (BrokenPipeError, OSError):
                pass
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))
        for proc in self.procs:
            if proc.is_alive():
                proc.kill()
            proc.join()
