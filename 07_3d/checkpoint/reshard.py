"""Which elements of a global tensor a rank holds, and how the pieces of one mesh fill another's.

Every way the course shards a tensor is one shape of description, a *region*:

    region = elements [flat_start, flat_start + numel) of the row-major flattening of a *box*,
             the block of shape box_shape whose corner sits at `offsets` in a tensor of global_shape

    TP slice       wq rows [r·o/t, (r+1)·o/t):   box = those rows, the whole box (flat_start 0)
    FSDP shard     flat range of one unit's flat parameter that falls on this tensor: a flat range
                   of the (TP-local) box; FSDP over TP is a flat range of a TP box
    PP stage       the stage's tensors whole: box = the global tensor
    padding        a box may reach past the tensor's end (TP pads a vocab that t does not divide):
                   those elements belong to no one and are skipped

A flat range of a box is not a box, but it splits into at most 2·ndim − 1 *runs*, boxes whose
elements are contiguous in the region's storage (a partial first row, whole rows, a partial last
row, recursively), so any run is a `view` of a slice of the local 1-d tensor:

    shape (4, 5), range [3, 17):   row 0 cols 3..4 │ rows 1..2 whole │ row 3 cols 0..1
                                   . . . x x        x x x x x          x x . . .

Loading mesh B from mesh A's files is then, per tensor, for each target run and each source run:
copy their intersection (a box: per dim max of starts, min of ends), a slice of each side's view.
Depends only on torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, shape)


@dataclass(frozen=True)
class Run:
    """A box (global coordinates) stored contiguously from element `start` of the local tensor."""

    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    start: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Region:
    """Which elements of a global tensor a local 1-d run of `numel` elements holds (see above)."""

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    box_shape: tuple[int, ...]
    flat_start: int
    numel: int

    @classmethod
    def box(cls, global_shape, offsets, box_shape) -> Region:
        """A whole box: a TP slice, or the whole tensor when offsets are 0 and shapes equal."""
        return cls(tuple(global_shape), tuple(offsets), tuple(box_shape), 0, math.prod(box_shape))

    @classmethod
    def full(cls, global_shape) -> Region:
        return cls.box(global_shape, (0,) * len(global_shape), global_shape)

    def check(self) -> str | None:
        """What is wrong with this description, or None."""
        n = len(self.global_shape)
        if len(self.offsets) != n or len(self.box_shape) != n:
            return (f"offsets {list(self.offsets)} and box {list(self.box_shape)} must have "
                    f"{n} dims like global shape {list(self.global_shape)}")
        if any(o < 0 for o in self.offsets) or any(s < 0 for s in (*self.global_shape, *self.box_shape)):
            return f"negative offsets or sizes: offsets {list(self.offsets)}, box {list(self.box_shape)}"
        if self.flat_start < 0 or self.numel < 0 or self.flat_start + self.numel > math.prod(self.box_shape):
            return (f"flat range [{self.flat_start}, {self.flat_start + self.numel}) is outside "
                    f"the box {list(self.box_shape)} ({math.prod(self.box_shape)} elements)")
        return None

    def runs(self) -> list[Run]:
        """The contiguous boxes of this region in global coordinates (padding included: clip
        them with `valid_box`)."""
        return [Run(tuple(o + a for o, a in zip(self.offsets, offsets, strict=True)), shape,
                    start - self.flat_start)
                for offsets, shape, start in flat_runs(self.box_shape, self.flat_start,
                                                       self.flat_start + self.numel)]

    def valid_box(self, box: Box) -> Box | None:
        """`box` clipped to the global tensor (None: all padding)."""
        return intersect(box, ((0,) * len(self.global_shape), self.global_shape))

    def valid_numel(self) -> int:
        """Elements that lie inside the global tensor (the rest is padding)."""
        boxes = (self.valid_box((r.offsets, r.shape)) for r in self.runs())
        return sum(math.prod(b[1]) for b in boxes if b is not None)

    def to_json(self) -> dict:
        return {"offsets": list(self.offsets), "box_shape": list(self.box_shape),
                "flat_start": self.flat_start, "numel": self.numel}

    @classmethod
    def from_json(cls, global_shape, d: dict) -> Region:
        return cls(tuple(global_shape), tuple(d["offsets"]), tuple(d["box_shape"]),
                   int(d["flat_start"]), int(d["numel"]))


def flat_runs(shape: tuple[int, ...], a: int, b: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Split the flat range [a, b) of a row-major tensor of `shape` into boxes (offsets, shape,
    flat position of the box's first element); each box is contiguous in the flattening."""
    if a >= b:
        return []
    if not shape:
        return [((), (), 0)]
    inner = math.prod(shape[1:])
    rest = tuple(shape[1:])
    zeros = (0,) * len(rest)
    lo, hi = a // inner, b // inner  # first row touched, first row not reached in full
    if a % inner == 0 and b % inner == 0:
        return [((lo, *zeros), (hi - lo, *rest), a)]

    def sub(row: int, x: int, y: int):  # the range [x, y) inside one row
        return [((row, *o), (1, *s), row * inner + p) for o, s, p in flat_runs(rest, x, y)]

    if lo == hi:  # inside one row
        return sub(lo, a - lo * inner, b - lo * inner)
    out = []
    first_full = lo
    if a % inner:
        out += sub(lo, a - lo * inner, inner)
        first_full = lo + 1
    if hi > first_full:
        out.append(((first_full, *zeros), (hi - first_full, *rest), first_full * inner))
    if b % inner:
        out += sub(hi, 0, b - hi * inner)
    return out


