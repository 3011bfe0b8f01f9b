"""mlcomp's ONNX emitter writes ``aten.copy`` and ``aten.slice_scatter`` (BART's shift of the decoder ids)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import mlcomp

pytestmark = pytest.mark.ort


class ShiftRight(nn.Module):
    """``shifted[:, 1:] = ids[:, :-1]; shifted[:, 0] = 7`` and a float slice assignment."""

    def forward(self, ids):
        shifted = ids.new_zeros(ids.shape)
        shifted[:, 1:] = ids[:, :-1].clone()
        shifted[:, 0] = 7
        z = torch.zeros(2, 5, 3)
        z[:, 1:3] = ids[:, :2, None].float()
        return shifted.masked_fill(shifted == 3, 1), z


def test_copy_and_slice_scatter_are_emitted_and_match_torch():
    ids = torch.randint(0, 5, (2, 6), generator=torch.Generator().manual_seed(0))
    art = mlcomp.compile(ShiftRight(), (ids,), target="onnxruntime", pipeline="-O2")
    assert art.verification["passed"] and art.runtime.stats["onnx_export"] == "mlcomp"
    got, want = art(ids), ShiftRight()(ids)
    assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])


class LowPrecisionShift(nn.Module):
    """BART's id shift beside a bf16-able linear: ``copy`` broadcasts the scalar 7 into a column."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(8, 4)
        self.proj = nn.Linear(4, 4)

    def forward(self, ids):
        shifted = ids.new_zeros(ids.shape)
        shifted[:, 1:] = ids[:, :-1].clone()
        shifted[:, 0] = 7
        return self.proj(self.embed(shifted))


def test_a_bf16_graph_is_emitted_by_mlcomp_with_its_broadcasting_copy():
    """torchlib's ``aten.copy`` is ``CastLike(src, self)``: the scalar keeps rank 0 where torch broadcasts
    it to ``self``'s shape, which ONNX shape inference rejected once folded; the emitter's rule expands it."""
    torch.manual_seed(0)
    model = LowPrecisionShift().eval()
    ids = torch.randint(0, 7, (2, 6), generator=torch.Generator().manual_seed(0))
    art = mlcomp.compile(model, (ids,), target="onnxruntime", pipeline="cleanup,mixed-precision{dtype=bf16}")
    assert art.runtime.stats["onnx_export"] == "mlcomp" and art.verification["passed"]
    with torch.no_grad():
        want = model(ids)
    assert (art(ids) - want).abs().max() < 3e-2
