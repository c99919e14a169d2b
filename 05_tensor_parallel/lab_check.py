"""Lab 05's properties: what `make lab-check N=5` runs on your lab.py (common/grader.py runs them).

Each property runs one job of 4 ranks, twice: on two TP groups of 2 ({0, 1} and {2, 3}, each
computing the same thing) and on one TP group of 4; every rank's result is compared in float64
with the same computation on one device at 1e-10 (max relative difference per tensor): f and g
with their definitions; the parallel linears with nn.Linear (the output, the input's gradient,
each rank's slice of the weight and bias and of their gradients); parallelize_mlp and
parallelize_attention with common.model's FeedForward and Attention, counting the collectives
each direction posts; a 2-layer LLaMA made of your pieces trains 2 SGD steps against
common.reference, the gradients gathered from the ranks' slices every step. Optional, reported
but not needed to pass: sequence parallelism's pair and ring attention's merge (lab_check_extra).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from common.data import SyntheticTokens, split_inputs_targets
from common.grader import Property
from common.model import build_model, get_config, loss_fn, rope_cos_sin
from common.reference import make_optimizer, make_reference
from tensor_parallel.lab_check_extra import (
    EXTRA,
    TPS,
    WORLD,
    B,
    T,
    agree,
    close,
    counting,
    diagnose,
    first_difference,
    rand,
    to_rank0,
    tp_group,
    where,
)

TITLE = "tensor parallelism: f, g, the parallel linears, a TP LLaMA block"
IN, OUT = 8, 12
CFG = get_config("tiny", n_layers=2)  # dim 32, 4 heads, 4 K/V heads, FFN 96: splits over 2 and 4
BATCH, SEQ, LR = 4, 8, 0.1
COLUMN_NAMES = ("wq", "wk", "wv", "w1", "w3")  # split along dim 0 (rows); wo, w2 along dim 1
SWAPPED = " (f and g swapped?)"
AVERAGED = "averaged: TP sums partial results (ReduceOp.SUM, no 1/t)"
EVERYWHERE = "summed over all {world} ranks, not over the {tp} of its TP group: pass group= to the collective"
F_FORWARD = "f's forward summed over the ranks: f is the identity forward, its all-reduce is in backward"
F_OWN = ("the input's gradient is this rank's own only, missing the other ranks' contributions: "
         "f's backward must all-reduce (SUM) it")
G_OWN = "g's forward returned this rank's partial: the partial outputs must be summed (all-reduce)"
G_BACKWARD = ("summed over the ranks in backward: g's output and its gradient are already whole on "
              "every rank, so g's backward is the identity")
SWAPPED_BOTH = ("f and g are swapped: f = identity forward, all-reduce backward; g = all-reduce forward, "
                "identity backward")
X_REDUCED = "X was summed over the ranks in forward: f is the identity forward, its all-reduce is in backward"
F_MISSING = ("the input's gradient is this rank's partial only: every rank used all of X, so dL/dX "
             "is the sum over the ranks (f's all-reduce in backward is missing)")
F_SUBLAYER = F_MISSING.replace(")", ": f on the sub-layer's input)")
G_MISSING = "the output is this rank's partial sum: the partial outputs are never added (g, forward)"
GATHER_SUMMED = ("summed over the ranks: every rank computed the same loss from the gathered Y, so the "
                 "gather's backward keeps this rank's slice of the gradient (no sum)")
GROUP_SIZE = ("split over all {world} ranks, not over the {tp} of the TP group: use "
              "dist.get_world_size(group) and dist.get_rank(group)")


def _worlds() -> str:
    return " and ".join(map(str, TPS))


# --- 1 · f and g ----------------------------------------------------------------------------------

def run_fg(lab, world: int) -> list:
    rank, seen = dist.get_rank(), {}
    x, w = rand("x", 3, 4, rank=rank), rand("w", 3, 4, rank=rank)
    for tp in TPS:
        group = tp_group(tp)
        for op, fn in (("f", lab.copy_to_tp_region), ("g", lab.reduce_from_tp_region)):
            xin = x.clone().requires_grad_()
            y = fn(xin, group)
            seen[tp, op] = {"output": y.detach().clone(), "input after": xin.detach().clone()}
            (y * w).sum().backward()
            seen[tp, op]["input grad"] = None if xin.grad is None else xin.grad.clone()
    return to_rank0(seen)


def check_fg(runs) -> tuple[bool, str, str]:
    ranks = runs[0][1]
    xs = [rand("x", 3, 4, rank=q) for q in range(WORLD)]
    ws = [rand("w", 3, 4, rank=q) for q in range(WORLD)]
    for tp in TPS:
        for q, got in enumerate(ranks):
            members = range(q // tp * tp, q // tp * tp + tp)
            sx, sw = sum(xs[m] for m in members), sum(ws[m] for m in members)
            want = {"f": {"output": xs[q], "input grad": sw}, "g": {"output": sx, "input grad": ws[q]}}
            suspects = {("f", "output"): [(sx, F_FORWARD + SWAPPED)], ("f", "input grad"): [(ws[q], F_OWN)],
                        ("g", "output"): [(xs[q], G_OWN + SWAPPED)],
                        ("g", "input grad"): [(sw, G_BACKWARD + SWAPPED)]}
            for op, key in (("f", "input grad"), ("g", "output")):  # the two sums
                suspects[op, key].append((want[op][key] / tp, AVERAGED))
                if tp < WORLD:
                    everything = sum(xs) if key == "output" else sum(ws)
                    suspects[op, key].append((everything, EVERYWHERE.format(world=WORLD, tp=tp)))
            for op in ("f", "g"):
                if not close(got[tp, op]["input after"], xs[q]):
                    return False, f"{where(tp, q)}: {op} changed its input x in place", \
                        "all-reduce a copy (x.clone()): the caller still needs x, and autograd saved it"
                for key in ("output", "input grad"):
                    value = got[tp, op][key]
                    if close(value, want[op][key]):
                        continue
                    hint = diagnose(value, want[op][key], suspects[op, key], tp, key)
                    if op == "f" and key == "output" and close(got[tp, "g"]["output"], xs[q]):
                        hint = SWAPPED_BOTH
                    finding = first_difference({f"{op}: {key}": value}, {f"{op}: {key}": want[op][key]})
                    return False, f"{where(tp, q)}: {finding}", hint
    return True, f"f and g forward and backward exact at TP {_worlds()}", ""


# --- 2 · the parallel linears ---------------------------------------------------------------------

def full_linear() -> nn.Linear:
    linear = nn.Linear(IN, OUT, dtype=torch.float64)
    with torch.no_grad():
        linear.weight.copy_(rand("A", OUT, IN))
        linear.bias.copy_(rand("b", OUT))
    return linear


def _run_layer(layer: nn.Module, x: torch.Tensor, upstream: torch.Tensor, shape: tuple) -> dict:
    """The layer's weight and bias; if every rank's weight has `shape`, its output; if every
    output has the upstream gradient's shape, the gradients (all ranks go on, or none)."""
    seen = {"weight": layer.weight.detach().clone(),
            "bias": None if layer.bias is None else layer.bias.detach().clone()}
    if not agree(tuple(layer.weight.shape) == shape):
        return seen
    x.requires_grad_()
    y = layer(x)
    seen["output"] = y.detach().clone()
    if agree(y.shape == upstream.shape):
        (y * upstream).sum().backward()
        grads = {"input grad": x.grad, "weight grad": layer.weight.grad,
                 "bias grad": None if layer.bias is None else layer.bias.grad}
        seen.update({k: None if v is None else v.clone() for k, v in grads.items()})
    return seen


