"""Lab 05's properties: what `make lab-check N=5` runs on your lab.py (common/labs/grader.py runs them).

Each property runs one job of 4 ranks, twice: on two TP groups of 2 ({0, 1} and {2, 3}, each
computing the same thing) and on one TP group of 4; every rank's result is compared in float64
with the same computation on one device at 1e-10 (max relative difference per tensor): f and g
with their definitions; the parallel linears with nn.Linear (each rank's slice of the weight and
bias first, then the output, the input's gradient and the weight and bias gradients), and a size
the group does not divide refused; parallelize_mlp and parallelize_attention with common.kernel.model's
FeedForward and Attention, counting the collectives each direction posts (what TP is for: 1/t of
the weights per rank, one all-reduce each way per sub-layer); a 2-layer LLaMA made of your pieces
trains 2 SGD steps against common.reference. Optional, reported but not needed to pass: sequence
parallelism's pair and ring attention's merge.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from common.data import SyntheticTokens, split_inputs_targets
from common.kernel.model import build_model, get_config, loss_fn, rope_cos_sin
from common.labs.diagnosis import close, first_difference
from common.labs.grader import Fail, Property
from common.labs.rank import at
from common.labs.tools import agree, collectives, one_device, rand, split
from common.reference import make_optimizer
from tensor_parallel import lab_hints as h
from tensor_parallel.lab_check_extra import EXTRA
from tensor_parallel.lab_hints import TPS, WORLD, B, T, diagnose, where

TITLE = "tensor parallelism: f, g, the parallel linears, a TP LLaMA block"
CFG = get_config("tiny", n_layers=2)  # dim 32, 4 heads, 4 K/V heads, FFN 96: splits over 2 and 4
BATCH, SEQ, LR = 4, 8, 0.1
ONE_JOB = [{"world": WORLD}]


def _group(tp: int):
    return split([tp] * (WORLD // tp)).group


# --- 1 · f and g ----------------------------------------------------------------------------------

def run_fg(lab, world: int) -> dict:
    rank, seen = dist.get_rank(), {}
    x, w = rand("x", 3, 4, rank=rank), rand("w", 3, 4, rank=rank)
    for tp in TPS:
        group = _group(tp)
        for op, fn in (("f", lab.copy_to_tp_region), ("g", lab.reduce_from_tp_region)):
            at(phase=f"{op} at TP {tp}")
            xin = x.clone().requires_grad_()
            y = fn(xin, group)
            seen[tp, op] = {"output": y.detach().clone(), "input after": xin.detach().clone()}
            (y * w).sum().backward()
            seen[tp, op]["input grad"] = None if xin.grad is None else xin.grad.clone()
    return seen


def check_fg(runs) -> Fail | str:
    """f: identity forward, gradient summed over the TP group backward; g: the sum over the group
    forward, identity backward; neither changes its input."""
    for tp in TPS:
        for q, got in enumerate(runs[0].ranks):
            want, suspects = h.fg_case(tp, q)
            x = rand("x", 3, 4, rank=q)
            for op in ("f", "g"):
                if not close(got[tp, op]["input after"], x):
                    return Fail(f"{where(tp, q)}: {op} changed its input x in place",
                                "all-reduce a copy (x.clone()): the caller still needs x, and autograd saved "
                                "it")
                for key in ("output", "input grad"):
                    if close(value := got[tp, op][key], want[op][key]):
                        continue
                    hint = diagnose(value, want[op][key], suspects[op, key], tp, key)
                    if op == "f" and key == "output" and close(got[tp, "g"]["output"], x):
                        hint = h.SWAPPED_BOTH
                    finding = first_difference({f"{op}: {key}": value}, {f"{op}: {key}": want[op][key]})
                    return Fail(f"{where(tp, q)}: {finding}", hint)
    return "f and g forward and backward exact at TP 2 and 4"


# --- 2 · the parallel linears ---------------------------------------------------------------------

def _run_layer(layer, x: torch.Tensor, upstream: torch.Tensor, shape: tuple) -> dict:
    """The layer's weight and bias; if every rank's weight has `shape`, its output and the
    gradients (all ranks go on, or none: a rank-asymmetric shape would hang the others)."""
    seen = {"weight": layer.weight.detach().clone(),
            "bias": None if layer.bias is None else layer.bias.detach().clone(),
            "storage": layer.weight.untyped_storage().nbytes()}
    if not agree(tuple(layer.weight.shape) == shape):
        return seen
    x.requires_grad_()
    at(phase=f"{type(layer).__name__}.forward")
    y = layer(x)
    seen["output"] = y.detach().clone()
    if y.shape == upstream.shape:
        at(phase="backward")
        (y * upstream).sum().backward()
        grads = {"input grad": x.grad, "weight grad": layer.weight.grad,
                 "bias grad": None if layer.bias is None else layer.bias.grad}
        seen.update({k: None if v is None else v.clone() for k, v in grads.items()})
    return seen


def run_linear(lab, world: int, kind: str) -> dict:
    X, G, seen = rand("X", B, T, h.IN), rand("G", B, T, h.OUT), {}
    layer_class = lab.RowParallelLinear if kind == "row" else lab.ColumnParallelLinear
    try:  # 10 features do not split over 4 ranks
        at(phase=f"{layer_class.__name__} of 10 features over TP 4")
        layer_class(h.full_linear(10) if kind == "column" else torch.nn.Linear(10, h.OUT), None)
        seen["refused"] = None
    except NotImplementedError:
        raise
    except Exception as error:  # which error, is the check's to say
        seen["refused"] = f"{type(error).__name__}: {error}"
    for tp in TPS:
        group, r = _group(tp), dist.get_rank() % tp
        at(phase=f"{layer_class.__name__}.__init__ at TP {tp}")
        if kind == "row":
            seen[tp, None] = _run_layer(lab.RowParallelLinear(h.full_linear(), group),
                                        X.chunk(tp, -1)[r].clone(), G, (h.OUT, h.IN // tp))
            continue
        for gather in (False, True):
            layer = lab.ColumnParallelLinear(h.full_linear(), group, gather_output=gather)
            seen[tp, gather] = _run_layer(layer, X.clone(), G if gather else G.chunk(tp, -1)[r],
                                          (h.OUT // tp, h.IN))
    return seen


MODES = {None: "", False: ", split output", True: ", gather_output=True"}


def _cases(runs, kind: str):
    for tp in TPS:
        for q, results in enumerate(runs[0].ranks):
            for gather in ((None,) if kind == "row" else (False, True)):
                yield tp, q, gather, results[tp, gather], where(tp, q) + MODES[gather]


def check_weights(runs) -> Fail | str:
    """Every rank holds its slice of the full linear's weight ([out/t, in] column, [out, in/t] row)
    in a storage of its own (1/t of the memory, not a view of the full weight) and the bias
    (sliced for a column layer, whole for a row layer), checked on every rank first."""
    kind = runs[0].config["kind"]
    for tp, q, gather, got, label in _cases(runs, kind):
        if bad := h.weight_error(got, h.linear_case(tp, q % tp, kind, gather)[0], tp, q % tp, kind):
            return Fail(f"{label}: {bad[0]}", bad[1])
    return "every rank's weight and bias slice exact"


def check_outputs(runs) -> Fail | str:
    """The output, the input's gradient and the weight and bias gradients are the full linear's,
    sliced as this rank owns them (1e-10)."""
    kind = runs[0].config["kind"]
    for tp, q, gather, got, label in _cases(runs, kind):
        want, suspects = h.linear_case(tp, q % tp, kind, gather)
        if "output" not in got:
            return Fail(f"{label}: not run: some rank's weight has the wrong shape",
                        "the weights' check says which rank and why")
        for key in ("output", "input grad", "weight grad", "bias grad"):
            if key not in got:
                return Fail(f"{label}: output shape {list(got['output'].shape)}",
                            "the split output is [.., out/t]; gather_output=True gives every rank [.., out]")
            if not close(got[key], want[key]):
                hint = diagnose(got[key], want[key], suspects.get(key, []), tp, key)
                return Fail(f"{label}: {first_difference({key: got[key]}, {key: want[key]})}", hint)
    return f"output, input, weight and bias gradients exact at TP {TPS}"


def check_refused(runs) -> Fail | str:
    """A layer whose features the group's size does not divide (10 over TP 4) raises ValueError on
    every rank, naming both sizes, before any collective."""
    kind = runs[0].config["kind"]
    for q, got in enumerate(runs[0].ranks):
        said = got["refused"] or ""
        if not said.startswith("ValueError") or not all(s in said for s in ("10", "4")):
            return Fail(f"rank {q}: {'built it' if got['refused'] is None else repr(got['refused'])}",
                        f"{'out' if kind == 'column' else 'in'}_features % t != 0: raise ValueError naming "
                        "the features and the TP size (unequal chunks would desynchronize the ranks)")
    return "uneven split refused on every rank"


# --- 3 · the MLP and attention, and a LLaMA made of them ------------------------------------------

def _sublayer(kind: str):
    block = build_model(CFG, seed=0, dtype=torch.float64).layers[0]
    x = rand("X", B, T, CFG.dim).requires_grad_()
    if kind == "mlp":
        return block.feed_forward, (x,)
    return block.attention, (x, *rope_cos_sin(CFG, torch.arange(T), torch.float64))


def run_sublayer(lab, world: int, kind: str) -> dict:
    seen = {}
    for tp in TPS:
        group = _group(tp)
        module, args = _sublayer(kind)
        at(phase=f"parallelize_{kind} at TP {tp}")
        module = (lab.parallelize_mlp if kind == "mlp" else lab.parallelize_attention)(module, group)
        with collectives(lab) as forward:
            at(phase="forward")
            y = module(*args)
        with collectives(lab) as backward:
            at(phase="backward")
            (y * rand("G", B, T, CFG.dim)).sum().backward()
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}
        seen[tp] = {"output": y.detach().clone(), "input grad": args[0].grad, "grads": grads,
                    "forward": [p.op for p in forward], "backward": [p.op for p in backward]}
    return seen


def check_sublayer(runs) -> Fail | str:
    """Every rank's output and input gradient, and the weight gradients joined from each TP
    group's slices, equal the full sub-layer's (1e-10)."""
    ranks, kind = runs[0].ranks, runs[0].config["kind"]
    module, args = _sublayer(kind)
    y, G = module(*args), rand("G", B, T, CFG.dim)
    (y * G).sum().backward()
    want = {"output": y.detach(), "input grad": args[0].grad}
    for tp in TPS:
        for q, got in enumerate(ranks):
            local, largs = _sublayer(kind)
            partial = h.local(local, tp, q % tp)(*largs)
            (partial * G).sum().backward()
            suspects = {"output": [(partial.detach(), h.G_MISSING + " after the row layer" + h.SWAPPED)],
                        "input grad": [(largs[0].grad, h.F_SUBLAYER)]}
            for key in ("output", "input grad"):
                if not close(value := got[tp][key], want[key]):
                    hint = diagnose(value, want[key], suspects[key], tp, key)
                    return Fail(f"{where(tp, q)}: {first_difference({key: value}, {key: want[key]})}", hint)
        grads = {n: p.grad for n, p in module.named_parameters()}
        for first in range(0, WORLD, tp):
            if finding := first_difference(h.joined([got[tp]["grads"] for got in ranks[first : first + tp]]),
                                           grads):
                hint = ("keep the names: swap the linears in place (setattr on the module)" if finding.missing
                        else diagnose(None, None, [], tp, "gradients", finding))
                return Fail(f"TP {tp} (ranks {first}–{first + tp - 1}), joined from the ranks' slices: "
                            f"grad of {finding}", hint)
    return "output and every gradient exact at TP 2 and 4"


def check_counts(runs) -> Fail | str:
    """What TP is for, in messages: each sub-layer posts one all-reduce forward (g) and one
    backward (f), on every rank."""
    kind = runs[0].config["kind"]
    for tp in TPS:
        for q, got in enumerate(runs[0].ranks):
            if bad := h.counts_hint(got[tp]["forward"], got[tp]["backward"], 2 if kind == "mlp" else 3):
                return Fail(f"{where(tp, q)}: {bad[0]}", bad[1])
    return "1 all-reduce forward, 1 backward"


def run_train(lab, world: int, steps: int = 2) -> dict:
    seen = {}
    for tp in TPS:
        group, model = _group(tp), build_model(CFG, seed=0, dtype=torch.float64)
        for block in model.layers:
            lab.parallelize_attention(block.attention, group)
            lab.parallelize_mlp(block.feed_forward, group)
        opt, seen[tp] = make_optimizer(model.parameters(), "sgd", LR), []
        data = SyntheticTokens(CFG.vocab_size, SEQ)
        for step in range(steps):
            at(step=step + 1, phase=f"TP {tp}")
            inputs, targets = split_inputs_targets(data.global_batch(step, BATCH))
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            seen[tp].append({"loss": loss.item(), "grads": grads})
            opt.step()
            opt.zero_grad(set_to_none=True)
    return seen


def check_train(runs, steps: int = 2) -> Fail | str:
    """A 2-layer LLaMA whose blocks are parallelized by your functions: each step's loss on every
    rank and its gradients joined from each TP group's slices equal one device's (SGD, 1e-10)."""
    ranks, want = runs[0].ranks, one_device(CFG, steps, BATCH, SEQ, "sgd", LR)
    for s in range(steps):
        for tp in TPS:
            for first in range(0, WORLD, tp):
                group = ranks[first : first + tp]
                joined = h.joined([got[tp][s]["grads"] for got in group])
                if finding := first_difference(joined, want.grads[s]):
                    return Fail(f"step {s + 1}, TP {tp} (ranks {first}–{first + tp - 1}), joined: grad of "
                                f"{finding}", diagnose(None, None, [], tp, "gradients", finding), step=s)
            for q, got in enumerate(ranks):
                if abs(got[tp][s]["loss"] - want.losses[s]) > 1e-10 * abs(want.losses[s]):
                    return Fail(f"step {s + 1}, {where(tp, q)}: loss {got[tp][s]['loss']!r}, expected "
                                f"{want.losses[s]!r}", "the gradients were right: is the loss computed from "
                                "the model's (replicated) output?", step=s)
    return "every loss and gradient within 1e-10 at TP 2 and 4"


PROPERTIES = [
    Property("f and g: forward and backward (TP 2 and 4)", ONE_JOB, run_fg, [check_fg]),
    Property("ColumnParallelLinear equals nn.Linear (TP 2 and 4)", [{"world": WORLD, "kind": "column"}],
             run_linear, [check_weights, check_outputs, check_refused]),
    Property("RowParallelLinear equals nn.Linear (TP 2 and 4)", [{"world": WORLD, "kind": "row"}],
             run_linear, [check_weights, check_outputs, check_refused]),
    Property("parallelize_mlp: SwiGLU exact, 1 all-reduce each way", [{"world": WORLD, "kind": "mlp"}],
             run_sublayer, [check_sublayer, check_counts]),
    Property("parallelize_attention: exact, 1 all-reduce each way", [{"world": WORLD, "kind": "attention"}],
             run_sublayer, [check_sublayer, check_counts]),
    Property("a 2-layer TP LLaMA trains 2 SGD steps like one device", ONE_JOB, run_train, [check_train],
             after=("parallelize",)),
    *EXTRA,
]
