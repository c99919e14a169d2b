"""Chapter 04's FSDP dropped into a user's own training code: the original parameters by name
(use_orig_params), per-parameter optimizer groups, an LR scheduler, a state-dict round trip, norms
kept out of mixed precision, and gradients reduced in the configured reduce_dtype."""

from __future__ import annotations

from contextlib import nullcontext

import pytest
import torch
import torch.distributed as dist
from torch import nn

from common.comm import CommMeter
from common.data import local_micro_batches, split_inputs_targets
from common.kernel.model import RMSNorm, TransformerBlock, build_model, get_config, loss_fn
from common.reference import make_optimizer, relative_diff
from fsdp import (
    FullyShardedDataParallel,
    MixedPrecision,
    ModuleWrapPolicy,
    clean_name,
    fsdp_comm_bytes,
    unit_traffic,
)
from tests.equivalence import TrainSpec

# --- a user's own loop: param groups, a scheduler, names, a state-dict round trip ------------------

SPEC = TrainSpec(cfg=get_config("tiny", n_layers=2), world_size=2, global_batch=4, micro_batch=2,
                 seq_len=6, steps=2)


def users_optimizer(named: list[tuple[str, nn.Parameter]]):
    """No weight decay on norms; the LR halves every step."""
    decay = [p for n, p in named if not n.endswith("norm.weight")]
    no_decay = [p for n, p in named if n.endswith("norm.weight")]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=1e-2, foreach=False)
    return optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5**step)


