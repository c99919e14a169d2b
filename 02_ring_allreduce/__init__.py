"""Chapter 02: ring all-reduce (reduce-scatter + all-gather) from point-to-point messages."""

from .ring import (
    SUPPORTED_DTYPES,
    chunk_bounds,
    chunk_sizes,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    ring_traffic,
)

__all__ = [
    "SUPPORTED_DTYPES",
    "chunk_bounds",
    "chunk_sizes",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "ring_traffic",
]
