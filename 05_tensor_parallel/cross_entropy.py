"""Cross-entropy over vocab-parallel logits, without ever gathering them (Megatron's
`vocab_parallel_cross_entropy`).

Rank i holds the logits z[:, v] of its vocab range [v_i, v_i + V'/t). Per token:

    m   = max_v z_v                      all-reduce MAX   (numerical stability)
    S   = Σ_v exp(z_v − m)               ┐ one all-reduce SUM of [S_local, z_y_local]
    z_y = the target's logit − m         ┘ (only the rank owning y contributes it)
    loss = log S − z_y                   dloss/dz_v = softmax_v − [v = y]   (local, no comm)

Two all-reduces of N = b·s numbers replace an all-gather of N·V logits. Padding columns (ids ≥ V
when V is not divisible by t) get −∞: probability 0, never predicted, zero gradient. Which columns
are padding follows from V, the rank's range and its width, so it is decided on the host: a test
of the data (`(ids >= V).any()`) would be a host sync in every forward.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .sharding import group_size


def _all_reduce(x: torch.Tensor, op, group) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, targets, group, vocab_start: int, vocab_size: int):
        local_vocab = logits.shape[-1]
        real = vocab_size - vocab_start  # columns [real, local_vocab) are padding: known from shapes
        if real < local_vocab:  # decided on the host, never from data (`.any()` would sync a GPU)
            logits = logits.clone()
            logits[:, max(real, 0):] = float("-inf")
        logits_max = _all_reduce(logits.max(dim=-1).values, dist.ReduceOp.MAX, group)
        shifted = logits - logits_max.unsqueeze(-1)
        exp = shifted.exp()
        in_range = (targets >= vocab_start) & (targets < vocab_start + local_vocab)
        local_targets = (targets - vocab_start).masked_fill(~in_range, 0)
        predicted = shifted.gather(-1, local_targets.unsqueeze(-1)).squeeze(-1).masked_fill(~in_range, 0.0)
        both = _all_reduce(torch.stack([exp.sum(dim=-1), predicted]), dist.ReduceOp.SUM, group)
        sum_exp, predicted = both[0], both[1]
        exp.div_(sum_exp.unsqueeze(-1))  # softmax, kept for backward
        ctx.save_for_backward(exp, in_range, local_targets)
        return sum_exp.log() - predicted

    @staticmethod
    def backward(ctx, grad_loss):
        softmax, in_range, local_targets = ctx.saved_tensors
        grad = softmax.clone()
        rows = torch.arange(grad.shape[0], device=grad.device)
        grad[rows, local_targets] -= in_range.to(grad.dtype)
        return grad * grad_loss.unsqueeze(-1), None, None, None, None


def vocab_parallel_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, group,
                                 vocab_start: int, vocab_size: int) -> torch.Tensor:
    """Megatron's contract: the next-token cross-entropy of every position, shaped like `targets`
    (unreduced: mask or average it yourself; `parallelize.vocab_parallel_loss` takes the mean, like
    common.kernel.model.loss_fn), from this rank's logits [..., V'/t] (columns = vocab ids vocab_start …)
    and the full targets [...]. Computed in float32 or better, whatever the logits' dtype. Megatron
    reads the TP group and this rank's vocab range from global state; here they are arguments."""
    flat = logits.flatten(0, -2)
    if flat.dtype in (torch.float16, torch.bfloat16):
        flat = flat.float()
    losses = _VocabParallelCrossEntropy.apply(flat, targets.flatten(), group, vocab_start, vocab_size)
    return losses.view(targets.shape)
