"""Chapter 04's figures: a step of FSDP as its units live it (gather, compute, free, reduce-scatter,
recorded from a real run on two forked gloo ranks) and the units an auto-wrap policy makes of a
real model (where HSDP's bytes travel: hybrid.py)."""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import warnings
from collections import Counter
from datetime import timedelta
from functools import partial

from matplotlib.patches import Rectangle

from common.figures import Figure, Source, draw
from common.kernel.model import RMSNorm, TransformerBlock, build_model, get_config, loss_fn
from fsdp.wrap import (
    ShardingStrategy,
    apply_auto_wrap,
    exempting,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

# --- running a few steps on forked ranks ----------------------------------------------------------

def _rank_main(rank: int, world: int, port: int, send, fn, args: tuple) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timedelta(seconds=30))
        result = (True, fn(*args))
        dist.destroy_process_group()
    except BaseException as error:
        result = (False, error)
    if rank == 0:
        try:
            send.send(result)
        except Exception as error:
            send.send((False, RuntimeError(repr(result[1]) + f" ({error})")))
    os._exit(0)


def forked(world: int, fn, *args, timeout_s: float = 60.0):
    """fn(*args) on `world` ranks forked from this process and joined in a fresh gloo group: rank
    0's result, or its exception raised here. A fork copies this process, so a function the test
    replaced here is replaced in the ranks too. Refused where this process has a process group
    (a fork would inherit it): call it before init_process_group, e.g. in a fresh kernel."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        raise RuntimeError("this figure records a step on forked ranks, which cannot start their own "
                           "process group from a process that has one: call it before "
                           "init_process_group (or restart the kernel)")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("fork")
    receive, send = context.Pipe(duplex=False)
    ranks = [context.Process(target=_rank_main, args=(r, world, port, send, fn, args), daemon=True)
             for r in range(world)]
    for p in ranks:
        p.start()
    send.close()
    try:
        if not receive.poll(timeout_s):
            raise TimeoutError(f"the {world} forked ranks did not finish within {timeout_s:.0f} s")
        ok, value = receive.recv()
    finally:
        for p in ranks:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join()
        receive.close()
    if not ok:
        raise value
    return value


# --- one unit's life, recorded ----------------------------------------------------------------------

def record_step(model, sharding: str, forward_prefetch: bool, backward_prefetch: str | None,
                wrap: str = "blocks") -> dict:
    """On every rank: wrap `model` in our FSDP (a unit per TransformerBlock, or with `wrap` "none"
    the whole model one unit), run two training steps
    (the first records the order that prefetching follows), and return the second's events in the
    order they were issued: the memory ledger's gathers and frees (`memory_trace`), each unit's
    compute (module hooks, forward and backward), each reduction started, the end of backward."""
    import torch

    from fsdp import BackwardPrefetch, FullyShardedDataParallel
    from fsdp.train import full_params_peak_formula

    policy = partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerBlock}) \
        if wrap == "blocks" else None
    prefetch = backward_prefetch and BackwardPrefetch[backward_prefetch]
    fsdp = FullyShardedDataParallel(model, auto_wrap_policy=policy,
                                    sharding_strategy=ShardingStrategy[sharding],
                                    forward_prefetch=forward_prefetch, backward_prefetch=prefetch)
    events: list[dict] = []

    class Ledger(list):  # memory_trace: each gather and free also joins the events, in order
        def append(self, e: dict) -> None:
            events.append({"kind": e["event"], "unit": e["unit"], "live_bytes": e["live_bytes"]})

    def on(kind: str, unit: str, what: str = ""):
        return lambda *_: events.append({"kind": kind, "unit": unit, "what": what})

    root = fsdp.module
    owners = {shard.name for shard in fsdp.shard_layout()}  # the units that hold parameters
    bodies = [(unit.module, unit.unit_name, "block") for unit in fsdp.units()
              if unit.unit_name and unit.unit_name in owners]
    bodies += [(root.tok_embeddings, "<root>", "embed"), (root.output, "<root>", "head")]
    for module, unit, what in bodies:
        module.register_forward_pre_hook(on("forward", unit, what))
        module.register_forward_hook(on("forward_end", unit, what))
        module.register_full_backward_pre_hook(on("backward", unit, what))
        module.register_full_backward_hook(on("backward_end", unit, what))
    for h in fsdp._handles():  # reductions join the ledger, as tests/test_fsdp_torch_contract.py does
        def reduce(grad, sync, h=h, original=h.reduce_grad):
            events.append({"kind": "reduce", "unit": h.name})
            original(grad, sync)
        h.reduce_grad = reduce
    finish = fsdp._finish_backward

    def finish_backward() -> None:
        events.append({"kind": "end_of_backward", "unit": ""})
        finish()
    fsdp._finish_backward = finish_backward
    tokens = torch.randint(0, model.cfg.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    warnings.filterwarnings("ignore", message="Full backward hook is firing")  # the embedding's input: tokens
    for _ in range(2):
        events.clear()
        fsdp.memory_trace = Ledger()
        loss = loss_fn(fsdp(tokens[:, :-1]), tokens[:, 1:])
        events.append({"kind": "loss", "unit": ""})
        loss.backward()
    layout = [{"unit": u.name or "<root>", "numel": u.numel, "padded": u.padded_numel,
               "full_bytes": u.full_bytes} for u in fsdp.shard_layout()]
    return {"events": events, "units": layout, "peak_formula": full_params_peak_formula(fsdp)}


def unit_life_data(n_layers: int = 4, world: int = 2, sharding: str = "FULL_SHARD",
                   forward_prefetch: bool = True, backward_prefetch: str | None = "BACKWARD_PRE",
                   model: str = "tiny", wrap: str = "blocks") -> dict:
    """The second step of `model` with `n_layers` blocks under our FSDP on `world` forked gloo
    ranks, as rank 0 recorded it (orders and kinds of events, no timings)."""
    module = build_model(get_config(model, n_layers=n_layers), 0)
    recorded = forked(world, record_step, module, sharding, forward_prefetch, backward_prefetch, wrap)
    return {"model": model, "n_layers": n_layers, "world": world, "sharding": sharding,
            "forward_prefetch": forward_prefetch, "backward_prefetch": backward_prefetch, "wrap": wrap,
            **recorded}


def unit_life_draw(data: dict):
    events, units = data["events"], data["units"]
    lanes = [u["unit"] for u in units]
    row = {u: i for i, u in enumerate(lanes)}
    fig, (ax, mem) = draw.figure(height=0.42 * len(lanes) + 2.6, nrows=2, ncols=1,
                                 gridspec_kw={"height_ratios": [len(lanes), 2.4]}, sharex=True)
    bars, opened, gathered_at = [], {}, {}
    starts = [(i, e["unit"]) for i, e in enumerate(events) if e["kind"] in ("forward", "backward")]
    first_backward = next(i for i, e in enumerate(events) if e["kind"] == "loss") + 0.5
    for i, e in enumerate(events):
        kind, unit = e["kind"], e["unit"]
        if kind in ("forward", "backward"):
            opened[(unit, e["what"])] = i
        elif kind in ("forward_end", "backward_end"):
            start = opened.pop((unit, e["what"]))
            phase = kind.removesuffix("_end")
            label = {"embed": "emb", "head": "head"}.get(e["what"], "F" if phase == "forward" else "B")
            bars.append(draw.Bar(row[unit], start, i + 1, phase, label))
        elif kind == "gather":
            gathered_at[unit] = i
            own = next((j for j, u in starts if j > i and u == unit), len(events))
            prefetch = any(i < j < own and u != unit for j, u in starts)  # another unit computes first
            bars.append(draw.Bar(row[unit], i, i + 1, "gather", "AG"))
            if prefetch:
                ax.annotate("", xy=(i + 0.5, row[unit] - 0.42), xytext=(i + 0.5, row[unit] - 0.75),
                            arrowprops={"arrowstyle": "-|>", "color": "#E69F00", "lw": 0.8})
        elif kind == "free":
            start = gathered_at.pop(unit, 0)
            ax.add_patch(Rectangle((start, row[unit] - 0.45), i + 1 - start, 0.9, facecolor="#E69F00",
                                        alpha=0.13, edgecolor="none"))
            bars.append(draw.Bar(row[unit], i, i + 1, "free", ""))
        elif kind == "reduce":
            bars.append(draw.Bar(row[unit], i, i + 1, "reduce", "RS"))
        elif kind == "end_of_backward":
            for a in (ax, mem):
                a.axvline(i + 0.5, color="#D55E00", ls=":", lw=1)
            mem.text(i + 0.3, 0.95, "end of backward:\nevery RS waited, ÷N", ha="right", va="top",
                     fontsize=draw.SMALL, color="#D55E00", transform=mem.get_xaxis_transform())
    sizes = {u["unit"]: u["numel"] for u in units}
    names = [f"{'root' if u == '<root>' else u} ({sizes[u]:,})" for u in lanes]
    draw.timeline(ax, bars, names, legend=["gather", "forward", "backward", "free", "reduce"])
    ax.set_xlim(0, len(events))
    ax.axvline(first_backward, color="#555555", lw=0.8)
    ax.text(first_backward - 0.5, len(lanes) - 0.45, "forward ←  → backward", ha="center", va="top",
            fontsize=draw.SMALL, color="#555555", bbox={"facecolor": "white", "edgecolor": "none", "pad": 1})
    bp = data["backward_prefetch"] or "no backward prefetch"
    ax.set_title(f"One FSDP step of {data['model']} ({data['n_layers']} blocks, {data['world']} ranks, "
                 f"{data['sharding']}, forward_prefetch={data['forward_prefetch']}, {bp}), "
                 "as rank 0 issued it\n"
                 "AG all-gather (↓: issued ahead, a prefetch) · F, B compute · RS reduce-scatter · shaded: "
                 "the unit is whole", loc="left", fontsize=8.5)
    ledger = [(i, e["live_bytes"]) for i, e in enumerate(events) if "live_bytes" in e]
    xs = [0] + [i + 1 for i, _ in ledger] + [len(events)]
    ys = [0] + [b / 1024 for _, b in ledger] + [ledger[-1][1] / 1024]
    mem.step(xs, ys, where="post", color="#E69F00", lw=1.5, label="gathered (the ledger)")
    mem.axhline(data["peak_formula"] / 1024, color="#D55E00", ls="--", lw=0.8,
                label="full_params_peak_formula")
    mem.set_ylabel("KiB gathered")
    mem.set_xlabel("events in the order rank 0 issued them (not time)")
    mem.legend(fontsize=draw.SMALL, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def kept_after_forward(reshards: bool) -> bool:
    """A plausible bug for the test: units not freed after forward (or freed where they should stay)."""
    return not reshards


# --- the units an auto-wrap policy makes ----------------------------------------------------------

POLICIES = ("transformer", "transformer + RMSNorm in fp32", "size ≥ 5,000", "none")
POLICY_LABEL = dict(zip(POLICIES, (
    "auto_wrap_policy=partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerBlock})",
    "the same, with MixedPrecision(..., _module_classes_to_ignore=(RMSNorm,))",
    "auto_wrap_policy=partial(size_based_auto_wrap_policy, min_num_params=5_000)",
    "auto_wrap_policy=None"), strict=True))


def units_of(model: str, policy: str) -> dict:
    """Which unit owns each parameter of `model` (in registration order) when `apply_auto_wrap`
    runs `policy`, with a wrap that only records what it would wrap."""
    module = build_model(get_config(model), device="meta")
    blocks = partial(transformer_auto_wrap_policy, transformer_layer_cls={TransformerBlock})
    chosen = {"transformer": blocks, "transformer + RMSNorm in fp32": exempting(blocks, (RMSNorm,)),
              "size ≥ 5,000": partial(size_based_auto_wrap_policy, min_num_params=5_000),
              "none": None}[policy]
    picked: set[int] = set()

    def wrap(child):
        picked.add(id(child))
        return child
    made = 0 if chosen is None else apply_auto_wrap(module, chosen, wrap, lambda m: id(m) in picked)
    prefixes = [name for name, m in module.named_modules() if id(m) in picked]
    params = []
    for name, p in module.named_parameters():
        owner = max((u for u in prefixes if name.startswith(f"{u}.")), key=len, default="<root>")
        params.append([name, p.numel(), owner])
    return {"policy": policy, "made": made, "params": params}


def units_data(model: str = "tiny") -> dict:
    return {"model": model, "policies": [units_of(model, policy) for policy in POLICIES]}


def units_draw(data: dict):
    policies = data["policies"]
    fig, ax = draw.figure(height=0.75 * len(policies) + 0.9)
    total = sum(n for _, n, _ in policies[0]["params"])
    draw.blank(ax, (-0.02, 1.42), (-0.6, len(policies)))
    palette = [c for c in draw.RANK_COLORS if c not in ("#999999",)]
    for i, pol in enumerate(policies):
        owners = list(dict.fromkeys(owner for *_, owner in pol["params"] if owner != "<root>"))
        color = {o: palette[j % len(palette)] for j, o in enumerate(owners)} | {"<root>": "#BBBBBB"}
        x, sizes = 0.0, {}
        for _name, numel, owner in pol["params"]:
            draw.box(ax, x, i + 0.25, numel / total, 0.45, color=color[owner], edge="#FFFFFF")
            x += numel / total
            sizes[owner] = sizes.get(owner, 0) + numel
        ax.text(0, i + 0.2, POLICY_LABEL[pol["policy"]], va="bottom", fontsize=draw.SMALL, fontweight="bold",
                family="monospace")
        counts = Counter(v for k, v in sizes.items() if k != "<root>")
        units = f"{len(sizes)} unit{'s' if len(sizes) > 1 else ''}: root {sizes.get('<root>', 0):,}"
        units += "".join(f" + {c} × {v:,}" for v, c in sorted(counts.items()))
        ax.text(1.01, i + 0.47, units, va="center", fontsize=draw.SMALL)
    ax.text(0, -0.35, "parameters in registration order: tok_embeddings | layers.0 … | norm | output;\n"
            "colour = the unit that owns them (grey: the root unit, gathered for the whole step)",
            fontsize=draw.SMALL,
            va="center", color="#555555")
    ax.set_title(f"The units of {data['model']} ({total:,} parameters) under four auto-wrap policies",
                 loc="left")
    return fig


def never_descend(answer: bool) -> bool:
    """A plausible bug for the test: a policy that answers the opposite question."""
    return not answer


FIGURES = [
    Figure(name="fsdp_unit_life", path="04_fsdp/figures/fsdp_unit_life.svg", data=unit_life_data,
           draw=unit_life_draw, sizes={"n_layers": 4, "world": 2},
           sources=(Source("fsdp.wrap:reshards_after_forward", perturb=kept_after_forward),),
           alt="one FSDP step on tiny with 4 blocks: each unit's all-gather, compute, free and "
               "reduce-scatter in the order rank 0 issued them, and the gathered bytes"),
    Figure(name="fsdp_backward_post", path="04_fsdp/figures/fsdp_backward_post.svg", data=unit_life_data,
           draw=unit_life_draw,
           sizes={"n_layers": 4, "world": 2, "forward_prefetch": False, "backward_prefetch": "BACKWARD_POST"},
           sources=(Source("fsdp.wrap:reshards_after_forward", perturb=kept_after_forward),),
           alt="one FSDP step with torch's forward default and BACKWARD_POST: one block whole at a time"),
    Figure(name="fsdp_units", path="04_fsdp/figures/fsdp_units.svg", data=units_data, draw=units_draw,
           sources=(Source("fsdp.wrap:apply_auto_wrap", perturb=lambda made: made + 1),
                    Source("fsdp.wrap:transformer_auto_wrap_policy", perturb=never_descend),
                    Source("fsdp.wrap:size_based_auto_wrap_policy", perturb=never_descend)),
           alt="tiny's parameters coloured by the unit that owns them under four auto-wrap policies"),
]
