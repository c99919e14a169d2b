"""The DeepSpeed-style JSON config: the keys this engine understands, their defaults, validation,
and how they map onto ZeroOptimizer's keyword arguments (`optimizer_arguments`).

    {"bf16": {"enabled": true},
     "zero_optimization": {"stage": 2, "overlap_comm": true, "contiguous_gradients": true,
                           "reduce_bucket_size": 5e8, "allgather_bucket_size": 5e8},
     "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
     "train_micro_batch_size_per_gpu": 2}

The names and meanings follow DeepSpeed's documentation (bucket sizes count *elements*, not bytes;
`gradient_clipping: 0` means no clipping). Its documented stage-3 names are accepted:
`stage3_param_persistence_threshold` is `param_persistence_threshold` (the article's spelling,
which DeepSpeed also reads); `stage3_prefetch_bucket_size`, `stage3_max_live_parameters`,
`stage3_max_reuse_distance` and `stage3_gather_16bit_weights_on_model_save` tune DeepSpeed's
prefetcher and saving: validated and echoed in the report, they change nothing here (this engine
prefetches one unit ahead and holds at most two gathered; the numbers do not depend on either).
A stage-3 key under another stage is an error, as it would do nothing. Any key or value outside
the tables below is an error that lists what is supported, so a typo (`"stage": "2"`,
`"reduce_bucket_sise"`) cannot silently fall back to a default. Depends on nothing but the
standard library.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

OFFLOAD_DEVICES = ("none", "cpu")


class ZeroConfigError(ValueError):
    """An unknown key or an invalid value; the message lists what is supported."""


@dataclass(frozen=True)
class ZeroConfig:
    stage: int = 0
    bf16: bool = False
    overlap_comm: bool = True
    contiguous_gradients: bool = True
    reduce_bucket_size: int = 500_000_000
    allgather_bucket_size: int = 500_000_000
    param_persistence_threshold: int = 100_000
    offload_optimizer: str = "none"
    offload_param: str = "none"
    pin_memory: bool = True
    gradient_accumulation_steps: int | None = None
    gradient_clipping: float = 0.0
    train_micro_batch_size_per_gpu: int | None = None
    train_batch_size: int | None = None
    stage3_tuning: tuple[tuple[str, int | bool], ...] = ()  # DeepSpeed's knobs: echoed, no effect

    @property
    def clip(self) -> float | None:
        return self.gradient_clipping or None

    @property
    def offload(self) -> bool:
        return self.offload_optimizer != "none"


# key → (what it is, a checker returning an error string or None)
def _bool(v: Any) -> str | None:
    return None if isinstance(v, bool) else "must be true or false"


def _positive_int(v: Any) -> str | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0 and float(v).is_integer()
    return None if ok else "must be a positive whole number (elements; 5e8 is fine)"


def _nonnegative_int(v: Any) -> str | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0 and float(v).is_integer()
    return None if ok else "must be a whole number >= 0"


def _nonnegative(v: Any) -> str | None:
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0
    return None if ok else "must be a number >= 0 (0 = no clipping)"


def _stage(v: Any) -> str | None:
    return None if v in (0, 1, 2, 3) and not isinstance(v, bool) else "must be 0, 1, 2 or 3"


ZERO_KEYS = {
    "stage": _stage,
    "overlap_comm": _bool,
    "contiguous_gradients": _bool,
    "reduce_bucket_size": _positive_int,
    "allgather_bucket_size": _positive_int,
    "param_persistence_threshold": _nonnegative_int,
    "offload_optimizer": None,  # sections, checked by _offload
    "offload_param": None,
    "stage3_param_persistence_threshold": _nonnegative_int,  # DeepSpeed's documented name
    "stage3_prefetch_bucket_size": _positive_int,
    "stage3_max_live_parameters": _positive_int,
    "stage3_max_reuse_distance": _nonnegative_int,
    "stage3_gather_16bit_weights_on_model_save": _bool,
}
PERSISTENCE = ("param_persistence_threshold", "stage3_param_persistence_threshold")
STAGE3_TUNING = ("stage3_prefetch_bucket_size", "stage3_max_live_parameters", "stage3_max_reuse_distance",
                 "stage3_gather_16bit_weights_on_model_save")
TOP_KEYS = {
    "zero_optimization": None,
    "bf16": None,
    "fp16": None,
    "gradient_accumulation_steps": _positive_int,
    "gradient_clipping": _nonnegative,
    "train_micro_batch_size_per_gpu": _positive_int,
    "train_batch_size": _positive_int,
    "wall_clock_breakdown": _bool,  # accepted for compatibility with the source's config; no effect
}
OFFLOAD_KEYS = ("device", "pin_memory")


def _unknown(keys, supported, where: str) -> None:
    extra = sorted(set(keys) - set(supported))
    if extra:
        raise ZeroConfigError(f"{where}: unknown key(s) {', '.join(map(repr, extra))}; supported: "
                              f"{', '.join(supported)}")


def _check(section: dict, table: dict, where: str) -> None:
    for key, value in section.items():
        checker = table.get(key)
        if checker is not None and (error := checker(value)) is not None:
            raise ZeroConfigError(f"{where}.{key} = {value!r}: {error}")


def _offload(section: Any, where: str) -> tuple[str, bool]:
    if not isinstance(section, dict):
        raise ZeroConfigError(f"{where} = {section!r}: must be an object like {{\"device\": \"cpu\"}}")
    _unknown(section, OFFLOAD_KEYS, where)
    device = section.get("device", "none")
    if device not in OFFLOAD_DEVICES:
        raise ZeroConfigError(f"{where}.device = {device!r}: supported devices are "
                              f"{', '.join(OFFLOAD_DEVICES)} (nvme is not implemented)")
    pin = section.get("pin_memory", True)
    if _bool(pin):
        raise ZeroConfigError(f"{where}.pin_memory = {pin!r}: must be true or false")
    return device, pin


def _enabled(section: Any, where: str) -> bool:
    if not isinstance(section, dict) or set(section) - {"enabled"}:
        raise ZeroConfigError(f"{where} = {section!r}: supported form is {{\"enabled\": true|false}}")
    enabled = section.get("enabled", False)
    if _bool(enabled):
        raise ZeroConfigError(f"{where}.enabled = {enabled!r}: must be true or false")
    return enabled


def parse_config(raw: dict) -> ZeroConfig:
    """A DeepSpeed-style dict → ZeroConfig, or ZeroConfigError naming the key and what is allowed."""
    if not isinstance(raw, dict):
        raise ZeroConfigError(f"config must be a JSON object, got {type(raw).__name__}")
    _unknown(raw, TOP_KEYS, "config")
    _check(raw, TOP_KEYS, "config")
    zero = raw.get("zero_optimization", {})
    if not isinstance(zero, dict):
        raise ZeroConfigError("config.zero_optimization must be an object")
    _unknown(zero, ZERO_KEYS, "zero_optimization")
    _check(zero, ZERO_KEYS, "zero_optimization")
    if _enabled(raw.get("fp16", {}), "config.fp16"):
        raise ZeroConfigError("config.fp16.enabled = true: fp16 needs loss scaling, which this engine "
                              "does not implement; use \"bf16\": {\"enabled\": true}")
    opt_device, pin_opt = _offload(zero.get("offload_optimizer", {}), "zero_optimization.offload_optimizer")
    par_device, pin_par = _offload(zero.get("offload_param", {}), "zero_optimization.offload_param")
    stage = zero.get("stage", 0)
    stage3_keys = sorted(k for k in zero if k.startswith("stage3_"))
    if stage3_keys and stage != 3:
        raise ZeroConfigError(f"zero_optimization.{stage3_keys[0]} with stage {stage}: stage-3 keys "
                              "configure stage 3 only; use stage 3 or drop them")
    if all(k in zero for k in PERSISTENCE) and float(zero[PERSISTENCE[0]]) != float(zero[PERSISTENCE[1]]):
        raise ZeroConfigError(f"zero_optimization sets both {PERSISTENCE[0]} = {zero[PERSISTENCE[0]]!r} and "
                              f"{PERSISTENCE[1]} = {zero[PERSISTENCE[1]]!r}: one name, one value")
    persistence = next((zero[k] for k in PERSISTENCE if k in zero), 100_000)
    if par_device != "none" and stage != 3:
        raise ZeroConfigError(f"zero_optimization.offload_param with stage {stage}: only stage 3 "
                              "partitions parameters; use stage 3 or drop offload_param")
    as_int = lambda key, default: int(zero.get(key, default))  # noqa: E731
    top_int = lambda key: int(raw[key]) if key in raw else None  # noqa: E731
    return ZeroConfig(
        stage=stage, bf16=_enabled(raw.get("bf16", {}), "config.bf16"),
        overlap_comm=zero.get("overlap_comm", True),
        contiguous_gradients=zero.get("contiguous_gradients", True),
        reduce_bucket_size=as_int("reduce_bucket_size", 500_000_000),
        allgather_bucket_size=as_int("allgather_bucket_size", 500_000_000),
        param_persistence_threshold=int(persistence),
        offload_optimizer=opt_device, offload_param=par_device, pin_memory=pin_opt and pin_par,
        gradient_accumulation_steps=top_int("gradient_accumulation_steps"),
        gradient_clipping=float(raw.get("gradient_clipping", 0.0)),
        train_micro_batch_size_per_gpu=top_int("train_micro_batch_size_per_gpu"),
        train_batch_size=top_int("train_batch_size"),
        stage3_tuning=tuple((k, zero[k] if isinstance(zero[k], bool) else int(zero[k]))
                            for k in STAGE3_TUNING if k in zero),
    )


def load_config(path: str | Path) -> ZeroConfig:
    """Read and validate a JSON file (DeepSpeed's `ds_config.json`)."""
    try:
        raw = json.loads(Path(path).read_text())
    except OSError as error:
        raise ZeroConfigError(f"--config {path}: cannot read it ({error.strerror})") from None
    except json.JSONDecodeError as error:
        raise ZeroConfigError(f"--config {path}: not valid JSON ({error})") from None
    return parse_config(raw)


def optimizer_arguments(config: ZeroConfig) -> dict[str, Any]:
    """The ZeroOptimizer keyword arguments of `config` (the rest, accumulation, clipping, the
    batch and stage 3's persistence threshold, are the engine's and train.py's)."""
    return {"stage": config.stage, "bf16": config.bf16, "overlap_comm": config.overlap_comm,
            "contiguous_gradients": config.contiguous_gradients,
            "reduce_bucket_size": config.reduce_bucket_size,
            "allgather_bucket_size": config.allgather_bucket_size,
            "offload_optimizer": config.offload_optimizer == "cpu",
            "offload_param": config.offload_param == "cpu", "pin_memory": config.pin_memory}


def to_dict(config: ZeroConfig) -> dict:
    """The DeepSpeed-style dict of `config` (what the run report prints)."""
    zero = {"stage": config.stage, "overlap_comm": config.overlap_comm,
            "contiguous_gradients": config.contiguous_gradients,
            "reduce_bucket_size": config.reduce_bucket_size,
            "allgather_bucket_size": config.allgather_bucket_size,
            "param_persistence_threshold": config.param_persistence_threshold,
            "offload_optimizer": {"device": config.offload_optimizer},
            "offload_param": {"device": config.offload_param}, **dict(config.stage3_tuning)}
    out = {"bf16": {"enabled": config.bf16}, "zero_optimization": zero,
           "gradient_clipping": config.gradient_clipping}
    for key in ("gradient_accumulation_steps", "train_micro_batch_size_per_gpu", "train_batch_size"):
        if getattr(config, key) is not None:
            out[key] = getattr(config, key)
    return out
