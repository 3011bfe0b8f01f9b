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
