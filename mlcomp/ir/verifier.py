"""Is a graph sound?  :func:`verify` checks it through :class:`~mlcomp.ir.graph.Graph`'s public API.

It raises :class:`~mlcomp.base.errors.IRError` naming the first broken node and
says where it came from::

    >>> import dataclasses, torch
    >>> from mlcomp.ir import TensorMeta
    >>> from mlcomp.ir.builder import GraphBuilder
    >>> from mlcomp.ir.ops import aten
    >>> b = GraphBuilder("small")
    >>> graph = b.output(b.call(aten("relu"), b.input("x", (2, 8))))
    >>> verify(graph)                    # sound: None
    >>> _ = graph.replace(dataclasses.replace(graph.node("relu"), meta=TensorMeta((2, 4), torch.float32)))
    >>> verify(graph)                    # doctest: +ELLIPSIS
    Traceback (most recent call last):
    mlcomp.base.errors.IRError: invalid IR at node %relu (aten.relu.default): declared meta f32[2, 4] but its op produces f32[2, 8]. Where: graph small, module <root>; inputs %x; users %output. ...

Re-running each node's op on meta tensors is the costly part; :class:`MetaChecks`
(``graph.meta_checks``) remembers the nodes that passed, so a pipeline that
verifies after every pass re-checks only what a pass touched.
"""
from __future__ import annotations

import operator
from typing import TYPE_CHECKING

from mlcomp.base.errors import IRError
from mlcomp.ir import ops
from mlcomp.ir.meta import check_node_meta
from mlcomp.ir.node import Node, TensorMeta
from mlcomp.ir.ops import INPUT, OUTPUT, PARAM

if TYPE_CHECKING:
    from mlcomp.ir.graph import Graph

__all__ = ["MetaChecks", "verify"]


class MetaChecks:
    """The nodes whose meta checked out, each with the input nodes it was checked against.

    A node is re-checked when it, one of its inputs, or the graph's symbols are
    no longer the same objects/values.  :meth:`Graph.copy` copies it, :meth:`Graph.erase` forgets the node.
    """

    def __init__(self) -> None:
        self.symbols: tuple[tuple[str, int], ...] = ()
        self.passed: dict[str, tuple[Node, tuple[Node, ...]]] = {}

    def copy(self) -> MetaChecks:
        out = MetaChecks()
        out.symbols, out.passed = self.symbols, dict(self.passed)
        return out

    def forget(self, name: str) -> None:
        self.passed.pop(name, None)

    def still_valid(self, node: Node, inputs: tuple[Node, ...]) -> bool:
        memo = self.passed.get(node.name)
        return memo is not None and memo[0] is node and len(memo[1]) == len(inputs) \
            and all(map(operator.is_, memo[1], inputs))


def verify(graph: Graph, *, check_meta: bool = True) -> None:
    """Raise :class:`IRError` naming the first broken node; ``None`` if the graph is sound.

    Checks: acyclic and in topological order; every input reference exists
    and the users index agrees with the references; exactly one output;
    every value node has meta; params have their constant with matching
    shape/dtype; and (``check_meta``) each node's meta agrees with re-running
    its op on meta tensors (remembered in ``graph.meta_checks``).
    """
    order = graph.order()      # raises naming a cycle
    graph.output_node          # noqa: B018 - raises if not exactly one
    position = {name: i for i, name in enumerate(order)}
    edges = set(graph.edges())
    memo = graph.meta_checks
    symbols = tuple(sorted(graph.symbols.items()))
    if symbols != memo.symbols:
        memo.symbols, memo.passed = symbols, {}
    reads = 0
    for name in order:
        node = graph.node(name)
        srcs = node.input_names()
        inputs = _check_reads(graph, node, srcs, position, edges)
        reads += len(srcs)
        if node.op == OUTPUT:
            if graph.num_users(name):
                _fail(graph, node, "the output node has users")
        elif node.op == PARAM:
            _check_param(graph, node)
        else:
            _check_value(graph, node, inputs, check_meta)
    if reads != len(edges):
        raise IRError(f"graph {graph.name}: the users index holds edges no node reads",
                      hint="this is a bug in mlcomp.ir.graph; please report it")


def _check_reads(graph: Graph, node: Node, srcs: list[str], position: dict[str, int],
                 edges: set[tuple[str, str]]) -> tuple[Node, ...]:
    """The node's inputs as the graph records them, once its references and the users index check out."""
    for s in srcs:
        if s not in position:
            _fail(graph, node, f"reads %{s}, which does not exist")
        if position[s] >= position[node.name]:
            _fail(graph, node, f"reads %{s}, which comes later in the order")
        if (s, node.name) not in edges:
            _fail(graph, node, "graph edges disagree with the node's inputs")
    inputs = tuple(graph.producers(node.name))
    if [p.name for p in inputs] != srcs:
        _fail(graph, node, "graph edges disagree with the node's inputs")
    return inputs


def _check_param(graph: Graph, node: Node) -> None:
    t = graph.constants.get(node.name)
    if t is None:
        _fail(graph, node, "is a param with no tensor in graph.constants")
    if node.meta is None or tuple(t.shape) != node.tensor_meta.concrete_shape() \
            or t.dtype != node.tensor_meta.dtype:
        _fail(graph, node, f"meta {node.meta} does not match its tensor {TensorMeta.of(t)}")


def _check_value(graph: Graph, node: Node, inputs: tuple[Node, ...], check_meta: bool) -> None:
    if node.meta is None and node.op.namespace is not ops.Namespace.OPERATOR \
            and node.op.name not in ("sym_size", "sym_numel"):
        _fail(graph, node, "has no meta (shape/dtype)")
    if not check_meta or node.op == INPUT:
        return
    if graph.meta_checks.still_valid(node, inputs):
        return
    problem = check_node_meta(graph, node)
    if problem:
        _fail(graph, node, problem)
    graph.meta_checks.passed[node.name] = (node, inputs)


def _fail(graph: Graph, node: Node, problem: str) -> None:
    preds = ", ".join(f"%{p}" for p in node.input_names()) or "none"
    succs = ", ".join(f"%{b}" for a, b in graph.edges() if a == node.name)
    raise IRError(f"invalid IR at node %{node.name} ({node.op}): {problem}",
                  where=f"graph {graph.name}, module {node.origin}; inputs {preds}; users {succs or 'none'}",
                  hint="this is a bug in the pass that produced the graph; run with --dump-after all to see it")
