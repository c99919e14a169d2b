"""Chapter 03: ZeRO stages 0-3 on flat buffers (ZeroOptimizer: 0-2 as a torch optimizer; ZeroEngine:
DeepSpeed-style, with stage 3), CPU offload, a DeepSpeed-style JSON config."""

from .arguments import ELEMENTWISE
from .config import ZeroConfig, ZeroConfigError, load_config, optimizer_arguments, parse_config
from .engine import ZeroEngine
from .flat import (
    FlatGroup,
    ShardedGrad,
    assign_buckets,
    assign_owners,
    module_list_items,
    module_units,
    padded_size,
)
from .optimizer import ZeroOptimizer

__all__ = ["ELEMENTWISE", "FlatGroup", "ShardedGrad", "ZeroConfig", "ZeroConfigError", "ZeroEngine",
           "ZeroOptimizer", "assign_buckets", "assign_owners", "load_config", "module_list_items",
           "module_units", "optimizer_arguments", "padded_size", "parse_config"]
