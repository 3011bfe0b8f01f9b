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


SMALL_RESNET = {"widths": (8, 16), "blocks": 1}
"""ResNet-18's structure (:class:`mlcomp.models.resnet.ResNet18`) at a fraction of its size and node count:
the 3x3 stem, a stage of one identity-shortcut block, a stage of one strided block whose shortcut is a
1x1 conv + batch norm, pooling and the classifier; the zoo model's parameter and buffer names
(``stem.1``, ``layer1.0.conv1``, ``layer2.0.shortcut.0``) and its random batch-norm statistics (so
folding and running-stat updates are tested on real numbers).  Input ``[batch, 3, 16, 16]``."""


def small_resnet(batch: int, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A seeded ResNet-18 at :data:`SMALL_RESNET`'s widths and an input batch for it."""
    from mlcomp.models.resnet import resnet18

    torch.manual_seed(seed)
    return resnet18(**SMALL_RESNET), (torch.randn(batch, 3, 16, 16, generator=torch.Generator().manual_seed(seed)),)


def small_transformer(batch: int, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor]]:
    """The zoo transformer's class (:class:`mlcomp.models.transformer.TransformerEncoderModel`) at 2 layers of
    d_model 64, 4 heads, feed-forward 128, seeded, and a ``[batch, 16, 64]`` input for it."""
    from mlcomp.models.transformer import TransformerEncoderModel

    torch.manual_seed(seed)
    return (TransformerEncoderModel(d_model=64, heads=4, ff=128, layers=2),
            (torch.randn(batch, 16, 64, generator=torch.Generator().manual_seed(seed)),))