def run_linear(lab, world: int, kind: str) -> list:
    X, G, seen = rand("X", B, T, IN), rand("G", B, T, OUT), {}
    for tp in TPS:
        group = tp_group(tp)
        r = dist.get_rank(group)
        if kind == "row":
            layer = lab.RowParallelLinear(full_linear(), group)
            seen[tp, None] = _run_layer(layer, X.chunk(tp, -1)[r].clone(), G, (OUT, IN // tp))
            continue
        for gather in (False, True):
            layer = lab.ColumnParallelLinear(full_linear(), group, gather_output=gather)
            upstream = G if gather else G.chunk(tp, -1)[r]
            seen[tp, gather] = _run_layer(layer, X.clone(), upstream, (OUT // tp, IN))
    return to_rank0(seen)


def _linear_case(t: int, r: int, kind: str, gather: bool | None) -> tuple[dict, dict]:
    """One device: what rank r of t must hold and compute (the full linear's output and
    gradients, sliced), and the suspects: what typical bugs compute instead, with their hints."""
    linear = full_linear()
    X, G = rand("X", B, T, IN).requires_grad_(), rand("G", B, T, OUT)
    Y = linear(X)
    (Y * G).sum().backward()
    A, b, X, Y = linear.weight.detach(), linear.bias.detach(), X.detach(), Y.detach()
    twice = GATHER_SUMMED if gather else G_BACKWARD + SWAPPED
    if kind == "column":
        cut = slice(r * OUT // t, (r + 1) * OUT // t)
        want = {"weight": A[cut], "bias": b[cut], "output": Y if gather else Y[..., cut], "input grad": G @ A,
                "weight grad": linear.weight.grad[cut], "bias grad": linear.bias.grad[cut]}
        suspects = {"output": [((t * X) @ A[cut].T + b[cut], X_REDUCED + SWAPPED)],
                    "input grad": [(G[..., cut] @ A[cut], F_MISSING)]}
    else:
        cut = slice(r * IN // t, (r + 1) * IN // t)
        want = {"weight": A[:, cut], "bias": b, "output": Y, "input grad": (G @ A)[..., cut],
                "weight grad": linear.weight.grad[:, cut], "bias grad": linear.bias.grad}
        suspects = {"output": [(X[..., cut] @ A[:, cut].T + b, G_MISSING + SWAPPED),
                               (X[..., cut] @ A[:, cut].T, G_MISSING + SWAPPED),
                               (Y + (t - 1) * b, f"the bias is counted {t}× (once per rank): it was added "
                                                 "before the reduction; add it once, after g")],
                    "input grad": []}
    suspects["input grad"].append((t * want["input grad"], twice))
    suspects |= {key: [(t * want[key], twice)] for key in ("weight grad", "bias grad")}
    return want, suspects


def _check_weight(got: dict, want: dict, t: int, r: int, kind: str) -> tuple[str, str] | None:
    w, full, dim = got["weight"], (OUT, IN), 0 if kind == "column" else 1
    if w.shape != want["weight"].shape:
        owns = "output features (rows" if kind == "column" else "input features (columns"
        hint = f"rank r owns 1/t of the {owns} of torch's [out, in] weight): {list(want['weight'].shape)}"
        whole = 1 - dim  # the dim every rank keeps whole
        if w.dim() == 2 and w.shape[dim] * WORLD == full[dim] and w.shape[whole] == full[whole]:
            hint = GROUP_SIZE.format(world=WORLD, tp=t)
        elif w.dim() == 2 and (w.shape[whole] < full[whole] or w.shape[dim] == full[dim]):
            hint = "sliced along the wrong dimension: " + hint
        return f"weight shape {list(w.shape)} (the full weight is [{OUT}, {IN}], [out, in])", hint
    if not close(w, want["weight"]):
        pieces = full_linear().weight.detach().chunk(t, dim)
        other = next((k for k, p in enumerate(pieces) if close(w, p)), None)
        hint = (f"rank {r} holds rank {other}'s slice: rank r's starts at r·n/t" if other is not None
                else "the weight is not this rank's slice of the full weight")
        return str(first_difference({"weight": w}, {"weight": want["weight"]})), hint
    if close(got["bias"], want["bias"]):
        return None
    if kind == "row":
        return "the bias is not the full bias", "the row layer's output is whole after g, and so is its bias"
    return f"the bias is not rank {r}'s slice", "the bias belongs to the output features: cut it as A"


MODES = {None: "", False: ", split output", True: ", gather_output=True"}


def check_linear(runs, kind: str) -> tuple[bool, str, str]:
    ranks = runs[0][1]
    for tp in TPS:
        for q, results in enumerate(ranks):
            for gather in ((None,) if kind == "row" else (False, True)):
                got, at = results[tp, gather], where(tp, q) + MODES[gather]
                want, suspects = _linear_case(tp, q % tp, kind, gather)
                if bad := _check_weight(got, want, tp, q % tp, kind):
                    return False, f"{at}: {bad[0]}", bad[1]
                for key in ("output", "input grad", "weight grad", "bias grad"):
                    if key not in got:
                        return False, f"{at}: output shape {list(got['output'].shape)}", \
                            "the split output is [.., out/t]; gather_output=True gives every rank [.., out]"
                    if not close(got[key], want[key]):
                        hint = diagnose(got[key], want[key], suspects.get(key, []), tp, key)
                        return False, f"{at}: {first_difference({key: got[key]}, {key: want[key]})}", hint
    return True, f"output, input, weight and bias gradients exact at TP {_worlds()}", ""


# --- 3 · the MLP and attention, and a LLaMA made of them ------------------------------------------

def _sublayer(kind: str) -> tuple[nn.Module, tuple]:
    block = build_model(CFG, seed=0, dtype=torch.float64).layers[0]
    x = rand("X", B, T, CFG.dim).requires_grad_()
    if kind == "mlp":
        return block.feed_forward, (x,)
    return block.attention, (x, *rope_cos_sin(CFG, torch.arange(T), torch.float64))


def run_sublayer(lab, world: int, kind: str) -> list:
    seen = {}
    for tp in TPS:
        group = tp_group(tp)
        module, args = _sublayer(kind)
        module = (lab.parallelize_mlp if kind == "mlp" else lab.parallelize_attention)(module, group)
        with counting(lab) as forward:
            y = module(*args)
        with counting(lab) as backward:
            (y * rand("G", B, T, CFG.dim)).sum().backward()
        grads = {n: None if p.grad is None else p.grad.clone() for n, p in module.named_parameters()}
        seen[tp] = {"output": y.detach().clone(), "input grad": args[0].grad, "grads": grads,
                    "forward": forward, "backward": backward}
    return to_rank0(seen)


def _local(module: nn.Module, t: int, r: int) -> nn.Module:
    """Rank r's slices as plain linears, no communication: what a rank computes between f and g."""
    for name, linear in list(module.named_children()):
        piece = linear.weight.detach().chunk(t, 0 if name in COLUMN_NAMES else 1)[r]
        setattr(module, name, nn.Linear(piece.shape[1], piece.shape[0], bias=False, dtype=torch.float64))
        getattr(module, name).weight.data.copy_(piece)
    return module


def gathered(ranks: list, key) -> dict[str, torch.Tensor | None]:
    """One TP group's slices of each parameter (key(rank's result) → {name: tensor}), joined."""
    out = {}
    for name in key(ranks[0]):
        pieces, layer = [key(got).get(name) for got in ranks], name.rsplit(".", 2)[-2]
        if any(p is None for p in pieces) or layer not in (*COLUMN_NAMES, "wo", "w2"):
            out[name] = pieces[0]
            continue
        try:
            out[name] = torch.cat(pieces, 0 if layer in COLUMN_NAMES else 1)
        except RuntimeError:  # slices of unequal shapes: reported as a wrong shape
            out[name] = torch.empty(0, dtype=torch.float64)
    return out


def check_sublayer(runs, kind: str) -> tuple[bool, str, str]:
    ranks = runs[0][1]
    module, args = _sublayer(kind)
    y, G = module(*args), rand("G", B, T, CFG.dim)
    (y * G).sum().backward()
    want = {"output": y.detach(), "input grad": args[0].grad}
    for tp in TPS:
        for q, got in enumerate(ranks):
            local, largs = _sublayer(kind)
            partial = _local(local, tp, q % tp)(*largs)
            (partial * G).sum().backward()
            suspects = {"output": [(partial.detach(), G_MISSING + " after the row layer" + SWAPPED)],
                        "input grad": [(largs[0].grad, F_SUBLAYER)]}
            for key in ("output", "input grad"):
                if not close(value := got[tp][key], want[key]):
                    hint = diagnose(value, want[key], suspects[key], tp, key)
                    return False, f"{where(tp, q)}: {first_difference({key: value}, {key: want[key]})}", hint
        grads = {n: p.grad for n, p in module.named_parameters()}
        if finding := first_difference(gathered(ranks[:tp], lambda got, tp=tp: got[tp]["grads"]), grads):
            hint = ("keep the names: swap the linears in place (setattr on the module)" if finding.missing
                    else diagnose(None, None, [], tp, "gradients", finding))
            return False, f"TP {tp}, gathered from the ranks' slices: grad of {finding}", hint
        if bad := _check_counts(ranks[0][tp], 2 if kind == "mlp" else 3):
            return False, f"TP {tp}, rank 0: {bad[0]}", bad[1]
    return True, f"output and every gradient exact at TP {_worlds()}; 1 all-reduce forward, 1 backward", ""


def _check_counts(got: dict, columns: int) -> tuple[str, str] | None:
    fwd, bwd = got["forward"], got["backward"]
    seen = f"forward posted {fwd or 'nothing'}, backward {bwd or 'nothing'}"
    if fwd == ["all_reduce"] and bwd == ["all_reduce"]:
        return None
    if bwd == ["all_reduce"] * columns:
        return seen, (f"f in each of the {columns} column layers: one all-reduce per layer in backward where "
                      "one per sub-layer does; apply f once to the sub-layer's input (input_is_mapped=True, "
                      "f in a forward pre-hook)")
    if fwd.count("all_reduce") > 1:
        return seen, ("only the row layer's partial output is summed (g); the column layers' outputs stay "
                      "split, the activation is element-wise")
    return seen, "one all-reduce each way per sub-layer: g after the row layer, f (backward) on the input"


def run_train(lab, world: int, steps: int = 2) -> list:
    seen = {}
    for tp in TPS:
        group, model = tp_group(tp), build_model(CFG, seed=0, dtype=torch.float64)
        for block in model.layers:
            lab.parallelize_attention(block.attention, group)
            lab.parallelize_mlp(block.feed_forward, group)
        opt, seen[tp] = make_optimizer(model.parameters(), "sgd", LR), []
        data = SyntheticTokens(CFG.vocab_size, SEQ)
        for step in range(steps):
            inputs, targets = split_inputs_targets(data.global_batch(step, BATCH))
            loss = loss_fn(model(inputs), targets)
            loss.backward()
            grads = {n: p.grad.clone() for n, p in model.named_parameters()}
            seen[tp].append({"loss": loss.item(), "grads": grads})
            opt.step()
            opt.zero_grad(set_to_none=True)
        seen[tp].append({"params": {n: p.detach().clone() for n, p in model.named_parameters()}})
    return to_rank0(seen)


def check_train(runs, steps: int = 2) -> tuple[bool, str, str]:
    ranks = runs[0][1]
    for tp in TPS:
        trainer, data = make_reference(CFG, 0, torch.float64, "sgd", LR), SyntheticTokens(CFG.vocab_size, SEQ)
        for s in range(steps):
            loss, grads = trainer.step(data.global_batch(s, BATCH))
            if finding := first_difference(gathered(ranks[:tp], lambda got, s=s, tp=tp: got[tp][s]["grads"]),
                                           grads):
                return False, f"step {s + 1}, TP {tp}, gathered: grad of {finding}", \
                    diagnose(None, None, [], tp, "gradients", finding)
            if abs((got := ranks[0][tp][s]["loss"]) - loss) > 1e-10 * abs(loss):
                return False, f"step {s + 1}, TP {tp}: loss {got!r}, expected {loss!r}", \
                    "the gradients were right: is the loss computed from the model's (replicated) output?"
        if finding := first_difference(gathered(ranks[:tp], lambda got, tp=tp: got[tp][-1]["params"]),
                                       trainer.parameters()):
            return False, f"after {steps} steps, TP {tp}: parameter {finding}", \
                "the gradients were right: does every rank step its own slices?"
    return True, f"every loss, gradient and parameter within 1e-10 at TP {_worlds()}", ""


ONE_JOB = [{"world": WORLD}]
PROPERTIES = [
    Property("f and g: forward and backward (TP 2 and 4)", ONE_JOB, run_fg, check_fg),
    Property("ColumnParallelLinear equals nn.Linear (TP 2 and 4)", [{"world": WORLD, "kind": "column"}],
             run_linear, lambda runs: check_linear(runs, "column")),
    Property("RowParallelLinear equals nn.Linear (TP 2 and 4)", [{"world": WORLD, "kind": "row"}],
             run_linear, lambda runs: check_linear(runs, "row")),
    Property("parallelize_mlp: SwiGLU exact, 1 all-reduce each way", [{"world": WORLD, "kind": "mlp"}],
             run_sublayer, lambda runs: check_sublayer(runs, "mlp")),
    Property("parallelize_attention: exact, 1 all-reduce each way", [{"world": WORLD, "kind": "attention"}],
             run_sublayer, lambda runs: check_sublayer(runs, "attention")),
    Property("a 2-layer TP LLaMA trains 2 SGD steps like one device", ONE_JOB, run_train, check_train),
    *EXTRA,
]
