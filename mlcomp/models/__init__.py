"""The sample zoo: the textbook's models, written with ``torch.nn`` and random weights.

``get(name)`` returns a :class:`ZooModel` whose ``build()`` makes the module
(eval mode, seeded weights) and whose ``example_inputs(batch)`` makes inputs.
Nothing is downloaded.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from mlcomp.models.classic import LeNet, mlp
from mlcomp.models.resnet import resnet18
from mlcomp.models.sequence import GRUClassifier
from mlcomp.models.transformer import TransformerEncoderModel
from torch import nn


@dataclass(frozen=True)
class ZooModel:
    name: str
    summary: str
    factory: Callable[[], nn.Module]
    input_shape: tuple[int, ...]   # without the batch dimension
    input_dtype: torch.dtype = torch.float32

    def build(self, seed: int = 0) -> nn.Module:
        torch.manual_seed(seed)
        return self.factory().eval()

    def example_inputs(self, batch: int = 1, seed: int = 1) -> tuple[torch.Tensor, ...]:
        gen = torch.Generator().manual_seed(seed)
        return (torch.randn((batch, *self.input_shape), generator=gen, dtype=self.input_dtype),)


ZOO: dict[str, ZooModel] = {m.name: m for m in (
    ZooModel("mlp", "d2l MLP 512-256-128-2 (the hybridize experiment)", mlp, (512,)),
    ZooModel("lenet", "LeNet-5 (d2l: sigmoid, avg-pool) on 1x28x28", LeNet, (1, 28, 28)),
    ZooModel("resnet18", "ResNet-18, d2l CIFAR variant (3x3 stem, no max-pool), 10 classes",
             resnet18, (3, 32, 32)),
    ZooModel("transformer", "Transformer encoder: 4 layers, d_model 256, 4 heads, ff 1024, seq 128",
             TransformerEncoderModel, (128, 256)),
    ZooModel("gru", "GRU sequence classifier unrolled over 16 steps (Python loop), 64 features",
             GRUClassifier, (16, 64)),
)}


def names() -> list[str]:
    return list(ZOO)


def get(name: str) -> ZooModel:
    try:
        return ZOO[name]
    except KeyError:
        from mlcomp.base.errors import ModelLoadError
        raise ModelLoadError(f"there is no zoo model named {name!r}",
                             hint=f"choose one of: {', '.join(ZOO)} (see `mlcomp models list`)") from None


__all__ = ["ZOO", "ZooModel", "get", "names", "mlp", "LeNet", "resnet18", "TransformerEncoderModel",
           "GRUClassifier"]
