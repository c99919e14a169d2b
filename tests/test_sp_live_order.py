"""Sequence parallelism's backward re-gather (05's SequenceGather, layers._SequenceParallelLinear),
held to what the lesson claims beyond the values: the column layers save only their s/t tokens
and gather them again in backward, (1) posting that all-gather before the dx = dy·W GEMM it
overlaps and waiting for it after, and (2) dropping the gathered input once its last reader is
done, so no re-gathered input is alive when the next one is posted nor after backward.

A record on each of 2 ranks (TP 2, SP, float64): a shared gather read by two column layers (Q
and K's pattern), a row layer, then a column layer of its own and another row layer; one
backward. Every re-gather's post and wait and every matmul are logged in order, and at each post
the storages of the earlier re-gathers still alive are counted (weak references: a storage keeps
one Python object while it lives). Two planted bugs keep the values and the bytes and break the
claims: a re-gather posted at the wait (after the matmul), and the gathered inputs kept alive
to the end of backward.
"""

from __future__ import annotations

import contextlib
import weakref
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import tensor_parallel.mappings as mappings
from tensor_parallel import ColumnParallelLinear, RowParallelLinear
from tensor_parallel.mappings import SequenceGather, gather_for_column_parallel

MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.bmm.default, torch.ops.aten.addmm.default}


class Matmuls(TorchDispatchMode):
    def __init__(self, log: list):
        super().__init__()
        self.log = log

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in MATMULS:
            self.log.append(("matmul",))
        return func(*args, **(kwargs or {}))


class _Logged:
    """A work handle whose wait is logged."""

    def __init__(self, work, n: int, log: list):
        self.work, self.n, self.log = work, n, log

    def wait(self):
        self.log.append(("wait", self.n))
        return self.work.wait()


def planted(bug: str | None, kept: list):
    real_start, real_wait = SequenceGather.start, SequenceGather.wait
    if bug == "late post":  # the all-gather posted by the wait, after the dx GEMM
        def start(self, local):
            self._local = local

        def wait(self):
            if self._out is None:
                real_start(self, self._local)
            return real_wait(self)
        return mock.patch.multiple(SequenceGather, start=start, wait=wait)
    if bug == "kept alive":  # each gathered input referenced until backward ends
        def keep(self):
            kept.append(real_wait(self))
            return kept[-1]
        return mock.patch.object(SequenceGather, "wait", keep)
    return contextlib.nullcontext()


def record(bug: str | None) -> dict:
    rank, t = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    h, f = 8, 12
    dense = [nn.Linear(h, f, bias=False).double() for _ in range(3)] + \
            [nn.Linear(f, h, bias=False).double() for _ in range(2)]
    q, k, up = (ColumnParallelLinear.from_linear(d, None, sequence_parallel=True, input_is_mapped=i < 2)
                for i, d in enumerate(dense[:3]))
    down1, down2 = (RowParallelLinear.from_linear(d, None, input_is_parallel=True, sequence_parallel=True)
                    for d in dense[3:])
    x = torch.randn(2, 4 * t, h, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    local = x[:, rank * 4:(rank + 1) * 4].clone().requires_grad_()
    full = gather_for_column_parallel(local, None)
    y = down1(q(full) * k(full)).tanh()
    out = down2(up(y))

    log: list[tuple] = []
    storages: list[weakref.ref] = []
    alive_at_post: list[int] = []
    real = mappings.start_all_gather_along

    def start(x, dim, group):
        alive_at_post.append(sum(s() is not None for s in storages))
        n = len(storages)
        log.append(("post", n))
        gathered, work = real(x, dim, group)
        storages.append(weakref.ref(gathered.untyped_storage()))
        return gathered, _Logged(work, n, log)

    kept: list[torch.Tensor] = []
    with planted(bug, kept), mock.patch.object(mappings, "start_all_gather_along", start), Matmuls(log):
        out.square().sum().backward()
    alive_after = sum(s() is not None for s in storages)  # as backward returns
    kept.clear()
    return {"log": log, "alive_at_post": alive_at_post, "alive_after": alive_after,
            "grads": [p.grad.clone() for p in (q.weight, k.weight, up.weight)] + [local.grad.clone()]}


def overlap_errors(log: list[tuple]) -> list[str]:
    """Each re-gather: posted, then at least one matmul, then its first wait."""
    errors = []
    for n in sorted({e[1] for e in log if e[0] == "post"}):
        post, wait = log.index(("post", n)), log.index(("wait", n))
        if not any(e == ("matmul",) for e in log[post + 1:wait]):
            errors.append(f"re-gather {n}: no matmul between its post (#{post}) and its wait (#{wait})")
    return errors


@pytest.mark.parametrize("bug", [None, "late post", "kept alive"])
def test_sp_regather_overlaps_its_matmul_and_dies_after_its_last_reader(pools, bug):
    results = pools.run(2, record, bug)
    clean = pools.run(2, record, None) if bug else results
    for rank, (r, c) in enumerate(zip(results, clean, strict=True)):
        assert [e for e in r["log"] if e[0] == "post"] == [("post", 0), ("post", 1)], r["log"]
        assert all(torch.equal(a, b) for a, b in zip(r["grads"], c["grads"], strict=True))  # same values
        order, live = overlap_errors(r["log"]), r["alive_at_post"] + [r["alive_after"]]
        if bug is None:
            assert not order and live == [0, 0, 0], (rank, order, live)
        elif bug == "late post":
            assert len(order) == 2 and live == [0, 0, 0], (rank, order, live)
        else:
            assert not order and live == [0, 1, 2], (rank, order, live)
