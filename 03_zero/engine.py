"""ZeroEngine: DeepSpeed's engine in miniature, a module plus a ZeroOptimizer built from a ds_config.

    engine = ZeroEngine(model, torch.optim.AdamW, load_config("ds_config.json"), lr=3e-4)
    for x, y in micro_batches:                      # gradient_accumulation_steps of them
        loss_fn(engine(x), y).div(k).backward()     # hooks reduce(-scatter) into the owners' shards
    engine.step(); engine.zero_grad()               # clip (gradient_clipping), step, all-gather

The engine is a thin layer: stages 0-2 are the optimizer's ([`optimizer.py`](optimizer.py), where
the memory and wire formulas of every stage are), built from the config's keys
(`config.optimizer_arguments`); the engine adds what needs the module or the batch layout. It
counts the `gradient_accumulation_steps` backward passes of a step: at stages 0-1, which keep
full gradients, all but the last run without reducing (the optimizer's `no_sync`), so a step
reduces once; stages 2-3 reduce every micro-batch into the shard. Stage 3
partitions the parameters themselves, so it needs the module's units, each gathered whole (a
transformer block, or a module the blocks leave out: `flat.module_units`), and hooks on them that
gather a unit before it runs and free it after ([`stage3.py`](stage3.py)). A module built on the
meta device takes `init_values_fn(name)` (the full initial values of each parameter) and `device`:
the flat buffers are filled one group at a time, so at stage 3 a rank never holds more than its
shards and one unit (twice: the values and their cast copy). Depends only on torch (and
common/kernel/clip.py and common/kernel/collectives.py through the optimizer).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
from torch import nn

from .config import ZeroConfig, optimizer_arguments
from .flat import FlatGroup, UnitPolicy, module_units
from .optimizer import ZeroOptimizer
from .stage3 import ParameterPartitioner


class ZeroEngine:
    """Wraps `module` (its parameters become views of flat buffers) and shards its training state
    with a `ZeroOptimizer(module's parameters, optimizer_class, ownership, **defaults)` at
    `config.stage` (`optimizer_class` may be any `(param_groups) -> Optimizer` callable). Use it
    like DeepSpeed's engine: `loss = loss_fn(engine(x), y) / k; loss.backward()` for k
    micro-batches, then `engine.step()` and `engine.zero_grad()`. `process_group` is the
    data-parallel group (default: world). `unit_policy(module) -> bool` picks stage 3's units
    (e.g. `lambda m: isinstance(m, TransformerBlock)`; default: the items of every `nn.ModuleList`)."""

    def __init__(self, module: nn.Module, optimizer_class: Callable[..., torch.optim.Optimizer],
                 config: ZeroConfig | None = None, process_group=None,
                 gradient_accumulation_steps: int | None = None, unit_policy: UnitPolicy | None = None,
                 init_values_fn: Callable[[str], torch.Tensor] | None = None,
                 device: torch.device | None = None, ownership: str = "slice", **defaults):
        config = config or ZeroConfig()
        gas = gradient_accumulation_steps or config.gradient_accumulation_steps or 1
        self.module, self.config = module, replace(config, gradient_accumulation_steps=gas)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the module has no parameters that require gradients")
        units = (module_units(module, config.param_persistence_threshold, unit_policy)
                 if config.stage == 3 else None)
        self.optimizer = ZeroOptimizer(
            [p for _, p in named], optimizer_class, process_group=process_group, ownership=ownership,
            param_names={p: n for n, p in named}, units=units, init_values_fn=init_values_fn, device=device,
            **optimizer_arguments(config), **defaults)
        self.stage, self.gas, self.micro_step = config.stage, gas, 0
        self.optimizer.end_of_backward_hooks.append(self._count_micro_step)
        self._set_sync()
        self.rank, self.world, self.device = self.optimizer.rank, self.optimizer.world, self.optimizer.device
        self.units = self.optimizer.unit_groups
        self.partitioner = (ParameterPartitioner(module, self.units, self.optimizer)
                            if config.stage == 3 else None)
        self.last_grad_norm: float | None = None

    @property
    def groups(self) -> list[FlatGroup]:
        return self.optimizer.flat_groups

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _set_sync(self) -> None:
        """Reduce in this backward? Stages 2-3 always; stages 0-1 in a step's last micro-batch."""
        self.optimizer.require_backward_grad_sync = self.stage >= 2 or self.micro_step + 1 >= self.gas

    def _count_micro_step(self) -> None:
        self.micro_step += 1
        self._set_sync()

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return self.optimizer.clip_grad_norm_(max_norm)

    def step(self) -> None:
        """Clip by the config's `gradient_clipping`, step, bring the parameters up to date."""
        if self.micro_step != self.gas:
            raise RuntimeError(f"step() after {self.micro_step} backward passes; this engine accumulates "
                               f"{self.gas} micro-batches per step (gradient_accumulation_steps)")
        if self.config.clip is not None:
            self.last_grad_norm = self.clip_grad_norm_(self.config.clip).item()
        self.optimizer.step()
        self.micro_step = 0
        self._set_sync()

    def zero_grad(self) -> None:
        self.optimizer.zero_grad()
        self.micro_step = 0
        self._set_sync()

    # --- inspection (collectives: every rank of the group calls them) ---------------------------
    def full_gradients(self) -> dict[str, torch.Tensor]:
        return self.optimizer.full_gradients()

    def full_parameters(self) -> dict[str, torch.Tensor]:
        return self.optimizer.full_parameters()

    def state_tensors(self) -> dict[str, list[torch.Tensor]]:
        return self.optimizer.state_tensors()