def users_loop(spec: TrainSpec) -> dict:
    """Rank r trains FSDP(use_orig_params=True) on its half of each batch while training the
    single-device model on the whole batch itself; every step, each original parameter's grad
    (found by name) must equal its piece of the reference's gradient."""
    cfg, rank, world = spec.cfg, dist.get_rank(), dist.get_world_size()
    reference = build_model(cfg, spec.seed, torch.float64)
    model = FullyShardedDataParallel(build_model(cfg, spec.seed, torch.float64), use_orig_params=True,
                                     auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
    optimizer, scheduler = users_optimizer(list(model.named_parameters()))
    ref_optimizer, ref_scheduler = users_optimizer(list(reference.named_parameters()))
    layout = [p for unit in model.shard_layout() for p in unit.params]
    named = {clean_name(n): p for n, p in model.named_parameters()}  # torch's names, wrappers stripped
    grad_diff, losses, ref_losses = 0.0, [], []
    for step in range(spec.steps):
        tokens = spec.data().global_batch(step, spec.global_batch)
        inputs, targets = split_inputs_targets(local_micro_batches(tokens, rank, world, spec.micro_batch)[0])
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        ref_inputs, ref_targets = split_inputs_targets(tokens)
        ref_loss = loss_fn(reference(ref_inputs), ref_targets)
        ref_loss.backward()
        ref_grads = {n: p.grad for n, p in reference.named_parameters()}
        for p in layout:  # this rank's piece of each gradient, by the parameter's original name
            mine = named[p.name].grad.reshape(-1)
            theirs = ref_grads[p.name].reshape(-1)[p.offset : p.offset + p.numel]
            grad_diff = max(grad_diff, ((mine - theirs).abs().max() / ref_grads[p.name].abs().max()).item()
                            if p.numel else 0.0)
        for opt, sched in ((optimizer, scheduler), (ref_optimizer, ref_scheduler)):
            opt.step()
            sched.step()
            opt.zero_grad()
        losses.append(loss.detach())
        ref_losses.append(ref_loss.item())
    full = model.full_state_dict(rank0_only=False)
    fresh = FullyShardedDataParallel(build_model(cfg, spec.seed + 1, torch.float64), use_orig_params=True,
                                     auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
    fresh.load_state_dict(full)
    unwrapped = build_model(cfg, spec.seed + 1, torch.float64)
    unwrapped.load_state_dict(full)
    mean_losses = torch.stack(losses)
    dist.all_reduce(mean_losses)
    return {"names": list(named), "ref_names": [n for n, _ in reference.named_parameters()],
            "torch_names": [n for n, _ in model.named_parameters()],
            "shapes": {n: tuple(p.shape) for n, p in named.items()}, "grad_diff": grad_diff,
            "loss_diff": max(abs(a / world - b) / b for a, b in zip(mean_losses.tolist(), ref_losses,
                                                                    strict=True)),
            "param_diff": relative_diff({n: full[n] for n in named},
                                        {n: p.detach() for n, p in reference.named_parameters()}),
            "round_trip": relative_diff(fresh.full_state_dict(rank0_only=False), full) == 0
            and relative_diff(unwrapped.state_dict(), full) == 0}


def test_users_loop_with_original_parameters_equals_single_device(pools):
    results = pools.run(2, users_loop, SPEC)
    for r in results:
        assert r["names"] == r["ref_names"]  # original names, original order
        wrapped = "_fsdp_wrapped_module.layers.0._fsdp_wrapped_module.attention_norm.weight"
        assert r["torch_names"][1] == wrapped  # torch's names, with the wrappers' segments
        assert r["grad_diff"] <= 1e-10 and r["loss_diff"] <= 1e-10 and r["param_diff"] <= 1e-10, r
        assert r["round_trip"]
    shapes = results[0]["shapes"]
    assert len(shapes["layers.0.attention.wq.weight"]) == 1  # this rank's 1-D piece, like torch's


# --- a master-only checkpoint: torch's optim_state_dict pair, against one device and torch's FSDP1 ---

def optimizer_checkpoint(spec: TrainSpec, path: str) -> dict:
    """The torch user's FSDP1 checkpoint: model.state_dict() and FSDP.optim_state_dict(model, optim)
    on every rank (collectives), `if rank == 0: torch.save`, every rank loading the file into a
    fresh model (other init) with optim.load_state_dict(FSDP.optim_state_dict_to_load(...)), one
    more step. Single-device AdamW on the whole batch alongside (float64)."""
    cfg, rank, world = spec.cfg, dist.get_rank(), dist.get_world_size()
    def adamw(module: nn.Module):
        opt = torch.optim.AdamW(module.parameters(), lr=1e-2, weight_decay=0.1, foreach=False)
        return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)

    def wrap(seed: int):
        model = FullyShardedDataParallel(build_model(cfg, seed, torch.float64),
                                         auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
        return model, *adamw(model)

    reference = build_model(cfg, spec.seed, torch.float64)
    ref_opt, ref_sched = adamw(reference)

    def step(model, opt, sched, s: int) -> None:
        tokens = spec.data().global_batch(s, spec.global_batch)
        inputs, targets = split_inputs_targets(local_micro_batches(tokens, rank, world, spec.micro_batch)[0])
        loss_fn(model(inputs), targets).backward()
        ref_inputs, ref_targets = split_inputs_targets(tokens)
        loss_fn(reference(ref_inputs), ref_targets).backward()
        for o, sch in ((opt, sched), (ref_opt, ref_sched)):
            o.step()
            sch.step()
            o.zero_grad()

    model, opt, sched = wrap(spec.seed)
    for s in range(spec.steps):
        step(model, opt, sched, s)
    osd = FullyShardedDataParallel.optim_state_dict(model, opt)
    model_state = model.state_dict()
    ref_state = ref_opt.state_dict()
    names = [n for n, _ in reference.named_parameters()]
    by_name = {names[i]: v for i, v in ref_state["state"].items()}
    state_diff = max(relative_diff(osd["state"][n], by_name[n]) for n in names)
    if rank == 0:
        torch.save({"model": model_state, "optimizer": osd, "scheduler": sched.state_dict()}, path)
    dist.barrier()
    saved = torch.load(path)
    model, opt, sched = wrap(spec.seed + 1)
    model.load_state_dict(saved["model"])
    opt.load_state_dict(FullyShardedDataParallel.optim_state_dict_to_load(model, opt, saved["optimizer"]))
    sched.load_state_dict(saved["scheduler"])
    step(model, opt, sched, spec.steps)
    return {"names": sorted(osd["state"]) == sorted(names), "group_names": osd["param_groups"][0]["params"],
            "state_diff": state_diff, "keys": sorted(osd["state"][names[0]]),
            "param_diff": relative_diff(model.full_state_dict(rank0_only=False),
                                        {n: p.detach() for n, p in reference.named_parameters()})}


def torch_fsdp1_optim_state(cfg) -> dict:
    """torch's own FSDP1 (CPU, gloo) on the same model and batch: its optim_state_dict's names,
    keys and values (float32: its clip and gathers want it), and ours beside it."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    rank = dist.get_rank()
    tokens = torch.randint(0, cfg.vocab_size, (2, 7), generator=torch.Generator().manual_seed(rank))
    states = []
    for cls, kwargs in ((TorchFSDP, {"device_id": torch.device("cpu")}), (FullyShardedDataParallel, {})):
        model = cls(build_model(cfg, 0, torch.float32), auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
                    **kwargs)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=False)
        loss_fn(model(tokens[:, :-1]), tokens[:, 1:]).backward()
        opt.step()
        states.append(cls.optim_state_dict(model, opt))
        del model, opt
    theirs, ours = states
    return {"names": (list(theirs["state"]), list(ours["state"])),
            "keys": [{n: sorted(v) for n, v in osd["state"].items()} for osd in states],
            "groups": (theirs["param_groups"], ours["param_groups"]),
            "diff": max(relative_diff({k: v for k, v in theirs["state"][n].items() if k != "step"},
                                      {k: v for k, v in ours["state"][n].items() if k != "step"})
                        for n in theirs["state"])}


def test_a_master_only_checkpoint_with_torchs_optim_state_dict_pair_resumes_exactly(pools, tmp_path):
    for r in pools.run(2, optimizer_checkpoint, SPEC, str(tmp_path / "ckpt.pt")):
        assert r["names"] and r["keys"] == ["exp_avg", "exp_avg_sq", "step"], r
        assert r["state_diff"] <= 1e-10 and r["param_diff"] <= 1e-10, r


def test_optim_state_dict_is_torchs_fsdp1_format_and_values(pools):
    """torch's FSDP1 runs on CPU and gloo: the same names in the same order, the same keys, the same
    param_groups, values equal to float32 rounding (different summation orders)."""
    for r in pools.run(2, torch_fsdp1_optim_state, get_config("tiny", n_layers=2)):
        assert r["names"][0] == r["names"][1] and r["keys"][0] == r["keys"][1], r
        assert r["groups"][0] == r["groups"][1], r["groups"]
        assert r["diff"] <= 1e-5, r


# --- gradient accumulation through the original parameters ---------------------------------------

def accumulate_through_orig_params(spec: TrainSpec, no_sync: bool) -> dict:
    """A user's loop that accumulates its micro-batches before each step entirely through the
    original parameters: torch's optimizer over `model.parameters()` (use_orig_params=True), FSDP's
    `clip_grad_norm_`, and `no_sync()` around all but the last backward or not. Beside it, on each
    rank, the same loop on one process over the whole batch. Each step, every original parameter's
    `.grad` (the accumulated gradient, clipped) must equal its piece of the single-process one."""
    cfg, rank, world = spec.cfg, dist.get_rank(), dist.get_world_size()
    model = FullyShardedDataParallel(build_model(cfg, spec.seed, torch.float64), use_orig_params=True,
                                     auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}))
    reference = build_model(cfg, spec.seed, torch.float64)
    optimizers = [make_optimizer(m.parameters(), spec.optimizer, spec.lr) for m in (model, reference)]
    named = {clean_name(n): p for n, p in model.named_parameters()}
    layout = [p for unit in model.shard_layout() for p in unit.params]
    grad_diff, loss_diff = 0.0, 0.0
    for step in range(spec.steps):
        tokens = spec.data().global_batch(step, spec.global_batch)
        micro = local_micro_batches(tokens, rank, world, spec.micro_batch)
        loss = torch.zeros((), dtype=torch.float64)
        for i, batch in enumerate(micro):
            with model.no_sync() if no_sync and i < len(micro) - 1 else nullcontext():
                inputs, targets = split_inputs_targets(batch)
                part = loss_fn(model(inputs), targets) / len(micro)
                part.backward()
            loss += part.detach()
        model.clip_grad_norm_(spec.clip_grad)
        ref_inputs, ref_targets = split_inputs_targets(tokens)
        ref_loss = loss_fn(reference(ref_inputs), ref_targets)
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), spec.clip_grad, foreach=False)
        ref_grads = {n: p.grad for n, p in reference.named_parameters()}
        for p in layout:  # this rank's piece of each accumulated gradient, read where the user reads it
            if p.numel:
                theirs = ref_grads[p.name].reshape(-1)[p.offset : p.offset + p.numel]
                error = (named[p.name].grad.reshape(-1) - theirs).abs().max() / ref_grads[p.name].abs().max()
                grad_diff = max(grad_diff, error.item())
        dist.all_reduce(loss)
        loss_diff = max(loss_diff, abs(loss.item() / world - ref_loss.item()) / ref_loss.item())
        for optimizer in optimizers:
            optimizer.step()
            optimizer.zero_grad()
    full = model.full_state_dict(rank0_only=False)
    return {"grad_diff": grad_diff, "loss_diff": loss_diff,
            "param_diff": relative_diff(full, {n: p.detach() for n, p in reference.named_parameters()})}


@pytest.mark.parametrize("world, no_sync, optimizer", [(2, False, "sgd"), (3, True, "adamw")])
def test_two_backwards_accumulate_through_the_original_parameters(pools, world, no_sync, optimizer):
    """Two backward passes per step (each reduced, or the first under no_sync), stepped through the
    original parameters: float64, 1e-10 against one process, every step's gradients included."""
    spec = TrainSpec(cfg=get_config("tiny", n_layers=2), world_size=world, global_batch=2 * world,
                     micro_batch=1, seq_len=6, steps=3, optimizer=optimizer, clip_grad=1e-2)
    for r in pools.run(world, accumulate_through_orig_params, spec, no_sync):
        assert max(r.values()) <= 1e-10, r


# --- MixedPrecision(_module_classes_to_ignore=(RMSNorm,)) -------------------------------------------

class NormedMLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.norm, self.down = nn.Linear(8, 16, bias=False), RMSNorm(16, 1e-5), nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.norm(self.up(x)))


def bf16_recipe_grads(model: NormedMLP, xs: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The single-device recipe with norms in fp32: bf16 copies of the linears, the norm fp32 on
    fp32 inputs with its output cast to bf16; each rank's bf16 gradient cast to fp32, averaged."""
    copy = NormedMLP()
    copy.load_state_dict(model.state_dict())
    copy.up.bfloat16(), copy.down.bfloat16()
    copy.norm.register_forward_pre_hook(lambda _, args: (args[0].float(),))
    copy.norm.register_forward_hook(lambda _, __, out: out.bfloat16())
    total: dict[str, torch.Tensor] = {}
    for x in xs:
        copy.zero_grad()
        copy(x.bfloat16()).float().pow(2).sum().backward()
        for n, p in copy.named_parameters():
            total[n] = total.get(n, 0) + p.grad.float()
    return {n: g / len(xs) for n, g in total.items()}


def exempt_norm_grads(exempt: bool) -> dict:
    torch.manual_seed(0)
    model = NormedMLP()
    xs = [torch.randn(3, 8, generator=torch.Generator().manual_seed(r)) for r in range(2)]
    reference = bf16_recipe_grads(model, xs)
    seen: dict[str, torch.dtype] = {}
    for name in ("up", "norm", "down"):  # the modules themselves (FSDP may wrap the norm)
        getattr(model, name).register_forward_pre_hook(
            lambda m, _, name=name: seen.__setitem__(name, m.weight.dtype))
    mp = MixedPrecision(torch.bfloat16, torch.float32, _module_classes_to_ignore=(RMSNorm,) if exempt else ())
    fsdp = FullyShardedDataParallel(model, mixed_precision=mp, use_orig_params=True,  # torch: with a policy
                                    auto_wrap_policy=ModuleWrapPolicy({nn.Linear}))
    fsdp(xs[dist.get_rank()]).float().pow(2).sum().backward()
    grads = fsdp.full_gradients(rank0_only=False)
    return {"seen": seen, "diff": relative_diff(grads, reference),
            "names": sorted(clean_name(n) for n, _ in fsdp.named_parameters())}


def test_mixed_precision_keeps_exempt_norms_in_fp32(pools):
    """The norm computes with its fp32 weight and the linears with bf16 ones; the gradients are
    those of the single-device bf16 recipe that keeps norms in fp32 (2 ranks: the fp32 mean of
    the two ranks' bf16 gradients, exact up to fp32 rounding)."""
    for r in pools.run(2, exempt_norm_grads, True):
        assert r["seen"] == {"up": torch.bfloat16, "norm": torch.float32, "down": torch.bfloat16}
        assert r["diff"] <= 1e-6, r["diff"]
        assert r["names"] == ["down.bias", "down.weight", "norm.weight", "up.weight"]


# --- reduce_dtype is honoured (a bf16 reduction would round the sum) ----------------------------------

def reduce_one_and_a_tiny_gradient() -> dict:
    """Rank 0's gradient is 1.0, rank 1's 2⁻⁹: exact in bf16 each, but their sum is not (bf16 keeps
    8 significant bits), so only a float32 reduction gives (1 + 2⁻⁹)/2."""
    model = nn.Linear(1, 1, bias=False)
    fsdp = FullyShardedDataParallel(model, mixed_precision=MixedPrecision(torch.bfloat16, torch.float32))
    x = torch.tensor([[1.0 if dist.get_rank() == 0 else 2.0**-9]])
    with CommMeter() as meter:
        fsdp(x).sum().backward()
    return {"grad": fsdp.full_gradients(rank0_only=False)["weight"].item(), "bytes": meter.bytes_sent,
            "formula": fsdp_comm_bytes(unit_traffic(fsdp.shard_layout()), 2, fsdp.sharding_strategy)}


def test_gradients_are_reduced_in_reduce_dtype_and_the_formula_says_so(pools):
    for r in pools.run(2, reduce_one_and_a_tiny_gradient):
        assert r["grad"] == (1 + 2**-9) / 2
        assert r["bytes"] == r["formula"]  # 2 bf16 gathered + 2 fp32 reduced, (n-1)/n of each
