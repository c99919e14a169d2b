"""What a wrong holding, gradient or norm of lab 07 usually means (its checks call these;
lab_check.py says what runs).

`check_rank` compares what one rank holds after your `parallelize` with 07's own recipe on the
same mesh (stages, TP shapes, the FSDP group, 1/(dp·cp) of each unit, the seeded values);
`worst_piece` finds, over every piece every rank holds (copies included), the reference tensor
missed by most; `norm_hint` reads what an excess of ‖g‖² is made of (the TP copies counted again);
`held` is what a rank's chunks hold, `bytes_by_group` what it sent per group beside 07's formula.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from common.comm import CommMeter
from common.kernel.comm_bytes import ring_fraction
from common.kernel.model import LlamaConfig, build_model
from common.kernel.p2p_plan import P2PRecorder
from common.labs.diagnosis import TOLERANCE, Finding, near
from common.reference import SCALE_FLOOR
from fsdp import FSDP
from parallel3d.accounting import describe_rank
from parallel3d.checkpoint.reshard import extract
from parallel3d.comm_formulas import comm_bytes_per_step, cp_bytes_per_step, tp_bytes_per_microbatch
from parallel3d.parallelize import Parallel3DConfig
from tensor_parallel import local_piece

# n_kv_heads 1 < tp 2: wk and wv are TP copies (each TP rank holds the one K/V head), like the norms.
CFG = LlamaConfig(dim=16, n_layers=4, n_heads=4, n_kv_heads=1, vocab_size=32, multiple_of=8)
SEQ = 8
FULL_SHAPES = {n: tuple(p.shape) for n, p in build_model(CFG, device="meta").named_parameters()}
UNITS_HINT = ("one FSDP unit per TransformerBlock (auto_wrap_policy=ModuleWrapPolicy({TransformerBlock})), "
              "the rest of each chunk its root unit, over mesh.dp_cp_group")


def group_size(mesh: dict) -> int:
    """FSDP's group size: the dp × cp ranks that hold the same (pp, tp) piece."""
    return mesh.get("dp", 1) * mesh.get("cp", 1)


def check_rank(mesh: dict, where: str, got: dict, want: dict) -> tuple[str, str] | None:
    """What is wrong with one rank's holdings: (detail, hint), or None."""
    have, need, group = got["params"], want["params"], group_size(mesh)
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


CP_HINT = ("with cp > 1 each rank holds 2 of the 2·cp zig-zag chunks of every row: every attention of every "
           "chunk must attend over the CP ring (apply_context_parallel(chunk, mesh.cp_group)), and FSDP must "
           "average the gradients over the dp·cp ranks (mesh.dp_cp_group)")


def norm_hint(got_sq: float, want_sq: float, grads: dict[str, torch.Tensor], ranks: list[dict],
              max_norm: float, v: int = 1) -> str:
    """What a wrong ‖g‖² is made of: the norm after clipping, the TP copies counted on every TP
    rank (all of them, or only the shared K/V heads, or only the whole tensors), or a whole
    multiple."""
    coef = min(1.0, max_norm / (want_sq**0.5 + 1e-6))
    if coef < 1 and near(got_sq, want_sq * coef**2, 1e-6):
        return ("that is the norm after clipping (≈ max_norm): return ‖g‖ before scaling, as torch's "
                "clip_grad_norm_ returns the total norm of the original gradients")
    copies = {n: c for r in ranks for n, c in r["copies"].items()}  # name: (copies, replicated)
    whole = [n for n, (c, replicated) in copies.items() if c > 1 and replicated]
    shared = [n for n, (c, replicated) in copies.items() if c > 1 and not replicated]

    def extra(names: list[str]) -> float:  # ‖g‖² added by counting these on every copy
        return sum((copies[n][0] - 1) * float(grads[n].pow(2).sum()) for n in names)

    for counted in (whole + shared, shared, whole):
        if counted and near(got_sq - want_sq, extra(counted), 1e-6):
            kinds = ", ".join(sorted({n.split(".")[-2] for n in counted}))
            kv = ("; wk and wv have copies too when n_kv_heads < t: each K/V head is on t/n_kv ranks"
                  if set(shared) & set(counted) else "")
            return (f"TP copies counted on every TP rank: ‖g‖² exceeds one device's by exactly {kinds} "
                    f"counted again on each copy ({len(counted)} tensors with tp_specs[name].copies > 1"
                    f"{kv}). Count such a piece on one rank of its copies: tp_specs[name].counted_here")
    if got_sq < want_sq and v > 1:
        return (f"‖g‖ too small with {v} virtual stages: a rank holds {v} chunks (one per virtual stage), "
                "and the norm counted some of them only, or each chunk was clipped by its own norm. Sum "
                "the squares over every chunk of `chunks` first, then one all_reduce, one coefficient")
    if got_sq < want_sq:
        return ("‖g‖ too small: some pieces are counted nowhere. FSDP shards are disjoint (all count), a "
                "TP-split piece is this rank's own (counts); only copies (tp_specs[name].copies > 1) "
                "count once")
    ratio = round(got_sq / want_sq)
    if ratio > 1 and near(got_sq / want_sq, ratio, 1e-6):
        return f"‖g‖² {ratio}× too large: each piece added on {ratio} ranks, or the sum all-reduced twice"
    return "the norm counts every element of the full model's gradient exactly once, over the whole world"


