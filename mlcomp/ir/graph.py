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
``graph.constants`` under the same name.  Whole-graph analyses (``generations``,
``critical_path``, dominators) and printing are free functions over this public
API in :mod:`mlcomp.ir.graph_tools`, ``verify`` is :mod:`mlcomp.ir.verifier`;
networkx stays inside ``mlcomp.ir``.

Every edit is O(1) amortised in the graph size (plus the node's own inputs):
the order is a linked list with order labels (:mod:`mlcomp.ir.order`) and the
users of every value are indexed, so passes may query and edit freely.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable, Iterable, Iterator

import networkx as nx
import torch

from mlcomp.base.errors import IRError
from mlcomp.ir.constants import Constants
from mlcomp.ir.graph_tools import format_graph
from mlcomp.ir.node import (
    Mode,
    Node,
    Origin,
    Ref,
    TensorMeta,
    map_refs,
    refs_in,
)
from mlcomp.ir.ops import INPUT, OUTPUT, PARAM, Op
from mlcomp.ir.order import NodeOrder, topo_repair
from mlcomp.ir.verifier import MetaChecks, verify
from mlcomp.ir.symbols import SizeRange

__all__ = ["Graph"]

# ---------------------------------------------------------------------------
# Graph


class Graph:
    """A dataflow graph of :class:`Node` s.

    Order is stable: nodes iterate in topological order, ties broken by
    insertion order (a node added ``before=x`` sits right before ``x``), so two
    runs of the same pipeline print the same text.

    The order is kept incrementally in a :class:`~mlcomp.ir.order.NodeOrder`
    (O(1) insertion anywhere, O(1) "is a before b") next to a users index, so
    no edit re-sorts the graph.  An edit can make a node read a value that sits
    later in the list (``replace`` with new inputs, or ``add(before=x)`` of a node
    reading something after ``x``).  Such nodes are remembered; the next query
    that needs the order re-sorts only the span from the first of them to the
    last value they read, topologically with ties broken by the list order.  This
    is what a full lexicographic topological sort keyed by list position gives
    (the reader sinks to just after its latest input, its users follow), at the
    cost of the span, and a cycle is reported there.
    """

    def __init__(self, name: str = "graph", *, mode: Mode = Mode.INFERENCE) -> None:
        self.name = name
        self.mode = mode
        self.constants: Constants = Constants()   # copy-on-write between Graph.copy() siblings
        self.symbols: dict[str, int] = {}      # example values of symbolic sizes
        self.ranges: dict[str, SizeRange] = {}   # the sizes each symbol may take (mlcomp.ir.symbols)
        self._nodes: dict[str, Node] = {}       # in insertion order (edge order of to_dot)
        self._reads: dict[str, tuple[str, ...]] = {}     # name -> input names (Node.input_names)
        self._users: dict[str, dict[str, None]] = {}     # name -> readers, in edge insertion order
        self._by_op: dict[Op, dict[str, None]] = {}
        self._order = NodeOrder()
        self._unsorted: set[str] = set()        # nodes that may read a value placed after them
        self._names: list[str] | None = None    # cached order()
        self._suffix: dict[str, int] = {}       # fresh_name: every base_i below this is taken
        self._first_compute: str | None = None  # first node that is not PARAM/INPUT (add_constant)
        self._first_compute_stale = False
        self.meta_checks = MetaChecks()         # verify's memo: nodes whose meta checked out
        # infer_meta's memo: (op, literal args, input shapes/dtypes) -> meta; shared by copies
        self.meta_cache: dict[Any, Any] = {}
        # ops capture left undecomposed -> why (mlcomp.frontend.decompose); inspect and --explain print it
        self.kept_ops: dict[str, str] = {}
        # how capture traced the module: "one trace", or "two traces: why" (mlcomp.frontend.one_trace)
        self.capture_trace = ""

    # -- construction -----------------------------------------------------
    def add(self, node: Node, *, before: str | None = None) -> Node:
        """Insert ``node``; its inputs must exist.  ``before`` places it ahead of a node."""
        name = node.name
        if name in self._nodes:
            raise IRError(f"node %{name} already exists in graph {self.name}")
        reads = tuple(node.input_names())
        for src in reads:
            if src not in self._nodes:
                raise IRError(f"node %{name} ({node.op}) reads %{src}, which is not in the graph",
                              hint="add producers before their users")
        if before is not None and before not in self._nodes:
            raise IRError(f"cannot insert %{name} before %{before}: no such node in graph {self.name}")
        self._nodes[name] = node
        self._reads[name] = reads
        self._users[name] = {}
        for src in reads:
            self._users[src][name] = None
        self._by_op.setdefault(node.op, {})[name] = None
        if before is None:
            self._order.append(name)
        else:
            self._order.insert_before(name, before)
            self._note_reads(name)
        if node.op not in (PARAM, INPUT) and not self._first_compute_stale and (
                self._first_compute is None or self._order.precedes(name, self._first_compute)):
            self._first_compute = name
        self._names = None
        return node

    def _note_reads(self, name: str) -> None:
        label = self._order.label(name)
        if any(self._order.label(src) > label for src in self._reads[name]):
            self._unsorted.add(name)

    def add_constant(self, name: str, value: torch.Tensor, *, origin: Origin | None = None,
                     before: str | None = None) -> Node:
        """Add a PARAM node holding ``value`` (stored in ``graph.constants``)."""
        self.constants[name] = value
        node = Node(name, PARAM, meta=TensorMeta.of(value),
                    origin=origin or Origin(name.rpartition(".")[0]))
        return self.add(node, before=before or self._first_non_param())

    def _first_non_param(self) -> str | None:
        self._sort()
        if self._first_compute_stale:
            self._first_compute = next((n for n in self._order if self._nodes[n].op not in (PARAM, INPUT)), None)
            self._first_compute_stale = False
        return self._first_compute

    def fresh_name(self, base: str) -> str:
        """``base``, or ``base_i`` with the smallest free ``i``."""
        base = base or "v"
        if base not in self._nodes:
            return base
        i = self._suffix.get(base, 1)
        while f"{base}_{i}" in self._nodes:
            i += 1
        self._suffix[base] = i
        return f"{base}_{i}"

    # -- queries ----------------------------------------------------------
    def __contains__(self, name: object) -> bool:
        return name in self._nodes

    def __len__(self) -> int:
        return len(self._nodes)

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes())

    def node(self, name: str) -> Node:
        try:
            return self._nodes[name]
        except KeyError:
            raise IRError(f"no node %{name} in graph {self.name}") from None

    def order(self) -> list[str]:
        """Node names in topological order (a fresh list; cached until the next edit)."""
        return list(self._ordered())

    def _ordered(self) -> list[str]:
        self._sort()
        if self._names is None:
            self._names = list(self._order)
        return self._names

    def precedes(self, a: str, b: str) -> bool:
        """True if ``a`` comes before ``b`` in :meth:`order` (O(1))."""
        self._sort()
        return self._order.precedes(a, b)

    def position_key(self, name: str) -> int:
        """A number that sorts nodes as :meth:`order` does (valid until the next edit)."""
        self._sort()
        return self._order.label(name)

    def nodes(self, op: Op | None = None) -> list[Node]:
        """All nodes in topological order (only those with ``op`` if given)."""
        if op is None:
            return [self._nodes[n] for n in self._ordered()]
        self._sort()
        return [self._nodes[n] for n in sorted(self._by_op.get(op, ()), key=self._order.label)]

    def call_nodes(self) -> list[Node]:
        """Nodes that compute something (not input/param/output)."""
        return [n for n in self.nodes() if not n.op.is_structural]

    @property
    def input_nodes(self) -> list[Node]:
        return self.nodes(INPUT)

    @property
    def output_node(self) -> Node:
        outs = self._by_op.get(OUTPUT, {})
        if len(outs) != 1:
            raise IRError(f"graph {self.name} has {len(outs)} output nodes; it needs exactly one")
        return self._nodes[next(iter(outs))]

    @property
    def output_refs(self) -> list[Ref]:
        return refs_in(self.output_node.inputs)

    def users(self, name: str) -> list[Node]:
        """Nodes that read ``name``, in topological order."""
        if name not in self._users:
            self.node(name)                 # raises naming the missing node
        readers = self._users[name]
        if len(readers) > 1:
            self._sort()
            return [self._nodes[n] for n in sorted(readers, key=self._order.label)]
        return [self._nodes[n] for n in readers]

    def num_users(self, name: str) -> int:
        """How many nodes read ``name`` (O(1))."""
        return len(self._users[name])

    def producers(self, name: str) -> list[Node]:
        return [self._nodes[n] for n in self._reads[self.node(name).name]]

    def edges(self) -> list[tuple[str, str]]:
        """Every (value, reader) pair: values in insertion order, each one's readers in the order they came."""
        return [(src, user) for src, readers in self._users.items() for user in readers]

    def param(self, name: str) -> torch.Tensor:
        return self.constants[name]

    def writable_constant(self, name: str) -> torch.Tensor:
        """The tensor of PARAM ``name``, private to this graph: write into it in place."""
        return self.constants.writable(name)

    # -- mutation -----------------------------------------------------------
    def replace(self, node: Node) -> Node:
        """Swap in a new version of the node with the same name (edges follow its inputs)."""
        name = node.name
        old = self.node(name)
        reads = tuple(node.input_names())
        for src in reads:
            if src not in self._nodes:
                raise IRError(f"node %{name} would read %{src}, which is not in the graph")
        for src in self._reads[name]:
            del self._users[src][name]
        for src in reads:
            self._users[src][name] = None
        self._reads[name] = reads
        self._nodes[name] = node
        if node.op != old.op:
            del self._by_op[old.op][name]
            self._by_op.setdefault(node.op, {})[name] = None
            if (old.op in (PARAM, INPUT)) != (node.op in (PARAM, INPUT)):
                self._first_compute_stale = True
        self._note_reads(name)
        return node

    def replace_all_uses(self, old: str, new: str | Ref, *, only: Callable[[Node], bool] | None = None) -> int:
        """Make every user of ``old`` read ``new`` instead; returns the number of users changed."""
        new_ref = new if isinstance(new, Ref) else Ref(new)
        changed = 0
        swap = lambda r: new_ref if r.name == old else r  # noqa: E731
        for user in self.users(old):
            if user.name == new_ref.name or (only is not None and not only(user)):
                continue
            self.replace(replace(user, inputs=map_refs(user.inputs, swap),
                                 attrs=map_refs(dict(user.attrs), swap)))
            changed += 1
        return changed

    def erase(self, name: str) -> None:
        """Remove a node that nobody reads (raises naming its users otherwise)."""
        node = self.node(name)
        if self._users[name]:
            raise IRError(f"cannot erase %{name}: still read by "
                          + ", ".join(f"%{u.name}" for u in self.users(name)))
        if name == self._first_compute and not self._first_compute_stale:
            self._first_compute = next((n for n in self._order.walk(self._order.next(name))
                                        if self._nodes[n].op not in (PARAM, INPUT)), None)
        for src in self._reads.pop(name):
            del self._users[src][name]
        del self._users[name], self._nodes[name], self._by_op[node.op][name]
        self._order.remove(name)
        self._unsorted.discard(name)
        self.meta_checks.forget(name)
        self._names = None
        base, _, suffix = name.rpartition("_")
        if base and suffix.isdigit() and str(int(suffix)) == suffix and int(suffix) < self._suffix.get(base, 1):
            self._suffix[base] = int(suffix)
        if node.op == PARAM:
            self.constants.pop(name, None)

    def _sort(self) -> None:
        """Re-sort the span that edits left out of topological order (see the class docstring)."""
        if not self._unsorted:
            return
        label = self._order.label
        readers = [n for n in self._unsorted if any(label(s) > label(n) for s in self._reads[n])]
        if readers:
            first = min(readers, key=label)
            last = max((s for n in readers for s in self._reads[n]), key=label)
            lo, hi, outside = label(first), label(last), self._order.prev(first)
            left = topo_repair(self._order, first, last, self._reads.__getitem__)
            if left is not None:
                sub = nx.DiGraph((s, n) for n in left for s in self._reads[n] if s in set(left))
                cycle = nx.find_cycle(sub)
                names = " -> ".join(f"%{a}" for a, _ in cycle)
                raise IRError(f"graph {self.name} has a cycle: {names}")
            fc = self._first_compute
            if fc is not None and not self._first_compute_stale and lo <= label(fc) <= hi:
                start = self._order.head if outside is None else self._order.next(outside)
                self._first_compute = next(n for n in self._order.walk(start)
                                           if self._nodes[n].op not in (PARAM, INPUT))
            self._names = None
        self._unsorted.clear()

    # -- checking and printing (mlcomp.ir.verifier, mlcomp.ir.graph_tools) ----
    def verify(self, *, check_meta: bool = True) -> None:
        """Raise IRError naming the first broken node (:func:`mlcomp.ir.verifier.verify`)."""
        verify(self, check_meta=check_meta)

    def format(self) -> str:
        """The text form (:func:`mlcomp.ir.graph_tools.format_graph`)."""
        return format_graph(self)

    __str__ = format

    def __repr__(self) -> str:
        return f"<Graph {self.name}: {len(self)} nodes>"

    def ir_summary(self) -> str:
        return f"<graph {len(self)} nodes>"

    def copy(self) -> "Graph":
        """A new graph with the same nodes; constant tensors are shared until either graph writes one."""
        g = Graph(self.name, mode=self.mode)
        g.constants = self.constants.copy()
        g.symbols, g.ranges = dict(self.symbols), dict(self.ranges)
        g._nodes, g._reads = dict(self._nodes), dict(self._reads)
        g._users = {n: dict(u) for n, u in self._users.items()}
        g._by_op = {op: dict(names) for op, names in self._by_op.items()}
        g._order = self._order.copy()
        g._unsorted = set(self._unsorted)
        g._suffix = dict(self._suffix)
        g._first_compute, g._first_compute_stale = self._first_compute, self._first_compute_stale
        g.meta_checks = self.meta_checks.copy()
        g.meta_cache = self.meta_cache
        g.kept_ops = dict(self.kept_ops)
        g.capture_trace = self.capture_trace
        return g

    def subgraph(self, names: Iterable[str], *, name: str | None = None) -> "Graph":
        """Extract ``names`` into a new graph.

        Values read from outside become INPUT nodes (named as the outer node, in
        topological order) unless they are PARAMs, which are copied; values used
        outside (or graph outputs) become the subgraph's outputs.
        """
        keep = set(names)
        sub = Graph(name or f"{self.name}_sub", mode=self.mode)
        sub.symbols, sub.ranges = dict(self.symbols), dict(self.ranges)
        outer_outputs = {r.name for r in self.output_refs}
        produced: list[str] = []
        for node in self.nodes():
            if node.name not in keep:
                continue
            for src in self._reads[node.name]:
                if src in keep or src in sub:
                    continue
                outer = self._nodes[src]
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
                if n in outer_outputs or any(u not in keep for u in self._users[n])]
        sub.add(Node("output", OUTPUT, inputs=(tuple(Ref(n) for n in outs),)))
        return sub

