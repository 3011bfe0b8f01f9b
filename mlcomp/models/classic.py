"""The textbook's small models: the MLP of the hybridize experiment and LeNet-5."""
from __future__ import annotations

from torch import nn


def mlp() -> nn.Sequential:
    """``Linear(512,256) → ReLU → Linear(256,128) → ReLU → Linear(128,2)``."""
    return nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(), nn.Linear(128, 2))


class LeNet(nn.Module):
    """LeNet-5 as in d2l: 5x5 convs with sigmoid and average pooling, input 1x28x28."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 6, kernel_size=5, padding=2), nn.Sigmoid(), nn.AvgPool2d(2, 2),
            nn.Conv2d(6, 16, kernel_size=5), nn.Sigmoid(), nn.AvgPool2d(2, 2))
        self.classifier = nn.Sequential(
            nn.Flatten(), nn.Linear(16 * 5 * 5, 120), nn.Sigmoid(), nn.Linear(120, 84), nn.Sigmoid(),
            nn.Linear(84, num_classes))

    def forward(self, x):
        return self.classifier(self.features(x))
