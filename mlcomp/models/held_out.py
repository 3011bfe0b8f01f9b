"""Models no pass was written against: the rows that check a lowering generalises.

``gru-tagger-2l`` (embedding → 2-layer GRU → linear, 20 tokens), ``mlp-mixer``
(patch embedding, token- and channel-mixing MLPs with layer norm and GELU) and
``unet`` (two down and two up levels, skip connections, transposed convolutions),
small and with random weights::

    >>> model, inputs = build_held_out("unet", batch=1)
    >>> tuple(model(*inputs).shape)
    (1, 2, 32, 32)
"""
from __future__ import annotations

import torch
from torch import nn

from mlcomp.models.third_party import VOCAB, GRUTagger

__all__ = ["HELD_OUT", "MLPMixer", "SmallUNet", "build_held_out"]


class _MixerBlock(nn.Module):
    def __init__(self, tokens: int, dim: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.tokens = nn.Sequential(nn.Linear(tokens, 2 * tokens), nn.GELU(), nn.Linear(2 * tokens, tokens))
        self.channels = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.tokens(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channels(self.norm2(x))


class MLPMixer(nn.Module):
    """Image → patches → mixer blocks → mean over tokens → classes."""

    def __init__(self, image: int = 32, patch: int = 4, dim: int = 64, depth: int = 2, classes: int = 10) -> None:
        super().__init__()
        self.patches = nn.Conv2d(3, dim, patch, stride=patch)
        self.blocks = nn.Sequential(*[_MixerBlock((image // patch) ** 2, dim) for _ in range(depth)])
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.blocks(self.patches(x).flatten(2).transpose(1, 2))
        return self.head(self.norm(x).mean(1))


def _double_conv(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(), nn.Conv2d(cout, cout, 3, padding=1), nn.ReLU())


class SmallUNet(nn.Module):
    """Two down levels, a bottleneck, two up levels with skip connections; per-pixel classes."""

    def __init__(self, channels: int = 16, classes: int = 2) -> None:
        super().__init__()
        c = channels
        self.down1, self.down2, self.mid = _double_conv(3, c), _double_conv(c, 2 * c), _double_conv(2 * c, 4 * c)
        self.up2, self.dec2 = nn.ConvTranspose2d(4 * c, 2 * c, 2, stride=2), _double_conv(4 * c, 2 * c)
        self.up1, self.dec1 = nn.ConvTranspose2d(2 * c, c, 2, stride=2), _double_conv(2 * c, c)
        self.head = nn.Conv2d(c, classes, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        d1 = self.down1(x)
        d2 = self.down2(nn.functional.max_pool2d(d1, 2))
        m = self.mid(nn.functional.max_pool2d(d2, 2))
        u2 = self.dec2(torch.cat([self.up2(m), d2], 1))
        return self.head(self.dec1(torch.cat([self.up1(u2), d1], 1)))


HELD_OUT = ("gru-tagger-2l", "mlp-mixer", "unet")


def build_held_out(name: str, batch: int = 2, *, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """``(model in eval mode, example inputs)`` for one of :data:`HELD_OUT`; ``KeyError`` if unknown."""
    if name not in HELD_OUT:
        raise KeyError(name)
    torch.manual_seed(seed)
    gen = torch.Generator().manual_seed(seed + 1)
    if name == "gru-tagger-2l":
        model = GRUTagger()
        model.gru = nn.GRU(32, 64, num_layers=2, batch_first=True)
        return model.eval(), (torch.randint(0, VOCAB, (batch, 20), generator=gen),)
    if name == "mlp-mixer":
        return MLPMixer().eval(), (torch.randn(batch, 3, 32, 32, generator=gen),)
    return SmallUNet().eval(), (torch.randn(batch, 3, 32, 32, generator=gen),)
