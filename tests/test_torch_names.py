"""Where a class, function, method, attribute or argument carries torch's name, it keeps torch's
contract (the developers' guide, rule 6): each is called here, or in the test ENTRY_POINTS names,
exactly as torch's docs call it, against torch's own where it runs on CPU and gloo; what cannot be
honoured fails loudly, naming the fix.

`torch_named_entry_points()` finds them all: every public class and function of a chapter's core
files and of the kernel whose name is a public name of torch's distributed / nn / optim APIs (or
whose counterpart COUNTERPARTS names: ZeroOptimizer is ZeroRedundancyOptimizer's shape), its
methods and attributes with the counterpart's names, the methods of any class that override a torch
base class's (nn.Module's state_dict, Optimizer's step, ...), and every argument such a callable
shares with its counterpart. ENTRY_POINTS maps each to the test that calls it the torch way, and
`test_every_entry_point_is_listed_with_a_torch_way_call` fails when a new torch name appears
without one (or the test named no longer calls it).
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import importlib
import inspect
import textwrap
import warnings
from functools import cache
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import nn

from common import copy_sets
from common.kernel.collectives import all_gather_single, reduce_scatter_single
from common.kernel.model import RMSNorm
from common.reference import relative_diff
from data_parallel.ddp import DistributedDataParallel
from fsdp.torch_fsdp2 import fsdp2_unavailable
from tests.harness import RankError

TORCH_NAMESPACES = (
    "torch.nn", "torch.nn.utils", "torch.optim", "torch.optim.lr_scheduler", "torch.autograd",
    "torch.distributed", "torch.distributed.fsdp", "torch.distributed.fsdp.wrap", "torch.distributed.optim",
    "torch.nn.parallel", "torch.distributed.pipelining", "torch.distributed.tensor.parallel",
    "torch.distributed.device_mesh", "torch.utils.checkpoint", "torch.distributed.checkpoint",
    "torch.distributed.algorithms._checkpoint.checkpoint_wrapper")
# our own name, torch's shape: the torch classes whose contract it keeps
COUNTERPARTS = {"zero.optimizer.ZeroOptimizer": ("torch.distributed.optim.ZeroRedundancyOptimizer",),
               # FSDP1's shape, and FSDP2's (FSDPModule) for the FSDP2 methods it borrows
               "fsdp.fully_sharded.FullyShardedDataParallel": (
                   "torch.distributed.fsdp.FullyShardedDataParallel", "torch.distributed.fsdp.FSDPModule")}
PROTOCOL = {"forward", "backward", "extra_repr", "setup_context"}  # every Module / Function defines them
ALIASES = {"FullyShardedDataParallel": {"FSDP"}, "DistributedDataParallel": {"DDP"},
           "ZeroOptimizer": {"ZeroRedundancyOptimizer"}}  # what torch's docs and users call them

CONTRACT, HERE = "tests/test_fsdp_torch_contract.py", "tests/test_torch_names.py"
FSDP1 = f"{CONTRACT}::test_torchs_fsdp1_calls_give_torchs_results"
REFUSED = f"{CONTRACT}::test_torchs_fsdp1_methods_not_implemented_here_raise_naming_the_fix"
DDP = f"{HERE}::test_torchs_ddp_calls_give_torchs_results"
ZERO = "tests/test_zero_optimizer.py::test_torchs_zero_redundancy_optimizer_calls_give_torchs_results"
COLLECTIVES = f"{HERE}::test_collectives_take_torchs_signatures"
NORM = f"{HERE}::test_rmsnorm_is_torchs_rmsnorm_where_it_takes_one_dimension"
DIVIDE = f"{HERE}::test_gradient_divide_factor_divides_as_torchs_fsdp2"
MEMBERS = f"{CONTRACT}::test_enums_have_torchs_members_hybrid_shard_included"
SIZE_POLICY = f"{CONTRACT}::test_size_based_policy_answers_as_torchs"
LAYER_POLICY = f"{CONTRACT}::test_transformer_policy_answers_as_torchs"
PREFETCH = f"{CONTRACT}::test_backward_prefetch_issues_the_next_gather_where_torch_does"
HYBRID = f"{CONTRACT}::test_hybrid_shard_works_with_torchs_groups_and_the_whole_api"
SHARDING = "tests/test_fsdp.py::test_fsdp_equals_single_device_float64"
EXEMPT = "tests/test_fsdp_drop_in.py::test_mixed_precision_keeps_exempt_norms_in_fp32"
F, W = "fsdp.fully_sharded.FullyShardedDataParallel", "fsdp.wrap"


def entries(prefix: str, test: str, *suffixes: str) -> dict[str, str]:
    return {prefix + s: test for s in suffixes}


ENTRY_POINTS: dict[str, str] = {
    **entries("common.kernel.collectives.", COLLECTIVES, "all_gather_single", "all_gather_single(async_op)",
              "all_gather_single(group)", "all_gather_single(input_tensor)",
              "all_gather_single(output_tensor)", "reduce_scatter_single", "reduce_scatter_single(async_op)",
              "reduce_scatter_single(group)", "reduce_scatter_single(input)", "reduce_scatter_single(op)",
              "reduce_scatter_single(output)"),
    **entries("common.kernel.model.RMSNorm", NORM, "", "(eps)", ".eps", ".forward", ".forward(x)", ".weight"),
    **entries("data_parallel.ddp.DistributedDataParallel", DDP, "", "(broadcast_buffers)", "(bucket_cap_mb)",
              "(device_ids)", "(find_unused_parameters)", "(gradient_as_bucket_view)", "(module)",
              "(output_device)", "(process_group)", ".broadcast_buffers", ".device",
              ".find_unused_parameters", ".forward", ".module", ".no_sync", ".require_backward_grad_sync",
              ".zero_grad", ".zero_grad(set_to_none)"),
    **entries(F, FSDP1, "", "(auto_wrap_policy)", "(backward_prefetch)", "(cpu_offload)", "(device_id)",
              "(device_mesh)", "(forward_prefetch)", "(ignored_modules)", "(ignored_states)",
              "(limit_all_gathers)", "(mixed_precision)", "(module)", "(process_group)",
              "(sharding_strategy)", ".clip_grad_norm_",
              ".clip_grad_norm_(max_norm)", ".clip_grad_norm_(norm_type)", ".forward", ".load_state_dict",
              ".load_state_dict(assign)", ".load_state_dict(state_dict)", ".load_state_dict(strict)",
              ".mixed_precision", ".module", ".no_sync", ".optim_state_dict", ".optim_state_dict(group)",
              ".optim_state_dict(model)", ".optim_state_dict(optim)", ".optim_state_dict(optim_state_dict)",
              ".optim_state_dict_to_load", ".optim_state_dict_to_load(group)",
              ".optim_state_dict_to_load(is_named_optimizer)", ".optim_state_dict_to_load(load_directly)",
              ".optim_state_dict_to_load(model)", ".optim_state_dict_to_load(optim)",
              ".optim_state_dict_to_load(optim_state_dict)", ".process_group", ".state_dict",
              ".state_dict(destination)", ".state_dict(keep_vars)", ".state_dict(prefix)"),
    **entries(F + ".", REFUSED, "apply", "flatten_sharded_optim_state_dict", "full_optim_state_dict",
              "get_state_dict_type", "register_comm_hook", "rekey_optim_state_dict",
              "scatter_full_optim_state_dict", "set_state_dict_type", "shard_full_optim_state_dict",
              "sharded_optim_state_dict", "state_dict_type", "summon_full_params"),
    **entries(f"{W}.", MEMBERS, "BackwardPrefetch", "ShardingStrategy"),
    **entries(f"{W}.", FSDP1, "BackwardPrefetch.BACKWARD_PRE", "ShardingStrategy.FULL_SHARD",
              "MixedPrecision", "MixedPrecision(buffer_dtype)", "MixedPrecision(cast_forward_inputs)",
              "MixedPrecision(cast_root_forward_inputs)", "MixedPrecision(keep_low_precision_grads)",
              "MixedPrecision(param_dtype)", "MixedPrecision(reduce_dtype)", "ModuleWrapPolicy",
              "ModuleWrapPolicy(module_classes)"),
    f"{F}(param_init_fn)":  # with a function, not only None: torch's meta-device recipe
        "tests/test_construction.py::test_fsdp_param_init_fn_peak_is_one_unit_and_values_are_the_references",
    f"{F}(sync_module_states)": "tests/test_fsdp.py::test_sync_module_states_and_inf_norm_clipping",
    f"{F}(use_orig_params)":
        "tests/test_fsdp_drop_in.py::test_users_loop_with_original_parameters_equals_single_device",
    **entries(F, DIVIDE, ".set_gradient_divide_factor", ".set_gradient_divide_factor(factor)"),
    f"{W}.BackwardPrefetch.BACKWARD_POST": PREFETCH,
    f"{W}.ShardingStrategy.HYBRID_SHARD": HYBRID,
    f"{W}.ShardingStrategy.NO_SHARD": SHARDING,
    f"{W}.ShardingStrategy.SHARD_GRAD_OP": SHARDING,
    f"{W}.MixedPrecision(_module_classes_to_ignore)": EXEMPT,
    **entries(f"{W}.size_based_auto_wrap_policy", SIZE_POLICY, "", "(exclude_wrap_modules)",
              "(force_leaf_modules)", "(min_num_params)", "(module)", "(nonwrapped_numel)", "(recurse)"),
    **entries(f"{W}.transformer_auto_wrap_policy", LAYER_POLICY, "", "(module)", "(nonwrapped_numel)",
              "(recurse)", "(transformer_layer_cls)"),
    **entries("zero.optimizer.ZeroOptimizer", ZERO, "", "(optimizer_class)", "(params)", "(process_group)",
              ".add_param_group", ".add_param_group(param_group)", ".consolidate_state_dict",
              ".consolidate_state_dict(to)", ".load_state_dict", ".load_state_dict(state_dict)", ".optim",
              ".param_groups", ".rank", ".state_dict", ".step", ".step(closure)", ".zero_grad",
              ".zero_grad(set_to_none)"),
}


# --- the enumeration ------------------------------------------------------------------------------

@cache
def torch_vocabulary() -> dict[str, object]:
    """Every public class and function name of TORCH_NAMESPACES → the torch object."""
    out: dict[str, object] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for namespace in TORCH_NAMESPACES:
            module = importlib.import_module(namespace)
            for name in dir(module):
                value = getattr(module, name)
                if not name.startswith("_") and (inspect.isclass(value) or inspect.isroutine(value)):
                    out.setdefault(name, value)
    return out


def project_objects() -> dict[str, object]:
    """{dotted name: object} of every public class and function defined in a core or kernel file."""
    out = {}
    for path in copy_sets.core_files() + list(copy_sets.KERNEL):
        if path.endswith("__main__.py"):
            continue
        module = importlib.import_module(copy_sets.module_name(path))
        out.update((f"{module.__name__}.{n}", v) for n, v in vars(module).items()
                   if not n.startswith("_") and getattr(v, "__module__", None) == module.__name__
                   and (inspect.isclass(v) or inspect.isfunction(v)))
    return out


def parameters(fn) -> list[str]:
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):
        return []
    return [p.name for p in signature.parameters.values()
            if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def self_attributes(cls: type) -> set[str]:
    """The public `self.X` a class's source reads or writes (its instance attributes, and more)."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    except (OSError, TypeError):
        return set()
    return {n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
            and n.value.id == "self" and not n.attr.startswith("_")}


