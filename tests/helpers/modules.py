"""Small torch modules shared by tests of several layers."""
from __future__ import annotations

from torch import nn


class Tokens(nn.Module):
    """A transformer-like block over ``[batch, seq, 8]``: per-token linears around a reshape over
    batch*seq, softmax over the sequence (both sizes may be symbolic)."""

    def __init__(self):
        super().__init__()
        self.proj, self.out = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        b, t, c = x.shape
        h = self.proj(x).reshape(b * t, c).relu()
        return self.out(h.reshape(b, t, c)).softmax(1) + 1.0
