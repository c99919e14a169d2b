"""Short-lived gloo jobs forked from the test process, for tests that kill a rank on purpose.

The rank pool (harness.py) treats a dead rank as a failure and rebuilds itself, which costs
seconds; a fork of the already-imported test process starts in milliseconds and may die as it
likes. `run_forked(world, fn, ...)` runs fn(rank, *args) on `world` forked ranks joined in a fresh
gloo group and returns each rank's exit code: 0 when fn returned, 1 when it raised (the traceback
goes to stderr), whatever a rank passed to os._exit. Once one rank has died with a code other
than 0, the ranks still blocked in a collective with it are killed (exit code -9).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import sys
import time
import traceback
from collections.abc import Callable
from datetime import timedelta


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, env: dict, fn: Callable, args: tuple) -> None:
    import torch.distributed as dist

    os.environ.update(env)
    code = 0
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=timedelta(seconds=60))
        fn(rank, *args)
        dist.destroy_process_group()
    except BaseException:
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def run_forked(world: int, fn: Callable, *args, env: dict[int, dict] | None = None,
               timeout: float = 60.0, grace: float = 2.0) -> list[int]:
    """Exit codes of fn(rank, *args) on `world` forked gloo ranks; env[rank] is set in that rank."""
    context = mp.get_context("fork")
    port = _free_port()
    procs = [context.Process(target=_rank_main, args=(r, world, port, (env or {}).get(r, {}), fn, args))
             for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs) and time.monotonic() < deadline:
        if any(p.exitcode not in (None, 0) for p in procs):
            deadline = min(deadline, time.monotonic() + grace)
        time.sleep(0.02)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    return [p.exitcode for p in procs]
