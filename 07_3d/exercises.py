"""Chapter 07's exercise: the check that lesson.ipynb calls on the student's function.

The check prints ✓ or ✗ with the figure that decided and returns a bool; it never raises (a
stub's NotImplementedError prints "✗ not solved yet"). It runs in one process, against the code
the planner runs (`memory_model.parameters_per_gpu`), and on a wrong answer says which layout
and which way it is off, never the number to hit.

    params_per_gpu(cfg, tp, pp)      ψ, the parameters on one GPU of the heaviest pipeline stage

(The mesh's rank formula is printed in the README, so it is no exercise; composing the mesh's
pieces is the lab: lab.py, `grade(7)`.)
"""

from __future__ import annotations

from collections.abc import Callable

from common.exercise import attempt
from common.kernel.model import CONFIGS
from parallel3d.memory_model import parameters_per_gpu

# (model, tp, pp) from the simplest layout up, each with what it adds to the one before
PLANS = [
    (("tiny", 1, 1), ("llama2-70b", 1, 1)),
    (("tiny", 2, 1), ("llama2-70b", 4, 1)),
    (("tiny", 1, 3), ("llama2-13b", 1, 3)),
    (("tiny", 2, 2), ("llama2-13b", 2, 3), ("llama2-70b", 4, 4), ("llama3.1-405b", 8, 16),
     ("llama3.1-405b", 8, 8)),
]
HINTS = [
    "One GPU holds the whole model: every tensor of common.kernel.model's Llama, with K/V width "
    "n_kv_heads · head_dim (GQA: smaller than dim for 70B)",
    "Right on one GPU, wrong under TP alone: which tensors does TP split, and which does every TP "
    "rank hold whole?",
    "Right on one GPU and under TP, wrong under PP alone: which stage is the heaviest? The earlier "
    "stages take the remainder layers; the first holds the embedding, the last the final norm and head",
    "Right under TP alone and PP alone, wrong together: the embedding and head split over TP too "
    "(the vocabulary padded up to a multiple of t), on their stages",
]


def check_params_per_gpu(params_per_gpu: Callable) -> bool:
    """Nine (model, tp, pp) against memory_model.parameters_per_gpu, exactly, simplest first."""
    def body() -> tuple[bool, str]:
        for plans, hint in zip(PLANS, HINTS, strict=True):
            for name, tp, pp in plans:
                cfg = CONFIGS[name]
                got, want = params_per_gpu(cfg, tp, pp), parameters_per_gpu(cfg, tp, pp)
                if got != want:
                    way = "too large" if got > want else "too small"
                    return False, f"{name} at TP {tp} × PP {pp}: yours is {way}. {hint}"
        want = parameters_per_gpu(CONFIGS["llama3.1-405b"], 8, 16)
        return True, f"9 layouts exactly; Llama 3.1 405B at TP 8 × PP 16: ψ = {want / 1e9:.3f}B per GPU"
    return attempt(body)


EXERCISES: dict[str, Callable[[Callable], bool]] = {"params_per_gpu": check_params_per_gpu}


def _params_with_norms_split(cfg, tp: int, pp: int) -> int:
    """Divides every block parameter by tp, the RMSNorm weights too (they are whole on each rank)."""
    kv = cfg.n_kv_heads * cfg.head_dim
    block = cfg.dim * (2 * cfg.dim + 2 * kv) + 3 * cfg.dim * cfg.hidden_dim + 2 * cfg.dim
    layers = [cfg.n_layers // pp + (i < cfg.n_layers % pp) for i in range(pp)]
    vocab = -(-cfg.vocab_size // tp) * cfg.dim
    stages = [n * block // tp + (vocab if i == 0 else 0) + (vocab + cfg.dim if i == pp - 1 else 0)
              for i, n in enumerate(layers)]
    return max(stages)


WRONG: dict[str, Callable] = {"params_per_gpu": _params_with_norms_split}
