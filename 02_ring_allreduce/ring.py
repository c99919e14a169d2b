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

The plan is data: plan.py's `ring_exchanges` lists, per rank and phase, which segment goes out and
which comes in, group by group; the phases below run exactly that list, and `ring_plan` turns it
into every rank's P2P groups, which the suite replays under NCCL's rules and compares with what
real runs post.

Choices, each tested:
* Each exchange, one segment to the right and one from the left, is issued as one group with
  `dist.batch_isend_irecv`: NCCL needs a send and a receive that must progress together in one
  group (with n = 2 the left and right neighbours are the same peer, and two ungrouped calls on
  one communicator could each wait for the other). gloo runs the pair as two calls (its backend
  does not coalesce), so grouping costs gloo nothing by itself; what it must not do is make a rank
  wait for its sends: a rank waits only for its receives (in order) and for all its sends at the
  end of a phase, and the all-gather, whose receives land in their final place, keeps every
  exchange in flight that has its data.
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
  which nothing reads or sends until that receive has completed. On NCCL `wait()` only orders
  streams: the groups run in issue order on the communicator's stream, and each group waits for
  the compute stream's folds issued before it.
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
from .plan import Piece, chunk_sizes, ring_exchanges, segment_count
from .plan import all_gather_chunks as all_gather_chunks  # re-exported: the layout's home is plan.py
from .plan import chunk_bounds as chunk_bounds
from .plan import reduce_scatter_chunks as reduce_scatter_chunks

SEGMENT_BYTES = 2 << 20  # pipelining granularity: a chunk travels as segments of at most this
WINDOW = 2  # exchanges in flight per rank: two scratch buffers, alternating

# How each op folds a received partial chunk with our local copy: fn(received, local, out=...).
_FOLD = {SUM: torch.add, MAX: torch.maximum, MIN: torch.minimum, PRODUCT: torch.mul}


# ---------------------------------------------------------------- layout and schedule (pure)

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

@dataclass
class Exchange:
    """One group of a phase, on tensors: `send` to the right, `recv` from the left (either may be
    None); `then` runs once both completed; `needs`: the exchange whose receive brings the data
    that `send` sends (-1: none)."""

    send: torch.Tensor | None
    recv: torch.Tensor | None
    then: Callable[[], object] | None
    needs: int
    label: str


def run_exchanges(ring: Ring, exchanges: list[Exchange], window: int) -> None:
    """Issue the exchanges in order. Exchange j goes out only once the receives of exchange
    `needs` (its send's data) and of exchange j - `window` (the scratch buffer it reuses) have
    completed and been folded. Receives are completed in order; sends are waited for at the end:
    nothing writes a segment that was sent during the phase, and a fold that waited for its own
    send to drain would tie each rank to its right neighbour's pace as well as its left one's."""
    in_flight: deque = deque()  # (exchange, its receive's work or None), in issue order
    sends: list = []

    def complete() -> None:
        exchange, work = in_flight.popleft()
        if work is not None:
            _wait([work], ring, exchange.label)
        if exchange.then is not None:
            exchange.then()

    for j, exchange in enumerate(exchanges):
        while j - len(in_flight) <= max(exchange.needs, j - window):  # j - len: done so far
            complete()
        works = ring.exchange(exchange.send, exchange.recv)  # [send work][, receive work]
        sends += works[:1] if exchange.send is not None else []
        in_flight.append((exchange, works[-1] if exchange.recv is not None else None))
    while in_flight:
        complete()
    _wait(sends, ring, exchanges[-1].label if exchanges else "ring")


def _view(chunk: torch.Tensor, piece: Piece) -> torch.Tensor:
    return chunk[piece.start:piece.stop]


def _reduce_scatter_phase(ring: Ring, local: list[torch.Tensor], partials: list[torch.Tensor], op,
                          segment_bytes: int, window: int = WINDOW) -> None:
    """n-1 steps of `ring_exchanges("reduce_scatter", …)`. At step s the chunk arriving from the
    left is folded with our `local` copy into `partials[s]`, which travels on at step s+1;
    `partials[n-2]` ends as chunk `ring.rank` reduced over all ranks (divided by n for AVG).
    A received segment lands in one of `window` scratch buffers, in turn."""
    n = ring.size
    segment = max(1, segment_bytes // local[0].element_size())
    fold = _FOLD[SUM if op == AVG else op]
    scratch = [torch.empty(min(segment, max(c.numel() for c in local)), dtype=local[0].dtype,
                           device=local[0].device) for _ in range(window)]
    exchanges: list[Exchange] = []
    for j, e in enumerate(ring_exchanges("reduce_scatter", ring.rank, [c.numel() for c in local], segment)):
        recv = then = None
        if e.recv is not None:  # fold what arrived with our piece: the partial over ranks c+1 … r
            recv = scratch[j % window][: e.recv.numel]
            then = partial(fold, recv, _view(local[e.recv.chunk], e.recv),
                           out=_view(partials[e.step], e.recv))
        # step s sends on the chunk folded at step s-1 (partials[s-1]); step 0 our own copy
        source = local[e.send.chunk] if e.send is not None and e.step == 0 else partials[e.step - 1]
        send = None if e.send is None else _view(source, e.send)
        exchanges.append(Exchange(send, recv, then, e.needs, e.label(n)))
    run_exchanges(ring, exchanges, window)
    if op == AVG:
        partials[-1].div_(n)


def _all_gather_phase(ring: Ring, chunks: list[torch.Tensor], segment_bytes: int) -> None:
    """n-1 steps of `ring_exchanges("all_gather", …)`; `chunks[ring.rank]` must be complete,
    afterwards every chunk is. Each segment is received straight into its chunk's final place,
    which nothing reads until that receive completed, so no window bounds the exchanges in flight:
    only `needs` (a segment is sent on once it has arrived) holds an exchange back."""
    segment = max(1, segment_bytes // chunks[0].element_size())
    exchanges = [Exchange(None if e.send is None else _view(chunks[e.send.chunk], e.send),
                          None if e.recv is None else _view(chunks[e.recv.chunk], e.recv),
                          None, e.needs, e.label(ring.size))
                 for e in ring_exchanges("all_gather", ring.rank, [c.numel() for c in chunks], segment)]
    run_exchanges(ring, exchanges, max(1, len(exchanges)))


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

