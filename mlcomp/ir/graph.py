"""The mlcomp IR: a dataflow graph of frozen nodes behind a typed :class:`Graph`.

A graph printed with ``str(graph)`` reads like this::

    graph mlp(%x: f32[1, 512]) {
      %0.weight: f32[256, 512] = param                  # 0
      %0.bias: f32[256] = param                         # 0
      %permute: f32[512, 256] = aten.permute.default(%0.weight, [1, 0])   # 0 (Linear)
      %addmm: f32[1, 256] = aten.addmm.default(%0.bias, %x, %permute)    # 0 (Linear)
      %relu: f32[1, 256] = aten.relu.default(%addmm)                     # 1 (ReLU)
      return (%relu)
    }

Nodes are immutable; a pass changes one with :func:`dataclasses.replace` and
``graph.replace(node)``.  Parameters and buffers are ``PARAM`` nodes named by
their module path (``layer1.0.conv1.weight``); their tensors live in
``graph.constants`` under the same name.  networkx stays inside :class:`Graph`:
callers use its methods (topological order, users, ``replace_all_uses``,
``erase``, ``subgraph``, ``generations``, ``critical_path``).
"""
from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import networkx as nx
import torch

from mlcomp.base.errors import IRError
from mlcomp.ir import ops
from mlcomp.ir.dtypes import dtype_name, parse_dtype  # noqa: F401 - re-exported
from mlcomp.ir.meta import check_node_meta
from mlcomp.ir.node import (  # noqa: F401
    Annotations,
    Dim,
    Mode,
    Node,
    Origin,
    Precision,
    Ref,
    TensorMeta,
    format_meta,
    format_value,
    map_refs,
    refs_in,
)
from mlcomp.ir.ops import GETITEM, INPUT, OUTPUT, PARAM, Op

__all__ = ["Graph", "graph_inputs_meta", "outputs_meta", "sequence_of"]

# ---------------------------------------------------------------------------
# Graph


