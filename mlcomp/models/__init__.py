"""The sample zoo: the textbook's models, written with ``torch.nn`` and random weights.

``get(name)`` returns a :class:`ZooModel` whose ``build()`` makes the module
(eval mode, seeded weights) and whose ``example_inputs(batch)`` makes inputs.
Nothing is downloaded.

:func:`random_tensor` is the one way mlcomp makes random data for an input
(zoo examples, ``--input-shape``, pass verification, targets, artifacts)::

    >>> random_tensor((2, 3), torch.int64, torch.Generator().manual_seed(0))
    tensor([[4, 9, 3],
            [0, 3, 9]])
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

import torch
from mlcomp.base.errors import ModelLoadError
from mlcomp.base.registry import did_you_mean
from mlcomp.models.classic import LeNet, mlp
from mlcomp.models.mobilenet import mobilenet
from mlcomp.models.resnet import resnet18
from mlcomp.models.sequence import GRUClassifier
from mlcomp.models.transformer import TransformerEncoderModel
from torch import nn


def random_tensor(shape: Sequence[int], dtype: torch.dtype = torch.float32,
                  generator: torch.Generator | None = None) -> torch.Tensor:
    """Seeded random data: floats ~ N(0, 1) (drawn in f32), integers in [0, 10), booleans 50/50."""
    shape = tuple(int(s) for s in shape)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=generator).to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    return torch.randint(0, 10, shape, generator=generator).to(dtype)


def random_inputs(specs: Iterable[tuple[Sequence[int], torch.dtype]], seed: int = 0) -> tuple[torch.Tensor, ...]:
    """One :func:`random_tensor` per ``(shape, dtype)``, all from one generator seeded with ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    return tuple(random_tensor(shape, dtype, gen) for shape, dtype in specs)


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
        return random_inputs([((batch, *self.input_shape), self.input_dtype)], seed)


ZOO: dict[str, ZooModel] = {m.name: m for m in (
    ZooModel("mlp", "d2l MLP 512-256-128-2 (the hybridize experiment)", mlp, (512,)),
    ZooModel("lenet", "LeNet-5 (d2l: sigmoid, avg-pool) on 1x28x28", LeNet, (1, 28, 28)),
    ZooModel("resnet18", "ResNet-18, d2l CIFAR variant (3x3 stem, no max-pool), 10 classes",
             resnet18, (3, 32, 32)),
    ZooModel("transformer", "Transformer encoder: 4 layers, d_model 256, 4 heads, ff 1024, seq 128",
             TransformerEncoderModel, (128, 256)),
    ZooModel("gru", "GRU sequence classifier unrolled over 16 steps (Python loop), 64 features",
             GRUClassifier, (16, 64)),
    ZooModel("mobilenet", "MobileNetV2-style: depthwise convs, inverted residuals, 3x32x32", mobilenet, (3, 32, 32)),
)}


def names() -> list[str]:
    return list(ZOO)


def get(name: str) -> ZooModel:
    try:
        return ZOO[name]
    except KeyError:
        close = did_you_mean(name, ZOO)
        raise ModelLoadError(f"there is no zoo model named {name!r}" + (f" (did you mean {close!r}?)" if close else ""),
                             hint=f"choose one of: {', '.join(ZOO)} (see `mlcomp models list`)") from None


__all__ = ["ZOO", "ZooModel", "get", "names", "random_tensor", "random_inputs", "mlp", "LeNet", "resnet18", "TransformerEncoderModel",
           "GRUClassifier"]
