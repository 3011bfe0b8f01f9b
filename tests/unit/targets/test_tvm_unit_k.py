"""Products over a contraction of length 1 on TVM (``targets.tvm.unit_k``): ``Linear(1, N)`` with its bias and a
batched ``[B, M, 1] @ [B, 1, N]`` (MobileViT's attention over one channel) build and give eager's numbers."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import mlcomp

pytest.importorskip("tvm")
pytestmark = pytest.mark.tvm


class OuterProducts(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(1, 8)

    def forward(self, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.fc(x), torch.matmul(a, b)


def test_unit_contractions_build_and_match_eager():
    torch.manual_seed(0)
    model, inputs = OuterProducts().eval(), (torch.randn(4, 1), torch.randn(16, 1, 1), torch.randn(16, 1, 16))
    art = mlcomp.compile(model, inputs, target="tvm", pipeline="-O2", threads=1)
    for got, want in zip(art(*inputs), model(*inputs)):
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_the_rewrite_is_a_broadcast_multiply():
    import tvm
    from tvm.script import relax as R

    from mlcomp.targets.tvm.unit_k import unit_k_matmuls

    @R.function
    def main(x: R.Tensor((4, 1), "float32"), w: R.Tensor((1, 8), "float32"), v: R.Tensor((8, 2), "float32")):
        y = R.matmul(x, w, out_dtype="float32")
        z = R.matmul(y, v, out_dtype="float32")            # K = 8: stays a matmul
        return z

    text = unit_k_matmuls(tvm.IRModule({"main": main})).script()
    assert text.count("R.multiply(x, w)") == 1 and text.count("R.matmul(") == 1
