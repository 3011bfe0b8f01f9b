"""The joint graph runs what eager autograd runs: SiLU's fused backward, and reshapes where strides differ.

Two tiny models, each compiled for training once: an MLP with SiLU (the joint trace
records SiLU's backward as a composite; restored to ``silu_backward`` the gradients are
eager's bit for bit) and a ConvNeXt-style block whose convolution reads a permuted
(channels-last) tensor (``mse_loss_backward`` then returns a gradient laid out otherwise
than the trace assumed; a traced ``view`` of it failed at run time).
"""
from __future__ import annotations

from collections import Counter

import torch
from torch import nn

import mlcomp
from mlcomp.ir.ops import aten


def _ops(art) -> Counter:
    return Counter(n.op for n in art.graph.call_nodes())


def test_silu_backward_is_eagers_kernel_and_gradients_are_bitwise():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.SiLU(), nn.Linear(32, 8), nn.SiLU())
    x, y = torch.randn(8, 16), torch.randn(8, 8)
    art = mlcomp.compile(model, (x,), mode="train", target="cpu", loss="mse", optimizer="sgd", y=y)
    ops = _ops(art)
    assert ops[aten("silu_backward")] == 2 and ops[aten("silu")] == 2 and ops[aten("sigmoid")] == 0
    assert art.verification["worst_rel"] == 0.0 and art.verification["loss_rel"] == 0.0


class _ChannelsLastBlock(nn.Module):
    """conv(x as NCHW view of NHWC data) + permute(scale * linear(permute(conv))): ConvNeXt's layer shape."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.lin, self.scale = nn.Conv2d(4, 8, 1), nn.Linear(8, 8), nn.Parameter(torch.ones(8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv(x.permute(0, 3, 1, 2))
        return h + (self.scale * self.lin(h.permute(0, 2, 3, 1))).permute(0, 3, 1, 2)


def test_gradients_laid_out_otherwise_than_traced_are_reshaped():
    torch.manual_seed(0)
    model, x = _ChannelsLastBlock(), torch.randn(2, 3, 3, 4)
    art = mlcomp.compile(model, (x,), mode="train", target="cpu", loss="mse", optimizer="sgd")
    assert aten("view") not in _ops(art) and _ops(art)[aten("reshape")] > 0
    assert art.verification["passed"] and art.verification["worst_rel"] == 0.0


class _Upsample(nn.Module):
    """A conv and a bilinear resize (MobileViT's and SegFormer's decoders resize this way)."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.interpolate(self.conv(x), size=(9, 7), mode="bilinear", align_corners=False)


def test_bilinear_upsample_backward_is_eagers_kernel_and_the_override_comes_back():
    from torch._C import DispatchKey

    op = torch.ops.aten.upsample_bilinear2d.default
    before = dict(op.py_kernels)
    assert DispatchKey.Autograd in before             # torch._decomp's tracing-only decomposition
    torch.manual_seed(0)
    x, y = torch.randn(2, 3, 5, 6), torch.randn(2, 4, 9, 7)
    art = mlcomp.compile(_Upsample(), (x,), mode="train", target="cpu", loss="mse", optimizer="sgd", y=y)
    ops = _ops(art)
    assert ops[aten("upsample_bilinear2d_backward")] == 1 and ops[aten("index_put")] == 0
    assert art.verification["worst_rel"] == 0.0 and art.verification["loss_rel"] == 0.0
    assert op.py_kernels == before                      # lifted only while the joint graph was traced
