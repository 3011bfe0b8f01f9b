"""A GRU sequence classifier written with ``nn.Linear`` and a Python loop over time.

The loop is control flow on a *static* size (the sequence length), so capture
unrolls it correctly; no backend needs a fused RNN kernel.
"""
from __future__ import annotations

import torch
from torch import nn


class GRUCell(nn.Module):
    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.x2h = nn.Linear(inputs, 3 * hidden)
        self.h2h = nn.Linear(hidden, 3 * hidden)

    def forward(self, x, h):
        xr, xz, xn = self.x2h(x).chunk(3, dim=-1)
        hr, hz, hn = self.h2h(h).chunk(3, dim=-1)
        r = torch.sigmoid(xr + hr)
        z = torch.sigmoid(xz + hz)
        n = torch.tanh(xn + r * hn)
        return (1 - z) * n + z * h


class GRUClassifier(nn.Module):
    """Input (batch, 16 steps, 64) → GRU(128) over the steps → 10-way head on the last state."""

    def __init__(self, features: int = 64, hidden: int = 128, num_classes: int = 10, steps: int = 16) -> None:
        super().__init__()
        self.hidden = hidden
        self.steps = steps
        self.cell = GRUCell(features, hidden)
        self.head = nn.Linear(hidden, num_classes)

    def forward(self, x):
        h = x.new_zeros(x.shape[0], self.hidden)
        for t in range(self.steps):
            h = self.cell(x[:, t], h)
        return self.head(h)
