"""Scalars Dynamo passes as 0-d tensors read by ``.item()`` are baked into the lowered graph (mlcomp.dynamo.lower)."""
from __future__ import annotations

import torch

from mlcomp.dynamo.lower import Lowered, SizeSlots, _bake_scalars


def scaled():
    """out = x * m.item(): m is how Dynamo passes a module's float attribute under dynamic=True."""
    graph = torch.fx.Graph()
    x, m = graph.placeholder("x"), graph.placeholder("m")
    graph.output((graph.call_function(torch.mul, (x, graph.call_method("item", (m,)))),))
    return torch.fx.GraphModule({}, graph)


def test_a_scalar_read_by_item_is_baked_and_the_graph_left_as_it_was():
    gm = scaled()
    x = torch.randn(3)
    baked_gm, baked = _bake_scalars(gm, [x, torch.tensor(0.5)])
    assert baked == ((1, 0.5),)
    assert torch.equal(baked_gm(x, torch.tensor(9.0))[0], x * 0.5)         # the value baked, the input ignored
    assert torch.equal(gm(x, torch.tensor(9.0))[0], x * 9.0)               # the Dynamo graph is untouched
    assert not any(n.op == "call_method" for n in baked_gm.graph.nodes)


def test_nothing_is_baked_where_a_scalar_is_used_as_a_tensor():
    graph = torch.fx.Graph()
    x, m = graph.placeholder("x"), graph.placeholder("m")
    graph.output((graph.call_function(torch.mul, (x, m)),))
    gm = torch.fx.GraphModule({}, graph)
    assert _bake_scalars(gm, [torch.randn(3), torch.tensor(0.5)]) == (gm, ())


def test_holds_says_whether_a_call_brings_the_baked_values():
    low = Lowered(scaled(), SizeSlots(()), [0, 1], dynamic=False, baked=((1, 0.5),))
    assert low.holds([torch.randn(3), torch.tensor(0.5)])
    assert not low.holds([torch.randn(3), torch.tensor(0.25)])