def intersect(a: Box, b: Box) -> Box | None:
    """The overlap of two boxes, or None when they do not overlap."""
    starts = tuple(max(x, y) for x, y in zip(a[0], b[0], strict=True))
    ends = tuple(min(x + s, y + t) for x, s, y, t in zip(a[0], a[1], b[0], b[1], strict=True))
    if any(e <= s for s, e in zip(starts, ends, strict=True)):
        return None
    return starts, tuple(e - s for s, e in zip(starts, ends, strict=True))


def _view(flat: torch.Tensor, run: Run, box: Box) -> torch.Tensor:
    """The part `box` of `run` as a view of the local 1-d tensor `flat`."""
    whole = flat[run.start : run.start + run.numel].view(run.shape)
    index = tuple(slice(o - r, o - r + s) for o, s, r in zip(box[0], box[1], run.offsets, strict=True))
    return whole[index]


def _overlaps(a: Region, b: Region):
    """(run of a, run of b, shared box inside the global tensor) for every overlapping pair."""
    b_runs = b.runs()
    for ra in a.runs():
        for rb in b_runs:
            box = intersect((ra.offsets, ra.shape), (rb.offsets, rb.shape))
            box = box and a.valid_box(box)
            if box is not None:
                yield ra, rb, box


def overlap_numel(a: Region, b: Region) -> int:
    """Elements of the global tensor that two regions share."""
    return sum(math.prod(box[1]) for _, _, box in _overlaps(a, b))


def copy_overlap(dst: torch.Tensor, dst_region: Region, src: torch.Tensor, src_region: Region) -> int:
    """Copy the elements the two regions share from `src` into `dst` (both local 1-d tensors of
    their region's numel); returns how many were copied (casting to dst's dtype)."""
    copied = 0
    for rd, rs, box in _overlaps(dst_region, src_region):
        _view(dst, rd, box).copy_(_view(src, rs, box))
        copied += math.prod(box[1])
    return copied


def extract(full: torch.Tensor, region: Region) -> torch.Tensor:
    """The local 1-d tensor of `region` cut from the full tensor, written the naive way (pad the
    tensor to cover the box, take the box, flatten, slice): the reference the tests hold
    `copy_overlap` to. Padding elements are zero."""
    ends = [o + s for o, s in zip(region.offsets, region.box_shape, strict=True)]
    padded = full.new_zeros([max(e, g) for e, g in zip(ends, full.shape, strict=True)])
    padded[tuple(slice(0, g) for g in full.shape)] = full
    box = padded[tuple(slice(o, e) for o, e in zip(region.offsets, ends, strict=True))]
    return box.reshape(-1)[region.flat_start : region.flat_start + region.numel].clone()
