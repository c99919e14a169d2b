"""Loading a sharded checkpoint into any mesh: find it, check it, read only what overlaps.

    resolve     root/latest → root/step-N (or step-N itself); each way it is not a committed
                checkpoint (missing, empty, partial, mid-write) is one line naming the path
    check       metadata.json's own checksum and format; every name and number in it, as
                untrusted input (untrusted.py: files inside the directory, real dtypes, pieces
                inside their files and tensors); the model config the caller expects; every
                listed file present at its recorded size (a truncated file is named here)
    plan        per requested tensor: its global shape must match and its dtype be castable; the
                saved pieces whose region overlaps the requested one must cover it
    read        each needed piece: seek, read its bytes, check its crc32, copy the overlap
                (a piece equal to the request is read straight into the target's memory)

The first three steps read only metadata and file sizes, so every rank reaches the same verdict
with no collective; a checksum failure is seen by the rank that read the piece, and one
all-gather at the end makes every rank raise it. Depends only on torch.
"""

from __future__ import annotations

import json
import zlib
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .reshard import Region, copy_overlap, overlap_numel
from .save import (
    FORMAT,
    LATEST,
    METADATA,
    STEP_DIR,
    VERSION,
    CheckpointError,
    Shard,
    _all_gather,
    _body_checksum,
    _raise_first,
    _rank_world,
    _read_latest,
    as_shard,
    list_checkpoints,
)
from .untrusted import check_metadata, dtype_of, latest_target, member


@dataclass
class Loaded:
    """What a load returns besides the tensors it filled."""

    path: Path
    step: int
    state: dict | None  # the training state rank 0 saved
    rank_state: dict | None  # this rank's own saved state (RNG), when the world size matches
    metadata: dict


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint directory from `path`: the directory itself when it holds metadata.json, else
    the one its `latest` names. Raises one line for each way it is not a complete checkpoint."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint directory {path} does not exist")
    if not path.is_dir():
        raise CheckpointError(f"{path} is a file, not a checkpoint directory")
    if path.name.endswith(".tmp"):
        raise CheckpointError(f"{path} is a save that never finished (a crashed run's temporary "
                              f"directory): load {path.parent} or one of its step-* directories")
    if (path / METADATA).exists():
        return path
    latest = _read_latest(path)
    if latest is not None:
        target = latest_target(path, latest)
        if not target.is_dir():
            raise CheckpointError(f"{path / LATEST} names {latest}, which does not exist")
        if not (target / METADATA).exists():
            raise CheckpointError(f"{target} is partial: it has no {METADATA}")
        return target
    entries = sorted(p.name for p in path.iterdir())
    steps = list_checkpoints(path)
    if not entries:
        raise CheckpointError(f"checkpoint directory {path} is empty: nothing was saved there")
    if steps:
        raise CheckpointError(f"{path} has no {LATEST} pointer, so no save was committed; its "
                              f"step directories ({', '.join(steps)}) may be incomplete: pass one "
                              "explicitly to load it")
    unfinished = [e for e in entries if e.endswith(".tmp")]
    if unfinished:
        raise CheckpointError(f"{path} holds only a save that never finished "
                              f"({', '.join(unfinished)}): no complete checkpoint")
    if STEP_DIR.match(path.name):
        raise CheckpointError(f"{path} is partial: it has no {METADATA}")
    raise CheckpointError(f"{path} holds no checkpoint (no {LATEST} and no {METADATA})")


def read_metadata(directory: Path) -> dict:
    """metadata.json, checked against its own checksum, format and version."""
    file = directory / METADATA
    try:
        meta = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"{file} is unreadable or corrupt: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CheckpointError(f"{file} is not a {FORMAT} metadata file")
    if meta.get("version") != VERSION:
        raise CheckpointError(f"{file} has format version {meta.get('version')}; this code reads "
                              f"version {VERSION}")
    checksum = meta.pop("checksum", None)
    if checksum != _body_checksum(meta):
        raise CheckpointError(f"{file} is corrupt: its checksum does not match its contents")
    return meta


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def check_config(directory: Path, meta: dict, config: dict | None) -> None:
    """The caller's config (JSON) must equal the saved one; the error names each difference."""
    if config is None:
        return
    saved, wanted = _flat(meta.get("config") or {}), _flat(json.loads(json.dumps(config)))
    diffs = [f"{k} {saved.get(k)!r} != {wanted.get(k)!r}" for k in sorted(set(saved) | set(wanted))
             if saved.get(k) != wanted.get(k)]
    if diffs:
        raise CheckpointError(f"{directory / METADATA} is a checkpoint of another model config "
                              f"(saved != this run: {', '.join(diffs)})")


def check_files(directory: Path, meta: dict) -> None:
    """Every shard file listed is there, at the size recorded (catches a missing or truncated file)."""
    for name, info in meta["files"].items():
        path = member(directory, name)
        if not path.is_file():
            raise CheckpointError(f"shard file {path} is missing (listed in {METADATA})")
        size = path.stat().st_size
        if size != info["bytes"]:
            raise CheckpointError(f"shard file {path} is truncated or damaged: {size} bytes, "
                                  f"{METADATA} says {info['bytes']}")


