"""Whole-graph analyses and printing: free functions over :class:`~mlcomp.ir.graph.Graph`'s public API.

networkx is built on demand from the graph's edges and stays inside these
functions; callers get names and lists::

    >>> from mlcomp.ir.builder import GraphBuilder
    >>> from mlcomp.ir.ops import aten
    >>> b = GraphBuilder("g")
    >>> x = b.input("x", (4,))
    >>> a, n = b.call(aten("relu"), x), b.call(aten("neg"), x)
    >>> g = b.output(b.call(aten("add.Tensor"), a, b.call(aten("exp"), n)))
    >>> generations(g)                     # compute nodes that could run in parallel
    [['relu', 'neg'], ['exp'], ['add']]
    >>> critical_path(g)
    ['neg', 'exp', 'add']
    >>> annotate(g, "stage", {"relu": 0, "neg": 0, "exp": 1, "add": 1})     # a placement: node → stage
    True
    >>> print(to_dot(g).splitlines()[0])
    digraph "g" {
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Callable, Sequence

import networkx as nx

from mlcomp.ir.node import Node, Ref, TensorMeta, format_meta, format_value
from mlcomp.ir.ops import GETITEM, INPUT, OUTPUT, PARAM

if TYPE_CHECKING:
    from mlcomp.ir.graph import Graph

__all__ = ["annotate", "critical_path", "dominators", "format_graph", "generations", "graph_inputs_meta", "producer",
           "outputs_meta", "post_dominators", "sequence_of", "to_dot"]


def annotate(graph: Graph, field: str, values: Mapping[str, Any]) -> bool:
    """Set annotation ``field`` of each named node to its value; True if any node changed."""
    changed = False
    for name, value in values.items():
        node = graph.node(name)
        if getattr(node.ann, field) != value:
            graph.replace(node.with_ann(**{field: value}))
            changed = True
    return changed


def producer(graph: Graph, value: Any, *ops: Any) -> Node | None:
    """The node behind ``value`` if it is a :class:`Ref` to a node with one of ``ops`` (any op if none)."""
    if not isinstance(value, Ref):
        return None
    node = graph.node(value.name)
    return node if not ops or node.op in ops else None


def graph_inputs_meta(graph: Graph) -> list[TensorMeta]:
    """The metas of the graph's inputs, in order."""
    return [n.tensor_meta for n in graph.input_nodes]


def outputs_meta(graph: Graph) -> list[TensorMeta | None]:
    """The metas of the graph's outputs, in order (None for a non-tensor output)."""
    metas = []
    for r in graph.output_refs:
        m = graph.node(r.name).meta
        metas.append(m if isinstance(m, TensorMeta) else None)
    return metas


def sequence_of(value: Any) -> Sequence[Any]:
    """``value`` if it is a list or tuple, else ``(value,)``."""
    return value if isinstance(value, (list, tuple)) else (value,)


# -- analyses (networkx, built on demand) ------------------------------------------------

def _whole(graph: Graph) -> nx.DiGraph:
    """The whole graph as a networkx DiGraph."""
    g = nx.DiGraph()
    g.add_nodes_from(graph.order())
    g.add_edges_from(graph.edges())
    return g


def _compute_dag(graph: Graph) -> nx.DiGraph:
    """Compute nodes only, with edges that pass through GETITEM projections."""
    dag = nx.DiGraph()
    compute = [n for n in graph.call_nodes() if n.op != GETITEM]
    dag.add_nodes_from(n.name for n in compute)

    def sources(name: str) -> list[str]:
        node = graph.node(name)
        if node.op == GETITEM:
            return [s for p in node.input_names() for s in sources(p)]
        return [name] if not node.op.is_structural else []

    for node in compute:
        for p in node.input_names():
            for s in sources(p):
                dag.add_edge(s, node.name)
    return dag


def generations(graph: Graph) -> list[list[str]]:
    """Compute nodes grouped by topological generation: each group could run in parallel."""
    return [sorted(gen, key=graph.position_key) for gen in nx.topological_generations(_compute_dag(graph))]


def critical_path(graph: Graph, weight: Callable[[Node], float] | None = None) -> list[str]:
    """Longest chain of compute nodes (by count, or by ``weight`` per node)."""
    dag = _compute_dag(graph)
    order = [n for n in graph.order() if n in dag]
    if weight is not None:
        for a, b in dag.edges:
            dag.edges[a, b]["w"] = weight(graph.node(b))
        # a path's first node carries no incoming edge: count it through a virtual source
        for n in order:
            dag.add_edge("__source__", n, w=weight(graph.node(n)))
        path = nx.dag_longest_path(dag, weight="w", default_weight=0)
        return [p for p in path if p != "__source__"]
    return list(nx.dag_longest_path(dag, topo_order=order))


def dominators(graph: Graph, start: str) -> dict[str, str]:
    """Immediate dominators from ``start``: who every path must cross."""
    return nx.immediate_dominators(_whole(graph), start)


def post_dominators(graph: Graph) -> dict[str, str]:
    """Immediate post-dominators of every node w.r.t. the output node."""
    return nx.immediate_dominators(_whole(graph).reverse(copy=False), graph.output_node.name)


# -- printing ------------------------------------------------------------------------------

def format_graph(graph: Graph) -> str:
    """The text form (``str(graph)``): inputs in the header, one line per node, ``return``."""
    ins = ", ".join(f"%{n.name}: {n.meta}" for n in graph.input_nodes)
    lines = [f"graph {graph.name}({ins}) {{"]
    if graph.ranges:
        lines.append("  # sizes: " + ", ".join(f"{n} in {r}" for n, r in sorted(graph.ranges.items())))
    for node in graph.nodes():
        if node.op == INPUT:
            continue
        if node.op == OUTPUT:
            lines.append(f"  return {format_value(node.inputs[0] if len(node.inputs) == 1 else node.inputs)}")
        else:
            lines.append("  " + node.format())
    lines.append("}")
    return "\n".join(lines)


def to_dot(graph: Graph) -> str:
    """Graphviz text: one box per node, labelled with op and shape; params grey."""
    def q(s: str) -> str:  # labels keep their "\\n" line breaks
        return '"' + s.replace('"', '\\"') + '"'
    lines = [f"digraph {q(graph.name)} {{", "  rankdir=TB;", "  node [shape=box, fontname=monospace];"]
    for node in graph.nodes():
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
    lines.extend(f"  {q(a)} -> {q(b)};" for a, b in graph.edges())
    lines.append("}")
    return "\n".join(lines)


def _group_colour(group: int) -> str:
    palette = ["#fde0dd", "#e0ecf4", "#e5f5e0", "#fff7bc", "#efedf5", "#fee6ce", "#deebf7"]
    return palette[group % len(palette)]
