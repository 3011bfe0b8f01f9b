"""What a :class:`~mlcomp.ir.graph.Graph` offers on top of its nodes: analyses, verification, printing.

:class:`GraphTools` is the half of ``Graph`` that reads a whole graph: the
networkx analyses (built on demand from the users index), ``verify`` and the
text/dot forms.  ``Graph`` inherits it; nothing else should::

    >>> g.generations()                 # compute nodes that could run in parallel
    [['a', 'b'], ['c'], ['d']]
    >>> g.verify()                      # None, or IRError naming the first broken node
    >>> print(g.to_dot())               # digraph "g" { ... "a" -> "d"; ... }
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable

import networkx as nx

from mlcomp.base.errors import IRError
from mlcomp.ir import ops
from mlcomp.ir.meta import check_node_meta
from mlcomp.ir.node import Node, TensorMeta, format_meta, format_value
from mlcomp.ir.ops import GETITEM, INPUT, OUTPUT, PARAM

if TYPE_CHECKING:
    from mlcomp.ir.order import NodeOrder

__all__ = ["GraphTools"]


class GraphTools:
    """Whole-graph analyses, verification and printing, mixed into :class:`~mlcomp.ir.graph.Graph`."""

    # provided by Graph
    name: str
    constants: Any
    symbols: dict[str, int]
    _nodes: dict[str, Node]
    _reads: dict[str, tuple[str, ...]]
    _users: dict[str, dict[str, None]]
    _order: "NodeOrder"
    _checked: dict[str, tuple[Node, tuple[Node, ...]]]
    _checked_symbols: tuple[tuple[str, int], ...]
    call_nodes: Callable[[], list[Node]]
    replace: Callable[[Node], Node]
    nodes: Callable[..., list[Node]]
    _ordered: Callable[[], list[str]]
    _sort: Callable[[], None]

    # -- analysis (networkx, built on demand) ---------------------------------

    def annotate(self, field: str, values: Mapping[str, Any]) -> bool:
        """Set annotation ``field`` of each named node to its value; True if any node changed.

            >>> graph.annotate("stage", {"linear": 0, "relu": 1})    # a placement: node → stage
            True
        """
        changed = False
        for name, value in values.items():
            node = self._nodes[name]
            if getattr(node.ann, field) != value:
                self.replace(node.with_ann(**{field: value}))
                changed = True
        return changed
    def _nx(self) -> nx.DiGraph:
        """The whole graph as a networkx DiGraph (nodes and edges in insertion order)."""
        g = nx.DiGraph()
        g.add_nodes_from(self._nodes)
        g.add_edges_from((src, user) for src in self._nodes for user in self._users[src])
        return g

    def _compute_dag(self) -> nx.DiGraph:
        """Compute nodes only, with edges that pass through GETITEM projections."""
        dag = nx.DiGraph()
        compute = [n.name for n in self.call_nodes() if n.op != GETITEM]
        dag.add_nodes_from(compute)

        def sources(name: str) -> list[str]:
            node = self._nodes[name]
            if node.op == GETITEM:
                return [s for p in self._reads[name] for s in sources(p)]
            return [name] if not node.op.is_structural else []

        for name in compute:
            for p in self._reads[name]:
                for s in sources(p):
                    dag.add_edge(s, name)
        return dag

    def generations(self) -> list[list[str]]:
        """Compute nodes grouped by topological generation: each group could run in parallel."""
        self._sort()
        return [sorted(gen, key=self._order.label) for gen in nx.topological_generations(self._compute_dag())]

    def critical_path(self, weight: Callable[[Node], float] | None = None) -> list[str]:
        """Longest chain of compute nodes (by count, or by ``weight`` per node)."""
        dag = self._compute_dag()
        order = [n for n in self._ordered() if n in dag]
        if weight is not None:
            for a, b in dag.edges:
                dag.edges[a, b]["w"] = weight(self._nodes[b])
            # a path's first node carries no incoming edge: count it through a virtual source
            for n in order:
                dag.add_edge("__source__", n, w=weight(self._nodes[n]))
            path = nx.dag_longest_path(dag, weight="w", default_weight=0)
            return [p for p in path if p != "__source__"]
        return list(nx.dag_longest_path(dag, topo_order=order))

    def dominators(self, start: str) -> dict[str, str]:
        """Immediate dominators from ``start`` (networkx): who every path must cross."""
        return nx.immediate_dominators(self._nx(), start)

    def post_dominators(self) -> dict[str, str]:
        """Immediate post-dominators of every node w.r.t. the output node."""
        return nx.immediate_dominators(self._nx().reverse(copy=False), self.output_node.name)

    # -- verification -----------------------------------------------------
    def verify(self, *, check_meta: bool = True) -> None:
        """Raise :class:`IRError` naming the first broken node; ``None`` if the graph is sound.

        Checks: acyclic and in topological order; every input reference exists
        and the users index agrees with the references; exactly one output;
        every value node has meta; params have their constant with matching
        shape/dtype; and (``check_meta``) each node's meta agrees with re-running
        its op on meta tensors.  That check is remembered per node while the
        node, its inputs and ``symbols`` stay the same objects/values, so a
        pipeline re-checks only what a pass touched.
        """
        order = self._ordered()   # raises naming a cycle
        self.output_node  # noqa: B018 - raises if not exactly one
        label = self._order.label
        edges = 0
        symbols = tuple(sorted(self.symbols.items()))
        if symbols != self._checked_symbols:
            self._checked, self._checked_symbols = {}, symbols
        for name in order:
            node = self._nodes[name]
            srcs = node.input_names()
            for s in srcs:
                if s not in self._nodes:
                    self._fail(node, f"reads %{s}, which does not exist")
                if label(s) >= label(name):
                    self._fail(node, f"reads %{s}, which comes later in the order")
                if name not in self._users[s]:
                    self._fail(node, "graph edges disagree with the node's inputs")
            if tuple(srcs) != self._reads[name]:
                self._fail(node, "graph edges disagree with the node's inputs")
            edges += len(srcs)
            if node.op == OUTPUT:
                if self._users[name]:
                    self._fail(node, "the output node has users")
                continue
            if node.op == PARAM:
                t = self.constants.get(name)
                if t is None:
                    self._fail(node, "is a param with no tensor in graph.constants")
                if node.meta is None or tuple(t.shape) != node.tensor_meta.concrete_shape() \
                        or t.dtype != node.tensor_meta.dtype:
                    self._fail(node, f"meta {node.meta} does not match its tensor {TensorMeta.of(t)}")
                continue
            if node.meta is None and node.op.namespace is not ops.Namespace.OPERATOR \
                    and node.op.name not in ("sym_size", "sym_numel"):
                self._fail(node, "has no meta (shape/dtype)")
            if check_meta and node.op not in (INPUT,):
                inputs = tuple(self._nodes[s] for s in srcs)
                memo = self._checked.get(name)
                if memo is not None and memo[0] is node and len(memo[1]) == len(inputs) \
                        and all(a is b for a, b in zip(memo[1], inputs)):
                    continue
                problem = check_node_meta(self, node)
                if problem:
                    self._fail(node, problem)
                self._checked[name] = (node, inputs)
        if edges != sum(len(u) for u in self._users.values()):
            raise IRError(f"graph {self.name}: the users index holds edges no node reads",
                          hint="this is a bug in mlcomp.ir.graph; please report it")

    def _fail(self, node: Node, problem: str) -> None:
        preds = ", ".join(f"%{p}" for p in node.input_names()) or "none"
        succs = ", ".join(f"%{u}" for u in self._users.get(node.name, ()))
        raise IRError(f"invalid IR at node %{node.name} ({node.op}): {problem}",
                      where=f"graph {self.name}, module {node.origin}; inputs {preds}; users {succs or 'none'}",
                      hint="this is a bug in the pass that produced the graph; run with --dump-after all to see it")

    # -- printing -----------------------------------------------------------
    def format(self) -> str:
        ins = ", ".join(f"%{n.name}: {n.meta}" for n in self.input_nodes)
        lines = [f"graph {self.name}({ins}) {{"]
        for node in self.nodes():
            if node.op == INPUT:
                continue
            if node.op == OUTPUT:
                lines.append(f"  return {format_value(node.inputs[0] if len(node.inputs) == 1 else node.inputs)}")
            else:
                lines.append("  " + node.format())
        lines.append("}")
        return "\n".join(lines)

    __str__ = format

    def ir_summary(self) -> str:
        return f"<graph {len(self)} nodes>"

    def __repr__(self) -> str:
        return f"<Graph {self.name}: {len(self)} nodes>"

    def to_dot(self) -> str:
        """Graphviz text: one box per node, labelled with op and shape; params grey."""
        def q(s: str) -> str:  # labels keep their "\\n" line breaks
            return '"' + s.replace('"', '\\"') + '"'
        lines = [f"digraph {q(self.name)} {{", "  rankdir=TB;", "  node [shape=box, fontname=monospace];"]
        for node in self.nodes():
            label = f"{node.name}\\n{node.op}"
            if node.meta is not None:
                label += f"\\n{format_meta(node.meta)}"
            style = ""
            if node.op == PARAM:
                style = ", style=filled, fillcolor=lightgrey"
            elif node.op in (INPUT, OUTPUT):
                style = ", shape=ellipse"
            elif node.ann.fusion_group is not None:
                style = f", style=filled, fillcolor={q(_group_colour(node.ann.fusion_group))}"
            lines.append(f"  {q(node.name)} [label={q(label)}{style}];")
        for a, readers in self._users.items():
            lines.extend(f"  {q(a)} -> {q(b)};" for b in readers)
        lines.append("}")
        return "\n".join(lines)


def _group_colour(group: int) -> str:
    palette = ["#fde0dd", "#e0ecf4", "#e5f5e0", "#fff7bc", "#efedf5", "#fee6ce", "#deebf7"]
    return palette[group % len(palette)]
