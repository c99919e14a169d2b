"""Lab 07's properties: what `make lab-check N=7` runs on your lab.py (common/labs/grader.py runs them).

Each property builds 07's mesh on 4 ranks (several meshes in turn, in one job), calls your
`parallelize` on a float64 LLaMA built on the meta device and reads what every rank holds through
FSDP's `shard_layout()`: each piece of each flat shard is a region of a reference tensor (07's
shard_map), so every piece on every rank (copies included) is compared with one device where it
sits. In order: what each rank holds after your composition (its stages' tensors, their TP
shapes, 1/(dp·cp) of each, the seeded values, seed 0 and 1), against 07's own recipe on the same
mesh; two SGD steps run by 06's PipelineExecutor (loss, every gradient before clipping, every
parameter after each step, at 1e-10); your clipping with a max_norm that clips and one that does
not (the norm on every rank, the parameters after the step); all of it with context parallelism
in the mesh; and what the composition is for, in bytes: what each rank sends over its TP, CP, PP
and FSDP groups and the world, measured, against 07's closed form (comm_formulas.py).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from common.comm import CommMeter
from common.data import SyntheticTokens
from common.kernel.mesh import build_mesh, mesh_shape
from common.kernel.model import build_model, initializer
from common.kernel.p2p_plan import P2PRecorder
from common.labs.diagnosis import explain, near
from common.labs.grader import Fail, Property
from common.labs.rank import at
from common.labs.tools import one_device
from fsdp import FSDP
from parallel3d.lab_hints import (
    CFG,
    CP_HINT,
    SEQ,
    bytes_by_group,
    check_rank,
    group_size,
    held,
    norm_hint,
    worst_piece,
)
from parallel3d.parallelize import Parallel3DConfig, parallelize_3d, rank_inputs
from parallel3d.shards import shard_map
from pipeline import PipelineExecutor, make_schedule
from tensor_parallel import vocab_parallel_loss

TITLE = "3D: the recipe (split → TP → CP → FSDP) and clipping by the global norm"
LR, CLIPS, MAX_NORM = 1e-2, 1e-2, 1e3  # the gradient norm at init is ~1: 1e-2 clips, 1e3 does not
CPU = torch.device("cpu")
ERROR_HINTS = [
    (("object has no attribute 'weight'",),
     "a layer whose weight is gone: FSDP had already flattened the chunk (tensor parallelism applied after "
     "FSDP?); cut each chunk with parallelize_llama first, then wrap it in FSDP"),
    (("KeyError",), "a name FSDP asked for has no TPShard: tensor-parallelize every chunk before FSDP "
                    "wraps it"),
]


def _name(mesh: dict) -> str:
    dims = "×".join(f"{k}{mesh[k]}" for k in ("dp", "cp", "pp", "tp") if mesh.get(k, 1) > 1)
    return dims + (f" v{mesh['v']}" if mesh.get("v", 1) > 1 else "") + (
        f" seed {mesh['seed']}" if mesh.get("seed") else "")


def _where(mesh: dict, rank: int, coords: dict) -> str:
    return f"{_name(mesh)}, rank {rank} ({', '.join(f'{k} {v}' for k, v in coords.items())})"


def _meshes(runs) -> list[tuple[dict, list[dict]]]:
    """(mesh, every rank's result) for each mesh of each config."""
    return [(mesh, [ranks[i] for ranks in run.ranks])
            for run in runs for i, mesh in enumerate(run.config["meshes"])]


def _build(lab, dp: int, pp: int, tp: int, cp: int, v: int, seed: int = 0):
    mesh = build_mesh(mesh_shape(dist.get_world_size(), tp=tp, pp=pp, dp=dp, cp=cp))
    model = build_model(CFG, dtype=torch.float64, device="meta")
    at(phase=f"parallelize on {_name({'dp': dp, 'pp': pp, 'tp': tp, 'cp': cp, 'v': v})}")
    out = lab.parallelize(model, mesh, CPU, seed=seed, virtual_stages=v)
    chunks, specs = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
    fsdp_chunks = isinstance(chunks, list) and all(isinstance(c, FSDP) for c in chunks)
    if not fsdp_chunks or not isinstance(specs, dict):
        raise TypeError(f"parallelize returned {type(out).__name__}: return (chunks, tp_specs), the list "
                        "of FSDP-wrapped chunks (one per virtual stage) and parallelize_llama's specs")
    coords = {"dp": mesh.dp_rank, "pp": mesh.pp_rank, "cp": mesh.cp_rank, "tp": mesh.tp_rank}
    return mesh, chunks, specs, coords


# --- property 1: what each rank holds ------------------------------------------------------------

def holdings(lab, world: int, meshes: list[dict]) -> list:
    """This rank, each mesh in turn (forking a job costs more than building a mesh): what it holds
    after your parallelize, and after 07's recipe."""
    out = []
    for spec in meshes:
        seed, v = spec.get("seed", 0), spec.get("v", 1)
        mesh, chunks, _, coords = _build(lab, spec.get("dp", 1), spec.get("pp", 1), spec.get("tp", 1),
                                         spec.get("cp", 1), v, seed)
        config = Parallel3DConfig(schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v, seed=seed)
        meta = build_model(CFG, dtype=torch.float64, device="meta")
        ref_chunks, ref_specs = parallelize_3d(meta, mesh, config, CPU)  # 07's recipe: the expected layout
        init = initializer(CFG, seed)
        out.append({"coords": coords, "got": held(chunks, ref_specs, init), "want": held(ref_chunks)})
    return out


def check_holdings(runs) -> Fail | str:
    """After your parallelize, every rank holds its own stages' tensors and no other, each in its
    TP shape, 1/(dp·cp) of each FSDP unit (one per TransformerBlock), with the seeded values (seed 0
    and 1), as 07's own recipe on the same mesh."""
    for mesh, ranks in _meshes(runs):
        for rank, r in enumerate(ranks):
            if wrong := check_rank(mesh, _where(mesh, rank, r["coords"]), r["got"], r["want"]):
                return Fail(*wrong)
    return f"every rank holds its TP piece of its stages, 1/(dp·cp) of each, seeded " \
           f"({', '.join(_name(m) for m, _ in _meshes(runs))})"


# --- properties 2-5: train with 06's executor, compare every piece on every rank -----------------

def _pieces(shards, tensor_of) -> list:
    """(name, region, values) of every piece this rank holds, counted or not: copies must agree too."""
    return [(p.name, p.region, t.clone()) for p in shards.pieces
            if (t := shards.piece_of(p, tensor_of)) is not None]


def train(lab, world: int, meshes: list[dict]) -> list:
    """This rank, each run in turn (one job)."""
    return [train_one(lab, **mesh) for mesh in meshes]


def train_one(lab, dp: int = 1, pp: int = 1, tp: int = 1, cp: int = 1, v: int = 1, steps: int = 2,
              clip: float | None = None) -> dict:
    """Your composition trained `steps` SGD steps by 06's executor (1F1B; interleaved when v > 1),
    2 micro-batches of one row per DP rank; with `clip`, your clip_global_norm before each step.
    Step 1's bytes sent per group are measured (collectives: common.comm; send/recv:
    common.kernel.p2p_plan) beside 07's formula for this rank's layout."""
    mesh, chunks, specs, coords = _build(lab, dp, pp, tp, cp, v)
    shards = shard_map(chunks, specs, mesh)
    optimizer = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=LR, foreach=False)
    head = chunks[-1].module.output  # the vocab-parallel head, on the last stage
    schedule = make_schedule("interleaved" if v > 1 else "1f1b", pp, 2, v)
    executor = PipelineExecutor(schedule, mesh.pp_rank, chunks,
                                lambda logits, targets: vocab_parallel_loss(head, logits, targets),
                                (1, SEQ // cp, CFG.dim), torch.float64, CPU, mesh.pp_group)
    data = SyntheticTokens(CFG.vocab_size, SEQ, seed=0)
    out = {"losses": [], "grads": [], "norms": [], "params": [], "coords": coords,
           "copies": {n: (s.copies, s.replicated) for n, s in specs.items()}}
    for step in range(steps):
        rows = data.global_batch(step, 2 * dp).narrow(0, 2 * mesh.dp_rank, 2)
        inputs, targets, positions = zip(*(rank_inputs(m, mesh) for m in rows.split(1)), strict=True)
        with CommMeter() as meter, P2PRecorder() as sends:
            at(step=step + 1, phase="executor.run (forward and backward)")
            loss = executor.run(inputs, targets, positions)
            out["losses"].append(None if loss is None else loss.item())
            out["grads"].append(_pieces(shards, lambda u: u.flat_param.grad))
            if clip is not None:
                at(phase="clip_global_norm")
                norm = lab.clip_global_norm(chunks, specs, mesh, clip)
                if not isinstance(norm, (torch.Tensor, float)):
                    raise TypeError(f"clip_global_norm returned {type(norm).__name__}: return the norm "
                                    "before clipping (a 0-dim tensor)")
                out["norms"].append(float(norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        out["params"].append(_pieces(shards, lambda u: u.flat_param))
        if step == 0:
            out["bytes"] = bytes_by_group(meter, sends, mesh, schedule, chunks, clip is not None)
    return out


def _want(mesh: dict):
    return one_device(CFG, mesh.get("steps", 2), 2 * mesh.get("dp", 1), SEQ, "sgd", LR, mesh.get("clip"))


def check_grads(runs) -> Fail | str:
    """Each step, every piece of every gradient on every rank (copies included), before clipping,
    is one device's (1e-10): so is the loss they come from."""
    for mesh, ranks in _meshes(runs):
        want = _want(mesh)
        for s in range(mesh.get("steps", 2)):
            if miss := worst_piece([r["grads"][s] for r in ranks], want.grads[s]):
                rank, finding = miss
                cp_wrong = mesh.get("cp", 1) > 1 and not near(finding.scale, group_size(mesh))
                where = _where(mesh, rank, ranks[rank]["coords"])
                return Fail(f"step {s + 1}, {where}: gradient of {finding}",
                            CP_HINT if cp_wrong else explain(finding, group_size(mesh)), step=s)
    return "every piece of every gradient on every rank within 1e-10"


def check_norms(runs) -> Fail | str:
    """clip_global_norm returns, on every rank, torch's clip_grad_norm_'s norm on one device (the
    norm before clipping), with max_norm below the norm and above it."""
    for mesh, ranks in _meshes(runs):
        if mesh.get("clip") is None:
            continue
        want = _want(mesh)
        for s, ref in enumerate(want.norms):
            norms = [r["norms"][s] for r in ranks]
            other = next((i for i, n in enumerate(norms) if abs(n - norms[0]) > 1e-10 * norms[0]), None)
            if other is not None:
                where = _where(mesh, other, ranks[other]["coords"])
                return Fail(f"step {s + 1}: {_where(mesh, 0, ranks[0]['coords'])} clipped by the norm "
                            f"{norms[0]:.6g}, {where} by {norms[other]:.6g}",
                            "each rank clipped by its own norm, so each scaled its gradients by a different "
                            "coefficient: sum the squares of the pieces each rank counts over the whole "
                            "world (one all_reduce, SUM, default group), then take the square root", step=s)
            if abs(norms[0] - ref) > 1e-10 * ref:
                return Fail(f"{_name(mesh)}, step {s + 1}: global norm {norms[0]:.10g} on every rank, one "
                            f"device {ref:.10g} ({norms[0] / ref - 1:+.2g})",
                            norm_hint(norms[0] ** 2, ref**2, want.grads[s], ranks, mesh["clip"],
                                      mesh.get("v", 1)), step=s)
    return "the norm on every rank as torch's clip_grad_norm_"


def check_params(runs) -> Fail | str:
    """After each step, every piece of every parameter on every rank is one device's (the update
    clipped by min(1, max_norm / (‖g‖ + 1e-6)) when clipping)."""
    for mesh, ranks in _meshes(runs):
        want = _want(mesh)
        for s in range(mesh.get("steps", 2)):
            if miss := worst_piece([r["params"][s] for r in ranks], want.params[s + 1]):
                rank, finding = miss
                clip = mesh.get("clip")
                hint = (f"max_norm {clip:g} is above ‖g‖ = {want.norms[s]:.3g}: the gradients must stay as "
                        "they are; min(1, ·) caps the coefficient at 1" if clip and clip > want.norms[s] else
                        "the gradients and the norm were right: scale every gradient shard in place by "
                        "min(1, max_norm / (‖g‖ + 1e-6)), once" if clip else
                        "the gradients were right: does the optimizer hold every shard?")
                return Fail(f"after step {s + 1}, {_where(mesh, rank, ranks[rank]['coords'])}: parameter "
                            f"{finding}", hint, step=s)
    return "every piece of every parameter within 1e-10 after every step"


def check_bytes(runs) -> Fail | str:
    """What the composition is for, in bytes: in step 1 each rank sends over its TP, CP, PP and
    FSDP groups and the world exactly 07's closed form for its layout (comm_formulas.py)."""
    for mesh, ranks in _meshes(runs):
        for rank, r in enumerate(ranks):
            for kind, (measured, formula) in r["bytes"].items():
                if not math.isclose(measured, formula, rel_tol=1e-9, abs_tol=1e-6):
                    return Fail(f"{_where(mesh, rank, r['coords'])}: step 1 sent {measured:,.0f} B over its "
                                f"{kind} group, the formula {formula:,.0f} B",
                                "each dimension's traffic belongs to its own group: TP collectives over "
                                "mesh.tp_group, the CP ring over mesh.cp_group, FSDP over mesh.dp_cp_group, "
                                "the clipping norm over the world, once", step=0)
    mesh, ranks = _meshes(runs)[0]
    return "bytes per group as the formula, rank 0 of " + _name(mesh) + ": " + ", ".join(
        f"{k} {m:,.0f}" for k, (m, _) in ranks[0]["bytes"].items() if m)


def _each(*meshes: dict) -> list[dict]:
    """One configuration per mesh (one job of 4 ranks serves them all): a failing mesh stops the rest."""
    return [{"world": 4, "meshes": [mesh]} for mesh in meshes]


TRAIN = [check_grads, check_params, check_bytes]
CLIPPED = [check_grads, check_norms, check_params, check_bytes]
PROPERTIES = [
    Property("parallelize: each rank holds its TP piece of its stages, 1/(dp·cp)",
             _each({"pp": 2, "tp": 2, "v": 2}, {"dp": 2, "tp": 2}, {"cp": 2, "tp": 2},
                   {"dp": 2, "pp": 2, "seed": 1}), holdings, [check_holdings]),
    Property("two SGD steps equal one device (pp2×tp2, dp2×pp2 interleaved)",
             _each({"pp": 2, "tp": 2}, {"dp": 2, "pp": 2, "v": 2}), train, TRAIN),
    Property("clip_global_norm equals torch's clip on one device (dp2×tp2, pp2×tp2, dp2×pp2 v2)",
             _each({"dp": 2, "tp": 2, "clip": CLIPS, "steps": 1},
                   {"pp": 2, "tp": 2, "clip": MAX_NORM, "steps": 1},
                   {"dp": 2, "pp": 2, "v": 2, "clip": CLIPS, "steps": 1}), train, CLIPPED,
             after=("parallelize",)),
    Property("with context parallelism: cp2×tp2, two clipped steps", _each({"cp": 2, "tp": 2, "clip": CLIPS}),
             train, CLIPPED, after=("clip_global_norm",)),
]
