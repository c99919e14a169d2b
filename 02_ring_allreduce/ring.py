"""Ring all-reduce built from point-to-point messages: reduce-scatter, then all-gather.

The n ranks of a group stand in a ring; rank r sends only to its right neighbour r+1 and receives
only from its left neighbour r-1. Each rank cuts its length-L tensor into n chunks (chunk i has
L//n + (1 if i < L%n else 0) elements, as `torch.tensor_split` cuts it):

    reduce-scatter, steps s = 0 … n-2: send chunk (r-1-s) mod n to the right, receive chunk
        (r-2-s) mod n from the left and fold it into our own copy of that chunk. A chunk picks up
        one contribution per hop, so after n-1 hops rank r holds the full reduction of chunk r.
    all-gather, steps s = 0 … n-2: send chunk (r-s) mod n (complete) to the right, receive the
        complete chunk (r-1-s) mod n from the left. After n-1 hops every rank holds every chunk.

2(n-1) steps in all. Every step moves one chunk per rank, on every link at once, so each rank sends

    bytes_r = 2(n-1)/n · S        (S = L · element size; exactly (L - c_r) + (L - c_{r+1}) elements)

which stays below 2S whatever n is: more ranks add steps (latency), not traffic per rank. Among
algorithms built from point-to-point messages no all-reduce sends less (in-network reduction,
NVLink SHARP, is not one of them). Same call shape as `dist.all_reduce(tensor, op, group)`.

Pipelining: a chunk travels as segments of at most `segment_bytes`, 2(n-1)·⌈chunk/segment⌉
messages in all, and a segment moves on as soon as it has arrived (and, in the reduce-scatter,
been folded in), without waiting for the rest of its chunk: the steps overlap like a bucket
brigade, and folding one segment overlaps the transfer of the next.

Choices, each tested:
* Each exchange, one segment to the right and one from the left, is issued as one group with
  `dist.batch_isend_irecv`: NCCL needs a send and a receive that must progress together in one
  group (with n = 2 the left and right neighbours are the same peer, and two ungrouped calls on
  one communicator could each wait for the other). gloo runs the pair as two calls, as before.
* AVG never travels on the wire (gloo on torch 2.5-2.8 mishandles it): SUM, then divide by n.
  AVG of an integer tensor raises, as torch's own gloo all_reduce does.
* `check=True` (the default) first passes the 32-byte call signature of agreement.py (length,
  dtype, op, segment_bytes; or "my own arguments are wrong") n-1 hops round the ring, so that
  every rank knows whether all agree before any data moves: a mismatch, or a bad argument on one
  rank only, is then an error on every rank instead of a crashed peer or a hang. It costs n-1
  messages and 32·(n-1) bytes per rank, which the comm meter shows. `CheckOncePerShape` runs it
  only on the first call of each shape (DDP's fixed buckets).
* A received segment lands in a scratch buffer that no pending operation references (`WINDOW` of
  them, in turn; one is reused only after its segment was folded), and is folded into our chunk
  after the receive completed. The all-gather receives straight into the chunk's final place,
  which nothing reads or sends until that receive has completed.
* The ring runs synchronously; `async_op=True` returns an already-completed handle, so a DDP that
  uses it does not overlap communication with backward.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist

from .agreement import (
    AVG,
    FAILED,
    MAX,
    MIN,
    PRODUCT,
    SUM,
    CompletedWork,
    call_signature,
    check_message,
    raise_unless_all_agree,
    validate,
    wire_device,
)
from .agreement import OP_NAMES as OP_NAMES  # re-exported: the ring's callers import them from here
from .agreement import SUPPORTED_DTYPES as SUPPORTED_DTYPES
from .agreement import CheckOncePerShape as CheckOncePerShape

SEGMENT_BYTES = 2 << 20  # pipelining granularity: a chunk travels as segments of at most this
WINDOW = 2  # exchanges in flight per rank: two scratch buffers, alternating

# How each op folds a received partial chunk with our local copy: fn(received, local, out=...).
_FOLD = {SUM: torch.add, MAX: torch.maximum, MIN: torch.minimum, PRODUCT: torch.mul}


# ---------------------------------------------------------------- layout and schedule (pure)

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


def ring_traffic(length: int, element_size: int, rank: int, n: int, phase: str = "all_reduce",
                 segment_bytes: int = SEGMENT_BYTES) -> tuple[int, int]:
    """(bytes, messages) that rank `rank` sends: every chunk but its own in the reduce-scatter,
    every chunk but its right neighbour's in the all-gather; ≈ (n-1)/n · S each."""
    sizes, segment = chunk_sizes(length, n), max(1, segment_bytes // element_size)
    sent = {"reduce_scatter": [sizes[reduce_scatter_chunks(rank, s, n)[0]] for s in range(n - 1)],
            "all_gather": [sizes[all_gather_chunks(rank, s, n)[0]] for s in range(n - 1)]}
    sent["all_reduce"] = sent["reduce_scatter"] + sent["all_gather"]
    return (sum(sent[phase]) * element_size, sum(segment_count(c, segment) for c in sent[phase]))


@dataclass(frozen=True)
class Ring:
    """This rank's place in the ring of `group`: group rank, size, and the global ranks of its
    neighbours (P2P ops address peers by global rank on every torch from 2.6 on)."""

    rank: int
    size: int
    right: int
    left: int
    group: object

    @classmethod
    def of(cls, group=None) -> Ring:
        group = group if group is not None else dist.group.WORLD
        rank, size = dist.get_rank(group), dist.get_world_size(group)
        if rank < 0:
            raise ValueError(f"global rank {dist.get_rank()} is not a member of the group it passed: "
                             "only the group's own ranks may call a collective on it")
        return cls(rank, size, dist.get_global_rank(group, (rank + 1) % size),
                   dist.get_global_rank(group, (rank - 1) % size), group)

    def exchange(self, send: torch.Tensor | None, recv: torch.Tensor | None) -> list:
        """Send `send` to the right and receive `recv` from the left, as one group."""
        ops = ([dist.P2POp(dist.isend, send, self.right, self.group)] if send is not None else []) + (
            [dist.P2POp(dist.irecv, recv, self.left, self.group)] if recv is not None else [])
        return dist.batch_isend_irecv(ops) if ops else []


def _wait(works, ring: Ring, what: str) -> None:
    """Wait for sends and receives; a peer that never arrives becomes a clear error."""
    try:
        for work in works:
            work.wait()
    except RuntimeError as error:
        raise RuntimeError(
            f"{what}: group rank {ring.rank} of {ring.size} failed while exchanging with its "
            f"neighbours (global ranks {ring.left} → me → {ring.right}). A peer did not reach this "
            "point: does every rank of the group call the same collectives in the same order, with "
            f"the same tensor size (check=True verifies that up front)? Cause: {error}") from error


def check_same_call(ring: Ring, signature: int, setting: int, device: torch.device, what: str,
                    setting_name: str = "segment_bytes") -> None:
    """Pass the running elementwise max of the ranks' check messages n-1 hops round the ring (32
    bytes a hop): after hop k a rank has heard from the k ranks on its left, so after n-1 hops
    every rank knows whether all agree, and they all raise together if not."""
    extremes = check_message(signature, setting, device)
    for _ in range(ring.size - 1):
        heard = torch.empty_like(extremes)
        _wait(ring.exchange(extremes, heard), ring, f"{what} (call check)")
        extremes = torch.maximum(extremes, heard)
    high, low = extremes[:2].tolist(), (-extremes[2:]).tolist()
    raise_unless_all_agree((signature, setting), tuple(high), tuple(low), f"group rank {ring.rank}",
                           what, setting_name)


def agree(ring: Ring, check: bool, what: str, local_checks: Callable[[], tuple[torch.Tensor, object]],
          segment_bytes: int):
    """Run this rank's own checks (`local_checks` returns the tensor that defines the call and the
    op); with `check`, then agree with the group on (length, dtype, op, segment_bytes), so that a
    fault on any rank, local or a mismatch, stops every rank with a clear error before any data
    moves. Returns the op."""
    try:
        if not (isinstance(segment_bytes, int) and segment_bytes >= 1):
            raise ValueError(f"segment_bytes={segment_bytes!r}: must be a positive int (bytes)")
        tensor, op = local_checks()
        signature, error = call_signature(tensor, op), None
    except (TypeError, ValueError) as local_error:
        tensor, op, signature, error = None, None, FAILED, local_error
    if check and ring.size > 1:
        check_same_call(ring, signature, segment_bytes if error is None else 0,
                        wire_device(ring.group, tensor), what)
    if error is not None:
        raise error
    return op


# ---------------------------------------------------------------- the two phases

def segments(t: torch.Tensor, segment_elements: int) -> list[torch.Tensor]:
    """`t` as consecutive views of at most `segment_elements` (an empty `t` is one empty view)."""
    return list(t.split(segment_elements)) if t.numel() else [t]


@dataclass
class Exchange:
    """One grouped step of a phase: `send` to the right, `recv` from the left (either may be
    None); `then` runs once both completed. `needs`: the exchange whose receive brings the data
    that `send` sends (-1: none)."""

    send: torch.Tensor | None
    recv: torch.Tensor | None
    then: Callable[[], object] | None
    needs: int
    label: str


def run_exchanges(ring: Ring, exchanges: list[Exchange], window: int) -> None:
    """Issue the exchanges in order, at most `window` in flight, completing them in order; an
    exchange is issued only once the one it `needs` has completed (and been folded)."""
    in_flight: deque = deque()

    def complete() -> None:
        exchange, works = in_flight.popleft()
        _wait(works, ring, exchange.label)
        if exchange.then is not None:
            exchange.then()

    for j, exchange in enumerate(exchanges):
        while j - len(in_flight) <= max(exchange.needs, j - window):  # j - len: done so far
            complete()
        in_flight.append((exchange, ring.exchange(exchange.send, exchange.recv)))
    while in_flight:
        complete()


def _reduce_scatter_phase(ring: Ring, local: list[torch.Tensor], partials: list[torch.Tensor], op,
                          segment_bytes: int, window: int = WINDOW) -> None:
    """n-1 steps. At step s the chunk arriving from the left is folded with our `local` copy into
    `partials[s]`, which travels on at step s+1; `partials[n-2]` ends as chunk `ring.rank` reduced
    over all ranks (divided by n for AVG). Segment by segment, at most `window` in flight."""
    n, r = ring.size, ring.rank
    segment = max(1, segment_bytes // local[0].element_size())
    fold = _FOLD[SUM if op == AVG else op]
    scratch = [torch.empty(min(segment, max(c.numel() for c in local)), dtype=local[0].dtype,
                           device=local[0].device) for _ in range(window)]
    exchanges: list[Exchange] = []
    arrived: dict[tuple[int, int], int] = {}  # (step, segment) → the exchange that received it
    for step in range(n - 1):
        sends = segments(local[reduce_scatter_chunks(r, 0, n)[0]] if step == 0 else partials[step - 1],
                         segment)
        folds = list(zip(segments(local[reduce_scatter_chunks(r, step, n)[1]], segment),
                         segments(partials[step], segment), strict=True))
        for k in range(max(len(sends), len(folds))):
            j, recv, then = len(exchanges), None, None
            if k < len(folds):  # fold what arrived with our piece: the partial over ranks c+1 … r
                local_piece, partial_piece = folds[k]
                recv = scratch[j % window][: local_piece.numel()]
                then = partial(fold, recv, local_piece, out=partial_piece)
                arrived[step, k] = j
            exchanges.append(Exchange(sends[k] if k < len(sends) else None, recv, then,
                                      arrived.get((step - 1, k), -1) if k < len(sends) else -1,
                                      f"ring reduce-scatter step {step + 1}/{n - 1}"))
    run_exchanges(ring, exchanges, window)
    if op == AVG:
        partials[-1].div_(n)


def _all_gather_phase(ring: Ring, chunks: list[torch.Tensor], segment_bytes: int,
                      window: int = WINDOW) -> None:
    """n-1 steps; `chunks[ring.rank]` must be complete, afterwards every chunk is. Each segment is
    received straight into its chunk's final place and forwarded at the next step."""
    n, r = ring.size, ring.rank
    segment = max(1, segment_bytes // chunks[0].element_size())
    exchanges: list[Exchange] = []
    arrived: dict[tuple[int, int], int] = {}  # (step, segment) → the exchange that received it
    for step in range(n - 1):
        sends = segments(chunks[all_gather_chunks(r, step, n)[0]], segment)
        recvs = segments(chunks[all_gather_chunks(r, step, n)[1]], segment)
        for k in range(max(len(sends), len(recvs))):
            if k < len(recvs):
                arrived[step, k] = len(exchanges)
            exchanges.append(Exchange(sends[k] if k < len(sends) else None,
                                      recvs[k] if k < len(recvs) else None, None,
                                      arrived.get((step - 1, k), -1) if k < len(sends) else -1,
                                      f"ring all-gather step {step + 1}/{n - 1}"))
    run_exchanges(ring, exchanges, window)


# ---------------------------------------------------------------- the collectives

@torch.no_grad()
def ring_all_reduce(tensor: torch.Tensor, op=SUM, group=None, async_op: bool = False,
                    check: bool = True, segment_bytes: int = SEGMENT_BYTES) -> CompletedWork | None:
    """In place, like `dist.all_reduce`: every rank ends with op over the ranks' tensors.
    Each rank sends 2(n-1)/n · S bytes in 2(n-1) steps (+ n-1 messages of 32 bytes with `check`).
    The reduce-scatter folds each arriving chunk into the tensor's own copy, which travels on."""
    ring = Ring.of(group)
    op = agree(ring, check, "ring_all_reduce", lambda: (tensor, validate(tensor, op)), segment_bytes)
    flat, n, r = tensor.view(-1), ring.size, ring.rank
    if n > 1:  # with one rank, SUM, AVG, MAX, MIN and PRODUCT of the tensor are the tensor
        chunks = list(flat.split(chunk_sizes(flat.numel(), n)))
        partials = [chunks[reduce_scatter_chunks(r, step, n)[1]] for step in range(n - 1)]
        _reduce_scatter_phase(ring, chunks, partials, op, segment_bytes)  # ends in chunks[r]
        _all_gather_phase(ring, chunks, segment_bytes)
    return CompletedWork() if async_op else None


def _check_chunk(chunk: torch.Tensor, whole: torch.Tensor, ring: Ring, role: str, whole_role: str) -> None:
    """`chunk` must be exactly this rank's chunk of `whole` (same dtype)."""
    expected = chunk_sizes(whole.numel(), ring.size)[ring.rank]
    if chunk.numel() != expected or chunk.dtype != whole.dtype:
        raise ValueError(f"{role} has {chunk.numel()} elements of {chunk.dtype}; group rank {ring.rank} "
                         f"of {ring.size} goes with chunk {ring.rank} of the {whole.numel()}-element "
                         f"{whole_role}: {expected} elements of {whole.dtype} (the layout is "
                         "chunk_sizes(L, n))")


@torch.no_grad()
def ring_reduce_scatter(output: torch.Tensor, input: torch.Tensor, op=SUM, group=None,
                        async_op: bool = False, check: bool = True,
                        segment_bytes: int = SEGMENT_BYTES) -> CompletedWork | None:
    """Like `dist.reduce_scatter_tensor(output, input, op, group)`, for any input length L:
    `output` (chunk_sizes(L, n)[r] elements) gets chunk r of op over the ranks' inputs. Each rank
    sends (n-1)/n · S bytes in n-1 steps. `input` stays unchanged: the partial reductions in
    transit need n-2 chunks of scratch."""
    ring = Ring.of(group)

    def local_checks():
        checked = validate(input, op, "input")
        validate(output, checked, "output")
        _check_chunk(output, input, ring, "output", "input")
        return input, checked

    op = agree(ring, check, "ring_reduce_scatter", local_checks, segment_bytes)
    flat, n, r = input.view(-1), ring.size, ring.rank
    sizes = chunk_sizes(flat.numel(), n)
    if n == 1:
        output.view(-1).copy_(flat)
    else:
        partials = [torch.empty(sizes[reduce_scatter_chunks(r, step, n)[1]], dtype=flat.dtype,
                                device=flat.device) for step in range(n - 2)] + [output.view(-1)]
        _reduce_scatter_phase(ring, list(flat.split(sizes)), partials, op, segment_bytes)
    return CompletedWork() if async_op else None


@torch.no_grad()
def ring_all_gather(output: torch.Tensor, input: torch.Tensor, group=None, async_op: bool = False,
                    check: bool = True, segment_bytes: int = SEGMENT_BYTES) -> CompletedWork | None:
    """Like `dist.all_gather_into_tensor(output, input, group)`, for any output length L: rank r's
    `input` (chunk_sizes(L, n)[r] elements) becomes chunk r of `output` on every rank. Each rank
    sends (n-1)/n · S bytes in n-1 steps."""
    ring = Ring.of(group)

    def local_checks():
        validate(input, name="input")
        validate(output, name="output")
        _check_chunk(input, output, ring, "input", "output")
        return output, None

    agree(ring, check, "ring_all_gather", local_checks, segment_bytes)
    flat, n, r = output.view(-1), ring.size, ring.rank
    chunks = list(flat.split(chunk_sizes(flat.numel(), n)))
    chunks[r].copy_(input.view(-1))
    if n > 1:
        _all_gather_phase(ring, chunks, segment_bytes)
    return CompletedWork() if async_op else None

