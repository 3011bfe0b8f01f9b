"""Shared fixtures and the marker policy.

Markers split tests by what they need: ``tvm`` and ``ort`` run everywhere the
Makefile installs their packages (CI included); ``cuda`` skips, saying why,
when no GPU is present.  Nothing else is skipped silently.
"""
from __future__ import annotations

import warnings

import pytest
import torch

warnings.filterwarnings("ignore", category=FutureWarning)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def zoo():
    from mlcomp.models import ZOO

    return ZOO


@pytest.fixture(scope="session")
def captured(zoo):
    """Zoo graphs captured once per session via torch.export: name -> (module, inputs, graph)."""
    from mlcomp.frontend.loading import load_model

    cache: dict[str, tuple] = {}

    def get(name: str, batch: int = 2):
        key = f"{name}@{batch}"
        if key not in cache:
            z = zoo[name]
            module, inputs = z.build(), z.example_inputs(batch)
            graph = load_model(module, example_inputs=inputs).capture()
            cache[key] = (module, inputs, graph)
        return cache[key]

    return get
