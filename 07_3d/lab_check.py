"""Lab 07's properties: what `make lab-check N=7` runs on your lab.py (common/grader.py runs them).

Each property builds 07's mesh on 4 ranks (several meshes in turn, in one job), calls your
`parallelize` on a float64 LLaMA built on the meta device and reads what every rank holds through
FSDP's `shard_layout()`: each piece of each flat shard is a region of a reference tensor (07's
shard_map), so every piece on every rank (copies included) is compared with one device where it
sits. In order: what each rank holds after your composition (its stages' tensors, their TP
shapes, 1/(dp·cp) of each, the seeded values), against 07's own recipe on the same mesh; two SGD
steps run by 06's PipelineExecutor (loss, every gradient before clipping, parameters after, at
1e-10); your clipping with a max_norm that clips (the norm on every rank, the parameters after
the step); all of it with context parallelism in the mesh.
"""

from __future__ import annotations

import math
import traceback

import torch
import torch.distributed as dist

from common.data import SyntheticTokens
from common.diagnosis import Finding, explain, near
from common.grader import Property
from common.mesh import build_mesh, mesh_shape
from common.model import LlamaConfig, build_model, initializer
from common.reference import SCALE_FLOOR, make_reference
from fsdp import FSDP
from parallel3d.checkpoint.reshard import extract
from parallel3d.parallelize import Parallel3DConfig, parallelize_3d, rank_inputs
from parallel3d.shards import shard_map
from pipeline import PipelineExecutor, make_schedule
from tensor_parallel import local_piece, vocab_parallel_loss

TITLE = "3D: the recipe (split → TP → CP → FSDP) and clipping by the global norm"
# n_kv_heads 1 < tp 2: wk and wv are TP copies (each TP rank holds the one K/V head), like the norms.
CFG = LlamaConfig(dim=16, n_layers=4, n_heads=4, n_kv_heads=1, vocab_size=32, multiple_of=8)
FULL_SHAPES = {n: tuple(p.shape) for n, p in build_model(CFG, device="meta").named_parameters()}
SEED, SEQ, LR, MAX_NORM = 0, 8, 1e-2, 1e-2  # the gradient norm at init is ~1: MAX_NORM clips
TOLERANCE = 1e-10
CPU = torch.device("cpu")
UNITS_HINT = ("one FSDP unit per TransformerBlock (auto_wrap_policy=ModuleWrapPolicy({TransformerBlock})), "
              "the rest of each chunk its root unit, over mesh.dp_cp_group")


def _name(mesh: dict) -> str:
    dims = "×".join(f"{k}{mesh[k]}" for k in ("dp", "cp", "pp", "tp") if mesh.get(k, 1) > 1)
    return dims + (f" v{mesh['v']}" if mesh.get("v", 1) > 1 else "")


def _where(mesh: dict, rank: int, coords: dict) -> str:
    return f"{_name(mesh)}, rank {rank} ({', '.join(f'{k} {v}' for k, v in coords.items())})"


def _group(mesh: dict) -> int:
    """FSDP's group size: the dp × cp ranks that hold the same (pp, tp) piece."""
    return mesh.get("dp", 1) * mesh.get("cp", 1)


def _meshes(runs) -> list[tuple[dict, list[dict]]]:
    """(mesh, every rank's result) for each mesh of each config."""
    return [(mesh, ranks) for config, result in runs
            for mesh, ranks in zip(config["meshes"], result, strict=True)]


def _to_rank0(obj) -> list | None:
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(obj, out, dst=0)
    return out


def _build(lab, dp: int, pp: int, tp: int, cp: int, v: int):
    mesh = build_mesh(mesh_shape(dist.get_world_size(), tp=tp, pp=pp, dp=dp, cp=cp))
    model = build_model(CFG, dtype=torch.float64, device="meta")
    out = _call(lab.parallelize, model, mesh, CPU, seed=SEED, virtual_stages=v)
    chunks, specs = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
    fsdp_chunks = isinstance(chunks, list) and all(isinstance(c, FSDP) for c in chunks)
    if not fsdp_chunks or not isinstance(specs, dict):
        raise TypeError(f"parallelize returned {type(out).__name__}: return (chunks, tp_specs), the list "
                        "of FSDP-wrapped chunks (one per virtual stage) and parallelize_llama's specs")
    coords = {"dp": mesh.dp_rank, "pp": mesh.pp_rank, "cp": mesh.cp_rank, "tp": mesh.tp_rank}
    return mesh, chunks, specs, coords


