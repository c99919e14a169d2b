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

which stays below 2S whatever n is: more ranks add steps (latency), not traffic per rank. That is
why the ring is called bandwidth-optimal. Same call shape as `dist.all_reduce(tensor, op, group)`.

Pipelining: a chunk travels as segments of at most `segment_bytes`, and a segment moves on as soon
as it has arrived (and, in the reduce-scatter, been folded in), without waiting for the rest of its
chunk: the steps overlap like a bucket brigade, and folding one segment overlaps the transfer of the
next. A chunk that fits in one segment is one message, so a small tensor costs 2(n-1) messages.

Choices, each tested:
* AVG never travels on the wire (gloo on torch 2.5-2.8 mishandles it): SUM, then divide by n.
  AVG of an integer tensor raises, as torch's own gloo all_reduce does.
* `check=True` (the default) first passes a 16-byte signature (length, dtype, op; or "my own
  arguments are wrong") n-1 hops round the ring, so that every rank knows whether all agree before
  any data moves: a mismatch, or a bad argument on one rank only, is then an error on every rank
  instead of a crashed peer (gloo aborts the process on a size mismatch) or a hang. It costs n-1
  extra messages and 16·(n-1) bytes per rank, which the comm meter shows. Without it a local
  fault raises at once, before any communication, on the rank that has it.
* A received segment lands in a scratch buffer that no pending operation references (two of them,
  alternating: the next segment arrives in one while the other is folded; a buffer is reused only
  after its segment was folded), and is folded into our chunk after the receive completed. The
  all-gather receives straight into the chunk's final place, which nothing reads or sends until
  that receive has completed.
* The ring runs synchronously; `async_op=True` returns an already-completed handle, so a DDP that
  uses it does not overlap communication with backward.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

SUM, AVG, MAX, MIN, PRODUCT = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX,
                               dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT)
OP_NAMES = {SUM: "SUM", AVG: "AVG", MAX: "MAX", MIN: "MIN", PRODUCT: "PRODUCT"}
# The dtypes that gloo and NCCL both reduce; int16, bool and complex are rejected up front.
SUPPORTED_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16,
                    torch.int64, torch.int32, torch.int8, torch.uint8)
SEGMENT_BYTES = 2 << 20  # pipelining granularity: a chunk travels as segments of at most this
WINDOW = 2  # reduce-scatter segments in flight per rank: two scratch buffers, alternating

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


# ---------------------------------------------------------------- checks before communicating

