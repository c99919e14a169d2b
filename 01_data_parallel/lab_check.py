"""Lab 01's properties: what `make lab-check N=1` runs on your lab.py (common/grader.py runs them).

A small LLaMA in float64 is trained with your BucketedDDP on 2 and 3 ranks, each rank on its slice
of the global batch, and compared with the same training on one device (common/reference.py):
every gradient after backward, every step, and the parameters at the end, at 1e-10.
"""

from __future__ import annotations

from contextlib import nullcontext

import torch
import torch.distributed as dist

from common.data import SyntheticTokens, local_micro_batches, split_inputs_targets
from common.diagnosis import explain, first_difference, steps_pattern
from common.grader import Property
from common.model import build_model, get_config, loss_fn
from common.patch import patch_dist
from common.reference import make_optimizer, make_reference

TITLE = "bucketed DDP"
CFG = get_config("tiny", n_layers=2)
BATCH, SEQ, LR, CAP_MB = 6, 8, 1e-2, 0.01  # 0.01 MiB: the tiny model's gradients make several buckets
TOLERANCE = 1e-10


def _names(model: torch.nn.Module) -> dict[int, str]:
    return {id(p): n for n, p in model.named_parameters()}


def bucket_layouts(lab, world: int) -> dict[float, list[list[str]]]:
    """Your assign_buckets on the model's parameters at a few caps, as names."""
    model = build_model(CFG, dtype=torch.float64, device="meta")
    names, params = _names(model), list(model.parameters())
    return {cap: [[names[id(p)] for p in b] for b in lab.assign_buckets(params, cap)]
            for cap in (0.0, 4096.0, 40_000.0, float("inf"))}


def reference_layouts() -> dict[float, list[list[str]]]:
    from data_parallel import assign_buckets  # the chapter's own, in reverse order too

    named = list(build_model(CFG, dtype=torch.float64, device="meta").named_parameters())
    return {cap: [[n for n, _ in b] for b in assign_buckets(named, cap)]
            for cap in (0.0, 4096.0, 40_000.0, float("inf"))}


def check_layouts(runs) -> tuple[bool, str, str]:
    got, want = runs[0][1], reference_layouts()
    for cap, buckets in want.items():
        if got[cap] == buckets:
            continue
        flat = [n for b in got[cap] for n in b]
        if flat == [n for b in buckets for n in b][::-1]:
            hint = "forward order: backward produces the last layer's gradients first, so reverse the list"
        elif sorted(flat) != sorted(n for b in buckets for n in b):
            hint = "every parameter must be in exactly one bucket"
        else:
            hint = ("cut when adding the next parameter would pass the cap (not after it passed); "
                    "a parameter larger than the cap gets a bucket of its own")
        sizes, expected = [len(b) for b in got[cap]], [len(b) for b in buckets]
        if sizes != expected:
            return False, f"cap {cap:g} B: {len(sizes)} buckets {sizes}, " \
                          f"expected {len(expected)} {expected}", hint
        i = next(i for i, (g, w) in enumerate(zip(got[cap], buckets, strict=True)) if g != w)
        return False, f"cap {cap:g} B: bucket {i} holds {_members(got[cap][i])}, " \
                      f"expected {_members(buckets[i])}", hint
    return True, f"{sum(len(b) for b in want.values())} buckets at 4 caps, as expected", ""


def _members(bucket: list[str]) -> str:
    """A bucket's parameter names; a long one by its first and last."""
    return str(bucket) if len(bucket) <= 3 else f"[{bucket[0]}, … {len(bucket) - 2} more …, {bucket[-1]}]"


