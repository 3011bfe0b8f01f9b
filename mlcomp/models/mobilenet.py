"""A MobileNetV2-style network: inverted residual blocks with depthwise convolutions, CIFAR-sized.

Each block expands with a 1x1 convolution, filters with a 3x3 *depthwise* convolution
(``groups == channels``) and projects back with a linear 1x1 convolution; a block
that keeps its shape adds its input (the inverted residual)::

    x ─ conv1x1 (c → 6c) ─ BN ─ ReLU6 ─ dw3x3 (6c, groups=6c) ─ BN ─ ReLU6 ─ conv1x1 (6c → c) ─ BN ─(+ x)

The zoo entry is ``mobilenet`` (input 3x32x32, 10 classes, random weights).
"""
from __future__ import annotations

import torch
from torch import nn

from mlcomp.models.resnet import randomize_batchnorm


class InvertedResidual(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int, expand: int) -> None:
        super().__init__()
        hidden = cin * expand
        self.use_residual = stride == 1 and cin == cout
        self.block = nn.Sequential(
            nn.Conv2d(cin, hidden, 1, bias=False), nn.BatchNorm2d(hidden), nn.ReLU6(),
            nn.Conv2d(hidden, hidden, 3, stride=stride, padding=1, groups=hidden, bias=False),
            nn.BatchNorm2d(hidden), nn.ReLU6(),
            nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.use_residual else y


class MobileNetSmall(nn.Module):
    """Stem 3x3 conv, six inverted-residual blocks (two with residuals), 1x1 head conv, pooled classifier."""

    # (out channels, stride, expansion) per block
    BLOCKS = ((16, 1, 1), (24, 2, 6), (24, 1, 6), (32, 2, 6), (32, 1, 6), (64, 2, 6))

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 32, 3, padding=1, bias=False), nn.BatchNorm2d(32), nn.ReLU6())
        blocks, cin = [], 32
        for cout, stride, expand in self.BLOCKS:
            blocks.append(InvertedResidual(cin, cout, stride, expand))
            cin = cout
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Sequential(nn.Conv2d(cin, 256, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU6())
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(256, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.head(self.blocks(self.stem(x)))
        return self.fc(self.pool(x).flatten(1))


def mobilenet(num_classes: int = 10) -> MobileNetSmall:
    return randomize_batchnorm(MobileNetSmall(num_classes))   # non-trivial statistics, as in the zoo ResNet