def ours(cls: type) -> bool:
    return cls.__module__.split(".")[0] in copy_sets.PACKAGES


def counterparts(qual: str) -> list[object]:
    """The torch objects whose contract `qual` keeps: COUNTERPARTS', or torch's of the same name."""
    if qual in COUNTERPARTS:
        return [getattr(importlib.import_module(p.rpartition(".")[0]), p.rpartition(".")[2])
                for p in COUNTERPARTS[qual]]
    name = qual.rpartition(".")[2]
    return [torch_vocabulary()[name]] if name in torch_vocabulary() else []


def torch_named_entry_points() -> list[str]:
    out = []
    for qual, obj in project_objects().items():
        if inspect.isclass(obj) and issubclass(obj, BaseException):
            continue  # an exception's name promises no call (07's CheckpointError is not torch's)
        theirs = counterparts(qual)
        if theirs:
            out.append(qual)
            if not (inspect.isclass(obj) and issubclass(obj, enum.Enum)):
                out += [f"{qual}({a})" for a in parameters(obj) if a in parameters(theirs[0])]
        if inspect.isclass(obj):
            out += torch_named_members(qual, obj, theirs)
    return sorted(set(out))


def torch_named_members(qual: str, cls: type, theirs: list[object]) -> list[str]:
    """Methods and attributes of `cls` named like its counterparts' (theirs), and its overrides of
    a torch base class's methods, with the arguments each shares with torch's."""
    bases = [c for c in cls.__mro__[1:] if c.__module__.split(".")[0] == "torch"]
    names = set().union(*(set(dir(t)) | self_attributes(t) for t in theirs + bases)) if theirs else set()
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    own: dict[str, object] = {}
    for c in (c for c in cls.__mro__ if ours(c)):
        for n, v in vars(c).items():
            own.setdefault(n, v)
    out = []
    for n in own:
        if n.startswith("_") or n in fields:
            continue
        member = getattr(cls, n)
        overrides = n not in PROTOCOL and callable(member) and any(hasattr(b, n) for b in bases)
        if overrides or n in names:
            out.append(f"{qual}.{n}")
            counterpart = next((getattr(t, n) for t in theirs + bases if hasattr(t, n)), None)
            if callable(member) and callable(counterpart):
                out += [f"{qual}.{n}({a})" for a in parameters(member) if a in parameters(counterpart)]
    for c in (c for c in cls.__mro__ if ours(c)):
        out += [f"{qual}.{a}" for a in self_attributes(c) & names  # instance attributes of torch's names
                if a not in own and a not in fields and not any(hasattr(b, a) for b in bases)]
    return out


