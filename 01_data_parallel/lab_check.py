"""Lab 01's properties: what `make lab-check N=1` runs on your lab.py (common/labs/grader.py runs them).

A small LLaMA in float64 is trained with your BucketedDDP on 2 and 3 ranks, and on a world of 3
cut into groups of 2 and 1 (your `group=`), each rank on its slice of the global batch, and
compared with the same training on one device (common/reference.py): every rank's gradients
after backward, every step, at 1e-10. Then what bucketing is for: one all-reduce per bucket, the
first posted while backward is still producing gradients.
"""

from __future__ import annotations

from contextlib import nullcontext
from functools import cache

import torch

from common.data import SyntheticTokens
from common.kernel.model import build_model, get_config, loss_fn
from common.kernel.patch import patch_dist
from common.labs.diagnosis import close, explain, first_difference, near, steps_pattern
from common.labs.grader import Fail, Property
from common.labs.rank import at
from common.labs.tools import group_of, local_rows, one_device, split, where
from common.reference import make_optimizer, make_reference

TITLE = "bucketed DDP"
CFG = get_config("tiny", n_layers=2)
BATCH, SEQ, LR, CAP_MB = 6, 8, 1e-2, 0.01  # 0.01 MiB: the tiny model's gradients make several buckets
_LAST = list(build_model(CFG, dtype=torch.float64, device="meta").parameters())[::-1]
EXACT = float(sum(p.numel() * p.element_size() for p in _LAST[:3]))  # a running size: fits, no cut
CAPS = (0.0, 4096.0, EXACT, 40_000.0, float("inf"))


# --- on every rank -------------------------------------------------------------------------------

def bucket_layouts(lab, world: int) -> dict[float, list[list[str]]]:
    """Your assign_buckets on the model's parameters at a few caps, as names."""
    model = build_model(CFG, dtype=torch.float64, device="meta")
    names = {id(p): n for n, p in model.named_parameters()}
    return {cap: [[names[id(p)] for p in b] for b in lab.assign_buckets(list(model.parameters()), cap)]
            for cap in CAPS}


