"""Chapter 05 benchmark: our tensor parallelism vs torch DTensor's, and the dense model.

    torchrun --standalone --nproc-per-node 4 05_tensor_parallel/bench.py      (or `make bench-5`)

One launch of 4 ranks, five configurations of the same model (same seed) on the same batch:
dense (every rank trains the whole model alone), ours and torch's at TP = 2 (two TP groups of 2
ranks, side by side) and at TP = 4. torch's is `parallelize_module` with the plain Megatron plan
(torchtitan's default without its SequenceParallel norms and loss parallelism): ColwiseParallel
for wq, wk, wv, w1, w3, RowwiseParallel for wo, w2, a vocab-parallel embedding (RowwiseParallel)
and a column-parallel head whose logits are all-gathered for a plain cross-entropy (ours keeps
them split: `vocab_parallel_cross_entropy`). The configurations are interleaved and timed by
`common.bench`, one step of each per round in a rotated order, so all see the same background
load; a step (forward, backward, AdamW) counts as its slowest rank's time; the table shows
medians. Prints a table, writes bench.png, then one JSON line.
"""

from __future__ import annotations

import argparse
from functools import partial
from pathlib import Path

import torch

from common import bench as harness
from common.data import split_inputs_targets
from common.dist import print0
from common.kernel.model import build_model, get_config, loss_fn
from common.reference import make_optimizer
from tensor_parallel import parallelize_llama, vocab_parallel_loss

TARGET = 1.2  # the goal: ours within 1.2× of torch's step time (aim: <= 1.0×)
HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = harness.bench_parser(__doc__, warmup=2, steps=6)
    p.add_argument("--batch", type=int, default=8, help="sequences per step (every TP group)")
    p.add_argument("--png", default=str(HERE / "bench.png"), help="where to write the plot ('' to skip)")
    return harness.parse_checked(p, argv, positive=("batch",))


def torch_tp(model: torch.nn.Module, mesh) -> torch.nn.Module:
    """torch's own TP (DTensor) on common.kernel.model's LLaMA: the plain Megatron plan (no SP, no
    loss parallel)."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    parallelize_module(model, mesh, {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate()),
        "output": ColwiseParallel(output_layouts=Replicate()),
    })
    for block in model.layers:
        parallelize_module(block, mesh, {
            "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(),
            "attention.wv": ColwiseParallel(), "attention.wo": RowwiseParallel(),
            "feed_forward.w1": ColwiseParallel(), "feed_forward.w3": ColwiseParallel(),
            "feed_forward.w2": RowwiseParallel(),
        })
    return model


def build(kind: str, tp: int, args, meshes, device: torch.device) -> tuple:
    cfg = get_config(args.model)
    model = build_model(cfg, args.seed, torch.float32, device)
    if kind == "ours":
        parallelize_llama(model, meshes[tp].get_group("tp"))
        loss = lambda logits, targets: vocab_parallel_loss(model.output, logits, targets)  # noqa: E731
    else:
        if kind == "torch":
            torch_tp(model, meshes[tp]["tp"])
        loss = loss_fn
    return model, make_optimizer(model.parameters(), "adamw", 1e-3), loss


def step(model, optimizer, loss, tokens) -> torch.Tensor:
    inputs, targets = split_inputs_targets(tokens)
    value = loss(model(inputs), targets)
    value.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return value.detach()  # read after the timing: no host sync inside the timed step


def plot(median: dict[str, float], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.6))
    names = list(median)
    colors = ["gray" if n == "dense" else "tab:blue" if n.startswith("ours") else "tab:orange" for n in names]
    ax.bar(names, [1e3 * median[n] for n in names], color=colors)
    ax.set(ylabel="step time, ms (median)", title=title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    ctx = harness.launch()
    world = ctx.world_size
    tps = [t for t in (2, 4) if world % t == 0]  # 4 ranks: both (CPU default, `make bench-5`)
    from torch.distributed.device_mesh import init_device_mesh
    meshes = {t: init_device_mesh(ctx.device.type, (world // t, t), mesh_dim_names=("dp", "tp"))
              for t in tps}
    configs = {"dense": ("dense", 1)}
    for t in tps:
        configs |= {f"ours tp={t}": ("ours", t), f"torch tp={t}": ("torch", t)}
    runs = {name: build(kind, tp, args, meshes, ctx.device) for name, (kind, tp) in configs.items()}
    names = list(configs)
    loss_at_0: dict[str, torch.Tensor] = {}

    def timed_step(name: str, tokens: torch.Tensor) -> None:
        loss_at_0.setdefault(name, step(*runs[name], tokens))

    batches = harness.synthetic_batches(get_config(args.model).vocab_size, args.seq_len, args.seed,
                                        args.batch, ctx.device)
    median = harness.interleaved({n: partial(timed_step, n) for n in names}, args.steps, args.warmup,
                                 ctx.device, batches).median
    first_loss = {n: float(loss) for n, loss in loss_at_0.items()}
    tokens_per_step = args.batch * args.seq_len
    ratios = {tp: median[f"ours tp={tp}"] / median[f"torch tp={tp}"] for tp in tps}
    print0(f"chapter 5 bench · {args.model} · {world} ranks · {ctx.backend} on {ctx.device} · batch "
           f"{args.batch}×{args.seq_len} per TP group · median of {args.steps} steps (+{args.warmup})")
    print0(f"{'config':<14}{'step ms':>10}{'tokens/s':>10}{'/ dense':>9}{'/ torch':>9}{'loss@0':>9}")
    for n in names:
        tp = configs[n][1]
        vs_torch = f"{median[n] / median[f'torch tp={tp}']:.3f}" if tp > 1 else "-"
        print0(f"{n:<14}{1e3 * median[n]:>10.1f}{tokens_per_step / median[n]:>10.0f}"
               f"{median[n] / median['dense']:>9.3f}{vs_torch:>9}{first_loss[n]:>9.4f}")
    met = all(v <= TARGET for v in ratios.values())
    print0(f"ours/torch: {' · '.join(f'tp={t} {r:.3f}' for t, r in ratios.items())} · target ≤ "
           f"{TARGET}: {harness.verdict(met)}")
    if ctx.is_main and args.png:
        plot(median, args.png, f"{args.model}, {world} {ctx.device.type} ranks ({ctx.backend})")
    harness.finish({
        "chapter": 5, "bench": "tensor_parallel", "model": args.model, "world_size": world,
        "backend": ctx.backend, "device": str(ctx.device), "batch": args.batch,
        "seq_len": args.seq_len, "warmup": args.warmup, "steps": args.steps,
        "step_s_median": median, "tokens_per_s": {n: tokens_per_step / median[n] for n in names},
        "first_loss": first_loss, "ours_over_torch": {str(k): v for k, v in ratios.items()},
        "target": TARGET, "target_met": met,
    }, runs, meshes)  # frees the DTensor modules and meshes while the groups live


if __name__ == "__main__":
    main()
