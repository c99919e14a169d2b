"""Chapter 07's exercises: the checks that lesson.ipynb calls on the student's functions.

Each check prints ✓ or ✗ with the figure that decided and returns a bool; it never raises (a
stub's NotImplementedError prints "✗ not solved yet"). Both run in one process, against the code
the trainer and the planner run: `mesh.coordinates` and `memory_model.parameters_per_gpu`.

    rank_of(pp_rank, dp_rank, tp_rank, pp, dp, tp)   the global rank of mesh coordinates, TP
                                                     innermost, then DP, PP outermost:
                                                     rank = (pp_rank·dp + dp_rank)·tp + tp_rank
    params_per_gpu(cfg, tp, pp)                      ψ, the parameters on one GPU of the heaviest
                                                     pipeline stage, TP-split (norms whole)
"""

from __future__ import annotations

from collections.abc import Callable

from common.exercise import attempt
from common.model import CONFIGS
from parallel3d.memory_model import parameters_per_gpu
from parallel3d.mesh import coordinates

MESHES = [(2, 2, 2), (1, 4, 2), (4, 2, 1), (2, 3, 4), (3, 1, 2)]  # (dp, pp, tp)


def check_rank_of(rank_of: Callable) -> bool:
    """Every rank of five (dp, pp, tp) meshes: the student's rank of mesh.coordinates(rank)."""
    def body() -> tuple[bool, str]:
        for dp, pp, tp in MESHES:
            for rank in range(dp * pp * tp):
                at = coordinates(rank, dp=dp, pp=pp, tp=tp)
                got = rank_of(at.pp, at.dp, at.tp, pp, dp, tp)
                if got != rank:
                    return False, (f"dp {dp} × pp {pp} × tp {tp}: (pp {at.pp}, dp {at.dp}, tp {at.tp}) "
                                   f"is rank {rank} in mesh.py, yours says {got}")
        return True, "5 meshes, every rank: TP neighbours are consecutive ranks, as in mesh.py"
    return attempt(body)


PLANS = [("llama3.1-405b", 8, 16), ("llama3.1-405b", 8, 8), ("llama2-70b", 4, 4), ("llama2-7b", 1, 1),
         ("llama2-13b", 2, 3), ("tiny", 2, 2)]  # (model, tp, pp)


def check_params_per_gpu(params_per_gpu: Callable) -> bool:
    """Six (model, tp, pp) against memory_model.parameters_per_gpu, exactly."""
    def body() -> tuple[bool, str]:
        for name, tp, pp in PLANS:
            cfg = CONFIGS[name]
            want, got = parameters_per_gpu(cfg, tp, pp), params_per_gpu(cfg, tp, pp)
            if got != want:
                return False, (f"{name} at TP {tp} × PP {pp}: yours {got:,}, the planner's {want:,} "
                               f"({got - want:+,})")
        want = parameters_per_gpu(CONFIGS["llama3.1-405b"], 8, 16)
        return True, f"6 layouts exactly; Llama 3.1 405B at TP 8 × PP 16: ψ = {want / 1e9:.3f}B per GPU"
    return attempt(body)


EXERCISES: dict[str, Callable[[Callable], bool]] = {"rank_of": check_rank_of,
                                                    "params_per_gpu": check_params_per_gpu}


def _rank_with_pp_innermost(pp_rank: int, dp_rank: int, tp_rank: int, pp: int, dp: int, tp: int) -> int:
    """The order reversed: consecutive ranks are pipeline neighbours, TP groups stride over pp·dp."""
    return (tp_rank * dp + dp_rank) * pp + pp_rank


def _params_with_norms_split(cfg, tp: int, pp: int) -> int:
    """Divides every block parameter by tp, the RMSNorm weights too (they are whole on each rank)."""
    kv = cfg.n_kv_heads * cfg.head_dim
    block = cfg.dim * (2 * cfg.dim + 2 * kv) + 3 * cfg.dim * cfg.hidden_dim + 2 * cfg.dim
    layers = [cfg.n_layers // pp + (i < cfg.n_layers % pp) for i in range(pp)]
    vocab = -(-cfg.vocab_size // tp) * cfg.dim
    stages = [n * block // tp + (vocab if i == 0 else 0) + (vocab + cfg.dim if i == pp - 1 else 0)
              for i, n in enumerate(layers)]
    return max(stages)


WRONG: dict[str, Callable] = {"rank_of": _rank_with_pp_innermost,
                              "params_per_gpu": _params_with_norms_split}
