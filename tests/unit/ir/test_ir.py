"""The IR itself: construction, queries, mutation, verification, printing."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from mlcomp.base.errors import IRError
from mlcomp.ir import Graph, Node, Origin, Ref, TensorMeta, ops
from mlcomp.ir.graph_tools import critical_path, generations, to_dot
from mlcomp.ir.interpreter import Interpreter

F32 = torch.float32


def small_graph() -> Graph:
    """x -> relu -> add(relu, w) -> output, with a param w."""
    g = Graph("small")
    g.add(Node("x", ops.INPUT, meta=TensorMeta((2, 3), F32)))
    g.add_constant("lin.weight", torch.ones(2, 3), origin=Origin("lin"))
    g.add(Node("relu", ops.aten("relu"), (Ref("x"),), meta=TensorMeta((2, 3), F32), origin=Origin("act", "ReLU")))
    g.add(Node("add", ops.aten("add.Tensor"), (Ref("relu"), Ref("lin.weight")), meta=TensorMeta((2, 3), F32)))
    g.add(Node("output", ops.OUTPUT, ((Ref("add"),),)))
    return g


def test_text_form_is_stable_and_readable():
    g = small_graph()
    assert g.format() == (
        "graph small(%x: f32[2, 3]) {\n"
        "  %lin.weight: f32[2, 3] = param   # lin\n"
        "  %relu: f32[2, 3] = aten.relu.default(%x)   # act\n"
        "  %add: f32[2, 3] = aten.add.Tensor(%relu, %lin.weight)\n"
        "  return (%add,)\n"
        "}")
    assert g.format() == g.copy().format()


def test_queries_and_interpretation():
    g = small_graph()
    assert [n.name for n in g.users("relu")] == ["add"]
    assert [n.name for n in g.producers("add")] == ["relu", "lin.weight"]
    assert [n.name for n in g.call_nodes()] == ["relu", "add"]
    x = torch.tensor([[-1.0, 2.0, -3.0], [4.0, -5.0, 6.0]])
    (out,) = Interpreter(g).run(x)
    assert torch.equal(out, torch.relu(x) + 1)
    g.verify()


def test_replace_all_uses_and_erase():
    g = small_graph()
    with pytest.raises(IRError, match="still read by %add"):
        g.erase("relu")
    assert g.replace_all_uses("relu", "x") == 1
    g.erase("relu")
    assert "relu" not in g
    g.verify()
    assert "aten.add.Tensor(%x, %lin.weight)" in g.format()


def test_insert_before_keeps_order_stable():
    g = small_graph()
    g.add(Node("neg", ops.aten("neg"), (Ref("x"),), meta=TensorMeta((2, 3), F32)), before="relu")
    assert [n.name for n in g.call_nodes()] == ["neg", "relu", "add"]


def test_nodes_are_frozen():
    node = small_graph().node("relu")
    with pytest.raises(dataclasses.FrozenInstanceError):
        node.name = "other"  # type: ignore[misc]
    assert node.with_ann(checkpoint=True).ann.checkpoint and not node.ann.checkpoint


def test_verify_names_the_node_on_bad_meta():
    g = small_graph()
    g.replace(dataclasses.replace(g.node("relu"), meta=TensorMeta((3, 3), F32)))
    with pytest.raises(IRError) as err:
        g.verify()
    msg = str(err.value)
    assert "%relu" in msg and "aten.relu.default" in msg and "inputs %x" in msg and "users %add" in msg


def test_verify_rejects_missing_meta_and_missing_constant():
    g = small_graph()
    g.replace(dataclasses.replace(g.node("add"), meta=None))
    with pytest.raises(IRError, match="%add .*no meta"):
        g.verify()
    g = small_graph()
    del g.constants["lin.weight"]
    with pytest.raises(IRError, match="lin.weight"):
        g.verify()


def test_add_refuses_dangling_input_and_duplicates():
    g = small_graph()
    with pytest.raises(IRError, match="reads %nope"):
        g.add(Node("bad", ops.aten("relu"), (Ref("nope"),), meta=TensorMeta((2, 3), F32)))
    with pytest.raises(IRError, match="already exists"):
        g.add(Node("relu", ops.aten("relu"), (Ref("x"),), meta=TensorMeta((2, 3), F32)))


def test_cycle_is_reported():
    g = small_graph()
    g.replace(dataclasses.replace(g.node("relu"), inputs=(Ref("add"),)))
    with pytest.raises(IRError, match="cycle"):
        g.verify()


def test_subgraph_extracts_boundary_inputs_and_outputs():
    g = small_graph()
    sub = g.subgraph(["add"])
    assert [n.name for n in sub.input_nodes] == ["relu"]
    assert [r.name for r in sub.output_refs] == ["add"]
    assert "lin.weight" in sub.constants
    sub.verify()
    x = torch.randn(2, 3)
    assert torch.equal(Interpreter(sub).run(x)[0], x + 1)


def test_generations_and_critical_path_on_branches():
    g = Graph("branches")
    meta = TensorMeta((4,), F32)
    g.add(Node("x", ops.INPUT, meta=meta))
    g.add(Node("a", ops.aten("relu"), (Ref("x"),), meta=meta))
    g.add(Node("b", ops.aten("neg"), (Ref("x"),), meta=meta))
    g.add(Node("c", ops.aten("exp"), (Ref("b"),), meta=meta))
    g.add(Node("d", ops.aten("add.Tensor"), (Ref("a"), Ref("c")), meta=meta))
    g.add(Node("output", ops.OUTPUT, ((Ref("d"),),)))
    assert generations(g) == [["a", "b"], ["c"], ["d"]]
    assert critical_path(g) == ["b", "c", "d"]


def test_dot_output_names_every_node():
    dot = to_dot(small_graph())
    assert dot.startswith('digraph "small"')
    for name in ("x", "lin.weight", "relu", "add", "output"):
        assert f'"{name}" [label=' in dot
    assert '"relu" -> "add";' in dot


def test_op_values_not_strings():
    assert ops.aten("relu") == ops.Op.from_torch(torch.ops.aten.relu.default)
    assert ops.category(ops.aten("relu")) is ops.Category.ELEMWISE
    assert ops.category(ops.aten("convolution")) is ops.Category.COMPUTE
    assert ops.aten("relu").resolve() is torch.ops.aten.relu.default


def test_meta_inference_memo_keys_on_shapes_and_literals():
    from mlcomp.ir.meta import infer_meta

    g = Graph("memo")
    g.add(Node("x", ops.INPUT, meta=TensorMeta((2, 3), F32)))
    g.add(Node("y", ops.INPUT, meta=TensorMeta((4, 3), torch.float16)))
    sum_x = Node("s", ops.aten("sum.dim_IntList"), (Ref("x"), [1]))
    assert infer_meta(g, sum_x) == TensorMeta((2,), F32)
    assert infer_meta(g, sum_x.with_(inputs=(Ref("y"), [1]))) == TensorMeta((4,), torch.float16)
    assert infer_meta(g, sum_x.with_(inputs=(Ref("x"), [0]))) == TensorMeta((3,), F32)
    assert infer_meta(g, sum_x.with_(inputs=(Ref("x"), [1], True))) == TensorMeta((2, 1), F32)
    hits = len(g.meta_cache)
    assert infer_meta(g, sum_x.with_(name="again")) == TensorMeta((2,), F32)
    assert len(g.meta_cache) == hits == 4          # same signature: answered from the memo
    assert g.copy().meta_cache is g.meta_cache


def test_verify_rechecks_what_changed_since_the_last_verify():
    g = small_graph()
    g.verify()
    g.replace(dataclasses.replace(g.node("x"), meta=TensorMeta((5, 3), F32)))   # relu's input changed
    with pytest.raises(IRError, match="%relu"):
        g.verify()
    g = small_graph()
    g.verify()
    h = g.copy()
    h.replace(dataclasses.replace(h.node("add"), meta=TensorMeta((2, 4), F32)))
    with pytest.raises(IRError, match="%add"):
        h.verify()
    g.verify()                                       # the original is untouched
