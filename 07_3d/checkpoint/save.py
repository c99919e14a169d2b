"""Sharded checkpoints: each rank writes only what it holds, atomically, checksummed, and any
mesh loads what any other mesh saved.

A rank describes what it holds as {name: Shard(local tensor, global shape, offsets[, box, flat
start])} (a `Region` of reshard.py: TP slices, FSDP flat-shard pieces, its pipeline stage's
tensors; optimizer state the same way) plus JSON training state. One save:

    root/step-00000100.tmp/   rank 0 makes it; each rank writes rank-0000r.bin (its pieces, raw
                              bytes, each with its crc32; a piece replicated on several ranks is
                              written once, by the lowest rank holding it); fsync
      gather                  every rank's pieces, checksums, per-rank state → rank 0 (barrier)
      metadata.json           rank 0: each tensor's global shape, dtype, which file holds which
                              region at which byte offset; file sizes and crc32s; state; fsync
    rename → root/step-00000100/   atomic; fsync root
    root/latest ← "step-00000100"   write latest.tmp, fsync, rename: the commit point

A crash anywhere before the last rename leaves `latest` naming the previous checkpoint, whose files
were never touched. Loading reads metadata.json, checks every file's size (a truncated file is
named before any byte is read), reads only the pieces that overlap what this rank asks for, checks
each piece's crc32, and copies the overlaps (reshard.copy_overlap). Every structural error is the
same one line on every rank before any collective; a checksum error found by one reader reaches
every rank through one all-gather at the end. Depends only on torch.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .reshard import Region, overlap_numel

FORMAT, VERSION = "parallel3d-checkpoint", 1
METADATA, LATEST = "metadata.json", "latest"
ALIGN = 64  # bytes: each piece starts on a cache line
STEP_DIR = re.compile(r"^step-(\d+)$")
MAX_PAIRWISE = 256  # pieces per tensor up to which a save proves they do not overlap
CRASH_ENV = "PFS_CKPT_CRASH"  # "RANK:POINT": that rank os._exit(1)s at POINT of a save (tests)


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be saved or loaded; the message is one line naming the file."""


@dataclass(frozen=True)
class Shard:
    """`tensor` holds `region` of a tensor of `global_shape`: the box at `offsets` of shape
    `box_shape` (default: tensor.shape), or with `flat_start` the 1-d range [flat_start,
    flat_start + numel) of that box's row-major flattening (an FSDP flat-shard piece)."""

    tensor: torch.Tensor
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    box_shape: tuple[int, ...] | None = None
    flat_start: int | None = None

    @property
    def region(self) -> Region:
        box = tuple(self.box_shape if self.box_shape is not None else self.tensor.shape)
        start = 0 if self.flat_start is None else self.flat_start
        return Region(tuple(self.global_shape), tuple(self.offsets), box, start, self.tensor.numel())


def as_shard(value) -> Shard:
    """A Shard, a (tensor, global_shape, offsets) tuple, or a whole tensor (replicated)."""
    if isinstance(value, Shard):
        return value
    if isinstance(value, torch.Tensor):
        return Shard(value, tuple(value.shape), (0,) * value.dim())
    return Shard(*value)


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


# --- files: durable writes ------------------------------------------------------------------

def fsync_dir(path: Path) -> None:
    """Make a directory's entries (a created or renamed file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: Path, data: bytes) -> None:
    """Write `path` so that a reader sees either the old file or the whole new one."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _crash_wanted(point: str, rank: int) -> bool:
    """Fault injection for the crash tests: PFS_CKPT_CRASH=RANK:POINT kills that rank there."""
    return os.environ.get(CRASH_ENV, "") == f"{rank}:{point}"


def _crash_point(point: str, rank: int) -> None:
    if _crash_wanted(point, rank):
        os._exit(17)


def _bytes(t: torch.Tensor):
    """A tensor's bytes as a buffer (no copy for a contiguous CPU tensor; any dtype)."""
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()


def _body_checksum(body: dict) -> int:
    return zlib.crc32(json.dumps(body, sort_keys=True).encode())


# --- process group helpers (None group: the default one; no process group: one rank) --------

def _rank_world(group) -> tuple[int, int]:
    if not dist.is_initialized():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def _all_gather(obj, group) -> list:
    if _rank_world(group)[1] == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def _gather0(obj, group) -> list | None:
    rank, world = _rank_world(group)
    if world == 1:
        return [obj]
    out = [None] * world if rank == 0 else None
    dst = dist.get_global_rank(group, 0) if group is not None else 0
    dist.gather_object(obj, out, dst=dst, group=group)
    return out


