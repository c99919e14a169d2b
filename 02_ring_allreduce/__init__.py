"""Chapter 02: ring all-reduce (reduce-scatter + all-gather) from point-to-point messages."""

from functools import partial

import torch.distributed as dist

from .naive import naive_all_reduce
from .ring import (
    SUPPORTED_DTYPES,
    chunk_bounds,
    chunk_sizes,
    ring_all_gather,
    ring_all_reduce,
    ring_reduce_scatter,
    ring_traffic,
)

# The three all-reduces by name, without the call check (torch's own has none): what the bench and
# the demo time side by side.
TIMED_ALL_REDUCES = {"ring": partial(ring_all_reduce, check=False),
                     "naive": partial(naive_all_reduce, check=False), "builtin": dist.all_reduce}

__all__ = [
    "SUPPORTED_DTYPES",
    "TIMED_ALL_REDUCES",
    "chunk_bounds",
    "chunk_sizes",
    "naive_all_reduce",
    "ring_all_gather",
    "ring_all_reduce",
    "ring_reduce_scatter",
    "ring_traffic",
]
