"""Fixtures more than one layer's unit tests use."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mlcomp.hardware.threads import threads


@pytest.fixture(scope="module")
def mlp_joint():
    """A seeded 4-3-2 MLP, a batch of two, its labels and its joint training graph (cross entropy):
    ``(model, x, y, graph)``.  Module-scoped: a test that rewrites the graph works on a copy."""
    from mlcomp.frontend.joint import capture_joint

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))
    x, y = torch.randn(2, 4), torch.tensor([0, 1])
    return model, x, y, capture_joint(model, (x,), y)


@pytest.fixture
def one_thread():
    """One intra-op thread for the test: on a small shared machine OpenMP spin-waits dominate tiny ops otherwise."""
    with threads(1):
        yield
