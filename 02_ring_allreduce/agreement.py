"""Before any data moves: the checks each rank makes on its own arguments, and the signature of
a call that the ranks of a group agree on (chapter 02's ring and naive all-reduce share them).

A collective is matched across ranks only by the order of the calls. If one rank passes 5
elements and another 6, gloo aborts the receiving process ("Received data size doesn't match
expected size") and NCCL may hang; if one rank's own arguments are bad and it raises alone, its
peers wait forever. So each rank first runs `validate` on its own arguments, then (check=True) the
ranks exchange one small message that encodes the call,

    [signature, setting, -signature, -setting]     int64, 32 bytes; signature = (length, dtype, op)

(setting: the ring's segment_bytes, the naive all-reduce's root; FAILED when the rank's own checks
failed). The elementwise max over all ranks gives the group's highest and lowest of both: they
are equal iff every rank made the same call, and every rank raises together if not. Depends only
on torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist

SUM, AVG, MAX, MIN, PRODUCT = (dist.ReduceOp.SUM, dist.ReduceOp.AVG, dist.ReduceOp.MAX,
                               dist.ReduceOp.MIN, dist.ReduceOp.PRODUCT)
OP_NAMES = {SUM: "SUM", AVG: "AVG", MAX: "MAX", MIN: "MIN", PRODUCT: "PRODUCT"}
# The dtypes that gloo and NCCL both reduce; int16, bool and complex are rejected up front.
SUPPORTED_DTYPES = (torch.float64, torch.float32, torch.float16, torch.bfloat16,
                    torch.int64, torch.int32, torch.int8, torch.uint8)
CHECK_BYTES = 32  # the call check's message: [signature, setting, -signature, -setting] int64


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


FAILED = -1  # the signature of a rank whose own checks failed


def call_signature(tensor: torch.Tensor, op) -> int:
    """A number >= 0 encoding (length, dtype, op): equal on all ranks iff their calls agree."""
    op_index = list(OP_NAMES).index(op) + 1 if op is not None else 0
    return (tensor.numel() * 16 + SUPPORTED_DTYPES.index(tensor.dtype)) * 8 + op_index


def _describe(signature: tuple[int, int], setting_name: str) -> str:
    length, rest = divmod(signature[0], 128)
    dtype, op = divmod(rest, 8)
    return (f"length {length}, {SUPPORTED_DTYPES[dtype]}, op {(['-', *OP_NAMES.values()])[op]}, "
            f"{setting_name} {signature[1]}")


def raise_unless_all_agree(mine: tuple[int, int], high: tuple[int, int], low: tuple[int, int],
                           who: str, what: str, setting_name: str) -> None:
    """Given the group's highest and lowest (signature, setting), raise unless every rank sent
    `mine`. (A rank that sent FAILED raises its own error; this tells the others why they stop.)"""
    if mine[0] == FAILED:
        return
    if low[0] == FAILED:
        raise ValueError(f"{what}: another rank of the group rejected its arguments (its own error "
                         f"says why), so {who} stops too, before any data moved")
    if high != low:
        raise ValueError(
            f"{what}: the ranks of the group disagree on the call. {who} has "
            f"{_describe(mine, setting_name)}; across the group the calls range from "
            f"({_describe(low, setting_name)}) to ({_describe(high, setting_name)}). Every rank must "
            f"pass a tensor of the same length and dtype, and the same op and {setting_name}")


def wire_device(group, tensor) -> torch.device:
    """Where the check message lives: the tensor's device, or NCCL's current GPU."""
    if isinstance(tensor, torch.Tensor):
        return tensor.device
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_message(signature: int, setting: int, device: torch.device) -> torch.Tensor:
    """[signature, setting, -signature, -setting]: an elementwise max over ranks of these gives
    the group's highest and (negated) lowest of both."""
    return torch.tensor([signature, setting, -signature, -setting], dtype=torch.int64, device=device)


class CompletedWork:
    """What `async_op=True` returns: the ring already ran, so `wait()` returns at once."""

    def wait(self, timeout=None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class CheckOncePerShape:
    """`all_reduce` (ring or naive) with the call check only on the first call of each shape
    (length, dtype, op, group), for a caller whose calls repeat step after step, as DDP's buckets
    do. Every rank's first step still checks each of its buckets, so ranks whose buckets differ
    stop together at step one; afterwards each call saves n-1 messages. Every rank must use one."""

    def __init__(self, all_reduce: Callable):
        self.all_reduce, self.seen = all_reduce, set()
        self.__name__ = getattr(all_reduce, "__name__", type(self).__name__)

    def __call__(self, tensor: torch.Tensor, op=SUM, group=None, async_op: bool = False, **kwargs):
        key = (tensor.numel(), tensor.dtype, str(op), id(group))
        work = self.all_reduce(tensor, op=op, group=group, async_op=async_op,
                               check=key not in self.seen, **kwargs)
        self.seen.add(key)
        return work
