"""The ZeRO paper's closed forms: memory per rank and bytes on the wire per rank, by stage.

Ψ parameters, N data-parallel ranks, b_p bytes per parameter element (bf16: 2), b_g bytes per
gradient element (2 in the paper; 4 with this engine's fp32 gradient reduction), K bytes of
optimizer state per parameter (mixed-precision AdamW: fp32 master 4 + m 4 + v 4 = 12):

    stage 0   params b_p·Ψ          grads b_g·Ψ      optimizer K·Ψ      = (2 + 2 + K)Ψ in the paper
    stage 1   params b_p·Ψ          grads b_g·Ψ      optimizer K·Ψ/N    = 4Ψ + KΨ/N
    stage 2   params b_p·Ψ          grads b_g·Ψ/N    optimizer K·Ψ/N    = 2Ψ + (2 + K)Ψ/N
    stage 3   params b_p·Ψ/N        grads b_g·Ψ/N    optimizer K·Ψ/N    = (4 + K)Ψ/N

(stage 3 keeps parameters under `param_persistence_threshold` whole: b_p·(Ψ_s/N + Ψ_p)). Wire
bytes by nccl-tests' convention, f = (N-1)/N, k micro-batches per step:

    stage 0   all-reduce of the gradients                          2f·Ψ·b_g
    stage 1   reduce-scatter of the gradients + all-gather params  f·Ψ·b_g + f·Ψ·b_p
    stage 2   a reduce-scatter per micro-batch + all-gather        k·f·Ψ·b_g + f·Ψ·b_p
    stage 3   per micro-batch: 2 all-gathers + 1 reduce-scatter    k·f·(Ψ·b_g + 2·Ψ_s·b_p) + f·Ψ_p·b_p

With b_p = b_g and k = 1, stages 1-2 move exactly DP's 2f·Ψ·b and stage 3 1.5× that.
Plain arithmetic; the optimizer's state per element is common/kernel/optimizer_bytes.py's
`optimizer_state_bytes`.
"""

from __future__ import annotations

from common.kernel.optimizer_bytes import optimizer_state_bytes

GB = 1e9


def optimizer_bytes_per_param(optimizer: str, mixed: bool, itemsize: int) -> int:
    """K: AdamW keeps m and v in the master dtype (its step counters, 4 bytes a tensor, are not
    per element: left out, as in the paper); bf16 mode adds the fp32 master copy."""
    master = 4 if mixed else itemsize
    states = optimizer_state_bytes(optimizer, 1, master, n_tensors=0)
    return states + (4 if mixed else 0)


def memory_formula(stage: int, psi: int, n: int, b_param: int, b_grad: int, k: float,
                   psi_persistent: int = 0) -> dict[str, float]:
    """Bytes per rank of parameters, gradients and optimizer state (the ZeRO paper's Figure 1)."""
    params = b_param * ((psi - psi_persistent) / n + psi_persistent if stage == 3 else psi)
    grads = b_grad * psi / (n if stage >= 2 else 1)
    optimizer = k * psi / (n if stage >= 1 else 1)
    return {"params": params, "grads": grads, "optimizer": optimizer}


def comm_formula(stage: int, psi: int, n: int, b_param: int, b_grad: int, grad_accum: int = 1,
                 psi_persistent: int = 0, clip: bool = False) -> float:
    """Wire bytes per rank per optimizer step (nccl-tests' accounting). `clip` adds the one
    scalar all-reduce of the squared norm that stages 1-3 need."""
    f = (n - 1) / n
    if stage == 0:
        return 2 * f * psi * b_grad
    gather = f * psi * b_param
    if stage == 1:
        comm = f * psi * b_grad + gather
    elif stage == 2:
        comm = grad_accum * f * psi * b_grad + gather
    else:
        sharded = psi - psi_persistent
        comm = grad_accum * f * (psi * b_grad + 2 * sharded * b_param) + f * psi_persistent * b_param
    return comm + (2 * f * b_grad if clip else 0.0)


def paper_table(psi: float, n: int, b_param: int = 2, b_grad: int = 2, k: float = 12) -> list[dict]:
    """GB per rank of each stage for Ψ parameters on N ranks (default: the paper's fp16/bf16 mixed
    precision Adam, 2 + 2 + 12 = 16 bytes per parameter)."""
    rows = []
    for stage in range(4):
        m = memory_formula(stage, int(psi), n, b_param, b_grad, k)
        rows.append({"stage": stage, **{key: v / GB for key, v in m.items()}, "total": sum(m.values()) / GB})
    return rows


def article_estimate(psi: float = 7e9, n: int = 8, activations_gb: float = 30.0) -> dict[str, float]:
    """The source article's arithmetic as printed (read in 01's README, "The article's 42 GB"):
    fp16 weights 2Ψ + its 42 GB (weights + m + v, "×3 the weights" = 6Ψ) + activations ≈ 30 GB:
    14 + 42 + 30 ≈ 86 GB for 7B (weights twice, no gradients: the slips cancel); its ZeRO-3
    figure on 8 GPUs, ≈ 11 GB, is that total divided by 8 (activations too: each GPU takes 1/8 of
    the batch)."""
    out = {"weights": 2 * psi / GB, "optimizer": 6 * psi / GB, "activations": activations_gb}
    out["total"] = sum(out.values())
    out["zero3_per_gpu"] = out["total"] / n
    return out
