"""The onnxruntime target hands ORT recurrent layers it runs as one kernel: assertions on ORT's optimised graph."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import mlcomp
from mlcomp.measure.executed import ort_executed

pytestmark = pytest.mark.ort


class Tagger(nn.Module):
    def __init__(self, layers: int, bidirectional: bool) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 4)
        self.gru = nn.GRU(4, 6, num_layers=layers, bidirectional=bidirectional, batch_first=True)
        self.out = nn.Linear(6 * (2 if bidirectional else 1), 3)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(self.gru(self.emb(ids))[0])


@pytest.mark.parametrize("layers, bidirectional, grus", [(2, False, 2), (1, True, 1)])
def test_stacked_and_bidirectional_grus_run_as_onnx_gru(layers, bidirectional, grus):
    """Capture folds the all-zero initial state into one constant per layer and direction; the layer is
    still put back whole, so ORT runs GRU kernels and no unrolled cell."""
    torch.manual_seed(0)
    module = Tagger(layers, bidirectional).eval()
    ids = torch.randint(0, 20, (2, 5), generator=torch.Generator().manual_seed(1))
    art = mlcomp.compile(module, (ids,), target="onnxruntime", pipeline="-O2", threads=1)
    assert art.runtime.rewritten["recomposed"] == ["gru"] and art.runtime.rewritten["skipped"] == {}
    counts = ort_executed(art.runtime.model)
    assert counts["GRU"] == grus and counts["Gemm"] == 1
    assert not {"Sigmoid", "Tanh", "Split", "Add"} & set(counts)
    with torch.no_grad():
        assert torch.allclose(art(ids), module(ids), rtol=1e-4, atol=1e-5)


def test_an_initial_state_that_is_not_zero_is_kept():
    """``h0`` given by the module (ones here) is data: the layer reads it, so it is passed as the state."""

    class WithState(Tagger):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return self.out(self.gru(self.emb(ids), torch.ones(1, ids.shape[0], 6))[0])

    torch.manual_seed(0)
    module = WithState(1, False).eval()
    ids = torch.randint(0, 20, (2, 5), generator=torch.Generator().manual_seed(1))
    art = mlcomp.compile(module, (ids,), target="onnxruntime", pipeline="-O2", threads=1)
    assert art.runtime.rewritten["recomposed"] == ["gru"]
    with torch.no_grad():
        assert torch.allclose(art(ids), module(ids), rtol=1e-4, atol=1e-5)
