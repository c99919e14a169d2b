"""Run a script as N ranks, as `torchrun --standalone --nproc-per-node N` would, in milliseconds.

    result = forkrun("01_data_parallel/train.py", "--check", "--steps", "2", nproc=4)
    result.returncode, result.stdout, result.stderr   # as subprocess.run's, all ranks together

torchrun starts a fresh Python for every rank, and each spends ~2.5 s of CPU importing torch before
it reaches the first line of the script: on a 2-core laptop, 8 ranks wait ~10 s for nothing. Here
the ranks are forked from a server process that imported torch once (multiprocessing's
"forkserver", started on first use and kept for the life of the caller), so a rank starts with
torch in memory. Each rank gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT, TORCHELASTIC_*) and runs the script as `__main__`
with `sys.argv` set, so the script cannot tell the difference; what differs from torchrun:
- the exit status is the lowest failing rank's own code (torchrun reports 1), and once one rank
  has failed the others get `grace_s` seconds to finish before they are killed (torchrun stops
  them at once);
- no restarts (`--max-restarts`) and no multi-node rendezvous: use torchrun for those;
- output: the ranks write into one stdout and one stderr, returned when the job ends.

For the lessons' notebooks and the test suite (CPU, gloo); on a GPU box torchrun is the tool.
"""

from __future__ import annotations

import atexit
import gc
import multiprocessing as mp
import os
import runpy
import socket
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "common.training"]  # what every rank imports
TIMEOUT_EXIT = 124  # the status of a job that ran past its deadline (as coreutils' timeout)


@dataclass
class ForkRun:
    """A finished job: the status (0 when every rank exited 0), all ranks' output, its seconds."""

    returncode: int
    stdout: str
    stderr: str
    seconds: float
    codes: list[int | None]  # each rank's exit status (None: killed after the job had failed)


def forkserver_context() -> mp.context.BaseContext:
    """multiprocessing's forkserver context with torch imported in the server (once per process)."""
    context = mp.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_env(rank: int, world: int, port: int) -> dict[str, str]:
    """What torchrun --standalone sets for each worker (the subset scripts read)."""
    return {"RANK": str(rank), "LOCAL_RANK": str(rank), "GROUP_RANK": "0", "ROLE_RANK": str(rank),
            "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(world), "ROLE_WORLD_SIZE": str(world),
            "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": "forkrun",
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0",
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}


def _rank_main(target: str, is_module: bool, argv: list[str], env: dict[str, str], logs: tuple[str, str],
               cwd: str) -> None:
    """One rank: torchrun's environment, output into the job's two logs, the script as __main__."""
    gc.freeze()  # the server's imported heap (torch's): a full collection then takes ms, not ~0.4 s
    os.chdir(cwd)
    os.environ.update(env)
    for fd, log in enumerate(logs, start=1):
        os.dup2(os.open(log, os.O_WRONLY | os.O_APPEND), fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    code = 0
    try:
        if is_module:
            sys.argv = [target, *argv]
            runpy.run_module(target, run_name="__main__", alter_sys=True)
        else:
            sys.argv = [target, *argv]
            sys.path.insert(0, str(Path(target).resolve().parent))  # as `python script.py` does
            runpy.run_path(target, run_name="__main__")
    except SystemExit as exit_:
        if isinstance(exit_.code, int) or exit_.code is None:
            code = exit_.code or 0
        else:
            print(exit_.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:  # what interpreter exit would run: atexit handlers, then the garbage
        atexit._run_exitfuncs()
        gc.collect()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def forkrun(target: str, *args: str, nproc: int = 2, module: bool = False, cwd: str | Path | None = None,
            env: dict[str, str] | None = None, timeout_s: float = 300.0, grace_s: float = 5.0) -> ForkRun:
    """Run `target` (a script path, or with module=True a module name, as `python -m`) with `args`
    on `nproc` forked ranks; `env` is added to every rank's environment."""
    context = forkserver_context()
    port, cwd = free_port(), str(cwd or os.getcwd())
    with tempfile.NamedTemporaryFile("w+", prefix="forkrun-", suffix=".out") as out, \
            tempfile.NamedTemporaryFile("w+", prefix="forkrun-", suffix=".err") as err:
        envs = [{**(env or {}), **rank_env(r, nproc, port)} for r in range(nproc)]
        procs = [context.Process(target=_rank_main, daemon=True,
                                 args=(target, module, list(args), envs[r], (out.name, err.name), cwd))
                 for r in range(nproc)]
        start = time.perf_counter()
        for p in procs:
            p.start()
        deadline, timed_out = start + timeout_s, False
        while any(p.is_alive() for p in procs):
            if any(p.exitcode not in (None, 0) for p in procs):
                deadline = min(deadline, time.perf_counter() + grace_s)
            if time.perf_counter() > deadline:
                timed_out = not any(p.exitcode not in (None, 0) for p in procs)
                break
            time.sleep(0.01)
        codes = [p.exitcode for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
        seconds = time.perf_counter() - start
        stdout, stderr = out.read(), err.read()
    failed = [c for c in codes if c not in (None, 0)]
    if timed_out:
        stderr += f"\nforkrun: {target} did not finish within {timeout_s:.0f} s; the ranks were killed\n"
    returncode = TIMEOUT_EXIT if timed_out else (failed[0] if failed else 0)
    return ForkRun(returncode, stdout, stderr, seconds, codes)


def torchrun_forked(argv: list[str], cwd: str | Path | None = None, env: dict[str, str] | None = None,
                    timeout_s: float = 300.0) -> ForkRun:
    """`torchrun ARGV` on forked ranks, for ARGV of the form `--standalone --nproc-per-node N
    [-m] TARGET ARGS...` (what the lessons print and launch)."""
    argv, nproc, module = list(argv), 1, False
    while argv and argv[0].startswith("-"):
        flag = argv.pop(0)
        if flag in ("--nproc-per-node", "--nproc_per_node"):
            nproc = int(argv.pop(0))
        elif flag.startswith(("--nproc-per-node=", "--nproc_per_node=")):
            nproc = int(flag.split("=", 1)[1])
        elif flag == "-m":
            module = True
            break
        elif flag != "--standalone":
            raise ValueError(f"torchrun flag {flag!r}: forkrun runs only --standalone --nproc-per-node N "
                             "jobs; use torchrun itself for the others")
    return forkrun(argv[0], *argv[1:], nproc=nproc, module=module, cwd=cwd, env=env, timeout_s=timeout_s)
