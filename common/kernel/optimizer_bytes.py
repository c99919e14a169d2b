"""The closed form of an optimizer's state in bytes: the one copy of this formula, read by the
chapters' accounting (03, 07) and by the train.py files beside what the memory ledger measured.

    AdamW   m and v per element + a 4-byte step counter per tensor:   2·numel·itemsize + 4·n_tensors
    SGD     nothing (no momentum)                                       0

Part of the torch-only kernel that chapters' core files may import (common/copy_sets.py).
"""

from __future__ import annotations


def optimizer_state_bytes(optimizer: str, numel: float, itemsize: int, n_tensors: int) -> float:
    """The closed form of `optimizer`'s state for `numel` elements of `itemsize` bytes held in
    `n_tensors` tensors: AdamW keeps m and v (2·numel·itemsize) and a 4-byte step counter per
    tensor (torch's float32 `step`); plain SGD keeps nothing."""
    if optimizer == "adamw":
        return 2 * numel * itemsize + 4 * n_tensors
    if optimizer == "sgd":
        return 0
    raise ValueError(f"unknown optimizer {optimizer!r}: use 'adamw' or 'sgd'")
