"""Chapter 01: data parallelism (naive per-tensor all-reduce, and bucketed DDP with overlap)."""

from .ddp import DistributedDataParallel, assign_buckets
from .naive import NaiveDataParallel, broadcast_module

__all__ = ["DistributedDataParallel", "NaiveDataParallel", "assign_buckets", "broadcast_module"]