def held(chunks: list[FSDP], ref_specs: dict | None = None, init=None) -> dict:
    """Per original parameter its TP-local shape, how many elements this rank holds and (given the
    recipe's specs and the seeded init) their largest difference from the init's TP piece."""
    params, units = {}, [u for c in chunks for u in c.shard_layout()]
    for u in units:
        for p in u.params:
            diff = 0.0
            if init is not None and p.numel and p.name in ref_specs:
                want = local_piece(init(p.name), ref_specs[p.name]).reshape(-1)[p.offset : p.offset + p.numel]
                got = u.flat_param.detach()[p.shard_offset : p.shard_offset + p.numel]
                diff = float((got - want).abs().max()) if want.shape == got.shape else math.inf
            shape, numel, worst = params.get(p.name, (tuple(p.shape), 0, 0.0))
            params[p.name] = (shape, numel + p.numel, max(worst, diff))
    return {"params": params, "units": len(units), "groups": sorted({u.shard_world for u in units})}


def bytes_by_group(meter: CommMeter, sends: P2PRecorder, mesh, schedule, chunks, clip: bool) -> dict:
    """{kind: (measured, formula)} for TP, CP, PP, FSDP and the clipping all-reduce."""
    def p2p(group) -> float:
        ranks = tuple(dist.get_process_group_ranks(group if group is not None else dist.group.WORLD))
        return sum(op.nbytes for g in sends.groups.get(ranks, []) for op in g if op.kind == "send")

    def over(group) -> float:
        """The collectives' bytes over `group`: the meter's count over its ranks holds the batched
        sends too (the CP ring's, when the CP group is the dp·cp one at dp = 1)."""
        return meter.bytes_over(group) - p2p(group) if dist.get_world_size(group) > 1 else 0.0

    r = describe_rank(CFG, mesh, schedule, chunks, Parallel3DConfig(), 1, SEQ, torch.float64, clip, "sgd")
    recompute = r.parallel.activation_checkpointing
    stages = [schedule.stage(mesh.pp_rank, c) for c in range(len(chunks))]
    tp = schedule.m * sum(tp_bytes_per_microbatch(CFG, mesh.tp, 1, SEQ // mesh.cp, 8, False, recompute,
                                                  blocks, stage == 0, stage == schedule.n_stages - 1)
                          for stage, blocks in zip(stages, r.chunk_blocks, strict=True))
    pp = math.prod(r.activation_shape) * 8 * sum(schedule.send(mesh.pp_rank, a) is not None
                                                 for a in schedule.actions[mesh.pp_rank])
    world = ring_fraction(mesh.size, 2) * 8 if clip else 0.0
    cp = cp_bytes_per_step(r, 1)
    return {"TP": (over(mesh.tp_group), tp), "CP ring": (p2p(mesh.cp_group) if mesh.cp > 1 else 0.0, cp),
            "PP": (p2p(mesh.pp_group) if mesh.pp > 1 else 0.0, pp),
            "FSDP (dp·cp)": (over(mesh.dp_cp_group), comm_bytes_per_step(r, 1) - tp - cp - pp - world),
            "clipping (world)": (over(None), world)}