# --- the list, and each entry's torch-way call --------------------------------------------------------

def test_every_entry_point_is_listed_with_a_torch_way_call():
    found = torch_named_entry_points()
    new = [e for e in found if e not in ENTRY_POINTS]
    assert not new, (f"torch-named entry points with no torch-way call listed: {new}. Call each as torch's "
                     "docs do, against torch's own where it runs on CPU, and add it to ENTRY_POINTS")
    gone = [e for e in ENTRY_POINTS if e not in found]
    assert not gone, f"ENTRY_POINTS lists names that are no longer torch-named entry points: {gone}"


@cache
def parsed(path: str) -> ast.Module:
    return ast.parse((copy_sets.ROOT / path).read_text(encoding="utf-8"))


def callee(node: ast.expr) -> str | None:
    return node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None


def resolve(target: str):
    """A dotted entry (module.Class.member or module.function) → the object."""
    objects = project_objects()
    if target in objects:
        return objects[target]
    owner, _, member = target.rpartition(".")
    return getattr(objects[owner], member)


def called_the_torch_way(entry: str, tree: ast.Module) -> bool:
    """The test file uses the entry: a name or attribute of it (or the string that indexes it); for
    `f(arg)`, a call of f (by its name or a torch alias) passing arg by keyword, by position or
    through **kwargs; for a module's forward, a call of the module built from its class."""
    target, _, arg = entry.partition("(")
    owner, _, last = target.rpartition(".")
    nodes = list(ast.walk(tree))
    if last == "forward":
        cls = owner.rpartition(".")[2]
        built = {cls} | ALIASES.get(cls, set())
        return any(isinstance(n, ast.Call) and callee(n.func) in built for n in nodes)
    names = {last} | ALIASES.get(last, set())
    if not arg:
        return any(callee(n) in names or (isinstance(n, ast.Constant) and n.value == last) for n in nodes
                   if isinstance(n, ast.Name | ast.Attribute | ast.Constant))
    arg, position = arg.rstrip(")"), parameters(resolve(target)).index(arg.rstrip(")"))
    return any(isinstance(n, ast.Call) and callee(n.func) in names
               and (any(k.arg in (arg, None) for k in n.keywords) or len(n.args) > position) for n in nodes)


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_the_test_named_for_each_entry_point_calls_it(entry):
    path, _, function = ENTRY_POINTS[entry].partition("::")
    tree = parsed(path)
    assert any(isinstance(n, ast.FunctionDef) and n.name == function for n in tree.body), ENTRY_POINTS[entry]
    assert called_the_torch_way(entry, tree), f"{path} does not call {entry} the torch way"