def _broadcast0(obj, group):
    if _rank_world(group)[1] == 1:
        return obj
    box = [obj]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _raise_first(errors: list[str | None]) -> None:
    for error in errors:
        if error:
            raise CheckpointError(error)


# --- save -----------------------------------------------------------------------------------

def describe_shards(shards: dict[str, Shard]) -> list[dict]:
    """This rank's pieces as plain data; raises CheckpointError on a bad description."""
    out = []
    for name, shard in shards.items():
        region = shard.region
        problem = region.check()
        if shard.flat_start is not None and shard.tensor.dim() != 1:
            problem = (f"a flat piece (flat_start={shard.flat_start}) must be 1-d, got "
                       f"{list(shard.tensor.shape)}")
        if problem:
            raise CheckpointError(f"cannot save {name!r}: {problem}")
        out.append({"name": name, "shape": list(region.global_shape),
                    "dtype": dtype_name(shard.tensor.dtype), **region.to_json()})
    return out


def plan_writes(plans: list[list[dict]]) -> tuple[dict[str, dict], list[list[int]]]:
    """From every rank's piece list: {name: {shape, dtype}} and, per rank, the indices of its
    pieces it writes (each distinct region once, by the lowest rank holding it). Checks that the
    ranks agree on shapes and dtypes and that each tensor's regions tile it exactly."""
    tensors: dict[str, dict] = {}
    regions: dict[str, list[Region]] = {}
    seen: set[tuple] = set()
    writes: list[list[int]] = []
    for rank, pieces in enumerate(plans):
        mine = []
        for i, p in enumerate(pieces):
            info = tensors.setdefault(p["name"], {"shape": p["shape"], "dtype": p["dtype"]})
            if (info["shape"], info["dtype"]) != (p["shape"], p["dtype"]):
                raise CheckpointError(
                    f"cannot save {p['name']!r}: rank {rank} holds it as {p['dtype']} {p['shape']}, "
                    f"another rank as {info['dtype']} {info['shape']}")
            region = Region.from_json(p["shape"], p)
            key = (p["name"], region)
            if key in seen:
                continue
            seen.add(key)
            mine.append(i)
            regions.setdefault(p["name"], []).append(region)
        writes.append(mine)
    for name, rs in regions.items():
        total, covered = math.prod(tensors[name]["shape"]), sum(r.valid_numel() for r in rs)
        # pairwise overlaps: O(pieces²), so only for the piece counts of a course-sized mesh
        shared = (sum(overlap_numel(a, b) for i, a in enumerate(rs) for b in rs[i + 1:])
                  if len(rs) <= MAX_PAIRWISE else 0)
        if covered != total or shared:
            raise CheckpointError(
                f"cannot save {name!r}: its pieces cover {covered - shared} of {total} elements "
                f"({shared} held twice in different pieces): the shard descriptions are wrong")
    return tensors, writes


