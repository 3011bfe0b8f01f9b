"""TVM's importer given operands of two dtypes (``targets.tvm.converters``): ``where`` with an f32 and a bf16
branch, and ``div`` with a rounding mode on int64 by a Python int, build and match eager as torch promotes them.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import mlcomp

pytest.importorskip("tvm")
pytestmark = pytest.mark.tvm


class MixedOperands(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("fill", torch.tensor(-3.5, dtype=torch.bfloat16))

    def forward(self, x: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        masked = torch.where(x > 0, x, self.fill)                  # f32 and bf16: an f32 result
        return masked, ids // 3, torch.div(ids, 2, rounding_mode="trunc")    # int64 by an int: int64


def test_mixed_dtype_operands_build_and_match_eager():
    model = MixedOperands().eval()
    x, ids = torch.randn(4, 6), torch.arange(-5, 7)
    art = mlcomp.compile(model, (x, ids), target="tvm", pipeline="-O0", threads=1)
    got, want = art(x, ids), model(x, ids)
    assert [t.dtype for t in got] == [torch.float32, torch.int64, torch.int64]
    for g, w in zip(got, want):
        assert torch.equal(g, w)