# --- the torch-way calls this file owns --------------------------------------------------------------

def torch_way_ddp(ours_: bool) -> dict:
    """One user's DDP code on torch's DistributedDataParallel and on ours: every argument by torch's
    keyword, accumulation under no_sync(), require_backward_grad_sync set by hand (nanoGPT's way),
    zero_grad(set_to_none=False), the state dict's "module." keys, module / device / the flags."""
    from torch.nn.parallel import DistributedDataParallel as TorchDDP

    DDP = DistributedDataParallel if ours_ else TorchDDP  # torch users' alias
    torch.manual_seed(0)
    module = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2)).double()
    model = DDP(module=module, device_ids=None, output_device=None, broadcast_buffers=True,
                process_group=None, bucket_cap_mb=25, find_unused_parameters=False,
                gradient_as_bucket_view=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(dist.get_rank())
    grads = []
    for _ in range(2):
        with model.no_sync():
            model(torch.randn(3, 4, generator=gen, dtype=torch.float64)).sum().backward()
        model.require_backward_grad_sync = False  # nanoGPT's per-micro-batch switch
        model(torch.randn(3, 4, generator=gen, dtype=torch.float64)).sum().backward()
        model.require_backward_grad_sync = True
        model(torch.randn(3, 4, generator=gen, dtype=torch.float64)).sum().backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters()})
        opt.step()
        model.zero_grad(set_to_none=False)
    facts = {"module": model.module is module, "device": model.device, "flags": (
        model.broadcast_buffers, model.find_unused_parameters, model.require_backward_grad_sync),
        "zeroed": all(p.grad is not None and not p.grad.any() for p in model.parameters())}
    state = model.state_dict()
    model = opt = None  # torch's DDP holds the process group: gone before the pool's next call
    return {"grads": grads, "state": state, **facts}


