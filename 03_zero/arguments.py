"""What ZeroOptimizer refuses before it builds anything, each with the fix: a stage it has not
(stage 3 is ZeroEngine's, over a module's units), whole-parameter ownership at stage 3 (it gathers
slices), bucket sizes that are not whole numbers of elements, parameter offload below stage 3,
ZeroRedundancyOptimizer's flags it does not implement, and, with slice ownership, an optimizer that
is not element-wise: a slice crosses parameter boundaries, so an update that reads more than an
element's own gradient and state (Adafactor's row and column statistics, LAMB's per-tensor norm)
would step shapes no single-device run has, silently off.
"""

from __future__ import annotations

from typing import Any

import torch

# torch optimizers whose update of an element reads only that element's own gradient and state
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax,
               torch.optim.NAdam, torch.optim.RAdam, torch.optim.Adagrad, torch.optim.Adadelta,
               torch.optim.RMSprop, torch.optim.Rprop, torch.optim.ASGD)
OWNERSHIPS = ("slice", "parameter")
BUCKETS = ("reduce_bucket_size", "allgather_bucket_size")


def refuse_bad_arguments(stage: int, ownership: str, has_units: bool, reduce_bucket_size: Any,
                         allgather_bucket_size: Any, offload_param: bool, defaults: dict[str, Any]) -> None:
    """ValueError (NotImplementedError for ZeroRedundancyOptimizer's flags) naming the argument
    and the fix; pops those flags from `defaults` when False (torch's defaults)."""
    if ownership not in OWNERSHIPS:
        raise ValueError(f"ownership={ownership!r}: use 'slice' or 'parameter'")
    if stage not in (0, 1, 2, 3) or (stage == 3) != has_units:
        raise ValueError(f"stage={stage!r}: ZeroOptimizer shards the optimizer (1) and the gradients "
                         "(2); stage 3 also shards the parameters of a module: use ZeroEngine")
    if has_units and ownership != "slice":
        raise ValueError("stage 3 gathers slices; whole-parameter ownership is for stages 0-2")
    for key, value in zip(BUCKETS, (reduce_bucket_size, allgather_bucket_size), strict=True):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 1 or value % 1:
            raise ValueError(f"{key}={value!r}: a whole number of elements >= 1 (DeepSpeed's 5e8)")
    if offload_param and stage != 3:
        raise ValueError(f"offload_param=True with stage {stage}: only stage 3 partitions the parameters")
    for key in ("parameters_as_bucket_view", "overlap_with_ddp"):  # ZeroRedundancyOptimizer's, False
        if defaults.pop(key, False):
            raise NotImplementedError(f"{key}=True is not implemented here: ZeroOptimizer keeps its own "
                                      "flat buckets and overlaps its reductions with backward; drop it")


def require_elementwise(optimizer: torch.optim.Optimizer, ownership: str) -> None:
    """Under slice ownership, only an ELEMENTWISE inner optimizer is exact."""
    if ownership == "slice" and (cls := type(optimizer)) not in ELEMENTWISE:
        raise ValueError(
            f"{cls.__name__} is not element-wise, and ZeRO's slices are 1-D pieces that cross "
            f"parameter boundaries: it would step shapes no single-device run has (silently "
            f"off). Pass ownership='parameter' (each rank steps whole tensors), or one of: "
            f"{', '.join(c.__name__ for c in ELEMENTWISE)}")
