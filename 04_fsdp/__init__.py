"""Chapter 04: FSDP from scratch with torch's API shape (units, auto-wrap, MixedPrecision,
ShardingStrategy with HSDP, BackwardPrefetch). See fully_sharded.py's docstring for the public API."""

from .flat_param import FlatParamHandle, ParamShard, UnitShard
from .formulas import (
    UnitTraffic,
    fsdp_comm_bytes,
    fsdp_comm_bytes_by_group,
    unit_comm_bytes,
    unit_comm_bytes_by_group,
    unit_traffic,
)
from .fully_sharded import FullyShardedDataParallel
from .state import clean_name
from .wrap import (
    HYBRID_STRATEGIES,
    BackwardPrefetch,
    MixedPrecision,
    ModuleWrapPolicy,
    ShardingStrategy,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
)

FSDP = FullyShardedDataParallel

__all__ = ["FSDP", "HYBRID_STRATEGIES", "BackwardPrefetch", "FlatParamHandle", "FullyShardedDataParallel",
           "MixedPrecision", "ModuleWrapPolicy", "ParamShard", "ShardingStrategy", "UnitShard", "UnitTraffic",
           "clean_name", "fsdp_comm_bytes", "fsdp_comm_bytes_by_group",
           "size_based_auto_wrap_policy", "transformer_auto_wrap_policy", "unit_comm_bytes",
           "unit_comm_bytes_by_group", "unit_traffic"]
