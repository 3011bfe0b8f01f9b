"""Small torch modules shared by tests of several layers."""
from __future__ import annotations

import torch
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


class SmallResNet(nn.Module):
    """ResNet-18's structure (``mlcomp.models.resnet``) at a fraction of its size and node count: the
    3x3 stem (conv, batch norm, relu), a stage of one identity-shortcut block, a stage of one strided
    block whose shortcut is a 1x1 conv + batch norm, pooling and the classifier.  Parameter and buffer
    names follow the zoo model's (``stem.1``, ``layer1.0.conv1``, ``layer2.0.shortcut.0``), batch-norm
    statistics are random (seeded), so folding and running-stat updates are tested on real numbers.
    Input ``[batch, 3, 16, 16]``."""

    def __init__(self, widths: tuple[int, int] = (8, 16), num_classes: int = 10) -> None:
        from mlcomp.models.resnet import Residual, randomize_batchnorm

        super().__init__()
        w1, w2 = widths
        self.stem = nn.Sequential(nn.Conv2d(3, w1, 3, padding=1, bias=False), nn.BatchNorm2d(w1), nn.ReLU())
        self.layer1 = nn.Sequential(Residual(w1, w1))
        self.layer2 = nn.Sequential(Residual(w1, w2, stride=2))
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(w2, num_classes)
        randomize_batchnorm(self)

    def forward(self, x):
        x = self.layer2(self.layer1(self.stem(x)))
        return self.fc(self.pool(x).flatten(1))


def small_resnet(batch: int, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A seeded :class:`SmallResNet` and an input batch for it."""
    torch.manual_seed(seed)
    return SmallResNet(), (torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(seed)),)
