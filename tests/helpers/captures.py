"""Small test models captured once per test process and handed out as copies.

A ``torch.export`` capture costs ~0.4 CPU-s even for a three-layer model (most of it torch's
decomposition tables, the same for every model), so a builder that many tests call is
captured once: :func:`captured_once` wraps ``build(*args) -> (model, *inputs, graph)`` and every
call returns a deep copy of the model, clones of the inputs and ``graph.copy()`` (constants
shared copy-on-write), and leaves torch's global generator where ``build`` left it.
:func:`changed` names the cached graphs a test changed in place (``tests/conftest.py``
asserts it is empty when the session ends).
"""
from __future__ import annotations

import copy
import functools
import hashlib
from typing import Any, Callable

import torch

from mlcomp.ir import Graph

_CACHE: dict[str, tuple[Any, ...]] = {}
_RNG: dict[str, torch.Tensor] = {}
_PRINTS: dict[str, tuple[str, dict[str, str]]] = {}


def fingerprint(graph) -> tuple[str, dict[str, str]]:
    """The graph's text and a digest of every constant's bytes."""
    digests = {name: hashlib.sha256(t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy()).hexdigest()
               for name, t in graph.constants.items()}
    return graph.format(), digests


def _fresh(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, torch.nn.Module):
        return copy.deepcopy(value)
    return value.copy() if isinstance(value, Graph) else value


def captured_once(build: Callable[..., tuple[Any, ...]]) -> Callable[..., tuple[Any, ...]]:
    """``build(*args)`` run once per process and ``args`` (hashable); each call: ``(deepcopy(model),
    *clones(inputs), graph.copy())``, and torch's global generator left as ``build`` leaves it (a builder that
    seeds it draws the same numbers after it)."""
    name = f"{build.__module__}.{build.__qualname__}"

    @functools.wraps(build)
    def get(*args: Any) -> tuple[Any, ...]:
        key = f"{name}{args!r}"
        if key not in _CACHE:
            _CACHE[key] = build(*args)
            _RNG[key] = torch.get_rng_state()
            _PRINTS[key] = fingerprint(_CACHE[key][-1])
        torch.set_rng_state(_RNG[key])
        return tuple(_fresh(v) for v in _CACHE[key])

    return get


def changed() -> list[str]:
    """The builders whose cached graph no longer matches its fingerprint."""
    return [key for key, values in _CACHE.items() if fingerprint(values[-1]) != _PRINTS[key]]


@captured_once
def conv_linear():
    """conv → relu → flatten → linear (seed 0), its ``[2, 3, 8, 8]`` example input and its captured graph."""
    from torch import nn

    from mlcomp.frontend.loading import load_model

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 5)).eval()
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    return model, x, load_model(model, example_inputs=(x,)).capture()