class Graph:
    """A dataflow graph of :class:`Node` s.

    Order is stable: nodes iterate in topological order, ties broken by
    insertion order, so two runs of the same pipeline print the same text.
    """

    def __init__(self, name: str = "graph", *, mode: Mode = Mode.INFERENCE) -> None:
        self.name = name
        self.mode = mode
        self.constants: dict[str, torch.Tensor] = {}
        self.symbols: dict[str, int] = {}      # example values of symbolic sizes
        self._g: nx.DiGraph = nx.DiGraph()
        self._key: dict[str, float] = {}        # insertion order key
        self._next_key = 0.0
        self._topo: list[str] | None = None
        self._pos: dict[str, int] = {}

    # -- construction -----------------------------------------------------
    def add(self, node: Node, *, before: str | None = None) -> Node:
        """Insert ``node``; its inputs must exist.  ``before`` places it ahead of a node."""
        if node.name in self._g:
            raise IRError(f"node %{node.name} already exists in graph {self.name}")
        for src in node.input_names():
            if src not in self._g:
                raise IRError(f"node %{node.name} ({node.op}) reads %{src}, which is not in the graph",
                              hint="add producers before their users")
        if before is not None:
            key = self._key_before(before)
        else:
            self._next_key += 1.0
            key = self._next_key
        self._g.add_node(node.name, node=node)
        self._key[node.name] = key
        for src in node.input_names():
            self._g.add_edge(src, node.name)
        self._topo = None
        return node

    def _key_before(self, anchor: str) -> float:
        keys = sorted(self._key.values())
        k = self._key[anchor]
        i = keys.index(k)
        prev = keys[i - 1] if i > 0 else k - 1.0
        return (prev + k) / 2.0

    def add_constant(self, name: str, value: torch.Tensor, *, origin: Origin | None = None,
                     before: str | None = None) -> Node:
        """Add a PARAM node holding ``value`` (stored in ``graph.constants``)."""
        self.constants[name] = value
        node = Node(name, PARAM, meta=TensorMeta.of(value),
                    origin=origin or Origin(name.rpartition(".")[0]))
        return self.add(node, before=before or self._first_non_param())

    def _first_non_param(self) -> str | None:
        for n in self.nodes():
            if n.op not in (PARAM, INPUT):
                return n.name
        return None

    def fresh_name(self, base: str) -> str:
        base = base or "v"
        if base not in self._g:
            return base
        for i in itertools.count(1):
            cand = f"{base}_{i}"
            if cand not in self._g:
                return cand
        raise AssertionError  # pragma: no cover

    # -- queries ----------------------------------------------------------
    def __contains__(self, name: object) -> bool:
        return name in self._g

    def __len__(self) -> int:
        return self._g.number_of_nodes()

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes())

    def node(self, name: str) -> Node:
        try:
            return self._g.nodes[name]["node"]
        except KeyError:
            raise IRError(f"no node %{name} in graph {self.name}") from None

    def order(self) -> list[str]:
        if self._topo is None:
            try:
                self._topo = list(nx.lexicographical_topological_sort(self._g, key=self._key.__getitem__))
            except nx.NetworkXUnfeasible:
                cycle = nx.find_cycle(self._g)
                names = " -> ".join(f"%{a}" for a, _ in cycle)
                raise IRError(f"graph {self.name} has a cycle: {names}") from None
            self._pos = {n: i for i, n in enumerate(self._topo)}
        return self._topo

    def nodes(self, op: Op | None = None) -> list[Node]:
        """All nodes in topological order (only those with ``op`` if given)."""
        out = [self._g.nodes[n]["node"] for n in self.order()]
        return out if op is None else [n for n in out if n.op == op]

    def call_nodes(self) -> list[Node]:
        """Nodes that compute something (not input/param/output)."""
        return [n for n in self.nodes() if not n.op.is_structural]

    @property
    def input_nodes(self) -> list[Node]:
        return self.nodes(INPUT)

    @property
    def output_node(self) -> Node:
        outs = self.nodes(OUTPUT)
        if len(outs) != 1:
            raise IRError(f"graph {self.name} has {len(outs)} output nodes; it needs exactly one")
        return outs[0]

    @property
    def output_refs(self) -> list[Ref]:
        return refs_in(self.output_node.inputs)

    def users(self, name: str) -> list[Node]:
        """Nodes that read ``name``, in topological order."""
        self.order()
        return [self._g.nodes[n]["node"] for n in sorted(self._g.successors(name), key=self._pos.__getitem__)]

    def producers(self, name: str) -> list[Node]:
        return [self.node(n) for n in self.node(name).input_names()]

    def param(self, name: str) -> torch.Tensor:
        return self.constants[name]

    # -- mutation -----------------------------------------------------------
    def replace(self, node: Node) -> Node:
        """Swap in a new version of the node with the same name (edges follow its inputs)."""
        old = self.node(node.name)
        for src in node.input_names():
            if src not in self._g:
                raise IRError(f"node %{node.name} would read %{src}, which is not in the graph")
        for src in old.input_names():
            self._g.remove_edge(src, node.name)
        for src in node.input_names():
            self._g.add_edge(src, node.name)
        self._g.nodes[node.name]["node"] = node
        self._topo = None
        return node

    def replace_all_uses(self, old: str, new: str | Ref, *, only: Callable[[Node], bool] | None = None) -> int:
        """Make every user of ``old`` read ``new`` instead; returns the number of users changed."""
        new_ref = new if isinstance(new, Ref) else Ref(new)
        changed = 0
        for user in self.users(old):
            if user.name == new_ref.name or (only is not None and not only(user)):
                continue
            swap = lambda r: new_ref if r.name == old else r  # noqa: E731
            self.replace(replace(user, inputs=map_refs(user.inputs, swap),
                                 attrs=map_refs(dict(user.attrs), swap)))
            changed += 1
        return changed

    def erase(self, name: str) -> None:
        """Remove a node that nobody reads (raises naming its users otherwise)."""
        users = self.users(name)
        if users:
            raise IRError(f"cannot erase %{name}: still read by "
                          + ", ".join(f"%{u.name}" for u in users))
        node = self.node(name)
        self._g.remove_node(name)
        del self._key[name]
        if node.op == PARAM:
            self.constants.pop(name, None)
        self._topo = None

    def copy(self) -> "Graph":
        """A new graph with the same nodes; constant tensors are shared, not cloned."""
        g = Graph(self.name, mode=self.mode)
        g.constants = dict(self.constants)
        g.symbols = dict(self.symbols)
        g._g = self._g.copy()
        g._key = dict(self._key)
        g._next_key = self._next_key
        return g

    def subgraph(self, names: Iterable[str], *, name: str | None = None) -> "Graph":
        """Extract ``names`` into a new graph.

        Values read from outside become INPUT nodes (named as the outer node, in
        topological order) unless they are PARAMs, which are copied; values used
        outside (or graph outputs) become the subgraph's outputs.
        """
        keep = set(names)
        sub = Graph(name or f"{self.name}_sub", mode=self.mode)
        sub.symbols = dict(self.symbols)
        outer_outputs = {r.name for r in self.output_refs}
        produced: list[str] = []
        for node in self.nodes():
            if node.name not in keep:
                continue
            for src in node.input_names():
                if src in keep or src in sub:
                    continue
                outer = self.node(src)
                if outer.op == PARAM:
                    sub.add_constant(src, self.constants[src], origin=outer.origin)
                else:
                    sub.add(Node(src, INPUT, meta=outer.meta, origin=outer.origin))
            if node.op == PARAM:
                sub.add_constant(node.name, self.constants[node.name], origin=node.origin)
                continue
            sub.add(node)
            produced.append(node.name)
        outs = [n for n in produced
                if n in outer_outputs or any(u.name not in keep for u in self.users(n))]
        sub.add(Node("output", OUTPUT, inputs=(tuple(Ref(n) for n in outs),)))
        return sub

    # -- analysis -----------------------------------------------------------
    def _compute_dag(self) -> nx.DiGraph:
        """Compute nodes only, with edges that pass through GETITEM projections."""
        dag = nx.DiGraph()
        compute = [n.name for n in self.call_nodes() if n.op != GETITEM]
        dag.add_nodes_from(compute)

        def sources(name: str) -> list[str]:
            node = self.node(name)
            if node.op == GETITEM:
                return [s for p in node.input_names() for s in sources(p)]
            return [name] if not node.op.is_structural else []

        for name in compute:
            for p in self.node(name).input_names():
                for s in sources(p):
                    dag.add_edge(s, name)
        return dag

    def generations(self) -> list[list[str]]:
        """Compute nodes grouped by topological generation: each group could run in parallel."""
        return [sorted(gen, key=self._key.__getitem__) for gen in nx.topological_generations(self._compute_dag())]

    def critical_path(self, weight: Callable[[Node], float] | None = None) -> list[str]:
        """Longest chain of compute nodes (by count, or by ``weight`` per node)."""
        dag = self._compute_dag()
        order = [n for n in self.order() if n in dag]
        if weight is not None:
            for a, b in dag.edges:
                dag.edges[a, b]["w"] = weight(self.node(b))
            # a path's first node carries no incoming edge: count it through a virtual source
            for n in order:
                dag.add_edge("__source__", n, w=weight(self.node(n)))
            path = nx.dag_longest_path(dag, weight="w", default_weight=0)
            return [p for p in path if p != "__source__"]
        return list(nx.dag_longest_path(dag, topo_order=order))

    def dominators(self, start: str) -> dict[str, str]:
        """Immediate dominators from ``start`` (networkx): who every path must cross."""
        return nx.immediate_dominators(self._g, start)

    def post_dominators(self) -> dict[str, str]:
        """Immediate post-dominators of every node w.r.t. the output node."""
        rev = self._g.reverse(copy=False)
        return nx.immediate_dominators(rev, self.output_node.name)

    # -- verification -----------------------------------------------------
    def verify(self, *, check_meta: bool = True) -> None:
        """Raise :class:`IRError` naming the first broken node; ``None`` if the graph is sound.

        Checks: acyclic; every input reference exists and edges agree with the
        references; exactly one output; every value node has meta; params have
        their constant with matching shape/dtype; and (``check_meta``) each
        node's meta agrees with re-running its op on meta tensors.
        """
        if not nx.is_directed_acyclic_graph(self._g):
            self.order()  # raises naming the cycle
        self.output_node  # noqa: B018 - raises if not exactly one
        for node in self.nodes():
            srcs = node.input_names()
            for s in srcs:
                if s not in self._g:
                    self._fail(node, f"reads %{s}, which does not exist")
            if set(self._g.predecessors(node.name)) != set(srcs):
                self._fail(node, "graph edges disagree with the node's inputs")
            if node.op == OUTPUT:
                if self.users(node.name):
                    self._fail(node, "the output node has users")
                continue
            if node.op == PARAM:
                t = self.constants.get(node.name)
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
                problem = check_node_meta(self, node)
                if problem:
                    self._fail(node, problem)

    def _fail(self, node: Node, problem: str) -> None:
        preds = ", ".join(f"%{p}" for p in node.input_names()) or "none"
        succs = ", ".join(f"%{u}" for u in self._g.successors(node.name)) if node.name in self._g else ""
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
        for a, b in self._g.edges:
            lines.append(f"  {q(a)} -> {q(b)};")
        lines.append("}")
        return "\n".join(lines)


def _group_colour(group: int) -> str:
    palette = ["#fde0dd", "#e0ecf4", "#e5f5e0", "#fff7bc", "#efedf5", "#fee6ce", "#deebf7"]
    return palette[group % len(palette)]


def graph_inputs_meta(graph: Graph) -> list[TensorMeta]:
    return [n.tensor_meta for n in graph.input_nodes]


def outputs_meta(graph: Graph) -> list[TensorMeta | None]:
    metas = []
    for r in graph.output_refs:
        m = graph.node(r.name).meta
        metas.append(m if isinstance(m, TensorMeta) else None)
    return metas


def sequence_of(value: Any) -> Sequence[Any]:
    return value if isinstance(value, (list, tuple)) else (value,)
