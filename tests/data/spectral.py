"""A model with an op no mlcomp target lowers (an FFT), for the fallback tests.

    mlcomp compile tests/data/spectral.py:build --target cpu            # UnsupportedOpError
    mlcomp compile tests/data/spectral.py:build --target cpu --fallback eager
"""
from __future__ import annotations

import torch
from torch import nn


class SpectralMLP(nn.Module):
    """Linear → ReLU → |rfft| (complex, unsupported everywhere) → Linear → ReLU → Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(33, 32)
        self.head = nn.Linear(32, 10)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        spectrum = torch.fft.rfft(h, dim=-1).abs()
        return self.head(torch.relu(self.fc2(spectrum)))


def build() -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    torch.manual_seed(0)
    return SpectralMLP().eval(), (torch.randn(4, 64, generator=torch.Generator().manual_seed(1)),)
