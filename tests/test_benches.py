"""Every chapter's bench.py runs to the end and exits, under the collective guard.

Each bench runs at a tiny size on 2 CPU ranks (forked as torchrun would start them: common.forkrun)
under `tests.collective_guard`, which fails the run when a collective gets a tensor that NCCL
would reject (made without `device=`) or when the process group is destroyed while a torch DDP,
FSDP2 module, ZeroRedundancyOptimizer or pipelining stage still holds it (the exit hang of
pytorch#56297). A hard timeout catches a hang the guard does not foresee. The guard's own
negative controls run in the rank pool.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from common.bench import interleaved, seconds_per_call
from common.forkrun import TIMEOUT_EXIT, ForkRun, forkrun
from fsdp.torch_fsdp2 import fsdp2_unavailable
from tests.collective_guard import (
    CollectiveGuard,
    LiveGroupHolderError,
    live_group_holders,
)

REPO = Path(__file__).resolve().parent.parent
TIMEOUT_S = 120  # a tiny bench takes seconds; a hang takes forever
TINY = ["--seq-len", "8", "--warmup", "0", "--steps", "1"]
BENCHES = {  # chapter directory: (ranks, the smallest flags that run every code path once)
    "01_data_parallel": (2, ["--model", "tiny", "--global-batch", "2", *TINY]),
    "02_ring_allreduce": (2, ["--sizes", "4K,16K", "--rounds", "1", "--plot", ""]),
    "03_zero": (2, ["--model", "tiny", "--global-batch", "2", "--png", "", *TINY]),
    "04_fsdp": (2, ["--model", "tiny", "--global-batch", "2", *TINY]),
    "05_tensor_parallel": (2, ["--model", "tiny", "--batch", "2", "--png", "", *TINY]),
    "06_pipeline": (2, ["--model", "tiny", "--microbatches", "2", "--micro-batch", "1", "--seq-len", "8",
                        "--steps", "1", "--schedules", "1f1b", "--png", ""]),
    "07_3d": (2, ["--model", "tiny", "--mesh", "1,1,2", "--reshard-mesh", "1,2,1", "--repeats", "1"]),
    "05_tensor_parallel/bench_context_parallel.py": (2, ["--model", "tiny", "--seq-len", "16", "--warmup",
                                                         "0", "--steps", "1"]),
    "05_tensor_parallel/bench_expert_parallel.py": (2, ["--batch", "2", *TINY]),
}


pytestmark = pytest.mark.usefixtures("closed_pools")  # see conftest.RUN_LAST


def run_bench(chapter: str, nproc: int, flags: list[str]) -> ForkRun:
    """The bench as `torchrun -m tests.collective_guard SCRIPT FLAGS` would run it, on ranks forked
    with torch already imported (common.forkrun: a run starts in milliseconds, not seconds)."""
    script = chapter if chapter.endswith(".py") else f"{chapter}/bench.py"  # a chapter's second bench
    proc = forkrun("tests.collective_guard", script, *flags, module=True, nproc=nproc, cwd=REPO,
                   env={"PFS_BACKEND": "gloo"}, timeout_s=TIMEOUT_S)
    if proc.returncode == TIMEOUT_EXIT:
        pytest.fail(f"{script} did not exit within {TIMEOUT_S} s (a hang at exit?):\n{proc.stderr[-2000:]}")
    return proc


def result_line(stdout: str) -> dict | list:
    """The bench's JSON result: its last stdout line that parses."""
    for line in reversed(stdout.strip().splitlines()):
        try:
            return json.loads(line)
        except json.JSONDecodeError:
            continue
    raise AssertionError(f"no JSON result line in:\n{stdout[-2000:]}")


@pytest.mark.slow
@pytest.mark.parametrize("chapter", list(BENCHES))
def test_bench_exits_with_a_result_under_the_collective_guard(chapter):
    if chapter == "06_pipeline":  # its yardstick, torch's schedules, hangs on gloo before torch 2.8
        from pipeline.bench import torch_yardstick_error

        if (reason := torch_yardstick_error("gloo")) is not None:
            pytest.skip(reason)
    if chapter == "04_fsdp" and fsdp2_unavailable("cpu") is not None:  # it times torch's FSDP2 too
        pytest.skip(fsdp2_unavailable("cpu"))
    nproc, flags = BENCHES[chapter]
    proc = run_bench(chapter, nproc, flags)
    assert proc.returncode == 0, f"exit {proc.returncode} after {proc.seconds:.0f} s:\n{proc.stderr[-3000:]}"
    checked = re.findall(r"collective guard: rank (\d+) checked (\d+)", proc.stderr)
    assert len(checked) == nproc, proc.stderr[-2000:]  # the guard ran on every rank
    assert result_line(proc.stdout)


