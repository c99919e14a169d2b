"""Chapter 05 expert-parallel benchmark: all-to-all dispatch against an all-gather baseline and
replicated experts.

    torchrun --standalone --nproc-per-node 4 05_tensor_parallel/bench_expert_parallel.py
    (or `make bench-5-ep`)

One launch, one EP group of every rank, one MoE layer of `--model` (its first MoE block's
feed-forward: router, E experts, top-k, the shared expert) on each rank's own `--batch` ×
`--seq-len` tokens, forward + backward. Three contenders with the same weights, each rank routing
its own tokens, timed by `common.bench` (one step of each per round in a rotated order; a step
counts as its slowest rank's time; medians):

    expert_parallel  `expert_parallel(layer, group)`: E/ep experts per rank; an all-to-all sends
                     each kept slot's row to its expert's rank, another brings the output back
    all_gather       E/ep experts per rank; every rank all-gathers every rank's tokens and plans,
                     runs its experts on every slot routed to them, and a reduce-scatter sums the
                     partial outputs back to their ranks (the same sum in another order)
    replicated       all E experts on every rank, its own tokens only: no communication in the
                     layer (plain data parallelism)

Bytes per step (rank mean, from `CommMeter`): the all-to-all moves about 4·(ep-1)/ep · N·k·dim·e
(balanced routing), the all-gather baseline 4·(ep-1) · N·dim·e: EP sends ~k/ep of it. Beside them,
the expert weights each rank holds, and the gradient all-reduce a training step would add: 2(ep-1)/ep
of the parameters replicated over the ranks (all of them when the experts are replicated; the
router and the shared expert only under EP). Before timing, the three are checked in float64 to
give the same output and input gradient (max relative difference ≤ 1e-10; exit 1 if not).
Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.distributed as dist

from common import bench as harness
from common.cli import DTYPES
from common.comm import CommMeter
from common.dist import print0, shutdown
from common.kernel.model import feed_forward, get_config, init_parameter
from common.kernel.moe import MoEFeedForward, RoutingPlan, permute, unpermute
from tensor_parallel import gather_from_sequence_parallel_region, reduce_scatter_to_sequence_parallel_region
from tensor_parallel.expert_parallel import expert_parallel
from tensor_parallel.mappings import all_gather_along

MiB = 2**20
TOLERANCE = 1e-10
NAMES = ("expert_parallel", "all_gather", "replicated")


class AllGatherDispatcher:
    """The baseline's dispatcher seam: rank r holds experts [r·E/ep, (r+1)·E/ep) (as under EP) and
    computes, for every token n of every rank, the part of y_n = Σ_j g_nj · E_{e_nj}(x_n) whose
    experts it holds; a reduce-scatter sums the ep parts and hands each rank its own tokens' rows.
    Backward: the gathers' reduce-scatters and the reduce-scatter's all-gather (chapter 05's SP
    mappings, on the token dim)."""

    def __init__(self, group, n_experts: int):
        self.group = group
        self.local = n_experts // dist.get_world_size(group)
        self.lo = dist.get_rank(group) * self.local
        self._plan: RoutingPlan | None = None

    def dispatch(self, x: torch.Tensor, plan: RoutingPlan) -> tuple[torch.Tensor, list[int]]:
        k = plan.top_k
        routed = all_gather_along(torch.cat([plan.experts, plan.kept.long()], 1), 0, self.group)
        experts, kept = routed[:, :k], routed[:, k:].bool()
        mine = kept & (experts >= self.lo) & (experts < self.lo + self.local)
        weights = gather_from_sequence_parallel_region(plan.weights, self.group, dim=0)
        self._plan = RoutingPlan(experts - self.lo, weights, mine, self.local)  # local expert ids
        return permute(gather_from_sequence_parallel_region(x, self.group, dim=0), self._plan)

    def combine(self, expert_outputs: torch.Tensor, plan: RoutingPlan) -> torch.Tensor:
        if self._plan is None:
            raise RuntimeError("AllGatherDispatcher.combine without a dispatch before it")
        partial, self._plan = unpermute(expert_outputs, self._plan), None  # [ep·N, dim], my experts' part
        return reduce_scatter_to_sequence_parallel_region(partial, self.group, dim=0)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.bench_parser(__doc__, warmup=2, steps=10)
    p.set_defaults(model="tiny-moe")
    p.add_argument("--batch", type=int, default=8, help="sequences per rank (each rank its own)")
    p.add_argument("--dtype", choices=DTYPES, default="float32", help="the timed layers' dtype")
    return harness.parse_checked(p, argv, positive=("batch",))


def build_layers(args: argparse.Namespace, dtype: torch.dtype,
                 device: torch.device) -> dict[str, MoEFeedForward]:
    """The three contenders from the same weights: the first MoE block's feed-forward of the
    model (`init_parameter`'s values, the same on every rank)."""
    cfg = get_config(args.model)
    L = cfg.first_dense_layers
    replicated = feed_forward(cfg, L)
    with torch.no_grad():
        for name, p in replicated.named_parameters():
            p.copy_(init_parameter(f"layers.{L}.feed_forward.{name}", p.shape, args.seed, cfg.n_layers))
    replicated = replicated.to(device=device, dtype=dtype)
    ep, gathered = copy.deepcopy(replicated), copy.deepcopy(replicated)
    expert_parallel(ep, None)
    expert_parallel(gathered, None)
    gathered.dispatcher = AllGatherDispatcher(None, cfg.n_experts)
    return {"expert_parallel": ep, "all_gather": gathered, "replicated": replicated}


def step(layer: MoEFeedForward, x: torch.Tensor, dout: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward from `dout`; returns (the output, the input's gradient)."""
    layer.zero_grad(set_to_none=True)
    x = x.detach().requires_grad_()
    y = layer(x)
    y.backward(dout)
    return y.detach(), x.grad


def rank_inputs(args: argparse.Namespace, dtype: torch.dtype,
                device: torch.device) -> tuple[torch.Tensor, ...]:
    """This rank's tokens x [B, T, dim] and output gradient, its own (seeded by rank)."""
    dim = get_config(args.model).dim
    g = torch.Generator().manual_seed(args.seed * 1000 + 1 + dist.get_rank())
    return tuple(torch.randn(args.batch, args.seq_len, dim, generator=g, dtype=torch.float64)
                 .to(device=device, dtype=dtype) for _ in range(2))


def max_rel_diffs(args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    """float64: max over ranks of max|a - replicated| / max|replicated|, output and input gradient."""
    layers = build_layers(args, torch.float64, device)
    x, dout = rank_inputs(args, torch.float64, device)
    out = {n: step(layer, x, dout) for n, layer in layers.items()}
    diffs = torch.stack([(a - b).abs().max() / b.abs().max().clamp_min(1e-300)
                         for n in NAMES[:2] for a, b in zip(out[n], out["replicated"], strict=True)])
    dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
    keys = [f"{n} {what}" for n in NAMES[:2] for what in ("output", "input grad")]
    return dict(zip(keys, diffs.tolist(), strict=True))


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    cfg = get_config(args.model)

    def check(world: int) -> str | None:
        if not cfg.n_experts:
            return f"--model {args.model} has no MoE layer: use a MoE config (tiny-moe)"
        if cfg.n_experts % world:
            return (f"{cfg.n_experts} experts do not split over {world} ranks: launch a number of "
                    f"ranks that divides {cfg.n_experts}")
        return None

    ctx = harness.launch(check=check)
    ep = ctx.world_size
    diffs = max_rel_diffs(args, ctx.device)
    worst = max(diffs.values())
    print0("float64 check, max rel diff vs replicated: "
           + " · ".join(f"{k} {v:.1e}" for k, v in diffs.items())
           + f" → {'OK' if worst <= TOLERANCE else 'FAILED'} (≤ {TOLERANCE:g})")
    if not worst <= TOLERANCE:
        shutdown()
        raise SystemExit(1)

    dtype = DTYPES[args.dtype]
    layers = build_layers(args, dtype, ctx.device)
    x, dout = rank_inputs(args, dtype, ctx.device)
    sent = {}
    for n, layer in layers.items():
        with CommMeter() as meter:
            step(layer, x, dout)
        total = torch.tensor([meter.bytes_sent], dtype=torch.float64, device=ctx.device)
        dist.all_reduce(total)
        sent[n] = total.item() / ep
    steps = {n: (lambda _, layer=layer: step(layer, x, dout)) for n, layer in layers.items()}
    median = harness.interleaved(steps, args.steps, args.warmup, ctx.device).median

    def nbytes(params) -> int:
        return sum(p.numel() * p.element_size() for p in params)

    experts_held = {n: nbytes(layer.experts.parameters()) for n, layer in layers.items()}
    replicated_params = {n: nbytes(layer.parameters()) - (0 if n == "replicated" else experts_held[n])
                         for n, layer in layers.items()}
    grad_sync = {n: 2 * (ep - 1) / ep * b for n, b in replicated_params.items()}
    print0(f"chapter 5 EP bench · {args.model}'s MoE layer (dim {cfg.dim}, E {cfg.n_experts}, "
           f"top-{cfg.top_k}, expert width {cfg.expert_hidden_dim}, shared {cfg.n_shared_experts}) · "
           f"ep = {ep} ranks · {ctx.backend} on {ctx.device} · {args.dtype} · "
           f"{args.batch} × {args.seq_len} tokens per rank · forward + backward · "
           f"median of {args.steps} (+{args.warmup})")
    print0(f"{'contender':<17}{'step ms':>9}{'/ EP':>7}{'sent MiB':>10}{'experts MiB':>13}"
           f"{'grad sync MiB':>15}")
    for n in NAMES:
        print0(f"{n:<17}{1e3 * median[n]:>9.2f}{median[n] / median['expert_parallel']:>7.2f}"
               f"{sent[n] / MiB:>10.3f}{experts_held[n] / MiB:>13.3f}{grad_sync[n] / MiB:>15.3f}")
    print0("sent: the layer's forward + backward collectives per rank (mean over ranks; CommMeter); "
           "experts: the expert weights a rank holds; grad sync: the all-reduce a training step adds "
           "for the weights replicated over the ranks (2(ep-1)/ep of them)")
    harness.finish({
        "chapter": 5, "bench": "expert_parallel", "model": args.model, "world_size": ep,
        "backend": ctx.backend, "device": str(ctx.device), "dtype": args.dtype, "batch": args.batch,
        "seq_len": args.seq_len, "warmup": args.warmup, "steps": args.steps, "step_s_median": median,
        "sent_bytes_per_rank": sent, "expert_bytes_per_rank": experts_held, "grad_sync_bytes": grad_sync,
        "max_rel_diff_float64": diffs,
    })


if __name__ == "__main__":
    main()
