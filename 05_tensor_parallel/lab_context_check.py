"""Lab 05 · context: what `make lab-check N=5 LAB=context` runs on your lab_context.py.

First the pure pieces, in one process: your zig-zag shard for cp = 1 … 4 and your block masks;
your merge in three cases (ordinary scores, scores in the thousands, a query that sees no key of
one set). Then your ring_attention on 2, 3 and 4 ranks and on a world of 4 cut into two groups of
2 (your `group=`): its sends and receives recorded without moving data and replayed under NCCL's
rules (common/kernel/p2p_plan.find_deadlock) before any real run; then for real, in float64 (2 heads,
chunks of 2 tokens): every rank's out and lse against causal attention over the whole sequence
on one device at 1e-10, and what the ring is for: every rank computes the same blocks (2·cp − 1
full, 2 diagonal, none of the skipped ones) and sends cp − 1 K/V blocks, nothing more.
"""

from __future__ import annotations

import math

import torch

from common.kernel.p2p_plan import P2PRecorder
from common.kernel.patch import patch_dist
from common.labs.diagnosis import close, first_difference
from common.labs.grader import Fail, Property
from common.labs.rank import at
from common.labs.tools import group_of, rand, split, where
from tensor_parallel import lab_check_extra as extra
from tensor_parallel.lab_check_extra import CASES, _merge_case

TITLE = "context parallelism: ring attention on zig-zag blocks, merged online"
B, H, C, D = 1, 2, 2, 4  # C tokens per chunk, 2·cp chunks
RINGS = [{"world": 2}, {"world": 3}, {"world": 4}, {"world": 4, "groups": [2, 2]}]


def _qkv(cp: int) -> tuple[torch.Tensor, ...]:
    return tuple(rand(f"cp {name}", B, H, 2 * cp * C, D) for name in "qkv")


def _shard(x: torch.Tensor, cp: int, rank: int) -> torch.Tensor:
    chunks = x.chunk(2 * cp, dim=-2)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=-2)


def _mode(q_chunk: int, k_chunk: int) -> str | None:
    return "full" if k_chunk < q_chunk else "causal" if k_chunk == q_chunk else None


# --- on the ranks ----------------------------------------------------------------------------------

def layouts(lab, world: int) -> dict:
    x = torch.arange(4 * 8 * 3, dtype=torch.float64).view(4, 8, 3)
    at(phase="shard_sequence and block_mode")
    return {"shards": {(cp, r): lab.shard_sequence(x, cp, r) for cp in (1, 2, 4) for r in range(cp)},
            "modes": {(i, j): lab.block_mode(i, j) for i in range(6) for j in range(6)}}


def merges(lab, world: int) -> dict:
    return {name: _merge_case(lab.merge, name) for name in CASES}


def ring(lab, world: int, groups: list[int] | None = None) -> dict:
    """This rank's shards of the seeded q, k, v through your ring_attention: its out and lse, the
    blocks it computed (attend_block counted) and the bytes it sent."""
    g = split(groups)
    q, k, v = (_shard(t, g.size, g.rank) for t in _qkv(g.size))
    blocks, events, attend = [], [], lab.attend_block

    def counted(q, k, v, mode):
        blocks.append(mode)
        events.append("attend")
        return attend(q, k, v, mode)

    class Waited:  # a posted transfer's handle: its wait() is an event too
        def __init__(self, work):
            self.work = work

        def wait(self, *args, **kwargs):
            events.append("wait")
            return self.work.wait(*args, **kwargs)

    def posting(batch):
        def post(ops):
            events.append("post")
            works = batch(ops)
            return None if works is None else [Waited(w) for w in works]
        return post

    lab.attend_block = counted
    with P2PRecorder() as recorder, patch_dist({"batch_isend_irecv": posting}):
        at(phase=f"ring_attention on a ring of {g.size}")
        out, lse = lab.ring_attention(q, k, v, g.group)
    sent = sum(op.nbytes for gs in recorder.groups.values() for grp in gs for op in grp if op.kind == "send")
    return {"out": out, "lse": lse, "blocks": blocks, "sent": sent, "events": events}