def _call(fn, *args, **kwargs):
    """fn(*args, **kwargs); an error comes back as one line naming the lab's function, and the
    usual cause when the traceback shows it (TP applied to a chunk FSDP already flattened)."""
    try:
        return fn(*args, **kwargs)
    except NotImplementedError:
        raise  # the grader stops at once and names what is left to write
    except Exception as error:
        frames = [f for f, _ in traceback.walk_tb(error.__traceback__)]
        late_tp = any(f.f_code.co_name in ("parallelize_llama", "apply_tp_plan")
                      and isinstance(f.f_locals.get("model", f.f_locals.get("module")), FSDP) for f in frames)
        missing = isinstance(error, KeyError) and error.args and error.args[0] in FULL_SHAPES
        why = (" — hint: tensor parallelism applied after FSDP: FSDP has already flattened the chunk's "
               "weights (drawn whole); cut each chunk with parallelize_llama first, then wrap it in FSDP"
               if late_tp else f" — hint: no TPShard for {error.args[0]} when FSDP drew its values: "
               "tensor-parallelize every chunk before FSDP wraps it" if missing else "")
        raise RuntimeError(f"{fn.__name__} raised {type(error).__name__}: {error}{why}") from error


# --- property 1: what each rank holds ------------------------------------------------------------

def holdings(lab, world: int, meshes: list[dict]) -> list:
    """Every rank, each mesh in turn (forking a job costs more than building a mesh)."""
    return [holding(lab, **mesh) for mesh in meshes]


def holding(lab, dp: int = 1, pp: int = 1, tp: int = 1, cp: int = 1, v: int = 1) -> list | None:
    """Per original parameter, its TP-local shape, how many elements this rank's shards hold and
    their largest difference from the seeded init's TP piece: yours, and 07's recipe's."""
    mesh, chunks, _, coords = _build(lab, dp, pp, tp, cp, v)
    config = Parallel3DConfig(schedule="interleaved" if v > 1 else "1f1b", virtual_stages=v, seed=SEED)
    model = build_model(CFG, dtype=torch.float64, device="meta")
    ref_chunks, ref_specs = parallelize_3d(model, mesh, config, CPU)  # 07's recipe: the expected layout
    init = initializer(CFG, SEED)

    def held(chunks: list[FSDP], values: bool) -> dict:
        params, units = {}, [u for c in chunks for u in c.shard_layout()]
        for u in units:
            for p in u.params:
                diff = 0.0
                if values and p.numel and p.name in ref_specs:
                    want = local_piece(init(p.name), ref_specs[p.name]).reshape(-1)
                    want = want[p.offset : p.offset + p.numel]
                    got = u.flat_param.detach()[p.shard_offset : p.shard_offset + p.numel]
                    diff = float((got - want).abs().max()) if want.shape == got.shape else math.inf
                shape, numel, worst = params.get(p.name, (tuple(p.shape), 0, 0.0))
                params[p.name] = (shape, numel + p.numel, max(worst, diff))
        return {"params": params, "units": len(units), "groups": sorted({u.shard_world for u in units})}

    return _to_rank0({"coords": coords, "got": held(chunks, True), "want": held(ref_chunks, False)})