def plan_reads(directory: Path, meta: dict, targets: dict[str, Shard]) -> list[tuple]:
    """(name, target shard, pieces to read) per target; checks names, shapes and coverage."""
    reads = []
    for name, shard in targets.items():
        info = meta["tensors"].get(name)
        if info is None:
            raise CheckpointError(f"{directory / METADATA} has no tensor {name!r} (it holds "
                                  f"{len(meta['tensors'])} others)")
        region = shard.region
        if list(region.global_shape) != info["shape"]:
            raise CheckpointError(f"{directory / METADATA}: {name!r} has shape {info['shape']}, this "
                                  f"run asks for {list(region.global_shape)}")
        if (problem := region.check()) is not None:
            raise CheckpointError(f"cannot load {name!r}: {problem}")
        saved = dtype_of(info["dtype"], f"{directory / METADATA}: {name!r}")
        if saved.is_floating_point != shard.tensor.dtype.is_floating_point:
            raise CheckpointError(f"{directory / METADATA}: {name!r} is saved as {saved}, this run asks "
                                  f"for {shard.tensor.dtype}: not the same kind of number")
        pieces, covered = [], 0
        for p in info["pieces"]:
            shared = overlap_numel(region, Region.from_json(info["shape"], p))
            if shared:
                pieces.append(p)
                covered += shared
        if covered != region.valid_numel():
            raise CheckpointError(f"{directory / METADATA}: the saved pieces of {name!r} cover "
                                  f"{covered} of the {region.valid_numel()} elements asked for")
        reads.append((name, shard, pieces))
    return reads


def _read_into(f, path: Path, piece: dict, name: str, out: torch.Tensor) -> None:
    """Read one piece's bytes into the contiguous CPU tensor `out` and check its crc32."""
    buf = out.detach().view(-1).view(torch.uint8).numpy()
    f.seek(piece["offset"])
    if f.readinto(buf) != piece["nbytes"] or zlib.crc32(buf) != piece["crc32"]:
        raise CheckpointError(f"shard file {path} is corrupt: the piece of {name!r} at byte "
                              f"{piece['offset']} fails its crc32 check")


def _read(directory: Path, meta: dict, reads: list[tuple]) -> None:
    files: dict[str, object] = {}
    try:
        with torch.no_grad():
            for name, shard, pieces in reads:
                dtype = dtype_of(meta["tensors"][name]["dtype"], name)
                region, target = shard.region, shard.tensor.detach()
                direct = target.device.type == "cpu" and target.is_contiguous()
                flat = target.view(-1) if direct else torch.empty(target.numel(), dtype=target.dtype)
                for p in pieces:
                    path = member(directory, p["file"])
                    f = files.get(p["file"]) or files.setdefault(p["file"], open(path, "rb"))  # noqa: SIM115
                    source = Region.from_json(region.global_shape, p)
                    if direct and source == region and dtype == target.dtype:
                        _read_into(f, path, p, name, flat)  # the same slice: no extra copy
                        continue
                    src = torch.empty(p["numel"], dtype=dtype)
                    _read_into(f, path, p, name, src)
                    copy_overlap(flat, region, src, source)
                if not direct:
                    target.copy_(flat.view(target.shape))
    finally:
        for f in files.values():
            f.close()


def open_checkpoint(path: str | Path, config: dict | None = None) -> tuple[Path, dict]:
    """Resolve, read and check a checkpoint without reading any tensor: (directory, metadata)."""
    directory = resolve_checkpoint(path)
    meta = read_metadata(directory)
    check_metadata(directory, meta)
    check_config(directory, meta, config)
    check_files(directory, meta)
    return directory, meta


def load_checkpoint(path: str | Path, targets: dict, *, config: dict | None = None,
                    group=None) -> Loaded:
    """Fill each target ({name: Shard | (tensor, global_shape, offsets)}, any region of any mesh)
    from the checkpoint at `path` (a root with `latest`, or a step directory). Every rank of
    `group` calls it; raises CheckpointError, the same on every rank."""
    targets = {k: as_shard(v) for k, v in targets.items()}
    directory, meta = open_checkpoint(path, config)  # the same verdict on every rank
    reads = plan_reads(directory, meta, targets)
    error = None
    try:
        _read(directory, meta, reads)
    except CheckpointError as e:
        error = str(e)
    if dist.is_initialized():
        _raise_first(_all_gather(error, group))  # a corrupt piece that one rank read: all raise
    elif error:
        raise CheckpointError(error)
    rank, world = _rank_world(group)
    ranks = meta.get("ranks") or []
    return Loaded(directory, meta["step"], meta.get("state"),
                  ranks[rank] if world == meta["world_size"] and rank < len(ranks) else None, meta)


def read_full(path: str | Path, names=None, *, config: dict | None = None,
              prefix: str = "") -> tuple[dict[str, torch.Tensor], dict]:
    """Whole tensors (saved dtype) of every name starting with `prefix` (or of `names`),
    assembled from every piece, in this process only (no collective): for export and checks."""
    directory, meta = open_checkpoint(path, config)
    tensors = meta["tensors"]
    names = [n for n in tensors if n.startswith(prefix)] if names is None else list(names)
    if missing := [n for n in names if n not in tensors]:
        raise CheckpointError(f"{directory / METADATA} has no tensor {missing[0]!r}")
    out = {n: torch.empty(tensors[n]["shape"], dtype=dtype_of(tensors[n]["dtype"], n)) for n in names}
    _read(directory, meta, plan_reads(directory, meta, {n: as_shard(t) for n, t in out.items()}))
    return out, meta


def verify_checkpoint(path: str | Path) -> Path:
    """Read every shard file whole and check its crc32 against metadata.json (what a resume
    does not do: it checks only the pieces it reads). Returns the directory; raises on a fault."""
    directory, meta = open_checkpoint(path)
    for name, info in meta["files"].items():
        crc = 0
        with open(member(directory, name), "rb") as f:
            while chunk := f.read(1 << 24):
                crc = zlib.crc32(chunk, crc)
        if crc != info["crc32"]:
            raise CheckpointError(f"shard file {directory / name} is corrupt: crc32 {crc:#010x}, "
                                  f"{METADATA} says {info['crc32']:#010x}")
    return directory
