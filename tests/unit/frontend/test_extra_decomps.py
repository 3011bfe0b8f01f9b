"""mlcomp's capture decompositions (``frontend.extra_decomps``): the mixture-of-experts routing of
``transformers`` (sort by expert, ``histc`` counts, the grouped matmul, the inverse permutation
written into ``empty_like``) lowers to core ATen every target runs, with eager's numbers.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import mlcomp
from mlcomp.frontend.capture import capture_module
from mlcomp.frontend.extra_decomps import empty_permuted, grouped_mm, histc
from mlcomp.ir.interpreter import evaluate

moe = pytest.importorskip("transformers.integrations.moe", reason="transformers is part of the test extra")

EXPERTS, TOP_K, HIDDEN, FFN = 4, 2, 8, 12


class Routed(nn.Module):
    """transformers' grouped-mm experts forward in miniature: top-k routing, rows sorted by expert."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.up = nn.Parameter(torch.randn(EXPERTS, HIDDEN, FFN) / HIDDEN ** 0.5)
        self.down = nn.Parameter(torch.randn(EXPERTS, FFN, HIDDEN) / FFN ** 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = torch.topk(self.router(x).softmax(-1), TOP_K, dim=-1)
        ids_sorted, perm = torch.sort(ids.reshape(-1))
        rows = x[perm // TOP_K]
        counts = torch.histc(ids_sorted.float(), bins=EXPERTS, min=0, max=EXPERTS - 1)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        h = torch.ops.transformers.grouped_mm_fallback(rows, self.up, offs=offs).relu()
        out = torch.ops.transformers.grouped_mm_fallback(h, self.down, offs=offs) * weights.reshape(-1)[perm, None]
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0))
        return out[inv].view(x.shape[0], TOP_K, HIDDEN).sum(1)


def _model_and_input():
    torch.manual_seed(0)
    return Routed().eval(), torch.randn(6, HIDDEN)


def test_lowerings_match_the_ops():
    x, w = torch.randn(7, 3), torch.randn(3, 3, 5)
    offs = torch.tensor([2, 2, 6], dtype=torch.int32)         # expert 1 has no rows; row 6 none (stays 0)
    assert torch.equal(grouped_mm(x, w, offs), torch.ops.transformers.grouped_mm_fallback(x, w, offs))
    data = torch.tensor([-1.0, 0.0, 0.5, 1.0, 2.9, 3.0, 3.5, float("nan")])
    assert torch.equal(histc(data, bins=4, min=0, max=3), torch.histc(data, bins=4, min=0, max=3))
    assert histc(data, bins=4) is NotImplemented              # the range read from the data: torch's own
    assert torch.equal(empty_permuted((2, 3), (1, 0), dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int64))


def test_routing_captures_to_core_aten_with_eager_values():
    model, x = _model_and_input()
    graph = capture_module(model, (x,))
    ops = {n.op.name for n in graph.call_nodes()}
    assert not ops & {"histc", "grouped_mm_fallback", "empty_permuted"}, ops
    (got,) = evaluate(graph, x)
    torch.testing.assert_close(got, model(x), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("target", [pytest.param("onnxruntime", marks=pytest.mark.ort),
                                    pytest.param("openvino", marks=pytest.mark.openvino),
                                    pytest.param("tvm", marks=[pytest.mark.tvm, pytest.mark.slow])])
def test_routing_compiles_on_every_target(target):
    pytest.importorskip({"onnxruntime": "onnxruntime", "openvino": "openvino", "tvm": "tvm"}[target])
    model, x = _model_and_input()
    art = mlcomp.compile(model, (x,), target=target, pipeline="-O2", threads=1)
    out = art(x)
    torch.testing.assert_close(out[0] if isinstance(out, tuple) else out, model(x), rtol=1e-4, atol=1e-5)
