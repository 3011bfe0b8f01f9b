"""The OpenVINO lowering's graph rewrites on small graphs: the IR they write and its numbers.

``activations_before_views`` moves an activation that reads a view read by nothing else before the view;
a view read twice stays as it was (one of symbolic sizes too: ``test_symbolic_targets``' OpenVINO test).
``shared_weights_as_linear`` writes ``bmm`` against a batch-repeated constant (a 2-d constant ``expand``-ed,
or stored repeated) as ``reshape → mm → view``; any other second operand stays a ``bmm``.
"""
from __future__ import annotations

import textwrap

import pytest
import torch
from torch import nn

from mlcomp.frontend.loading import load_model
from mlcomp.ir.builder import GraphBuilder
from mlcomp.ir.interpreter import Interpreter
from mlcomp.ir.ops import aten
from mlcomp.targets.openvino.lower import activations_before_views, shared_weights_as_linear


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


def _product(weight: str):
    """``bmm(x, W)``, ``x: [2, 5, 8]``, ``W: [2, 8, 6]`` made as ``weight`` says."""
    torch.manual_seed(0)
    b = GraphBuilder("lin")
    x = b.input("x", (2, 5, 8))
    if weight == "expand":                       # a 2-d constant broadcast along the batch
        w = b.call(aten("expand"), b.param("w", torch.randn(8, 6)), [2, 8, 6])
    elif weight == "stored":                     # weight folding stored the copies
        w = b.param("w", torch.randn(8, 6).expand(2, 8, 6).clone())
    elif weight == "expand-3d":                  # the expanded constant is 3-d itself
        w = b.call(aten("expand"), b.param("w", torch.randn(1, 8, 6)), [2, 8, 6])
    elif weight == "unequal":                    # a 3-d constant whose slices differ
        w = b.param("w", torch.randn(2, 8, 6))
    else:                                        # an expanded input: not a constant
        w = b.call(aten("expand"), b.input("w", (8, 6)), [2, 8, 6])
    return b.output(b.call(aten("bmm"), x, w))


def _linear_golden(weight: str) -> str:
    return textwrap.dedent(f"""
        graph lin(%x: f32[2, 5, 8]) {{
          %{weight}: f32[8, 6] = param
          %bmm_rows: f32[10, 8] = aten.reshape.default(%x, [10, 8])
          %bmm_mm: f32[10, 6] = aten.mm.default(%bmm_rows, %{weight})
          %bmm: f32[2, 5, 6] = aten.view.default(%bmm_mm, [2, 5, 6])
          return (%bmm,)
        }}""").strip()


@pytest.mark.parametrize("weight, kept", [("expand", "w"), ("stored", "w_w")])
def test_a_product_against_a_batch_repeated_constant_becomes_one_2d_product(weight, kept):
    graph = _product(weight)
    before = graph.format()
    out = shared_weights_as_linear(graph)
    assert out.format() == _linear_golden(kept)            # the constant once, no expand, no bmm
    assert graph.format() == before                         # the input graph is not modified
    x = torch.randn(2, 5, 8)
    (want,), (got,) = Interpreter(graph).run(x), Interpreter(out).run(x)
    assert got.shape == want.shape == (2, 5, 6) and torch.allclose(got, want, atol=1e-6)


@pytest.mark.parametrize("weight", ["expand-3d", "unequal", "input"])
def test_a_product_against_anything_else_stays_a_bmm(weight):
    graph = _product(weight)
    assert shared_weights_as_linear(graph) is graph
    assert [str(n.op) for n in graph.call_nodes()][-1] == "aten.bmm.default"


def _biased(bias_shape: tuple[int, ...], alpha: float = 1.0):
    """``view(mm(x, W)) + b``: the viewed 2-d product of a linear on a non-contiguous 3-d input, then its bias."""
    torch.manual_seed(0)
    b = GraphBuilder("lin")
    x = b.input("x", (10, 8))
    product = b.call(aten("mm"), x, b.param("w", torch.randn(8, 6)))
    view = b.call(aten("view"), product, [2, 5, 6])
    attrs = {} if alpha == 1.0 else {"alpha": alpha}
    return b.output(b.call(aten("add.Tensor"), view, b.param("b", torch.randn(*bias_shape)), **attrs))


def test_a_one_row_bias_after_a_products_view_moves_before_it():
    graph = _biased((6,))
    out = activations_before_views(graph)
    assert out.format().splitlines()[4:7] == [
        "  %add_rows: f32[10, 6] = aten.add.Tensor(%mm, %b)",
        "  %add: f32[2, 5, 6] = aten.view.default(%add_rows, [2, 5, 6])",
        "  return (%add,)"], out.format()
    x = torch.randn(10, 8)
    (want,), (got,) = Interpreter(graph).run(x), Interpreter(out).run(x)
    assert got.shape == want.shape == (2, 5, 6) and torch.allclose(got, want)


@pytest.mark.parametrize("shape, alpha", [((5, 6), 1.0), ((2, 1, 6), 1.0), ((6,), 2.0)])
def test_a_bias_of_more_than_one_row_or_scaled_stays_after_the_view(shape, alpha):
    graph = _biased(shape, alpha)
    assert activations_before_views(graph) is graph