def test_every_chapter_with_a_bench_is_exercised():
    benches = {p.parent.name for p in REPO.glob("0*_*/bench.py")}
    assert benches | {str(p.relative_to(REPO)) for p in REPO.glob("0*_*/bench_*.py")} == BENCHES.keys()


# --- the harness's timing method, in the rank pool (world size 2, gloo) ------------------------

def _time_three_contenders() -> tuple[list, dict, dict, int]:
    """"b" sleeps 10 ms on rank 0 and 30 ms on rank 1; "a" and "c" return at once."""
    order, calls = [], []
    naps = {"a": 0.0, "b": 0.01 + 0.02 * dist.get_rank(), "c": 0.0}
    steps = {n: (lambda r, n=n: (order.append((r, n)), time.sleep(naps[n]))) for n in "abc"}
    timings = interleaved(steps, rounds=2, warmup=1, device=torch.device("cpu"))
    per_call = seconds_per_call({"nap": lambda: (calls.append(1), time.sleep(0.005))}, iters=3, rounds=2,
                                device=torch.device("cpu"))
    return order, timings.rounds, per_call, len(calls)


def test_interleaved_rotates_the_order_and_keeps_the_slowest_rank(pools):
    results = pools.run(2, _time_three_contenders)
    order, rounds, per_call, n_calls = results[0]
    assert order == [(0, "a"), (0, "b"), (0, "c"), (1, "b"), (1, "c"), (1, "a"), (2, "c"), (2, "a"), (2, "b")]
    assert rounds == results[1][1]  # every rank reports the same, slowest-rank times
    assert [len(t) for t in rounds.values()] == [2, 2, 2]  # the warm-up round is not timed
    assert all(0.03 <= t < 0.3 for t in rounds["b"]), rounds["b"]  # rank 1's 30 ms, not rank 0's 10
    assert n_calls == 1 + 2 * 3 and 0.005 <= per_call["nap"] < 0.05  # one warm-up call; mean per call


# --- the guard's negative controls, in the rank pool (world size 2, gloo) ----------------------

def _guarded_all_reduce(make: str) -> float:
    device = torch.device("cpu")
    with CollectiveGuard(device):
        if make == "bare":
            t = torch.tensor([1.0, 2.0])
        elif make == "bare, derived":
            t = torch.stack([torch.tensor(1.0), torch.tensor(2.0)]).sum() * 2
        elif make == "bare, in place from a device tensor":
            t = torch.zeros(())
            t.add_(torch.ones((), device=device))
        elif make == "device=":
            t = torch.tensor([1.0, 2.0], device=device)
        elif make == "moved":
            t = torch.tensor([1.0, 2.0]).to(device)
        else:  # computed from a tensor on the device
            t = torch.ones(2, device=device).sum()
        dist.all_reduce(t)
        return float(t.sum())


@pytest.mark.parametrize("make", ["bare", "bare, derived", "bare, in place from a device tensor"])
def test_guard_rejects_a_collective_on_a_tensor_made_without_device(pools, make):
    with pytest.raises(AssertionError, match=r"CollectiveDeviceError.*without device="):
        pools.run(2, _guarded_all_reduce, make)


@pytest.mark.parametrize("make", ["device=", "moved", "computed"])
def test_guard_accepts_tensors_on_the_rank_device(pools, make):
    assert len(pools.run(2, _guarded_all_reduce, make)) == 2


def _holders_around_torch_ddp() -> tuple[list[str], list[str], str]:
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 2))
    alive = live_group_holders()
    guard = CollectiveGuard(torch.device("cpu"))
    try:
        guard._wrap_destroy(lambda: None)()  # the check alone: the pool's group must live on
        raised = ""
    except LiveGroupHolderError as error:
        raised = str(error)
    del model
    return alive, live_group_holders(), raised


def test_guard_names_a_torch_ddp_alive_at_destroy(pools):
    alive, after_del, raised = pools.run(2, _holders_around_torch_ddp)[0]
    assert alive == ["DistributedDataParallel"] and after_del == []
    assert "DistributedDataParallel alive" in raised


def _fsdp_clip_without_gradients(norm_type: float) -> str:
    """Chapter 04's clip on ranks that hold no gradient still joins the all-reduce: its zero
    must be on the rank's device and in the gradients' dtype (float64 here)."""
    from common.kernel.model import TransformerBlock, build_model, get_config
    from fsdp import FullyShardedDataParallel, ModuleWrapPolicy

    model = build_model(get_config("tiny", n_layers=2), seed=0, dtype=torch.float64)
    fsdp = FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
    with CollectiveGuard(torch.device("cpu")):
        total = fsdp.clip_grad_norm_(1.0, norm_type=norm_type)
    return f"{float(total)} {total.dtype}"


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_fsdp_clip_on_a_rank_without_gradients_passes_the_guard(pools, norm_type):
    assert pools.run(2, _fsdp_clip_without_gradients, norm_type) == ["0.0 torch.float64"] * 2
