"""Constants named like values reach torch.onnx as ``const_<name>`` (``targets.onnx.target.distinct_constant_names``):
a folded ``%scalar_tensor`` beside the ``scalar_tensor`` values torch.onnx's decompositions add stopped ONNX's
constant folder ("Initializer 'scalar_tensor' is already registered", BART in bf16 on onnxruntime)."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("onnxruntime")
pytestmark = pytest.mark.ort

from mlcomp.ir.builder import GraphBuilder  # noqa: E402
from mlcomp.ir.interpreter import evaluate  # noqa: E402
from mlcomp.ir.ops import PARAM, aten  # noqa: E402
from mlcomp.targets.onnx.target import distinct_constant_names  # noqa: E402


def _graph():
    b = GraphBuilder("consts")
    x = b.input("x", (2, 4))
    w = b.param("fc.weight", torch.randn(4, 4))
    fill = b.param("scalar_tensor", torch.tensor(-1.0))
    mm = b.call(aten("mm"), x, w)
    return b.output(b.call(aten("where.self"), b.call(aten("gt.Scalar"), mm, 0.0), mm, fill))


def test_folded_constants_are_renamed_module_weights_kept():
    graph = _graph()
    renamed = distinct_constant_names(graph)
    assert sorted(n.name for n in renamed.nodes(PARAM)) == ["const_scalar_tensor", "fc.weight"]
    assert sorted(n.name for n in graph.nodes(PARAM)) == ["fc.weight", "scalar_tensor"]     # not modified
    x = torch.randn(2, 4)
    assert torch.equal(evaluate(renamed, x)[0], evaluate(graph, x)[0])