def check_rank(mesh: dict, where: str, got: dict, want: dict) -> tuple[str, str] | None:
    """What is wrong with one rank's holdings: (detail, hint), or None."""
    have, need, group = got["params"], want["params"], _group(mesh)
    for name, (shape, _, _) in need.items():
        if name not in have:
            return f"{where}: holds no piece of {name}", (
                f"this rank's stage(s) hold {name}: keep every chunk split_model(model, mesh.pp, "
                "virtual_stages, mesh.pp_rank) returns, each wrapped")
        if have[name][0] != shape:
            whole = have[name][0] == FULL_SHAPES[name]
            return f"{where}: {name} is held as {list(have[name][0])}, its TP piece is {list(shape)}", (
                f"{name} is whole: tensor-parallelize each chunk (parallelize_llama(chunk, mesh.tp_group)) "
                "before FSDP flattens it" if whole else
                "the TP pieces are parallelize_llama(chunk, mesh.tp_group)'s, applied before FSDP")
    if extra := sorted(set(have) - set(need)):
        return f"{where}: holds {extra[0]}, which another pipeline stage owns", \
            "a rank keeps only its own stages: split_model(model, mesh.pp, virtual_stages, mesh.pp_rank)"
    if got["groups"] != [group]:
        dp_only = got["groups"] == [mesh.get("dp", 1)] and group > 1
        return f"{where}: FSDP shards over groups of {got['groups']} rank(s), expected dp·cp = {group}", (
            "sharded over the DP ranks only (mesh.dp_group): the CP ranks of a replica hold the same "
            "parameters (they see other tokens of the same rows), so FSDP shards and averages over "
            "mesh.dp_cp_group" if dp_only else
            "shard over mesh.dp_cp_group, the ranks that hold the same (pp, tp) piece")
    for name, (_, numel, diff) in have.items():
        if numel != need[name][1]:
            return f"{where}: holds {numel} elements of {name}, expected {need[name][1]} (1/{group} of " \
                   f"its FSDP unit's flat parameter)", UNITS_HINT
        if diff > 0:
            return f"{where}: {name} differs from the seeded init by up to {diff:.3g}", (
                "shard_init_fn(name, meta) returns this rank's TP piece of the seeded tensor: "
                "local_piece(initializer(model.cfg, seed)(name), tp_specs[name])")
    if got["units"] != want["units"]:
        return f"{where}: {got['units']} FSDP units, expected {want['units']}", UNITS_HINT
    return None


def check_holdings(runs) -> tuple[bool, str, str]:
    for mesh, ranks in _meshes(runs):
        for rank, r in enumerate(ranks):
            if wrong := check_rank(mesh, _where(mesh, rank, r["coords"]), r["got"], r["want"]):
                return False, *wrong
    names = ", ".join(_name(m) for m, _ in _meshes(runs))
    return True, f"every rank holds its TP piece of its stages, 1/(dp·cp) of each, seeded ({names})", ""


# --- properties 2-4: train with 06's executor, compare every piece on every rank -----------------

def _pieces(shards, tensor_of) -> list:
    """(name, region, values) of every piece this rank holds, counted or not: copies must agree too."""
    return [(p.name, p.region, t.clone()) for p in shards.pieces
            if (t := shards.piece_of(p, tensor_of)) is not None]


def train(lab, world: int, meshes: list[dict]) -> list:
    """Every rank, each run in turn (one job)."""
    return [train_one(lab, **mesh) for mesh in meshes]


