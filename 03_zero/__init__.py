"""Chapter 03: ZeRO stages 0-3 on flat buffers, CPU offload, a DeepSpeed-style JSON config."""

from .config import ZeroConfig, ZeroConfigError, load_config, parse_config
from .engine import ZeroEngine
from .flat import FlatGroup, assign_buckets, module_list_items, module_units, padded_size

__all__ = ["FlatGroup", "ZeroConfig", "ZeroConfigError", "ZeroEngine", "assign_buckets", "load_config",
           "module_list_items", "module_units", "padded_size", "parse_config"]
