"""The one way to wrap torch.distributed's functions from the outside (the comm meter, the P2P
recorder, the CP ring's byte counter, the labs' checks), so that core files stay plain
`dist.all_reduce(...)` and every wrapper composes with the others.

    with patch_dist({"all_reduce": counting}):          # counting(fn) -> fn's counted replacement
        with patch_dist({"all_reduce": tracing}):       # wraps what is installed: the counted one
            dist.all_reduce(x)                          # tracing → counting → torch's
        dist.all_reduce(x)                              # counting → torch's
    dist.all_reduce(x)                                  # torch's own again

Each (module, name) keeps a stack of layers over the function it held. Entering a block wraps the
top of each stack and installs it; leaving it, normally or by an exception, removes that block's
layers only, even out of order (the layers above are wrapped again over the one below), and
when the last layer goes the module holds its own function again. A block wraps torch.distributed
and, of the modules in `also`, each whose attribute is an alias of torch.distributed's function:
distributed_c10d, whose `isend`/`irecv` P2POp checks ops against (modules that held one function
keep holding one function, wrapped once), or a module that imported the name. Only
torch.distributed's own name is wrapped otherwise: torch's functions call each other through
distributed_c10d's names (all_gather_into_tensor calls all_gather_single), which a counter
wrapping both would count twice. A name torch.distributed lacks (an older torch) is skipped.
Depends only on torch.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager

import torch.distributed as dist

Wrapper = Callable[[Callable], Callable]  # the function installed so far → its replacement
Layer = tuple[object, Wrapper, Callable]  # (the block, its wrapper, the function it installed)

_ORIGINAL: dict[tuple[object, str], Callable] = {}  # what each patched (module, name) held
_LAYERS: dict[tuple[object, str], list[Layer]] = {}
_LOCK = threading.RLock()


def _top(module: object, name: str) -> Callable:
    layers = _LAYERS.get((module, name))
    return layers[-1][2] if layers else getattr(module, name)


def _modules(name: str, also: Iterable[object]) -> list[object]:
    """torch.distributed, and each module of `also` whose `name` is one of its functions."""
    key = (dist, name)
    aliases = {id(_ORIGINAL.get(key, getattr(dist, name)))} | {id(fn) for _, _, fn in _LAYERS.get(key, [])}
    return [dist, *(m for m in also if id(getattr(m, name, None)) in aliases)]


def _push(block: object, name: str, wrap: Wrapper, modules: list[object]) -> None:
    made: dict[int, Callable] = {}  # modules that held one function get one wrapped function
    for module in modules:
        key = (module, name)
        if key in _LAYERS and getattr(module, name) is not _LAYERS[key][-1][2]:
            raise RuntimeError(f"{getattr(module, '__name__', module)}.{name} was replaced by hand inside a "
                               "patch_dist block: wrap it with common.kernel.patch.patch_dist, which nests")
        inner = _top(module, name)
        _ORIGINAL.setdefault(key, inner)
        if id(inner) not in made:
            made[id(inner)] = wrap(inner)
        fn = made[id(inner)]
        _LAYERS.setdefault(key, []).append((block, wrap, fn))
        setattr(module, name, fn)


def _pop(block: object, name: str) -> None:
    made: dict[tuple[int, int], Callable] = {}
    for key in [k for k, layers in _LAYERS.items() if k[1] == name and any(b is block for b, _, _ in layers)]:
        layers = _LAYERS[key]
        at = next(i for i, (b, _, _) in enumerate(layers) if b is block)
        del layers[at]
        inner = layers[at - 1][2] if at else _ORIGINAL[key]
        for i in range(at, len(layers)):  # removed out of order: the layers above wrap anew
            b, wrap, _ = layers[i]
            if (id(inner), id(wrap)) not in made:
                made[id(inner), id(wrap)] = wrap(inner)
            inner = made[id(inner), id(wrap)]
            layers[i] = (b, wrap, inner)
        module, _ = key
        setattr(module, name, inner)
        if not layers:
            del _LAYERS[key], _ORIGINAL[key]


@contextmanager
def patch_dist(wrappers: Mapping[str, Wrapper], also: Iterable[object] = ()) -> Iterator[None]:
    """Inside the block, torch.distributed's `name` (and its aliases in `also`) is
    `wrappers[name](what was installed there)`, for each name."""
    block, also = object(), tuple(also)
    try:
        with _LOCK:
            for name, wrap in wrappers.items():
                if hasattr(dist, name):
                    _push(block, name, wrap, _modules(name, also))
        yield
    finally:
        with _LOCK:
            for name in wrappers:
                _pop(block, name)