def train_one(lab, dp: int = 1, pp: int = 1, tp: int = 1, cp: int = 1, v: int = 1, steps: int = 2,
              clip: bool = False) -> dict | None:
    """Your composition trained `steps` SGD steps by 06's executor (1F1B; interleaved when v > 1),
    2 micro-batches of one row per DP rank; with `clip`, your clip_global_norm before each step."""
    mesh, chunks, specs, coords = _build(lab, dp, pp, tp, cp, v)
    shards = shard_map(chunks, specs, mesh)
    optimizer = torch.optim.SGD([p for c in chunks for p in c.parameters()], lr=LR, foreach=False)
    head = chunks[-1].module.output  # the vocab-parallel head, on the last stage
    executor = PipelineExecutor(make_schedule("interleaved" if v > 1 else "1f1b", pp, 2, v), mesh.pp_rank,
                                chunks, lambda logits, targets: vocab_parallel_loss(head, logits, targets),
                                (1, SEQ // cp, CFG.dim), torch.float64, CPU, mesh.pp_group)
    data, out = SyntheticTokens(CFG.vocab_size, SEQ, seed=SEED), {"losses": [], "grads": [], "norms": []}
    for step in range(steps):
        rows = data.global_batch(step, 2 * dp).narrow(0, 2 * mesh.dp_rank, 2)
        inputs, targets, positions = zip(*(rank_inputs(m, mesh) for m in rows.split(1)), strict=True)
        loss = executor.run(inputs, targets, positions)
        out["losses"].append(None if loss is None else loss.item())
        out["grads"].append(_pieces(shards, lambda u: u.flat_param.grad))
        if clip:
            norm = _call(lab.clip_global_norm, chunks, specs, mesh, MAX_NORM)
            if not isinstance(norm, (torch.Tensor, float)):
                raise TypeError(f"clip_global_norm returned {type(norm).__name__}: return the norm "
                                "before clipping (a 0-dim tensor)")
            out["norms"].append(float(norm))
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    out.update(coords=coords, params=_pieces(shards, lambda u: u.flat_param),
               copies={n: (s.copies, s.replicated) for n, s in specs.items()})
    return _to_rank0(out)


def reference(mesh: dict) -> dict:
    """One device, the same global batches (2 rows per DP rank), SGD, torch's clip_grad_norm_."""
    steps, dp = mesh.get("steps", 2), mesh.get("dp", 1)
    clip = MAX_NORM if mesh.get("clip") else None
    trainer = make_reference(CFG, SEED, torch.float64, "sgd", LR, clip_grad=clip)
    data, out = SyntheticTokens(CFG.vocab_size, SEQ, seed=SEED), {"losses": [], "grads": [], "norms": []}
    for step in range(steps):
        loss, grads = trainer.step(data.global_batch(step, 2 * dp))
        out["losses"].append(loss)
        out["grads"].append(grads)
        out["norms"].append(math.sqrt(sum(float(g.pow(2).sum()) for g in grads.values())))
    out["params"] = {n: t.clone() for n, t in trainer.parameters().items()}
    return out


def worst_piece(pieces: list[list], want: dict[str, torch.Tensor]) -> tuple[int, Finding] | None:
    """pieces[rank] = [(name, region, values)]: the first reference tensor (in its order) that some
    rank's piece misses by more than TOLERANCE (relative to the tensor's largest element, floored as
    in common.reference), as (rank, Finding) for the rank that misses it most."""
    floor = SCALE_FLOOR * max(float(t.abs().max()) for t in want.values())
    for name, full in want.items():
        scale, misses = max(float(full.abs().max()), floor), []
        for rank, held in enumerate(pieces):
            for got, w in ((g.double(), extract(full.double(), r)) for n, r, g in held if n == name):
                if (rel := float((got - w).abs().max()) / scale) > TOLERANCE:
                    norm = float((w * w).sum())
                    factor = float((got * w).sum()) / norm if norm else None
                    zero = bool(got.abs().max() == 0 and w.abs().max() > 0)
                    misses.append((rank, Finding(name, rel, factor, zero)))
        if misses:
            return max(misses, key=lambda m: m[1].rel)
    return None


def check_training(runs) -> tuple[bool, str, str]:
    """Every piece of every gradient each step (before clipping), the losses, the norms, the parameters."""
    for mesh, ranks in _meshes(runs):
        want, steps, group = reference(mesh), mesh.get("steps", 2), _group(mesh)
        for s in range(steps):
            if miss := worst_piece([r["grads"][s] for r in ranks], want["grads"][s]):
                rank, finding = miss
                cp_wrong = mesh.get("cp", 1) > 1 and not near(finding.scale, group)
                hint = CP_HINT if cp_wrong else explain(finding, group)
                return False, f"step {s + 1}, {_where(mesh, rank, ranks[rank]['coords'])}: gradient of " \
                              f"{finding}", hint
        for s, ref in enumerate(want["losses"]):
            got = [r["losses"][s] for r in ranks if r["losses"][s] is not None]
            if abs(sum(got) / len(got) - ref) > TOLERANCE * abs(ref):
                return False, f"{_name(mesh)}: step {s + 1} loss {sum(got) / len(got):.12g}, one device " \
                              f"{ref:.12g}", "the gradients were right but not the loss: what differs " \
                                             "runs after the last block (the final norm, the head)"
        if mesh.get("clip") and (wrong := check_norms(mesh, ranks, want)):
            return False, *wrong
        if miss := worst_piece([r["params"] for r in ranks], want["params"]):
            rank, finding = miss
            hint = ("the gradients and the norm were right: scale every gradient shard in place by "
                    "min(1, max_norm / (‖g‖ + 1e-6)), once" if mesh.get("clip") else
                    "the gradients were right: does the optimizer hold every shard?")
            return False, f"after {steps} step(s), {_where(mesh, rank, ranks[rank]['coords'])}: " \
                          f"parameter {finding}", hint
    names = ", ".join(_name(m) for m, _ in _meshes(runs))
    return True, f"losses, every piece of every gradient and parameter on every rank within {TOLERANCE:g} " \
                 f"({names})", ""


CP_HINT = ("with cp > 1 each rank holds 2 of the 2·cp zig-zag chunks of every row: every attention of every "
           "chunk must attend over the CP ring (apply_context_parallel(chunk, mesh.cp_group)), and FSDP must "
           "average the gradients over the dp·cp ranks (mesh.dp_cp_group)")


def check_norms(mesh: dict, ranks: list[dict], want: dict) -> tuple[str, str] | None:
    """Every rank returns one device's norm; else the excess of ‖g‖² says what was counted twice."""
    for s, ref in enumerate(want["norms"]):
        norms = [r["norms"][s] for r in ranks]
        other = next((i for i, n in enumerate(norms) if abs(n - norms[0]) > TOLERANCE * norms[0]), None)
        if other is not None:
            return f"step {s + 1}: {_where(mesh, 0, ranks[0]['coords'])} clipped by the norm " \
                   f"{norms[0]:.6g}, {_where(mesh, other, ranks[other]['coords'])} by {norms[other]:.6g}", (
                       "each rank clipped by its own norm, so each scaled its gradients by a different "
                       "coefficient: sum the squares of the pieces each rank counts over the whole world "
                       "(one all_reduce, SUM, default group), then take the square root")
        got = norms[0]
        if abs(got - ref) > TOLERANCE * ref:
            return f"{_name(mesh)}, step {s + 1}: global norm {got:.10g} on every rank, one device " \
                   f"{ref:.10g} ({got / ref - 1:+.2g})", norm_hint(got**2, ref**2, want["grads"][s], ranks)
    return None


def norm_hint(got_sq: float, want_sq: float, grads: dict[str, torch.Tensor], ranks: list[dict]) -> str:
    """What the excess of ‖g‖² is made of: the TP copies counted on every TP rank (all of them, or
    only the shared K/V heads, or only the whole tensors), or a whole multiple."""
    copies = {n: c for r in ranks for n, c in r["copies"].items()}  # name: (copies, replicated)
    whole = [n for n, (c, replicated) in copies.items() if c > 1 and replicated]
    shared = [n for n, (c, replicated) in copies.items() if c > 1 and not replicated]

    def extra(names: list[str]) -> float:  # ‖g‖² added by counting these on every copy
        return sum((copies[n][0] - 1) * float(grads[n].pow(2).sum()) for n in names)

    for counted in (whole + shared, shared, whole):
        if counted and near(got_sq - want_sq, extra(counted), 1e-6):
            kinds = ", ".join(sorted({n.split(".")[-2] for n in counted}))
            kv = ("; wk and wv are copies too when n_kv_heads < t, though not replicated"
                  if set(shared) & set(counted) else "")
            return (f"TP copies counted on every TP rank: ‖g‖² exceeds one device's by exactly {kinds} "
                    f"counted again on each copy ({len(counted)} tensors with tp_specs[name].copies > 1"
                    f"{kv}). Count such a piece on one rank of its copies: tp_specs[name].counted_here")
    if got_sq < want_sq:
        return ("‖g‖ too small: some pieces are counted nowhere. FSDP shards are disjoint (all count), a "
                "TP-split piece is this rank's own (counts); only copies (tp_specs[name].copies > 1) "
                "count once")
    ratio = round(got_sq / want_sq)
    if ratio > 1 and near(got_sq / want_sq, ratio, 1e-6):
        return f"‖g‖² {ratio}× too large: each piece added on {ratio} ranks, or the sum all-reduced twice"
    return "the norm counts every element of the full model's gradient exactly once, over the whole world"


PROPERTIES = [
    Property("parallelize: each rank holds its TP piece of its stages, 1/(dp·cp)",
             [{"world": 4, "meshes": [{"pp": 2, "tp": 2, "v": 2}, {"dp": 2, "tp": 2}, {"cp": 2, "tp": 2},
                                      {"dp": 2, "pp": 2}]}], holdings, check_holdings),
    Property("two SGD steps equal one device (pp2×tp2, dp2×pp2 interleaved)",
             [{"world": 4, "meshes": [{"pp": 2, "tp": 2}, {"dp": 2, "pp": 2, "v": 2}]}], train,
             check_training),
    Property("clip_global_norm equals torch's clip on one device (dp2×tp2, pp2×tp2)",
             [{"world": 4, "meshes": [{"dp": 2, "tp": 2, "clip": True, "steps": 1},
                                      {"pp": 2, "tp": 2, "clip": True, "steps": 1}]}], train, check_training),
    Property("with context parallelism: cp2×tp2, two clipped steps",
             [{"world": 4, "meshes": [{"cp": 2, "tp": 2, "clip": True}]}], train, check_training),
]
