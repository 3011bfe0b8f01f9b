"""The OpenVINO lowering's graph rewrites on small captured graphs: the IR they write and its numbers.

``activations_before_views`` moves an activation that reads a view read by nothing else before the view;
a view read twice stays as it was (one of symbolic sizes too: ``test_symbolic_targets``' OpenVINO test).
"""
from __future__ import annotations

import torch
from torch import nn

from mlcomp.frontend.loading import load_model
from mlcomp.ir.interpreter import Interpreter
from mlcomp.ir.ops import aten
from mlcomp.targets.openvino.lower import activations_before_views


class LinearGelu(nn.Module):
    """A linear on a 3-d input (captured ``view → addmm → view``) read by a GELU, and, when ``twice``, also
    by the output (the view then has a second reader)."""

    def __init__(self, twice: bool = False) -> None:
        super().__init__()
        self.fc, self.twice = nn.Linear(8, 16), twice

    def forward(self, x):
        y = self.fc(x)
        return (nn.functional.gelu(y), y) if self.twice else nn.functional.gelu(y)


def _captured(twice: bool = False):
    torch.manual_seed(0)
    x = torch.randn(2, 5, 8)
    return load_model(LinearGelu(twice).eval(), example_inputs=(x,)).capture(), x


def _gelu_reads(graph) -> list:
    return [graph.node(n.inputs[0].name).op for n in graph.nodes(aten("gelu"))]


def test_a_gelu_after_a_linears_view_moves_before_it_and_computes_the_same():
    graph, x = _captured()
    assert _gelu_reads(graph) == [aten("view")]
    out = activations_before_views(graph)
    assert _gelu_reads(out) == [aten("addmm")] and out is not graph
    assert _gelu_reads(graph) == [aten("view")]                      # the input graph is not modified
    (want,), (got,) = Interpreter(graph).run(x), Interpreter(out).run(x)
    assert got.shape == want.shape and torch.equal(got, want)


def test_a_view_with_a_second_reader_stays():
    graph, _ = _captured(twice=True)
    assert activations_before_views(graph) is graph
