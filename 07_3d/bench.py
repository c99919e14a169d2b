"""Chapter 07 benchmark: checkpoint save/load time and bytes on disk, parallel3d.checkpoint vs
torch.distributed.checkpoint.

    torchrun --standalone --nproc-per-node 8 07_3d/bench.py --model small --mesh 2,2,2   (or `make bench-7`)

Each rank holds its dp × pp × tp slices (shard_layout.llama_3d_layout) of the weights and of
AdamW's exp_avg and exp_avg_sq, random numbers of the run's dtype (a checkpoint's cost does not
depend on the values). Both libraries get the same pieces per rank: DCP (FileSystemWriter,
fsync on, one .distcp file per rank) saves them under per-rank keys; ours as sharded regions.
Timed from a barrier to a barrier, best of --repeats; loads read back into the same mesh, and for
ours also into --reshard-mesh (DCP would need DTensors for that). Page cache is warm for both:
these are CPU-side costs (serialization, checksums, fsync), not disk bandwidth; the pieces live in
host memory on every backend, so no GPU work runs inside a timed window. The meshes must multiply
to the world size (8 ranks by default: `make bench-7`; e.g. `--mesh 1,1,2 --reshard-mesh 1,2,1` on 2).
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
import zlib
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from common import bench as harness
from common.dist import print0
from common.kernel.model import get_config
from parallel3d.checkpoint.load import load_checkpoint
from parallel3d.checkpoint.save import Shard, describe_shards, plan_writes, save_checkpoint
from parallel3d.checkpoint.shard_layout import llama_3d_layout

CONFIGS = {"small": {}, "medium": {"dim": 512, "n_heads": 8, "n_kv_heads": 4, "multiple_of": 128}}


def rank_state(cfg, mesh, rank: int, dtype: torch.dtype) -> dict[str, Shard]:
    """Random pieces, seeded by (name, region): ranks holding the same replicated piece agree."""
    out = {}
    for name, r in llama_3d_layout(cfg, *mesh, rank).items():
        for key in ("", "optim.{}.exp_avg", "optim.{}.exp_avg_sq"):
            full_name = key.format(name) if key else name
            g = torch.Generator().manual_seed(zlib.crc32(f"{full_name}{r}".encode()))
            t = torch.randn(r.numel, generator=g).to(dtype)
            out[full_name] = Shard(t, r.global_shape, r.offsets, r.box_shape, r.flat_start)
    return out


def timed(fn) -> float:
    dist.barrier()
    start = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - start


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def bench(model: str, mesh, reshard_mesh, dtype: torch.dtype, repeats: int, base: Path,
          device: torch.device) -> dict:
    cfg = get_config(model if model in ("tiny", "small") else "small", **CONFIGS.get(model, {}))
    rank = dist.get_rank()
    shards = rank_state(cfg, mesh, rank, dtype)
    # DCP gets exactly the bytes our planner assigns to this rank (replicated pieces once)
    plans = [None] * dist.get_world_size()
    dist.all_gather_object(plans, describe_shards(shards))
    names = list(shards)
    dcp_state = {f"{names[i]}@{rank}": shards[names[i]].tensor for i in plan_writes(plans)[1][rank]}
    ours_dir, dcp_dir = base / "ours", base / "dcp"
    res = {"save": [], "load": [], "reshard_load": [], "dcp_save": [], "dcp_load": []}
    for i in range(repeats):
        res["save"].append(timed(lambda i=i: save_checkpoint(ours_dir, i + 1, shards, {"step": i},
                                                             keep=1)))
        targets = {n: Shard(torch.empty_like(s.tensor), s.global_shape, s.offsets, s.box_shape,
                            s.flat_start) for n, s in shards.items()}
        res["load"].append(timed(lambda t=targets: load_checkpoint(ours_dir, t)))
        ok = all(torch.equal(targets[n].tensor, s.tensor) for n, s in shards.items())
        assert ok, "a same-mesh load must give back the saved bits"
        other = rank_state(cfg, reshard_mesh, rank, dtype)
        res["reshard_load"].append(timed(lambda o=other: load_checkpoint(ours_dir, o)))
        if rank == 0:
            shutil.rmtree(dcp_dir, ignore_errors=True)
        dist.barrier()
        res["dcp_save"].append(timed(lambda: dcp.save(dcp_state, checkpoint_id=str(dcp_dir))))
        back = {k: torch.empty_like(v) for k, v in dcp_state.items()}
        res["dcp_load"].append(timed(lambda b=back: dcp.load(b, checkpoint_id=str(dcp_dir))))
    best = {k: min(v) for k, v in res.items()}
    held = sum(s.tensor.numel() * s.tensor.element_size() for s in shards.values())
    total = torch.tensor([held], dtype=torch.float64, device=device)  # NCCL: on the rank's GPU
    dist.all_reduce(total)
    latest = (ours_dir / "latest").read_text().strip()
    return {"model": model, "mesh": mesh, "reshard_mesh": reshard_mesh, "dtype": str(dtype),
            "state_bytes_all_ranks": int(total.item()), **{f"{k}_s": v for k, v in best.items()},
            "bytes_ours": dir_bytes(ours_dir / latest), "bytes_dcp": dir_bytes(dcp_dir),
            "save_ratio": best["save"] / best["dcp_save"], "load_ratio": best["load"] / best["dcp_load"]}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", nargs="+", default=["small", "medium"], choices=["tiny", *CONFIGS])
    p.add_argument("--mesh", default="2,2,2", help="dp,pp,tp of the save")
    p.add_argument("--reshard-mesh", default="1,1,8", help="dp,pp,tp of the resharded load")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = p.parse_args(argv)
    for flag in ("mesh", "reshard_mesh"):
        try:
            shape = tuple(int(x) for x in getattr(args, flag).split(","))
        except ValueError:
            shape = ()
        if len(shape) != 3 or min(shape) < 1:
            p.error(f"--{flag.replace('_', '-')} {getattr(args, flag)!r}: give dp,pp,tp, e.g. 2,2,2")
        setattr(args, flag, shape)
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: must be >= 1")
    return args


def mesh_error(args: argparse.Namespace, world: int) -> str | None:
    """Both meshes must multiply to the launched ranks."""
    for flag, (dp, pp, tp) in (("--mesh", args.mesh), ("--reshard-mesh", args.reshard_mesh)):
        if dp * pp * tp != world:
            return (f"{flag} {dp},{pp},{tp} has {dp * pp * tp} ranks, the job {world}: give a dp,pp,tp "
                    f"whose product is {world}")
    return None


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ctx = harness.launch(check=lambda world: mesh_error(args, world))
    mesh, reshard_mesh = args.mesh, args.reshard_mesh
    base = Path(args.dir or tempfile.gettempdir()) / "pfs-bench-checkpoint"
    rows = []
    for model in args.model:
        if ctx.is_main:
            shutil.rmtree(base, ignore_errors=True)
        dist.barrier()
        rows.append(bench(model, mesh, reshard_mesh, getattr(torch, args.dtype), args.repeats, base,
                          ctx.device))
    print0(f"{'model':8} {'state MiB':>9} {'save s':>8} {'DCP save':>9} {'ratio':>6} {'load s':>8} "
           f"{'DCP load':>9} {'ratio':>6} {'reshard':>8} {'MiB ours':>9} {'MiB DCP':>8}")
    for r in rows:
        print0(f"{r['model']:8} {r['state_bytes_all_ranks'] / 2**20:9.1f} {r['save_s']:8.3f} "
               f"{r['dcp_save_s']:9.3f} {r['save_ratio']:6.2f} {r['load_s']:8.3f} {r['dcp_load_s']:9.3f} "
               f"{r['load_ratio']:6.2f} {r['reshard_load_s']:8.3f} {r['bytes_ours'] / 2**20:9.2f} "
               f"{r['bytes_dcp'] / 2**20:8.2f}")
    if ctx.is_main:
        shutil.rmtree(base, ignore_errors=True)
    harness.finish(rows)


if __name__ == "__main__":
    main()