def ring_plan(lab, world: int, groups: list[int] | None = None) -> None:
    """ring_attention once; the grader records (not sends) what it posts."""
    g = split(groups)
    q, k, v = (_shard(t, g.size, g.rank) for t in _qkv(g.size))
    at(phase=f"ring_attention on a ring of {g.size} (recorded, not sent)")
    lab.ring_attention(q, k, v, g.group)


# --- in the grader ----------------------------------------------------------------------------------

def check_layout(runs) -> Fail | str:
    """shard_sequence(x, cp, r) is chunks r and 2·cp−1−r of the 2·cp along dim -2 (cp = 1, 2, 4), and
    block_mode(i, j) is "full" for a key chunk before the query chunk, "causal" on it, None after."""
    got = runs[0].ranks[0]
    x = torch.arange(4 * 8 * 3, dtype=torch.float64).view(4, 8, 3)
    for (cp, r), shard in got["shards"].items():
        if not close(shard, want := _shard(x, cp, r)):
            chunks = x.chunk(2 * cp, dim=-2)
            halves = shard.chunk(2, dim=-2) if shard.shape == want.shape else ()
            held = [i for i, t in enumerate(chunks) if any(torch.equal(t, h) for h in halves)]
            return Fail(f"shard_sequence(x, {cp}, {r}) holds chunks {held or list(shard.shape)}, expected "
                        f"[{r}, {2 * cp - 1 - r}]", "rank r holds chunk r and chunk 2·cp−1−r of the 2·cp: "
                        "an early one with a late one, so every rank does the same work")
    for (i, j), mode in got["modes"].items():
        if mode != _mode(i, j):
            return Fail(f"block_mode({i}, {j}) = {mode!r}, expected {_mode(i, j)!r}",
                        "causal attention: key chunks before the query chunk are seen whole, the query's own "
                        "chunk causally (its diagonal), later chunks not at all (never computed)")
    return "the zig-zag pair for cp = 1, 2, 4, and every block's mode"


def check_merge(runs) -> Fail | str:
    """merge of two partial attentions (out, lse) equals attention over both key sets, and its
    gradients too: ordinary scores, scores in the thousands, a query that sees no key of one set."""
    return extra.check_merge(runs)


def _causal(cp: int) -> tuple[torch.Tensor, torch.Tensor]:
    q, k, v = _qkv(cp)
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    scores = scores.masked_fill(~torch.ones(scores.shape[-2:], dtype=torch.bool).tril(), float("-inf"))
    lse = scores.logsumexp(-1)
    return torch.exp(scores - lse[..., None]) @ v, lse


def check_ring(runs) -> Fail | str:
    """Every rank's out and lse are causal attention's over the whole sequence, at its zig-zag
    rows (1e-10), on rings of 2, 3, 4 and on groups of 2 of 4 ranks."""
    for run in runs:
        for rank, got in enumerate(run.ranks):
            r, cp, _ = group_of(run.config.get("groups") or [run.world], rank)
            out, lse = _causal(cp)
            want = {"out": _shard(out, cp, r), "lse": _shard(lse[..., None], cp, r)[..., 0]}
            if finding := first_difference({k: got[k] for k in want}, want):
                own = _causal_own(cp, r)
                alone = close(got["out"], own["out"])  # its lse may count its own keys several times
                hint = ("this rank attended only to its own K/V: the ring must bring every rank's K/V (cp "
                        "steps, cp − 1 transfers), each merged" if alone else
                        "a block attributed to the wrong chunk (after step s a rank holds the K/V of rank "
                        "r−s−1, whose chunks are r−s−1 and 2·cp−r+s), a wrong mode, or a merge that is not "
                        "the log-sum-exp rule")
                return Fail(f"{where(run.config, rank)}: {finding}", hint)
    return "out and lse exact on rings of 2, 3, 4 and in groups of 2"


