"""common/kernel/patch.py, the one way the project wraps torch.distributed: blocks nest (the inner wraps
the outer), each takes off its own layer only, even out of order, torch's function is back after
the last one, on an exception too, and aliases are wrapped only when asked (distributed_c10d's
isend for P2POp), so torch's internal calls are not counted twice."""

from __future__ import annotations

from contextlib import ExitStack

import pytest
import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from common.comm import CommMeter
from common.kernel.p2p_plan import P2PRecorder
from common.kernel.patch import patch_dist

TORCHS = dist.is_initialized  # a function callable without a process group


def tagging(calls: list[str], tag: str):
    def wrap(fn):
        def tagged(*args, **kwargs):
            calls.append(tag)
            return fn(*args, **kwargs)
        return tagged
    return wrap


def test_blocks_nest_the_inner_wrapping_the_outer_and_torchs_function_comes_back():
    calls: list[str] = []
    with patch_dist({"is_initialized": tagging(calls, "outer")}):
        outer = dist.is_initialized
        with patch_dist({"is_initialized": tagging(calls, "inner")}):
            dist.is_initialized()
        assert dist.is_initialized is outer  # the same function object, not a re-wrapped one
        dist.is_initialized()
    assert dist.is_initialized is TORCHS and c10d.is_initialized is TORCHS
    assert calls == ["inner", "outer", "outer"]


def test_an_exception_inside_restores_torchs_function():
    with (pytest.raises(ZeroDivisionError), patch_dist({"is_initialized": tagging([], "x")}),
          patch_dist({"is_initialized": tagging([], "y")})):
        raise ZeroDivisionError
    assert dist.is_initialized is TORCHS


def test_a_block_leaving_out_of_order_takes_off_its_own_layer_only():
    calls: list[str] = []
    first, second = patch_dist({"is_initialized": tagging(calls, "first")}), \
        patch_dist({"is_initialized": tagging(calls, "second")})
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # leaves before the block it encloses
    dist.is_initialized()
    assert calls == ["second"]
    second.__exit__(None, None, None)
    assert dist.is_initialized is TORCHS


def test_aliases_are_wrapped_only_when_asked_and_then_share_one_function():
    isend = dist.isend
    with patch_dist({"isend": tagging([], "alone")}):  # torch.distributed's name alone
        assert dist.isend is not isend and c10d.isend is isend
    with patch_dist({"isend": tagging([], "meter")}, also=(c10d,)):
        with patch_dist({"isend": tagging([], "recorder")}, also=(c10d,)):
            assert c10d.isend is dist.isend is not isend  # P2POp checks `op in [c10d.isend, …]`
        assert c10d.isend is dist.isend is not isend
    assert dist.isend is isend and c10d.isend is isend


def test_a_hand_replacement_inside_a_block_is_refused_and_a_missing_name_skipped():
    with patch_dist({"is_initialized": tagging([], "x"), "no_such_collective": tagging([], "y")}):
        assert not hasattr(dist, "no_such_collective")
        saved, dist.is_initialized = dist.is_initialized, lambda: True
        try:
            refused = pytest.raises(RuntimeError, match=r"is_initialized was replaced by hand inside a "
                                                         r"patch_dist block")
            with refused, patch_dist({"is_initialized": tagging([], "z")}):
                pass
        finally:
            dist.is_initialized = saved
    assert dist.is_initialized is TORCHS


def metered_p2p_raising() -> dict:
    """Rank 0 sends to rank 1 under the comm meter and, inside it, the P2P recorder; an exception
    leaves both; what each saw, and whether torch's functions are all back."""
    names = ("all_reduce", "isend", "irecv", "batch_isend_irecv", "all_gather_into_tensor")
    torchs = {(m, n): getattr(m, n) for m in (dist, c10d) for n in names}
    x = torch.arange(4.0)
    with ExitStack() as stack:
        meter = stack.enter_context(CommMeter())
        recorder = stack.enter_context(P2PRecorder())
        peer = 1 - dist.get_rank()
        op = dist.isend if dist.get_rank() == 0 else dist.irecv
        for work in dist.batch_isend_irecv([dist.P2POp(op, x, peer)]):
            work.wait()
        out, plain = torch.empty(8), []  # torch's all_gather_into_tensor calls c10d.all_gather_single
        with patch_dist({"all_gather_into_tensor": tagging(plain, "into"),
                         "all_gather_single": tagging(plain, "single")}):
            dist.all_gather_into_tensor(out, x)
        try:
            with patch_dist({"all_reduce": lambda fn: lambda *a, **k: 1 / 0}):
                dist.all_reduce(x)
        except ZeroDivisionError:
            pass
        dist.all_reduce(x)
    back = all(getattr(m, n) is fn for (m, n), fn in torchs.items())
    return {"meter": meter.as_dict(), "recorded": sum(len(g) for g in recorder.groups.values()), "back": back,
            "plain": plain}


def test_the_meter_and_the_recorder_nest_and_count_what_torch_runs_once(pools):
    for rank, r in enumerate(pools.run(2, metered_p2p_raising)):
        assert r["back"], rank
        assert r["recorded"] == 1, r
        assert r["meter"]["isend" if rank == 0 else "irecv"]["calls"] == 1, r["meter"]
        assert r["meter"]["all_gather_into_tensor"]["calls"] == 1 and "all_gather_single" not in r["meter"]
        assert r["plain"] == ["into"], r["plain"]  # a counter without a guard counts it once too
        assert r["meter"]["all_reduce"]["calls"] == 1, r["meter"]  # the raising layer's call never ran