def train(lab, world: int, steps: int = 1, optimizer: str = "sgd", micro: int = 1) -> dict:
    """Every rank: the model under your BucketedDDP, its slice of each global batch in `micro`
    micro-batches (all but the last under no_sync); rank 0 returns what the check compares."""
    rank = dist.get_rank()
    model = build_model(CFG, seed=0, dtype=torch.float64)
    ddp = lab.BucketedDDP(model, bucket_cap_mb=CAP_MB)
    opt = make_optimizer(model.parameters(), optimizer, LR)
    data, events, names = SyntheticTokens(CFG.vocab_size, SEQ, seed=0), [], _names(model)
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
            shards = local_micro_batches(data.global_batch(step, BATCH), rank, world, BATCH // world // micro)
            for i, tokens in enumerate(shards):
                with ddp.no_sync() if i < len(shards) - 1 else nullcontext():
                    inputs, targets = split_inputs_targets(tokens)
                    (loss_fn(ddp(inputs), targets) / len(shards)).backward()
            grads.append({n: p.grad.detach().clone() for n, p in model.named_parameters()})
            opt.step()
            opt.zero_grad(set_to_none=True)
    return {"grads": grads, "params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "events": events, "buckets": len(ddp.buckets)}


def reference(steps: int, optimizer: str) -> dict:
    trainer = make_reference(CFG, 0, torch.float64, optimizer, LR)
    data = SyntheticTokens(CFG.vocab_size, SEQ, seed=0)
    grads = [trainer.step(data.global_batch(step, BATCH))[1] for step in range(steps)]
    return {"grads": grads, "params": {n: t.clone() for n, t in trainer.parameters().items()}}


def check_equal(runs) -> tuple[bool, str, str]:
    """Every run's gradients (each step) and final parameters against one device."""
    for config, got in runs:
        steps, world = config.get("steps", 1), config["world"]
        want = reference(steps, config.get("optimizer", "sgd"))
        failing = [s for s in range(steps) if first_difference(got["grads"][s], want["grads"][s], TOLERANCE)]
        if failing:
            s = failing[0]
            finding = first_difference(got["grads"][s], want["grads"][s], TOLERANCE)
            hint = steps_pattern(failing, steps) or explain(finding, world)
            return False, f"step {s + 1}, world {world}, rank 0: grad of {finding}", hint
        if finding := first_difference(got["params"], want["params"], TOLERANCE):
            return False, f"after {steps} steps, world {world}: parameter {finding}", \
                "the gradients were right: is the optimizer given model.parameters() and stepped once?"
        if config.get("micro", 1) > 1:
            launched = sum(kind == "all_reduce" for kind, _ in got["events"])
            if launched != steps * got["buckets"]:
                return False, f"{launched} all-reduces for {steps} step(s) of {got['buckets']} buckets", \
                    "inside no_sync() nothing is communicated: one reduction per bucket per step"
    worlds = sorted({c["world"] for c, _ in runs})
    return True, f"every gradient and parameter within {TOLERANCE:g} at world {worlds}", ""


def check_overlap(runs) -> tuple[bool, str, str]:
    """The first all-reduce is posted before backward's last gradient, and there is one per bucket."""
    _, got = runs[0]
    kinds = [kind for kind, _ in got["events"]]
    launched = kinds.count("all_reduce")
    if launched != got["buckets"]:
        return False, f"{launched} all-reduces for {got['buckets']} buckets in one backward", \
            "one all-reduce per bucket per backward: launch a bucket exactly when its last gradient arrives"
    first = kinds.index("all_reduce")
    if "grad" not in kinds[first:]:
        return False, "every all-reduce was posted after backward's last gradient", \
            "launch each bucket from the hook as soon as it is full (async_op=True), not at the end"
    # the hook that launched it ran just before the grader's own hook on the same parameter
    to_come = kinds[first:].count("grad") - 1
    return True, f"{launched} all-reduces, the first posted with {to_come} of " \
                 f"{kinds.count('grad')} gradients still to come", ""


PROPERTIES = [
    Property("assign_buckets: reverse order, cut at the cap", [{"world": 1}], bucket_layouts, check_layouts),
    Property("one backward equals one device (SGD, 2 and 3 ranks)", [{"world": 2}, {"world": 3}],
             train, check_equal),
    Property("three AdamW steps equal one device (2 ranks)",
             [{"world": 2, "steps": 3, "optimizer": "adamw"}], train, check_equal),
    Property("no_sync: two micro-batches, one reduction (2 ranks)",
             [{"world": 2, "steps": 2, "micro": 2}], train, check_equal),
    Property("the all-reduces start during backward (2 ranks)", [{"world": 2}], train, check_overlap),
]
