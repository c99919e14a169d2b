"""Chapter 07's exercise solutions (lesson.ipynb never imports this file; tests/test_exercises.py does)."""

from __future__ import annotations

from common.kernel.model import LlamaConfig


def params_per_gpu(cfg: LlamaConfig, tp: int, pp: int) -> int:
    """Per stage: its blocks (matmul weights / tp, the two RMSNorms whole), the embedding on the
    first stage and the final norm + head on the last (vocabulary padded to a multiple of tp);
    earlier stages take the remainder layers. ψ is the heaviest stage's sum."""
    kv = cfg.n_kv_heads * cfg.head_dim
    split = cfg.dim * (2 * cfg.dim + 2 * kv) + 3 * cfg.dim * cfg.hidden_dim
    block = split // tp + 2 * cfg.dim
    vocab = -(-cfg.vocab_size // tp) * cfg.dim
    base, extra = divmod(cfg.n_layers, pp)
    stages = []
    for i in range(pp):
        root = (vocab if i == 0 else 0) + (vocab + cfg.dim if i == pp - 1 else 0)
        stages.append((base + (i < extra)) * block + root)
    return max(stages)
