"""Chapter 05: `ring_step`, one rank's compute at one step of the ring (what the lesson's figure
replays in one process), merges to exact causal attention: every rank's queries, merged with
every rank's K/V block in the ring's order, equal SDPA over the whole sequence (float64, GQA,
both layouts)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tensor_parallel.context_layout import shard_sequence, unshard_sequence
from tensor_parallel.context_parallel import ring_step


@pytest.mark.parametrize("cp", [2, 3, 4])
@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_steps_merge_to_causal_attention(cp: int, layout: str) -> None:
    gen = torch.Generator().manual_seed(cp)
    s, heads, kv_heads, d = 2 * cp * 3, 4, 2, 8
    q, k, v = (torch.randn(2, h, s, d, generator=gen, dtype=torch.float64)
               for h in (heads, kv_heads, kv_heads))
    want = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                          is_causal=True)
    outs = []
    for rank in range(cp):
        q_r = shard_sequence(q, cp, rank, dim=2, layout=layout)
        out, lse = torch.zeros_like(q_r), torch.full(q_r.shape[:-1], float("-inf"), dtype=q.dtype)
        for step in range(cp):  # the block of rank (rank - step) arrives at step `step`
            source = (rank - step) % cp
            kv = torch.stack([shard_sequence(x, cp, source, dim=2, layout=layout) for x in (k, v)])
            out, lse = ring_step(q_r, out, lse, kv, cp, rank, source, layout)
        outs.append(out)
    got = unshard_sequence(outs, dim=2, layout=layout)
    assert torch.allclose(got, want, rtol=0, atol=1e-12), (got - want).abs().max()
