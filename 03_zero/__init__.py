"""Chapter 03: ZeRO stages 0-3 on flat buffers (ZeroOptimizer: 0-2 as a torch optimizer; ZeroEngine:
DeepSpeed-style, with stage 3), CPU offload, a DeepSpeed-style JSON config."""

from .config import ZeroConfig, ZeroConfigError, load_config, parse_config
from .engine import ZeroEngine
from .flat import FlatGroup, assign_buckets, assign_owners, module_list_items, module_units, padded_size
from .optimizer import ELEMENTWISE, ZeroOptimizer

__all__ = ["ELEMENTWISE", "FlatGroup", "ZeroConfig", "ZeroConfigError", "ZeroEngine", "ZeroOptimizer",
           "assign_buckets", "assign_owners", "load_config", "module_list_items", "module_units",
           "padded_size", "parse_config"]