def _causal_own(cp: int, r: int) -> dict:
    """What a rank that never receives computes: its queries over its own two chunks only."""
    q, k, v = (_shard(t, cp, r) for t in _qkv(cp))
    scores = q @ k.transpose(-1, -2) / math.sqrt(D)
    positions = _shard(torch.arange(2 * cp * C)[:, None], cp, r)[:, 0]
    scores = scores.masked_fill(positions[None, :] > positions[:, None], float("-inf"))
    lse = scores.logsumexp(-1)
    return {"out": torch.exp(scores - lse[..., None]) @ v, "lse": lse}


def check_work(runs) -> Fail | str:
    """What the zig-zag is for: every rank computes 2·cp − 1 full blocks and 2 causal ones (its two
    diagonals), the same work on every rank, and never a block it would mask whole."""
    for run in runs:
        for rank, got in enumerate(run.ranks):
            cp = group_of(run.config.get("groups") or [run.world], rank)[1]
            counts = {mode: got["blocks"].count(mode) for mode in ("full", "causal")}
            if counts != {"full": 2 * cp - 1, "causal": 2} or len(got["blocks"]) != 2 * cp + 1:
                return Fail(f"{where(run.config, rank)}: attend_block ran {len(got['blocks'])} times "
                            f"({counts['full']} full, {counts['causal']} causal), expected {2 * cp - 1} full "
                            "and 2 causal", "skip the blocks block_mode says None for (keys after the "
                            "queries), and call attend_block once per (query chunk, key chunk) it computes")
    return "2·cp − 1 full blocks and 2 causal ones on every rank"


def check_ring_bytes(runs) -> Fail | str:
    """What the ring is for: each rank sends its K/V on, cp − 1 times (2 × its 2c tokens' keys and
    values per step), nothing more, by batch_isend_irecv."""
    for run in runs:
        for rank, got in enumerate(run.ranks):
            cp = group_of(run.config.get("groups") or [run.world], rank)[1]
            want = (cp - 1) * 2 * B * H * 2 * C * D * 8
            if got["sent"] != want:
                return Fail(f"{where(run.config, rank)}: sent {got['sent']:,} B, the ring sends {want:,} B "
                            f"(cp − 1 = {cp - 1} transfers of K and V)",
                            "one K/V block per step to the right neighbour, by dist.batch_isend_irecv: not "
                            "all of them to everyone, not the last step's (nobody uses it)")
    return "cp − 1 K/V transfers per rank"


def check_overlap(runs) -> Fail | str:
    """What the ring is for, in time: each step posts its K/V transfer, then attends, then waits,
    so the transfer runs under the blocks' compute (the order of posts, attend_block calls and
    wait()s, recorded)."""
    for run in runs:
        for rank, got in enumerate(run.ranks):
            since, order = None, " ".join(got["events"])
            for event in got["events"]:
                if event == "post":
                    since = 0
                elif event == "attend" and since is not None:
                    since += 1
                elif event == "wait" and since == 0:
                    return Fail(f"{where(run.config, rank)}: waited on a transfer before attending to any "
                                f"block after posting it (posts, attends, waits in order: {order[:160]})",
                                "the ring waits before it attends: nothing overlaps the transfer. Post the "
                                "next step's batch_isend_irecv, attend to the K/V you hold, then wait()")
            if got["events"].count("post") and not got["events"].count("wait"):
                return Fail(f"{where(run.config, rank)}: posted {got['events'].count('post')} transfers, "
                            "never waited", "wait() on every handle batch_isend_irecv returns before "
                            "reading the buffer it receives into (a missed wait() reads it half written)")
    return "every transfer posted, then blocks attended, then waited (the K/V moves under compute)"


PROPERTIES = [
    Property("the zig-zag shard and the block masks", [{"world": 1}], layouts, [check_layout]),
    Property("merge: the log-sum-exp rule, exact (large scores, an empty set)", [{"world": 1}], merges,
             [check_merge]),
    Property("NCCL order: the ring's sends and receives replay without deadlock", RINGS, ring_plan,
             plan=True),
    Property("ring_attention equals causal attention on one device (2, 3, 4 ranks; groups of 2)", RINGS, ring,
             [check_ring, check_work, check_ring_bytes, check_overlap], after=("merge", "zig-zag")),
]