def _write_file(path: Path, tensors: list[torch.Tensor], rank: int) -> tuple[list[dict], int, int]:
    """Write the pieces back to back (ALIGN-ed), fsync; (piece entries, size, crc32 of the file)."""
    entries, offset, file_crc = [], 0, 0
    with open(path, "wb") as f:
        for i, t in enumerate(tensors):
            pad = b"\0" * (-offset % ALIGN)
            f.write(pad)
            file_crc, offset = zlib.crc32(pad, file_crc), offset + len(pad)
            buf = _bytes(t)
            if i == len(tensors) // 2 and _crash_wanted("write", rank):
                f.write(buf[: len(buf) // 2])  # half a piece on disk, then the crash
                f.flush()
                os._exit(17)
            f.write(buf)
            crc = zlib.crc32(buf)
            entries.append({"offset": offset, "nbytes": len(buf), "crc32": crc})
            file_crc, offset = zlib.crc32(buf, file_crc), offset + len(buf)
        f.flush()
        os.fsync(f.fileno())
    return entries, offset, file_crc


def save_checkpoint(root: str | Path, step: int, shards: dict, state: dict | None = None, *,
                    config: dict | None = None, rank_state: dict | None = None, group=None,
                    keep: int | None = None) -> Path:
    """Save this rank's `shards` ({name: Shard | (tensor, global_shape, offsets)}) as checkpoint
    `step` under `root`; every rank of `group` calls it. `state` (JSON, rank 0's is kept): step,
    data position, LR schedule, ...; `rank_state` (JSON, one per rank): RNG states; `config`
    (JSON): what a loader must match. `keep`: delete all but the newest `keep` checkpoints after
    the commit. Returns the checkpoint directory."""
    rank, world = _rank_world(group)
    root = Path(root)
    name = step_dir_name(step)
    final, tmp = root / name, root / (name + ".tmp")
    shards = {k: as_shard(v) for k, v in shards.items()}
    error, pieces = None, []
    try:
        if final.exists() and _read_latest(root) == name:
            raise CheckpointError(f"{final} is the latest checkpoint; refusing to overwrite it "
                                  "(save a later step)")
        pieces = describe_shards(shards)
        if rank == 0:  # before the first collective, so the directory exists when ranks write
            root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)  # left by a crashed save of this step
            tmp.mkdir()
    except (CheckpointError, OSError) as e:
        error = str(e) if isinstance(e, CheckpointError) else f"cannot create {tmp}: {e}"
    plans = _all_gather({"pieces": pieces, "error": error}, group)
    _raise_first([p["error"] for p in plans])
    tensors, writes = plan_writes([p["pieces"] for p in plans])
    _crash_point("plan", rank)

    values = list(shards.values())
    mine = [pieces[i] for i in writes[rank]]
    file = f"rank-{rank:05d}.bin"
    result = {"file": file, "pieces": mine, "rank_state": rank_state, "error": None}
    try:
        if mine:
            entries, size, crc = _write_file(tmp / file, [values[i].tensor for i in writes[rank]], rank)
            for p, e in zip(mine, entries, strict=True):
                p.update(e, file=file)
            result.update(bytes=size, crc32=crc)
    except OSError as e:
        result["error"] = f"rank {rank} could not write {tmp / file}: {e}"
    _crash_point("gather", rank)
    results = _gather0(result, group)  # the barrier: every rank has finished writing

    verdict = None
    if rank == 0:
        try:
            _raise_first([r["error"] for r in results])
            _commit(root, name, tmp, final, results, tensors, step, world, state, config, keep)
        except (CheckpointError, OSError) as e:
            verdict = str(e)
    verdict = _broadcast0(verdict, group)
    if verdict:
        raise CheckpointError(verdict)
    return final


def _commit(root: Path, name: str, tmp: Path, final: Path, results: list[dict], tensors: dict,
            step: int, world: int, state, config, keep) -> None:
    """Rank 0, after every rank wrote: metadata, fsync, rename, move `latest`, prune."""
    for r in results:
        for p in r["pieces"]:
            piece = {k: p[k] for k in ("file", "offset", "nbytes", "crc32", "offsets", "box_shape",
                                        "flat_start", "numel")}
            tensors[p["name"]].setdefault("pieces", []).append(piece)
    body = {"format": FORMAT, "version": VERSION, "step": step, "world_size": world,
            "config": config, "state": state, "tensors": tensors,
            "files": {r["file"]: {"bytes": r["bytes"], "crc32": r["crc32"]}
                      for r in results if r["pieces"]},
            "ranks": [r["rank_state"] for r in results]}
    meta = json.dumps({**body, "checksum": _body_checksum(body)}, separators=(",", ":")).encode()
    with open(tmp / METADATA, "wb") as f:
        f.write(meta)
        f.flush()
        os.fsync(f.fileno())
    fsync_dir(tmp)
    _crash_point("rename", 0)
    aside = None
    if final.exists():  # an older save of this step that was never committed (latest is elsewhere)
        aside = root / (name + ".old")
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
    os.rename(tmp, final)
    fsync_dir(root)
    _crash_point("latest", 0)
    write_atomic(root / LATEST, (name + "\n").encode())
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    for debris in root.glob("step-*.tmp"):  # crashed saves (saves are collective: none is running)
        shutil.rmtree(debris, ignore_errors=True)
    if keep:
        for old in list_checkpoints(root)[:-keep]:
            if old != name:
                shutil.rmtree(root / old, ignore_errors=True)


# --- find a checkpoint ----------------------------------------------------------------------

def _read_latest(root: Path) -> str | None:
    try:
        return (root / LATEST).read_text().strip() or None
    except OSError:
        return None


def list_checkpoints(root: str | Path) -> list[str]:
    """Committed-looking step directories under `root`, oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    names = [p.name for p in root.iterdir() if p.is_dir() and STEP_DIR.match(p.name)]
    return sorted(names, key=lambda n: int(STEP_DIR.match(n).group(1)))
