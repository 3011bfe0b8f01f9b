"""The cut of a joint graph into the forward and backward an autograd.Function runs (mlcomp.dynamo.joint_split)."""
from __future__ import annotations

import pytest
import torch

from mlcomp.dynamo.joint import JointRefused, forward_closure
from mlcomp.dynamo.joint_split import cut, split_joint
from mlcomp.ir import Mode
from mlcomp.ir.builder import GraphBuilder
from mlcomp.ir.interpreter import evaluate
from mlcomp.ir.node import Phase
from mlcomp.ir.ops import GETITEM, aten


def joint(*, late_forward: bool = False):
    """out = relu(x @ w.T); tangent t; grads: dw = (t * (out > 0)).T @ x, dx = (t * (out > 0)) @ w."""
    b = GraphBuilder("j", mode=Mode.TRAINING)
    x, t = b.input("x", (4, 8)), b.input("t", (4, 3))
    w = b.param("fc.weight", torch.randn(3, 8, generator=torch.Generator().manual_seed(0)))
    out = b.call(aten("relu"), b.call(aten("mm"), x, b.call(aten("t"), w, name="wt"), name="mm"), name="out")
    g = b.call(aten("threshold_backward"), t, out, 0, name="g")
    dw = b.call(aten("mm"), b.call(aten("t"), g, name="gt"), x, name="dw")
    dx = b.call(aten("mm"), g, w, name="dx")
    graph = b.output(out, dw, dx)
    backward = {"g", "gt", "dw", "dx"}
    for node in graph.call_nodes():
        late = late_forward and node.name == "gt"
        phase = Phase.FORWARD if node.name not in backward or late else Phase.BACKWARD
        graph.replace(node.with_ann(phase=phase))
    return graph


def test_the_forward_saves_what_the_backward_reads_and_parameters_cost_nothing():
    c = cut(joint(), ["x", "fc.weight"], outputs=1)
    assert c.forward == {"x", "fc.weight", "wt", "mm", "out"}
    assert c.saved == ("x", "fc.weight", "out")
    assert (c.activations, c.activation_bytes) == (2, 4 * 8 * 4 + 4 * 3 * 4)     # x and out; the weight is free


def test_forward_then_backward_compute_what_the_joint_graph_computes():
    graph = joint()
    parts = split_joint(graph, ["x", "fc.weight"], ["t"], outputs=1)
    assert [n.name for n in parts.forward.input_nodes] == ["x", "fc.weight"]
    assert [n.name for n in parts.backward.input_nodes] == ["x", "fc.weight", "out", "t"]
    x, t, w = torch.randn(4, 8), torch.randn(4, 3), graph.constants["fc.weight"]
    whole = evaluate(graph, x, t)
    forward = evaluate(parts.forward, x, w)
    backward = evaluate(parts.backward, *forward[1:], t)
    assert torch.equal(forward[0], whole[0])
    assert all(torch.equal(a, b) for a, b in zip(backward, whole[1:]))


def test_the_forward_closure_is_what_the_outputs_read_and_the_projections_of_its_tuples():
    """out = dropout(x)[0]; the mask (projection 1 of the same tuple) only the backward reads."""
    b = GraphBuilder("d", mode=Mode.TRAINING)
    x, t = b.input("x", (4, 8)), b.input("t", (4, 8))
    pair = b.call(aten("native_dropout"), x, 0.5, True, name="pair")
    out, mask = b.call(GETITEM, pair, 0, name="out"), b.call(GETITEM, pair, 1, name="mask")
    grad = b.call(aten("native_dropout_backward"), t, mask, 2.0, name="grad")
    graph = b.output(out, grad)
    assert forward_closure(graph, 1) == {"x", "pair", "out", "mask"}
    assert forward_closure(graph, 2) == {"x", "t", "pair", "out", "mask", "grad"}
    assert forward_closure(graph, 0, extra=["pair"]) == {"pair", "out", "mask"}    # extra's projections too
    assert forward_closure(joint(), 1) == {"x", "fc.weight", "wt", "mm", "out"}    # g, gt, dw, dx: backward


def test_a_forward_node_reading_the_backward_is_refused():
    with pytest.raises(JointRefused, match="forward node %gt of j reads %g, which the forward does not compute"):
        cut(joint(late_forward=True), ["x", "fc.weight"], outputs=1)


def test_an_output_that_is_an_input_is_refused():
    b = GraphBuilder("k", mode=Mode.TRAINING)
    x, t = b.input("x", (2, 2)), b.input("t", (2, 2))
    graph = b.output(x, b.call(aten("neg"), t, name="dx"))
    graph.replace(graph.node("dx").with_ann(phase=Phase.BACKWARD))
    with pytest.raises(JointRefused, match="output 0 of k is an input or a parameter itself"):
        split_joint(graph, ["x"], ["t"], outputs=1)
