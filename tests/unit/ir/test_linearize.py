"""``bmm`` against a broadcast 2-D weight rewritten as ``addmm``/``mm`` (mlcomp.ir.linearize)."""
from __future__ import annotations

import pytest
import torch

from mlcomp.ir import Mode
from mlcomp.ir.builder import GraphBuilder
from mlcomp.ir.interpreter import evaluate
from mlcomp.ir.linearize import linearize_batched_matmuls
from mlcomp.ir.ops import aten


def batched_linear(*, weight_is_param: bool = True, bias_is_param: bool = True):
    """``bmm(x, expand(permute(w, [1, 0]), [2, 8, 4])) + b`` as capture leaves ``x @ w.T + b`` on 3-D ``x``."""
    gen = torch.Generator().manual_seed(0)
    b = GraphBuilder("lin", mode=Mode.INFERENCE)
    x = b.input("x", (2, 3, 8))
    w = b.param("fc.weight", torch.randn(4, 8, generator=gen)) if weight_is_param else b.input("w", (4, 8))
    bias = b.param("fc.bias", torch.randn(4, generator=gen)) if bias_is_param else b.input("bias", (4,))
    wt = b.call(aten("permute"), w, [1, 0], name="wt")
    wide = b.call(aten("expand"), wt, [2, 8, 4], name="wide")
    prod = b.call(aten("bmm"), x, wide, name="prod")
    return b.output(b.call(aten("add.Tensor"), prod, bias, name="out"))


@pytest.mark.parametrize("bias_is_param", [True, False])
def test_a_batched_product_with_a_parameter_weight_becomes_one_2d_product(bias_is_param):
    graph = batched_linear(bias_is_param=bias_is_param)
    inputs = [torch.randn(2, 3, 8, generator=torch.Generator().manual_seed(1))] + ([] if bias_is_param
                                                                                    else [torch.randn(4)])
    before = evaluate(graph, *inputs)
    assert linearize_batched_matmuls(graph) == 1
    ops = {n.op.name for n in graph.call_nodes()}
    assert "bmm" not in ops and ("addmm" in ops) == bias_is_param and ("mm" in ops) != bias_is_param
    torch.testing.assert_close(evaluate(graph, *inputs), before, rtol=1e-6, atol=1e-6)


def test_a_weight_that_is_an_input_stays_a_batched_product():
    graph = batched_linear(weight_is_param=False)
    assert linearize_batched_matmuls(graph) == 0
    assert "bmm" in {n.op.name for n in graph.call_nodes()}