def train(lab, world: int, steps: int = 1, optimizer: str = "sgd", micro: int = 1,
          groups: list[int] | None = None) -> dict:
    """The model under your BucketedDDP on this rank's group, its slice of each global batch in
    `micro` micro-batches (all but the last under no_sync); the grader's hook and all-reduce
    counter record when gradients arrive and reductions are posted."""
    g = split(groups)
    model = build_model(CFG, seed=0, dtype=torch.float64)
    ddp = lab.BucketedDDP(model, bucket_cap_mb=CAP_MB, group=g.group)
    opt = make_optimizer(model.parameters(), optimizer, LR)
    events, names = [], {id(p): n for n, p in model.named_parameters()}
    for p in model.parameters():  # registered after yours: fires after your hook
        p.register_post_accumulate_grad_hook(lambda p: events.append(("grad", names[id(p)])))

    def counting(all_reduce):
        def counted(tensor, *args, **kwargs):
            events.append(("all_reduce", tensor.numel()))
            return all_reduce(tensor, *args, **kwargs)
        return counted

    grads = []
    with patch_dist({"all_reduce": counting}):
        for step in range(steps):
            shards = local_rows(step, g.rank, g.size, BATCH, CFG, SEQ, micro)
            for i, (inputs, targets) in enumerate(shards):
                with ddp.no_sync() if i < len(shards) - 1 else nullcontext():
                    at(step=step + 1, phase="forward")
                    loss = loss_fn(ddp(inputs), targets) / len(shards)
                    at(phase="backward")
                    loss.backward()
            grads.append({n: None if p.grad is None else p.grad.detach().clone()
                          for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {"grads": grads, "events": events, "buckets": len(ddp.buckets)}


# --- the checks, in the grader's process ---------------------------------------------------------

def check_layouts(runs) -> Fail | str:
    """assign_buckets at caps 0, 4 KB, exactly the last three parameters' bytes, 40 KB and ∞: the
    parameters in reverse order, a new bucket when the next parameter would pass the cap (one
    larger than the cap alone); a bucket that reaches the cap exactly is full, not over."""
    from data_parallel import assign_buckets  # the chapter's own

    got = runs[0].ranks[0]
    named = list(build_model(CFG, dtype=torch.float64, device="meta").named_parameters())
    want = {cap: [[n for n, _ in b] for b in assign_buckets(named, cap)] for cap in CAPS}
    for cap, buckets in want.items():
        if got[cap] == buckets:
            continue
        flat, expected = [n for b in got[cap] for n in b], [n for b in buckets for n in b]
        if flat == expected[::-1]:
            hint = "forward order: backward produces the last layer's gradients first, so reverse the list"
        elif sorted(flat) != sorted(expected):
            hint = "every parameter must be in exactly one bucket"
        elif cap == EXACT and len(got[cap][0]) < 3 <= len(buckets[0]):
            hint = (f"the last three parameters fill {cap:g} B exactly, the cap: a bucket that reaches the "
                    "cap is full, not over it. Cut when the size would pass the cap (>), not reach it (>=)")
        else:
            hint = ("cut when adding the next parameter would pass the cap (not after it passed); "
                    "a parameter larger than the cap gets a bucket of its own")
        sizes, counts = [len(b) for b in got[cap]], [len(b) for b in buckets]
        if sizes != counts:
            return Fail(f"cap {cap:g} B: {len(sizes)} buckets {sizes}, expected {len(counts)} {counts}", hint)
        i = next(i for i, (g, w) in enumerate(zip(got[cap], buckets, strict=True)) if g != w)
        return Fail(f"cap {cap:g} B: bucket {i} holds {_members(got[cap][i])}, "
                    f"expected {_members(buckets[i])}", hint)
    return f"{sum(len(b) for b in want.values())} buckets at {len(CAPS)} caps, as expected"


def _members(bucket: list[str]) -> str:
    """A bucket's parameter names; a long one by its first and last."""
    return str(bucket) if len(bucket) <= 3 else f"[{bucket[0]}, … {len(bucket) - 2} more …, {bucket[-1]}]"


@cache
def _local(mine: int, size: int) -> dict[str, torch.Tensor]:
    """The gradient of one rank's own rows of step 1's batch alone (rank `mine` of `size`)."""
    tokens = SyntheticTokens(CFG.vocab_size, SEQ, seed=0).global_batch(0, BATCH)
    rows = tokens[mine * BATCH // size : (mine + 1) * BATCH // size]
    return make_reference(CFG, 0, torch.float64, "sgd", LR).step(rows)[1]


def _suspect(got: dict, config: dict, rank: int, want: dict) -> str | None:
    """What typical bugs leave in a rank's gradients at step 1: its own slice's gradient (never
    reduced), the average with its own gradient added on top, or the sum over the whole world
    divided by its group's size (group= not passed on)."""
    sizes = config.get("groups") or [config["world"]]
    mine, size, _ = group_of(sizes, rank)
    local = _local(mine, size)
    everyone = [_local(*group_of(sizes, q)[:2]) for q in range(config["world"])]
    suspects = [(local, "never averaged: each rank kept the gradient of its own slice (no all-reduce reached "
                        "p.grad: is the averaged bucket copied back into every p.grad?)"),
                ({n: want[n] + local[n] for n in want},
                 "the average plus this rank's own gradient: the average was written into p.grad before "
                 "autograd accumulated this backward's gradient on top (a hook on the wrong event: "
                 "Tensor.register_hook fires before accumulation; use register_post_accumulate_grad_hook)")]
    if len(sizes) > 1:
        suspects.append(({n: sum(g[n] for g in everyone) / size for n in want},
                         "summed over the whole world, not over your group: pass group= to every collective"))
    return next((hint for tensors, hint in suspects
                 if all(close(got.get(n), t) for n, t in tensors.items())), None)


def check_grads(runs) -> Fail | str:
    """Every rank's gradients after backward, each step, equal one device's on the whole batch
    (1e-10)."""
    for run in runs:
        config, steps = run.config, run.config.get("steps", 1)
        want = one_device(CFG, steps, BATCH, SEQ, config.get("optimizer", "sgd"), LR).grads
        failing = [k for k in range(steps)
                   if any(first_difference(r["grads"][k], want[k]) for r in run.ranks)]
        if not failing:
            continue
        k = failing[0]
        rank = next(r for r, got in enumerate(run.ranks) if first_difference(got["grads"][k], want[k]))
        got = run.ranks[rank]["grads"][k]
        finding = first_difference(got, want[k])
        _, n, _ = group_of(config.get("groups") or [run.world], rank)
        right = [r for r, other in enumerate(run.ranks) if not first_difference(other["grads"][k], want[k])]
        hint = ((_suspect(got, config, rank, want[k]) if k == 0 else None)
                or steps_pattern(failing, steps)
                or (f"ranks {right} are right, rank {rank} is not: every rank must end with the same average "
                    "(is something done on some ranks only?)" if right else "")
                or _divided_by(finding, n) or explain(finding, n))
        return Fail(f"step {k + 1}, {where(config, rank)}: grad of {finding}", hint)
    return f"every rank's gradients within 1e-10 at {', '.join(_label(r.config) for r in runs)}"


def _divided_by(finding, n: int) -> str:
    """A gradient scaled by n/m: divided by m where the group has n ranks."""
    for m in range(1, 9):
        if m != n and near(finding.scale, n / m):
            return (f"gradients {n}/{m} of the average: divided by {m} where the group has {n} ranks (a "
                    "hard-coded size, or the world's size where your group= is smaller)" if m > 1 else
                    f"gradients {n}× too large: summed, never divided (a missing 1/n)")
    return ""


def _label(config: dict) -> str:
    return f"world {config['world']}" + (f" in groups {config['groups']}" if config.get("groups") else "")


def check_no_sync(runs) -> Fail | str:
    """Inside no_sync nothing is communicated: one all-reduce per bucket per step, whatever the
    number of micro-batches."""
    for run in runs:
        for rank, got in enumerate(run.ranks):
            launched = sum(kind == "all_reduce" for kind, _ in got["events"])
            steps = run.config.get("steps", 1)
            if launched != steps * got["buckets"]:
                return Fail(f"{where(run.config, rank)}: {launched} all-reduces for {steps} step(s) of "
                            f"{run.config.get('micro', 1)} micro-batches and {got['buckets']} buckets",
                            "inside no_sync() nothing is communicated: one reduction per bucket per step")
    return "one all-reduce per bucket per step under no_sync"


def check_overlap(runs) -> Fail | str:
    """What bucketing is for: the first all-reduce is posted while backward still has gradients to
    produce, and there is one all-reduce per bucket."""
    for rank, got in enumerate(runs[0].ranks):
        kinds = [kind for kind, _ in got["events"]]
        launched = kinds.count("all_reduce")
        if launched != got["buckets"]:
            return Fail(f"rank {rank}: {launched} all-reduces for {got['buckets']} buckets in one backward",
                        "one all-reduce per bucket per backward: launch a bucket exactly when its last "
                        "gradient arrives")
        first = kinds.index("all_reduce")
        if "grad" not in kinds[first:]:
            return Fail(f"rank {rank}: every all-reduce was posted after backward's last gradient",
                        "launch each bucket from the hook as soon as it is full (async_op=True), not at "
                        "the end")
    kinds = [kind for kind, _ in runs[0].ranks[0]["events"]]
    first = kinds.index("all_reduce")
    to_come = kinds[first:].count("grad") - 1  # the hook that launched it ran just before the grader's own
    return (f"{launched} all-reduces, the first posted with {to_come} of {kinds.count('grad')} gradients "
            "still to come")


PROPERTIES = [
    Property("assign_buckets: reverse order, cut at the cap", [{"world": 1}], bucket_layouts,
             [check_layouts]),
    Property("one backward equals one device (SGD, 2 and 3 ranks)", [{"world": 2}, {"world": 3}],
             train, [check_grads]),
    Property("three AdamW steps equal one device (2 ranks)",
             [{"world": 2, "steps": 3, "optimizer": "adamw"}], train, [check_grads]),
    Property("no_sync: two micro-batches, one reduction (2 ranks)",
             [{"world": 2, "steps": 2, "micro": 2}], train, [check_grads, check_no_sync]),
    Property("group=: a world of 3 cut into groups of 2 and 1", [{"world": 3, "groups": [2, 1]}],
             train, [check_grads]),
    Property("the all-reduces start during backward (2 ranks)", [{"world": 2}], train, [check_overlap]),
]