def validate(tensor: torch.Tensor, op=SUM, name: str = "tensor"):
    """The local checks every rank makes before it sends anything; returns the op as one of
    OP_NAMES' keys."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dtype not in SUPPORTED_DTYPES:
        hint = {torch.bool: "cast it to torch.uint8 (then MAX is any, MIN is all)",
                torch.int16: "cast it to torch.int32"}.get(
            tensor.dtype, "view a complex tensor as real with torch.view_as_real (SUM/AVG only)")
        raise TypeError(f"{name} has dtype {tensor.dtype}, which gloo and NCCL cannot both reduce: "
                        f"{hint}. Supported: {', '.join(str(d) for d in SUPPORTED_DTYPES)}")
    matches = [known for known in OP_NAMES if op is known or _same_op(op, known)]
    if not matches:
        raise ValueError(f"op={op!r} is not supported: use dist.ReduceOp."
                         f"{', dist.ReduceOp.'.join(OP_NAMES.values())}")
    op = matches[0]
    if op == AVG and not tensor.is_floating_point():
        raise TypeError(f"op=AVG of an integer tensor ({tensor.dtype}) is ambiguous (floor or true "
                        "division?), and torch's own gloo all_reduce rejects it: use SUM and divide "
                        "as you mean to")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} is not contiguous (shape {tuple(tensor.shape)}, strides "
                         f"{tensor.stride()}): pass t.contiguous() and copy the result back")
    return op


def _same_op(op, known) -> bool:
    try:
        return bool(op == known)
    except (TypeError, ValueError):
        return False


@dataclass(frozen=True)
class Ring:
    """This rank's place in the ring of `group`: group rank, size, and the global ranks of its
    neighbours (isend/irecv address peers by global rank on every torch from 2.6 on)."""

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

    def send(self, t: torch.Tensor):
        return dist.isend(t, self.right, group=self.group)

    def recv(self, t: torch.Tensor):
        return dist.irecv(t, self.left, group=self.group)


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


FAILED = -1  # the signature of a rank whose own checks failed


def call_signature(tensor: torch.Tensor, op) -> int:
    """A number >= 0 encoding (length, dtype, op): equal on all ranks iff their calls agree."""
    op_index = list(OP_NAMES).index(op) + 1 if op is not None else 0
    return (tensor.numel() * 16 + SUPPORTED_DTYPES.index(tensor.dtype)) * 8 + op_index


def _describe(signature: int) -> str:
    length, rest = divmod(signature, 128)
    dtype, op = divmod(rest, 8)
    return f"length {length}, {SUPPORTED_DTYPES[dtype]}, op {(['-', *OP_NAMES.values()])[op]}"


def raise_unless_all_agree(mine: int, high: int, low: int, who: str, what: str) -> None:
    """Given the group's highest and lowest signatures, raise unless every rank sent `mine`.
    (A rank that sent FAILED raises its own error; this tells the others why they stop.)"""
    if mine == FAILED:
        return
    if low == FAILED:
        raise ValueError(f"{what}: another rank of the group rejected its arguments (its own error "
                         f"says why), so {who} stops too, before any data moved")
    if high != low:
        raise ValueError(
            f"{what}: the ranks of the group disagree on the call. {who} has {_describe(mine)}; "
            f"across the group the calls range from ({_describe(low)}) to ({_describe(high)}). "
            "Every rank must pass a tensor of the same length and dtype, and the same op")


def wire_device(group, tensor) -> torch.device:
    """Where the 16-byte check message lives: the tensor's device, or NCCL's current GPU."""
    if isinstance(tensor, torch.Tensor):
        return tensor.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_same_call(ring: Ring, signature: int, device: torch.device, what: str) -> None:
    """Pass the running [max, -min] of the ranks' signatures n-1 hops round the ring (16 bytes a
    hop): after hop k a rank has heard from the k ranks on its left, so after n-1 hops every rank
    knows whether all agree, and they all raise together if not."""
    extremes = torch.tensor([signature, -signature], dtype=torch.int64, device=device)
    for _ in range(ring.size - 1):
        heard = torch.empty_like(extremes)
        _wait([ring.send(extremes), ring.recv(heard)], ring, f"{what} (call check)")
        extremes = torch.maximum(extremes, heard)
    raise_unless_all_agree(signature, int(extremes[0]), -int(extremes[1]),
                           f"group rank {ring.rank}", what)


def agree(ring: Ring, check: bool, what: str, local_checks: Callable[[], tuple[torch.Tensor, object]]):
    """Run this rank's own checks (`local_checks` returns the tensor that defines the call and the
    op); with `check`, then agree with the group, so that a fault on any rank, local or a mismatch,
    stops every rank with a clear error before any data moves. Returns the op."""
    try:
        tensor, op = local_checks()
        signature, error = call_signature(tensor, op), None
    except (TypeError, ValueError) as local_error:
        tensor, op, signature, error = None, None, FAILED, local_error
    if check and ring.size > 1:
        check_same_call(ring, signature, wire_device(ring.group, tensor), what)
    if error is not None:
        raise error
    return op


class CompletedWork:
    """What `async_op=True` returns: the ring already ran, so `wait()` returns at once."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


# ---------------------------------------------------------------- the two phases

def segments(t: torch.Tensor, segment_elements: int) -> list[torch.Tensor]:
    """`t` as consecutive views of at most `segment_elements` (an empty `t` is one empty view)."""
    return list(t.split(segment_elements)) if t.numel() else [t]


