"""ResNet-18, the d2l CIFAR variant: 3x3 stem, no max-pool, four stages of two blocks."""
from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Residual(nn.Module):
    def __init__(self, in_channels: int, channels: int, stride: int = 1) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, channels, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.shortcut = None
        if stride != 1 or in_channels != channels:
            self.shortcut = nn.Sequential(nn.Conv2d(in_channels, channels, 1, stride=stride, bias=False),
                                          nn.BatchNorm2d(channels))

    def forward(self, x):
        y = F.relu(self.bn1(self.conv1(x)))
        y = self.bn2(self.conv2(y))
        return F.relu(y + (x if self.shortcut is None else self.shortcut(x)))


class ResNet18(nn.Module):
    """ResNet-18's layout: the 3x3 stem (conv, batch norm, relu), one stage ``layer<i>`` per width in
    ``widths`` of ``blocks`` residual blocks (each later stage's first block strided, its shortcut a 1x1
    conv + batch norm), pooling and the classifier.  The defaults are ResNet-18; ``widths=(8, 16),
    blocks=1`` is its structure at a fraction of its size and node count (the tests' small ResNet)."""

    def __init__(self, num_classes: int = 10, widths: tuple[int, ...] = (64, 128, 256, 512), blocks: int = 2) -> None:
        super().__init__()
        if not widths or blocks < 1:
            raise ValueError(f"a ResNet needs at least one stage width and one block per stage; got "
                             f"widths={widths!r}, blocks={blocks}")
        self.stem = nn.Sequential(nn.Conv2d(3, widths[0], 3, padding=1, bias=False), nn.BatchNorm2d(widths[0]),
                                  nn.ReLU())
        self.stages = [f"layer{i + 1}" for i in range(len(widths))]
        in_ch = widths[0]
        for i, ch in enumerate(widths):
            blocks_of = [Residual(in_ch, ch, 1 if i == 0 else 2)] + [Residual(ch, ch) for _ in range(blocks - 1)]
            self.add_module(self.stages[i], nn.Sequential(*blocks_of))
            in_ch = ch
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(widths[-1], num_classes)

    def forward(self, x):
        x = self.stem(x)
        for stage in self.stages:
            x = getattr(self, stage)(x)
        return self.fc(self.pool(x).flatten(1))


def resnet18(num_classes: int = 10, widths: tuple[int, ...] = (64, 128, 256, 512), blocks: int = 2) -> ResNet18:
    """:class:`ResNet18` with random but non-trivial batch-norm statistics, so BN folding is really tested."""
    return randomize_batchnorm(ResNet18(num_classes, widths, blocks))


def randomize_batchnorm(model: nn.Module, seed: int = 0) -> nn.Module:
    """Give every BatchNorm2d non-trivial statistics and affine parameters (seeded), so folding
    and pruning by BN scale are tested on something other than identity norms."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.num_features, generator=g) * 0.1)
    return model
