"""Lab 05 · experts: the layer and its one-device answers (lab_expert_check.py says what runs).

The MoE layer every rank builds (seeded, its router skewed so that the last DEAD experts never get
a token: at EP 2 and 4 some rank holds only those and receives no row), each rank's tokens, and,
in the grader, the same full layer on one device: each member's output, input gradient, own
parameter gradients, the gradients summed over an EP group's tokens, and each member's routing.
"""

from __future__ import annotations

import torch

from common.kernel.model import LlamaConfig, feed_forward, get_config
from common.kernel.moe import route
from common.labs.tools import rand, split

WORLD, EPS, E, T = 4, (2, 4), 8, 6
LAYER = LlamaConfig(dim=8, n_layers=1, n_heads=2, n_kv_heads=2, vocab_size=8, n_experts=E, top_k=2,
                    n_shared_experts=1, moe_hidden_dim=6, aux_loss_coef=0.0)
MODEL = get_config("tiny-moe", n_layers=2, first_dense_layers=0, capacity_factor=1.25)
BATCH, SEQ, LR, DEAD = 4, 8, 1e-2, 4  # the last 4 experts never chosen: ranks holding only them get no row


def full_layer():
    """The full layer, seeded, with a skewed router: x is shifted to +3 and the last DEAD router
    rows set to -2, so those experts' logits are ≈ -6·dim and no token picks them."""
    gen = torch.Generator().manual_seed(5)
    layer = feed_forward(LAYER, 0).double()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * 0.5)
        layer.router.weight[-DEAD:] = -2.0
    return layer


def tokens(rank: int) -> torch.Tensor:
    return rand("ep x", 1, T, LAYER.dim, rank=rank) + 3.0


def ep_group(ep: int):
    return split([ep] * (WORLD // ep))


def one_device_layer(members: list[int]):
    """The full layer on each member's tokens: (outputs, input gradients, the parameters'
    gradients summed over the members, each member's own parameter gradients, its plan)."""
    layer, ys, dxs, own, plans = full_layer(), [], [], [], []
    for q in members:
        x = tokens(q).requires_grad_()
        y = layer(x)
        (y * rand("ep g", *y.shape, rank=q)).sum().backward()
        ys.append(y.detach())
        dxs.append(x.grad)
        own.append({n: p.grad.clone() for n, p in layer.named_parameters()})
        layer.zero_grad()
        logits = layer.router(tokens(q).reshape(T, -1)).unsqueeze(0)
        plans.append(route(logits, LAYER.top_k, LAYER.gate, None)[0])
    total = {n: sum(o[n] for o in own) for n in own[0]}
    return ys, dxs, total, own, plans


def members_of(ep: int, rank: int) -> list[int]:
    first = rank // ep * ep
    return list(range(first, first + ep))


def sorted_rows(rows: torch.Tensor) -> torch.Tensor:
    key = rows @ torch.linspace(1, 2, rows.shape[1], dtype=rows.dtype)
    return rows[torch.argsort(key)]


