"""Whole-graph analyses, printing and verification as free functions over Graph's public API."""
from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pytest
import torch

from mlcomp.base.errors import IRError
from mlcomp.ir import Graph, Node, Ref, TensorMeta, graph_tools, ops, verifier
from mlcomp.ir.graph_tools import annotate, dominators, post_dominators, to_dot

F32 = torch.float32
META = TensorMeta((4,), F32)


def diamond() -> Graph:
    """x -> a, b (both read x) -> c = a + b -> output; b was added before a reads it."""
    g = Graph("diamond")
    g.add(Node("x", ops.INPUT, meta=META))
    g.add(Node("b", ops.aten("neg"), (Ref("x"),), meta=META))
    g.add(Node("a", ops.aten("relu"), (Ref("x"),), meta=META))
    g.add(Node("c", ops.aten("add.Tensor"), (Ref("a"), Ref("b")), meta=META))
    g.add(Node("output", ops.OUTPUT, ((Ref("c"),),)))
    return g


def test_edges_are_every_read_in_insertion_order():
    g = diamond()
    assert g.edges() == [("x", "b"), ("x", "a"), ("b", "c"), ("a", "c"), ("c", "output")]
    dot = to_dot(g)
    assert dot.index('"x" -> "b";') < dot.index('"x" -> "a";') < dot.index('"c" -> "output";')


def test_dominators():
    g = diamond()
    dom = dominators(g, "x")
    assert dom["c"] == "x" and dom["a"] == "x" and dom["output"] == "c"
    pdom = post_dominators(g)
    assert pdom["x"] == "c" and pdom["a"] == "c" and pdom["c"] == "output"


def test_annotate_reports_whether_anything_changed():
    g = diamond()
    assert annotate(g, "stage", {"a": 0, "b": 1}) is True
    assert (g.node("a").ann.stage, g.node("b").ann.stage) == (0, 1)
    assert annotate(g, "stage", {"a": 0, "b": 1}) is False
    with pytest.raises(IRError, match="no node %nope"):
        annotate(g, "stage", {"nope": 0})


def test_meta_is_rechecked_only_for_what_changed(monkeypatch):
    g = diamond()
    g.verify()
    assert set(g.meta_checks.passed) == {"a", "b", "c"}                 # inputs have nothing to check
    checked = []
    real = verifier.check_node_meta
    monkeypatch.setattr(verifier, "check_node_meta", lambda graph, node: checked.append(node.name) or real(graph, node))
    g.verify()
    assert checked == []                                          # nothing changed: nothing re-run
    g.replace(dataclasses.replace(g.node("a"), op=ops.aten("exp")))
    g.verify()
    assert checked == ["a", "c"]                                  # the node and its reader
    copy = g.copy()
    copy.erase("output")
    copy.erase("c")
    assert "c" not in copy.meta_checks.passed and "c" in g.meta_checks.passed
    g.symbols["n"] = 2                                            # new symbols: everything again
    g.verify()
    assert checked == ["a", "c", "b", "a", "c"]


def test_verify_names_the_broken_node():
    g = diamond()
    g.replace(dataclasses.replace(g.node("c"), meta=TensorMeta((5,), F32)))
    with pytest.raises(IRError, match=r"at node %c .*declared meta f32\[5\]") as info:
        g.verify()
    assert info.value.where == "graph diamond, module <root>; inputs %a, %b; users %output"
    g.verify(check_meta=False)                                    # the structure is sound


def _private_reads(module) -> list[str]:
    """``graph._x`` reads in a module's source (``self._x`` on its own classes excepted)."""
    tree = ast.parse(Path(inspect.getfile(module)).read_text())
    return [f"{n.value.id}.{n.attr}" for n in ast.walk(tree) if isinstance(n, ast.Attribute)
            and n.attr.startswith("_") and not n.attr.startswith("__")
            and isinstance(n.value, ast.Name) and n.value.id != "self"]


def test_tools_use_only_the_public_api():
    assert _private_reads(graph_tools) == []
    assert _private_reads(verifier) == []
    assert Graph.__bases__ == (object,)