def test_torchs_ddp_calls_give_torchs_results(pools):
    theirs, ours_ = (pools.run(2, torch_way_ddp, flag)[0] for flag in (False, True))
    for mine, want in zip(ours_["grads"], theirs["grads"], strict=True):
        assert list(mine) == list(want) and relative_diff(mine, want) <= 1e-12
    assert list(ours_["state"]) == list(theirs["state"])
    assert relative_diff(ours_["state"], theirs["state"]) <= 1e-12
    for key in ("module", "device", "flags", "zeroed"):
        assert ours_[key] == theirs[key], key


def ddp_at_torchs_defaults() -> None:
    DistributedDataParallel(nn.Linear(2, 2), dim=0, static_graph=False, mixed_precision=None)


def ddp_with(argument: str) -> None:
    DistributedDataParallel(nn.Linear(2, 2), **{argument: {"dim": 1, "static_graph": True,
                                                           "mixed_precision": object()}[argument]})


@pytest.mark.parametrize("argument, fix", [("dim", "inputs are not scattered"), ("static_graph", "drop it"),
                                           ("mixed_precision", "pass reduce_dtype=torch.float32")])
def test_ddp_refuses_torchs_arguments_it_does_not_implement_naming_the_fix(pools, argument, fix):
    """At torch's default they are accepted (they change nothing); otherwise refused before any
    collective, on every rank."""
    with pytest.raises(RankError, match=rf"does not implement {argument}: .*{fix}"):
        pools.run(2, ddp_with, argument)
    pools.run(2, ddp_at_torchs_defaults)


