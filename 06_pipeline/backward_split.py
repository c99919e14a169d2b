"""Zero-bubble's split backward: B (the stage input's gradient) now, W (the weights') later,
without computing anything twice.

For a linear layer Y = X Wᵀ the backward is two GEMMs: dX = dY W (the previous stage waits for
it) and dW = dYᵀ X (nobody waits for it until the optimizer step). Generically, on the autograd
graph of one chunk's forward:

    B:  walk the graph from the output y; mark the nodes that lead to the input x and those that
        lead to a parameter. A node on x's path with a child that leads only to parameters is where
        the two paths part (the mm of a linear, the mul of a norm's weight). Hook those nodes,
        run autograd.grad(y → x, retain_graph=True): autograd computes only what dX needs, and the
        hooks catch dY at each parting node.
    W:  from each parting node, with the dY caught there, compute only the gradient flowing into
        its weight-side inputs (the dW GEMM and nothing else); then one backward from all those
        edges into the leaves, so each leaf's AccumulateGrad, and a wrapper's hook on it, fires
        once. The leaves are whatever autograd saw: under FSDP the modules' weights are views of
        one gathered flat tensor per unit, shared by many weights, which is why W never walks
        into the input's side (from there it would reach the same leaf again).

This is what torch.distributed.pipelining's stage_backward_input/stage_backward_weight do; on the
first stage there is no x, so B is empty and W is the whole backward.

A custom autograd Function computes all its inputs' gradients whenever it runs, so a parting node
that is one (chapter 05's sequence-parallel column linear: dx = dy·W and dW = dyᵀ·x in one
backward) would run both GEMMs in B and again in W, and in W read a weight FSDP has freed. Such a
Function says it can do one half at a time by setting `ctx.split_backward = None` in forward: B
sets it to "input" on the parting nodes, W to "weight" (Megatron's zero-bubble linear defers its
dW the same way).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge


class WeightGradState:
    """What B leaves for W: per parting node, its output edges, the gradients caught there, and
    the edges into its weight-only children; and the leaves those children lead to."""

    def __init__(self) -> None:
        self.groups: list[tuple[list[GradientEdge], list[torch.Tensor], list[GradientEdge]]] = []
        self.leaves: list[torch.Tensor] = []


def _graph(root) -> list:
    """The nodes reachable from `root`, each once, children before parents (post-order)."""
    order, seen, stack = [], set(), [(root, False)]
    while stack:
        node, expanded = stack.pop()
        if expanded:
            order.append(node)
            continue
        if node is None or node in seen:
            continue
        seen.add(node)
        stack.append((node, True))
        stack.extend((child, False) for child, _ in node.next_functions if child is not None)
    return order


def backward_input(y: torch.Tensor, x: torch.Tensor, grad_y: torch.Tensor | None,
                   params: Sequence[torch.Tensor] | None = None) -> tuple[torch.Tensor, WeightGradState]:
    """B: ∂L/∂x only; returns it with the state that `backward_weight` needs. `params`: the leaves
    W differentiates; default: every leaf of the graph but x (what autograd saw, e.g. FSDP's
    gathered flat tensors rather than the module's sharded parameters). (A weight used on both
    sides of a parting node, e.g. tied weights inside one chunk, is not supported.)"""
    x_node = get_gradient_edge(x).node
    order = _graph(y.grad_fn)
    if params is None:
        param_of = {n: n.variable for n in order if hasattr(n, "variable") and n is not x_node}
    else:
        param_of = {get_gradient_edge(p).node: p for p in params}
    to_x, weights = {}, {}  # node → leads to x; node → parameters it leads to without passing x
    for node in order:
        children = [c for c, _ in node.next_functions if c is not None]
        to_x[node] = node is x_node or any(to_x[c] for c in children)
        weights[node] = ({param_of[node]} if node in param_of else set()).union(
            *(weights[c] for c in children if not to_x[c]))
    parting = {n: [(c, k) for c, k in n.next_functions if c is not None and not to_x[c] and weights[c]]
               for n in to_x if to_x[n]}
    parting = {n: children for n, children in parting.items() if children}
    caught: dict = {}
    _split(parting, "input")
    handles = [n.register_prehook(lambda grads, n=n: caught.setdefault(n, grads) and None) for n in parting]
    try:
        (x_grad,) = torch.autograd.grad(y, x, grad_y, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    state, leaves = WeightGradState(), {}
    for node, node_grads in caught.items():
        edges = [GradientEdge(node, k) for k, g in enumerate(node_grads) if g is not None]
        grads = [g for g in node_grads if g is not None]
        state.groups.append((edges, grads, [GradientEdge(c, k) for c, k in parting[node]]))
        leaves.update((id(p), p) for c, _ in parting[node] for p in weights[c])
    state.leaves = list(leaves.values())
    return x_grad, state


def _split(nodes, half: str) -> None:
    """Tell the custom Functions among `nodes` that can do it which half of their backward to run."""
    for node in nodes:
        if hasattr(node, "split_backward"):
            node.split_backward = half


def backward_weight(state: WeightGradState) -> None:
    """W: dW at each parting node from the dY caught in B (only that node's backward, into its
    weight-side edges, so the engine never walks back into the input's side), then one backward
    from all those edges into the leaves: each leaf's AccumulateGrad fires once. Each node runs
    once, so none retains its saved tensors: the dW GEMMs' inputs go as W finishes, the rest of
    the graph when the caller drops it."""
    edges, grads = [], []
    for out_edges, caught, weight_edges in state.groups:
        _split([e.node for e in out_edges], "weight")
        edges += weight_edges
        grads += torch.autograd.grad(out_edges, weight_edges, caught)
    if edges:
        torch.autograd.backward(edges, grads, inputs=state.leaves)