def _reduce_scatter_phase(ring: Ring, local: list[torch.Tensor], partial: list[torch.Tensor], op,
                          segment_bytes: int, window: int = WINDOW) -> None:
    """n-1 steps. At step s the chunk arriving from the left is folded with our `local` copy into
    `partial[s]`, which travels on at step s+1; `partial[n-2]` ends as chunk `ring.rank` reduced
    over all ranks (divided by n for AVG). Segment by segment, at most `window` in flight."""
    n, r = ring.size, ring.rank
    segment = max(1, segment_bytes // local[0].element_size())
    fold = _FOLD[SUM if op == AVG else op]
    # What arrives from the left, in order: (step, our local piece, where the fold goes).
    arrivals = [(step, local_piece, partial_piece)
                for step in range(n - 1)
                for local_piece, partial_piece in zip(
                    segments(local[reduce_scatter_chunks(r, step, n)[1]], segment),
                    segments(partial[step], segment), strict=True)]
    scratch = [torch.empty(min(segment, max(c.numel() for c in local)), dtype=local[0].dtype,
                           device=local[0].device) for _ in range(min(window, len(arrivals)))]

    def post_recv(i: int):
        buffer = scratch[i % len(scratch)][: arrivals[i][1].numel()]
        return buffer, ring.recv(buffer)

    what = "ring reduce-scatter"
    sends = [ring.send(piece) for piece in segments(local[reduce_scatter_chunks(r, 0, n)[0]], segment)]
    in_flight = deque(post_recv(i) for i in range(len(scratch)))
    for i, (step, local_piece, partial_piece) in enumerate(arrivals):
        buffer, work = in_flight.popleft()
        _wait([work], ring, f"{what} step {step + 1}/{n - 1}")
        fold(buffer, local_piece, out=partial_piece)  # partial reduction over ranks c+1 … r
        if step < n - 2:
            sends.append(ring.send(partial_piece))  # … travels on at the next step
        if i + len(scratch) < len(arrivals):
            in_flight.append(post_recv(i + len(scratch)))  # reuses the buffer just folded
    _wait(sends, ring, what)
    if op == AVG:
        partial[-1].div_(n)


def _all_gather_phase(ring: Ring, chunks: list[torch.Tensor], segment_bytes: int) -> None:
    """n-1 steps; `chunks[ring.rank]` must be complete, afterwards every chunk is. Every receive
    is posted at once, straight into the chunk's final place, and forwarded as it lands."""
    n, r = ring.size, ring.rank
    segment = max(1, segment_bytes // chunks[0].element_size())
    arrivals = [(step, piece) for step in range(n - 1)
                for piece in segments(chunks[all_gather_chunks(r, step, n)[1]], segment)]
    sends = [ring.send(piece) for piece in segments(chunks[all_gather_chunks(r, 0, n)[0]], segment)]
    receives = [ring.recv(piece) for _, piece in arrivals]
    for (step, piece), work in zip(arrivals, receives, strict=True):
        _wait([work], ring, f"ring all-gather step {step + 1}/{n - 1}")
        if step < n - 2:
            sends.append(ring.send(piece))  # the chunk we received at step s is sent at step s+1
    _wait(sends, ring, "ring all-gather")


# ---------------------------------------------------------------- the collectives

@torch.no_grad()
def ring_all_reduce(tensor: torch.Tensor, op=SUM, group=None, async_op: bool = False,
                    check: bool = True, segment_bytes: int = SEGMENT_BYTES) -> CompletedWork | None:
    """In place, like `dist.all_reduce`: every rank ends with op over the ranks' tensors.
    Each rank sends 2(n-1)/n · S bytes in 2(n-1) steps (+ n-1 messages of 16 bytes with `check`).
    The reduce-scatter folds each arriving chunk into the tensor's own copy, which travels on."""
    ring = Ring.of(group)
    op = agree(ring, check, "ring_all_reduce", lambda: (tensor, validate(tensor, op)))
    flat, n, r = tensor.view(-1), ring.size, ring.rank
    if n > 1:  # with one rank, SUM, AVG, MAX, MIN and PRODUCT of the tensor are the tensor
        chunks = list(flat.split(chunk_sizes(flat.numel(), n)))
        partial = [chunks[reduce_scatter_chunks(r, step, n)[1]] for step in range(n - 1)]
        _reduce_scatter_phase(ring, chunks, partial, op, segment_bytes)  # ends in chunks[r]
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

    op = agree(ring, check, "ring_reduce_scatter", local_checks)
    flat, n, r = input.view(-1), ring.size, ring.rank
    sizes = chunk_sizes(flat.numel(), n)
    if n == 1:
        output.view(-1).copy_(flat)
    else:
        partial = [torch.empty(sizes[reduce_scatter_chunks(r, step, n)[1]], dtype=flat.dtype,
                               device=flat.device) for step in range(n - 2)] + [output.view(-1)]
        _reduce_scatter_phase(ring, list(flat.split(sizes)), partial, op, segment_bytes)
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

    agree(ring, check, "ring_all_gather", local_checks)
    flat, n, r = output.view(-1), ring.size, ring.rank
    chunks = list(flat.split(chunk_sizes(flat.numel(), n)))
    chunks[r].copy_(input.view(-1))
    if n > 1:
        _all_gather_phase(ring, chunks, segment_bytes)
    return CompletedWork() if async_op else None
