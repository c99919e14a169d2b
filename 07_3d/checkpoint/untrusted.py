"""A checkpoint is untrusted input: check everything metadata.json says before a byte is read.

Checkpoints are shared and downloaded, and a checksum is not a signature (anyone who edits
metadata.json can recompute it). So before a load reads any shard, every name and number the
metadata gives is checked against the directory it came from and against itself:

    names     each shard file is a plain file name inside the step directory (no absolute
              path, no `..`, no separator, no symlink); `latest` names a step directory
              (step-N) of its own root, itself no symlink
    schema    step, world size, files, tensors and pieces have the types and signs they must
    dtypes    one of DTYPES (never `getattr(torch, name)` on an arbitrary name: torch.load is one)
    pieces    each in a listed file, nbytes = numel · itemsize, [offset, offset + nbytes) inside
              the file's recorded size (which check_files compares with the file on disk), its
              box inside the tensor's shape and its flat range inside its box

Each check raises CheckpointError with one line naming the file, the field and the value. The
checks read only metadata.json and the directory's entries, so every rank reaches the same
verdict with no collective. Depends only on torch.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from .save import METADATA, STEP_DIR, CheckpointError

DTYPES: dict[str, torch.dtype] = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.bool)}


def dtype_of(name: object, where: str) -> torch.dtype:
    """The torch dtype a metadata dtype name stands for; anything else is refused."""
    if not isinstance(name, str) or name not in DTYPES:
        raise CheckpointError(f"{where}: dtype {name!r} is not one of {', '.join(DTYPES)}")
    return DTYPES[name]


def member(directory: Path, name: object, what: str = "shard file") -> Path:
    """`directory / name` when `name` is a plain file name of an entry inside `directory`."""
    where = f"{directory / METADATA}"
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\\" in name \
            or "\0" in name or Path(name).is_absolute():
        raise CheckpointError(f"{where} names {what} {name!r}: a checkpoint's files must be plain names "
                              "inside its own directory (no path, no '..')")
    path = directory / name
    if path.is_symlink() or (path.exists() and path.resolve().parent != directory.resolve()):
        raise CheckpointError(f"{where} names {what} {name!r}, a link out of {directory}: refused")
    return path


def latest_target(root: Path, latest: str) -> Path:
    """The step directory `root/latest` names, when it is a step-N directory of `root` itself."""
    if not STEP_DIR.match(latest):
        raise CheckpointError(f"{root / 'latest'} names {latest!r}, not a step-N directory of {root}: "
                              "refused")
    target = root / latest
    if target.is_symlink():
        raise CheckpointError(f"{root / 'latest'} names {latest}, a link: refused (a checkpoint's "
                              "directories must be inside its root)")
    return target


def _int(value: object, where: str, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise CheckpointError(f"{where} is {value!r}: an integer >= {minimum} is expected")
    return value


def _ints(value: object, where: str, length: int | None = None) -> list[int]:
    if not isinstance(value, list) or (length is not None and len(value) != length):
        want = f"a list of {length} integers" if length is not None else "a list of integers"
        raise CheckpointError(f"{where} is {value!r}: {want} is expected")
    return [_int(v, where) for v in value]


def check_metadata(directory: Path, meta: dict) -> None:
    """Every name and number of `meta` (metadata.json of `directory`) is what a save writes."""
    where = str(directory / METADATA)
    _int(meta.get("step"), f"{where}: step")
    _int(meta.get("world_size"), f"{where}: world_size", 1)
    files, tensors = meta.get("files"), meta.get("tensors")
    if not isinstance(files, dict) or not isinstance(tensors, dict):
        raise CheckpointError(f"{where}: 'files' and 'tensors' must be objects")
    sizes = {}
    for name, info in files.items():
        member(directory, name)
        if not isinstance(info, dict):
            raise CheckpointError(f"{where}: file {name!r} has no size and checksum")
        sizes[name] = _int(info.get("bytes"), f"{where}: file {name!r} bytes")
        _int(info.get("crc32"), f"{where}: file {name!r} crc32")
    for tname, info in tensors.items():
        at = f"{where}: tensor {tname!r}"
        if not isinstance(info, dict):
            raise CheckpointError(f"{at} is not an object")
        itemsize = dtype_of(info.get("dtype"), at).itemsize
        shape = _ints(info.get("shape"), f"{at} shape")
        pieces = info.get("pieces", [])
        if not isinstance(pieces, list):
            raise CheckpointError(f"{at}: pieces must be a list")
        for p in pieces:
            _check_piece(p, at, shape, itemsize, sizes)


def _check_piece(p: object, at: str, shape: list[int], itemsize: int, sizes: dict[str, int]) -> None:
    if not isinstance(p, dict):
        raise CheckpointError(f"{at}: a piece is not an object")
    if p.get("file") not in sizes:
        raise CheckpointError(f"{at}: a piece is in {p.get('file')!r}, which 'files' does not list")
    offset, nbytes, numel = (_int(p.get(k), f"{at} piece {k}") for k in ("offset", "nbytes", "numel"))
    start = _int(p.get("flat_start"), f"{at} piece flat_start")
    _int(p.get("crc32"), f"{at} piece crc32")
    offsets = _ints(p.get("offsets"), f"{at} piece offsets", len(shape))
    box = _ints(p.get("box_shape"), f"{at} piece box_shape", len(shape))
    if nbytes != numel * itemsize:
        raise CheckpointError(f"{at}: a piece of {numel} elements says {nbytes} bytes "
                              f"({numel * itemsize} at {itemsize} bytes each)")
    if offset + nbytes > sizes[p["file"]]:
        raise CheckpointError(f"{at}: a piece at bytes [{offset}, {offset + nbytes}) runs past the end "
                              f"of {p['file']} ({sizes[p['file']]} bytes)")
    if any(o + b > s for o, b, s in zip(offsets, box, shape, strict=True)):
        raise CheckpointError(f"{at}: a piece's box {box} at {offsets} runs past the shape {shape}")
    if start + numel > math.prod(box):
        raise CheckpointError(f"{at}: a piece's flat range [{start}, {start + numel}) is outside its "
                              f"box {box}")
