"""Chapter 05's figure of DeepSeek-V3's auxiliary-loss-free balancing (common/kernel/moe.py), from
real runs: a seeded `tiny-moe` cut to its dense layer and one MoE layer (sigmoid affinities,
float64, AdamW at the course's lr 1e-3) trains on the course's synthetic tokens three times, with
neither balancing, with the sequence-wise aux loss, and with the selection bias updated after each
step (b_e += γ·sign(mean − load_e), γ = DeepSeek-V3's 0.001). Each step's tokens per expert are
what the layer's router chose (`last_tokens_per_expert`, before any capacity drop):

    per step    max_e load_e / mean_e load_e        (the step's slowest expert against the average)
    whole run   each expert's share of all the slots chosen over the run (balanced: 1/E each)
"""

from __future__ import annotations

import torch

from common.data import SyntheticTokens, split_inputs_targets
from common.figures import Figure, Source, draw
from common.kernel.model import build_model, get_config, loss_fn
from common.kernel.moe import moe_layers, update_bias_after_each_step
from tensor_parallel.figures.expert_parallel import rolled_experts


def trained_loads(aux_loss_coef: float, gamma: float, steps: int, batch: int, seq_len: int,
                  seed: int = 0) -> list[list[int]]:
    """[step][expert]: the tokens that chose each expert of the MoE layer in each training step."""
    cfg = get_config("tiny-moe", n_layers=2, gate="sigmoid", aux_loss_coef=aux_loss_coef,
                     bias_update_rate=gamma)
    model = build_model(cfg, seed=seed, dtype=torch.float64)  # the same choices on any CPU
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)  # the course's, foreach
    update_bias_after_each_step(optimizer, model)
    data, (layer,) = SyntheticTokens(cfg.vocab_size, seq_len, seed), moe_layers(model)
    loads = []
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for step in range(steps):
            inputs, targets = split_inputs_targets(data.global_batch(step, batch))
            loss_fn(model(inputs), targets).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            loads.append(layer.last_tokens_per_expert.tolist())
    return loads


def router_balance_data(steps: int = 100, batch: int = 8, seq_len: int = 32, gamma: float = 1e-3,
                        aux_loss_coef: float = 0.01) -> dict:
    """Per run: max/mean load of each step, each expert's share of the run's slots, and the run's
    max/mean share (how far the busiest expert is from 1/E over the whole run)."""
    runs = {"neither": (0.0, 0.0), f"aux loss α = {aux_loss_coef:g}": (aux_loss_coef, 0.0),
            f"bias γ = {gamma:g}": (0.0, gamma)}
    out = {}
    for name, (aux, g) in runs.items():
        loads = torch.tensor(trained_loads(aux, g, steps, batch, seq_len), dtype=torch.float64)
        total = loads.sum(0)
        out[name] = {"step_ratio": (loads.amax(-1) / loads.mean(-1)).tolist(),
                     "share": (total / total.sum()).tolist(),
                     "run_ratio": (total.max() / total.mean()).item()}
    return {"steps": steps, "tokens": batch * seq_len, "runs": out}


def router_balance_draw(data: dict, window: int = 10):
    fig, (left, right) = draw.figure(height=3.2, ncols=2, gridspec_kw={"width_ratios": [3, 2]})
    runs = data["runs"]
    for i, (name, run) in enumerate(runs.items()):
        ratio = run["step_ratio"]
        mean = [sum(ratio[j:j + window]) / len(ratio[j:j + window]) for j in range(0, len(ratio), window)]
        left.plot([j + window / 2 for j in range(0, len(ratio), window)], mean, marker="o", markersize=3,
                  color=draw.rank_color(i), label=f"{name} (whole run: {run['run_ratio']:.2f})")
        E = len(run["share"])
        right.bar([e + (i - 1) * 0.27 for e in range(E)], [100 * s for s in run["share"]], width=0.27,
                  color=draw.rank_color(i))
    left.set_xlabel("step")
    left.set_ylabel(f"max/mean load, mean of {window} steps")
    left.legend(fontsize=draw.SMALL, loc="upper left")
    right.axhline(100 / E, color="#333333", linestyle="--", linewidth=0.8)
    right.set_xticks(range(E), [str(e) for e in range(E)], fontsize=draw.SMALL)
    right.set_xlabel("expert")
    right.set_ylabel("share of the run's slots (%)")
    n, steps = data["tokens"], data["steps"]
    left.set_title(f"tiny-moe's MoE layer (sigmoid, top-2 of 8), {n} tokens a step, {steps} steps: left, "
                   "each step's busiest expert\nagainst the mean; right, each expert's share of the run "
                   "(dashed: 1/8). The bias evens the shares with no term\nin the loss (legend: the run's "
                   f"busiest share / mean); a step's max/mean keeps the noise of sampling {n} tokens",
                   loc="left", fontsize=8.5)
    return fig


FIGURES = [
    Figure(name="router_balance", path="05_tensor_parallel/figures/router_balance.svg",
           data=router_balance_data, draw=router_balance_draw,
           sources=(Source("common.kernel.moe:route", perturb=rolled_experts),),
           alt="expert load over training steps: with the aux loss, with DeepSeek-V3's bias, with neither"),
]
