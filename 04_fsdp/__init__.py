"""Chapter 04: FSDP from scratch with torch's API shape (units, auto-wrap, MixedPrecision,
ShardingStrategy). See fully_sharded.py's docstring for the public API."""

from .flat_param import FlatParamHandle, ParamShard, UnitShard
from .fully_sharded import FullyShardedDataParallel
from .state import clean_name
from .wrap import (
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

FSDP = FullyShardedDataParallel

__all__ = ["FSDP", "FlatParamHandle", "FullyShardedDataParallel", "MixedPrecision", "ModuleWrapPolicy",
           "ParamShard", "ShardingStrategy", "UnitShard", "clean_name", "size_based_auto_wrap_policy",
           "transformer_auto_wrap_policy"]
