"""The ring's communication plan as data: which segment each rank sends and receives, in which group.

One function, `ring_exchanges`, lays out the exchanges of one rank; `ring.py` runs exactly that
list (mapping each piece to a view of its tensors) and `ring_plan` turns the same list into every
rank's ordered P2P groups, which the suite replays under NCCL's rules (common/kernel/p2p_plan.py) and
compares with the groups real runs post. Plan and code therefore cannot drift apart.

Layout. A length-L tensor is cut into n chunks, chunk i of L//n + (1 if i < L % n else 0) elements
(`torch.tensor_split`'s cut). Rank r sends only to r+1 and receives only from r-1 (mod n):

    reduce-scatter step s = 0 … n-2: send chunk (r-1-s) mod n, receive chunk (r-2-s) mod n
    all-gather     step s = 0 … n-2: send chunk (r-s) mod n,   receive chunk (r-1-s) mod n

What r sends at step s is what r+1 receives at step s, so both sides agree on the chunk and its
segments. A chunk of c elements travels as max(1, ⌈c / seg⌉) segments (an empty chunk as one
empty message). Step s of rank r is K = max(#send segments, #receive segments) exchanges; the
k-th sends segment k (if there is one) to the right and receives segment k (if any) from the
left, as one group (`batch_isend_irecv`). A segment received at step s is sent on at step s+1:
`needs` names the exchange whose receive must have completed first.

Why this is deadlock-free under NCCL (groups in order per rank, FIFO per pair, a send completes
only when the peer's matching receive is in the peer's current group): the k-th send of r at step
s meets the k-th receive of r+1 at step s, and every rank walks its steps and segments in the
same order, so no rank ever waits on a group that itself waits, transitively, on a later one.
The suite checks it by replay for n = 2 … 8 and uneven chunk sizes rather than trusting this
paragraph. (Each exchange pairs its send with its receive in one group because with n = 2 the
right and left neighbours are one peer: two ungrouped calls could each wait for the other.)

Pure arithmetic on sizes: nothing here touches a tensor or a process group.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from .agreement import CHECK_BYTES  # the call check's message: 4 int64

PHASES = {"reduce_scatter": ("reduce_scatter",), "all_gather": ("all_gather",),
          "all_reduce": ("reduce_scatter", "all_gather")}


def chunk_sizes(length: int, n: int) -> list[int]:
    """Chunk i has length//n + (1 if i < length % n else 0) elements (torch.tensor_split's cut)."""
    return [length // n + (1 if i < length % n else 0) for i in range(n)]


def chunk_bounds(length: int, n: int) -> list[tuple[int, int]]:
    """(start, stop) of each chunk in the flat tensor."""
    bounds, start = [], 0
    for size in chunk_sizes(length, n):
        bounds.append((start, start + size))
        start += size
    return bounds


def reduce_scatter_chunks(rank: int, step: int, n: int) -> tuple[int, int]:
    """(chunk sent to the right, chunk received from the left) at reduce-scatter step `step`."""
    return (rank - 1 - step) % n, (rank - 2 - step) % n


def all_gather_chunks(rank: int, step: int, n: int) -> tuple[int, int]:
    """(chunk sent to the right, chunk received from the left) at all-gather step `step`."""
    return (rank - step) % n, (rank - 1 - step) % n


def segment_count(elements: int, segment_elements: int) -> int:
    """Messages a chunk of `elements` travels as: ⌈elements / segment⌉, and one if it is empty."""
    return max(1, -(-elements // segment_elements))


def segment_bounds(elements: int, segment_elements: int) -> list[tuple[int, int]]:
    """(start, stop) of each segment of a chunk, as `tensor.split(segment)` cuts it ([(0, 0)] if empty)."""
    return [(k * segment_elements, min(elements, (k + 1) * segment_elements))
            for k in range(segment_count(elements, segment_elements))]


@dataclass(frozen=True)
class Piece:
    """Elements [start, stop) of chunk `chunk`."""

    chunk: int
    start: int
    stop: int

    @property
    def numel(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class RingExchange:
    """One group of one rank: `send` goes to the right, `recv` comes from the left (either may be
    None). `needs`: the index (in this rank's list for the phase) of the exchange whose receive
    brings what `send` sends, -1 if none; `step`: the phase's step."""

    phase: str
    step: int
    send: Piece | None
    recv: Piece | None
    needs: int

    def label(self, n: int) -> str:
        return f"{self.phase.replace('_', '-')} step {self.step + 1}/{n - 1}"


def ring_exchanges(phase: str, rank: int, sizes: Sequence[int], segment_elements: int) -> list[RingExchange]:
    """Rank `rank`'s exchanges of one phase ("reduce_scatter" or "all_gather"), in issue order,
    for chunks of `sizes` elements (n = len(sizes)) cut into segments of `segment_elements`."""
    n, chunks = len(sizes), {"reduce_scatter": reduce_scatter_chunks, "all_gather": all_gather_chunks}[phase]
    exchanges: list[RingExchange] = []
    arrived: dict[tuple[int, int], int] = {}  # (step, segment) → the exchange that received it
    for step in range(n - 1):
        send_chunk, recv_chunk = chunks(rank, step, n)
        sends = [Piece(send_chunk, *b) for b in segment_bounds(sizes[send_chunk], segment_elements)]
        recvs = [Piece(recv_chunk, *b) for b in segment_bounds(sizes[recv_chunk], segment_elements)]
        for k in range(max(len(sends), len(recvs))):
            if k < len(recvs):
                arrived[step, k] = len(exchanges)
            sent = sends[k] if k < len(sends) else None
            exchanges.append(RingExchange(phase, step, sent, recvs[k] if k < len(recvs) else None,
                                          arrived.get((step - 1, k), -1) if sent is not None else -1))
    return exchanges


def ring_plan(collective: str, sizes: Sequence[int], element_size: int, segment_bytes: int,
              check: bool = False, ranks: Sequence[int] | None = None) -> dict[int, list[list[tuple]]]:
    """Every rank's ordered P2P groups for one ring collective ("reduce_scatter", "all_gather",
    "all_reduce") over chunks of `sizes` elements of `element_size` bytes, with `segment_bytes`
    segments, `check` the call check's n-1 hops first (n = 1: no message at all). A group is a
    list of `(kind, peer, nbytes, label)` tuples ("send"/"recv"); ranks and peers are `ranks[i]`
    for group rank i (default: the group ranks themselves), as common.kernel.p2p_plan.find_deadlock takes
    them."""
    n = len(sizes)
    ranks = list(range(n)) if ranks is None else list(ranks)
    segment = max(1, segment_bytes // element_size)
    plan: dict[int, list[list[tuple]]] = {}
    for r in range(n):
        right, left, groups = ranks[(r + 1) % n], ranks[(r - 1) % n], []
        if check and n > 1:
            groups += [[("send", right, CHECK_BYTES, f"call check hop {h + 1}/{n - 1}"),
                        ("recv", left, CHECK_BYTES, f"call check hop {h + 1}/{n - 1}")] for h in range(n - 1)]
        for phase in PHASES[collective] if n > 1 else ():
            for e in ring_exchanges(phase, r, sizes, segment):
                group = []
                if e.send is not None:
                    group.append(("send", right, e.send.numel * element_size,
                                  f"{e.label(n)} chunk {e.send.chunk} [{e.send.start}:{e.send.stop}]"))
                if e.recv is not None:
                    group.append(("recv", left, e.recv.numel * element_size,
                                  f"{e.label(n)} chunk {e.recv.chunk} [{e.recv.start}:{e.recv.stop}]"))
                groups.append(group)
        plan[ranks[r]] = groups
    return plan