def collectives_both_ways() -> dict:
    """Ours and torch's (the *_single names where torch has them), called as torch's docs call them:
    keywords by torch's names, reduce_scatter_single's op positional, async handles waited."""
    world, rank, f64 = dist.get_world_size(), dist.get_rank(), torch.float64
    x = torch.arange(6, dtype=f64) + 10 * rank
    theirs_gather = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
    theirs_scatter = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)
    results = [[torch.empty(6 * world, dtype=f64)] + [torch.empty(6 // world, dtype=f64) for _ in "ab"]
               for _ in "ab"]
    (gathered, summed, largest), theirs = results
    all_gather_single(output_tensor=gathered, input_tensor=x, group=None, async_op=True).wait()
    reduce_scatter_single(summed, x, dist.ReduceOp.SUM, None, False)
    reduce_scatter_single(output=largest, input=x, op=dist.ReduceOp.MAX, group=None, async_op=True).wait()
    theirs_gather(theirs[0], x, group=None, async_op=False)
    theirs_scatter(theirs[1], x, dist.ReduceOp.SUM, None, False)
    theirs_scatter(theirs[2], x, op=dist.ReduceOp.MAX, group=None, async_op=False)
    errors = []
    for call in (lambda: reduce_scatter_single(summed, x, dist.group.WORLD),
                 lambda: reduce_scatter_single(summed, x, op=dist.ReduceOp.AVG)):
        try:
            call()
        except (TypeError, ValueError) as e:
            errors.append(str(e))
    return {"same": all(torch.equal(a, b) for a, b in zip(*results, strict=True)), "errors": errors}


def test_collectives_take_torchs_signatures(pools):
    """A group passed where torch's signature has `op` is refused naming group=; AVG is refused
    naming SUM-then-divide (gloo on torch 2.5-2.8 sums silently)."""
    for result in pools.run(2, collectives_both_ways):
        assert result["same"], result
        group_error, avg_error = result["errors"]
        assert "pass the group as group=" in group_error and "pass ReduceOp.SUM and divide" in avg_error


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_rmsnorm_is_torchs_rmsnorm_where_it_takes_one_dimension(dtype):
    """RMSNorm(dim, eps=...) as torch.nn.RMSNorm(dim, eps=...): the same output and gradients, the
    same weight and eps attributes; torch's shape of several dimensions, and torch's default eps
    (machine epsilon, not LLaMA's), are refused rather than silently different."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=gen, dtype=dtype, requires_grad=True)
    norms = [RMSNorm(8, eps=1e-5), nn.RMSNorm(8, eps=1e-5)]
    outs = []
    for norm in norms:
        norm.to(dtype)
        with torch.no_grad():
            norm.weight.copy_(torch.linspace(0.5, 1.5, 8, dtype=dtype))
        x.grad = None
        y = norm(x)
        (y * torch.linspace(-1, 1, 8, dtype=dtype)).sum().backward()
        outs.append((y.detach(), x.grad.clone(), norm.weight.grad.clone(), norm.eps, norm.weight.shape))
    tolerance = {torch.float64: 1e-14, torch.float32: 1e-6}[dtype]
    for mine, want in zip(*outs, strict=True):
        if torch.is_tensor(mine):
            assert relative_diff({"t": mine}, {"t": want}) <= tolerance
        else:
            assert mine == want
    with pytest.raises(TypeError, match=r"dim is the size of the last dimension.*torch.nn.RMSNorm"):
        RMSNorm((5, 8), eps=1e-5)
    with pytest.raises(TypeError, match="eps"):
        RMSNorm(8)


def divided_gradients(ours: bool, factor: float | None) -> dict[str, torch.Tensor]:
    """One unit over 2 ranks, each rank its own rows, FSDP2's `set_gradient_divide_factor(factor)`
    (None: not called) on torch's fully_shard or ours: the full gradients after one backward, read
    as the weights one SGD step with lr 1 moved (each framework's own full state dict)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from fsdp.fully_sharded import FullyShardedDataParallel

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), nn.Tanh(), nn.Linear(6, 3)).double()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    x = torch.randn(5, 4, generator=torch.Generator().manual_seed(dist.get_rank()), dtype=torch.float64)
    if ours:
        model = FullyShardedDataParallel(model)
    else:
        fully_shard(model, mesh=init_device_mesh("cpu", (dist.get_world_size(),)))
    if factor is not None:
        model.set_gradient_divide_factor(factor)
    model(x).square().sum().backward()
    torch.optim.SGD(model.parameters(), lr=1.0).step()
    after = model.state_dict()
    after = {k: (v.full_tensor() if hasattr(v, "full_tensor") else v) for k, v in after.items()}
    return {k: before[k] - after[k] for k in before}


@pytest.mark.skipif(fsdp2_unavailable("cpu") is not None, reason=str(fsdp2_unavailable("cpu")))
def test_gradient_divide_factor_divides_as_torchs_fsdp2(pools):
    """set_gradient_divide_factor keeps FSDP2's contract: the unit's summed gradient is divided by
    the factor instead of the group's size (factor 1: the sum; 2 on 2 ranks: the default mean)."""
    for factor in (1.0, 2.0, 8.0):
        theirs, ours = (pools.run(2, divided_gradients, flag, factor)[0] for flag in (False, True))
        assert relative_diff(ours, theirs) < 1e-12, factor
    default, summed = (pools.run(2, divided_gradients, True, f)[0] for f in (None, 1.0))
    assert relative_diff({k: 2 * v for k, v in default.items()}, summed) < 1e-12


def test_entry_points_script_finds_a_new_torch_name(monkeypatch):
    """The enumeration's own control: a function named like torch's clip_grad_norm_ planted in a
    kernel module is found, and so is a planted override of nn.Module.state_dict."""
    import common.kernel.clip as clip

    def clip_grad_norm_(parameters, max_norm):  # the name the kernel's clip gave up (it now takes gradients)
        return None

    clip_grad_norm_.__module__ = clip.__name__
    monkeypatch.setattr(clip, "clip_grad_norm_", clip_grad_norm_, raising=False)
    monkeypatch.setattr(RMSNorm, "state_dict", lambda self, *a, **k: {}, raising=False)
    found = torch_named_entry_points()
    assert "common.kernel.clip.clip_grad_norm_" in found
    assert "common.kernel.clip.clip_grad_norm_(max_norm)" in found
    assert "common.kernel.model.RMSNorm.state_dict" in found
    assert Path(__file__).name == "test_torch_names.py"
