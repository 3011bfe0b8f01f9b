"""Memory over a schedule: which values are live at each step, bytes per step, the peak.

Every pass that reasons about memory (fusion's peak guard, rematerialisation,
placement) and every report reads it from here.  A value is *live* from the
step that produces it to the last step that reads it; the interpreter frees at
exactly that point.  Views share their base's buffer (a view chain is one
allocation, held until its last alias is read), graph outputs stay live to the
end, and a value nobody reads is held to the end too (nothing frees it)::

    graph chain(%x: f32[256]) {          step  live buffers           bytes
      %a = aten.relu(%x)                   0   a                       1024
      %v = aten.view(%a, [16, 16])         1   a (v aliases a)         1024
      %b = aten.exp(%v)                    2   a, b                    2048
      %c = aten.neg(%b)                    3   b, c                    2048
      return (%c)                                             peak =  2048
    }

    >>> from mlcomp.ir.builder import GraphBuilder
    >>> from mlcomp.ir.ops import aten
    >>> b = GraphBuilder("chain")
    >>> a = b.call(aten("relu"), b.input("x", (256,)), name="a")
    >>> v = b.call(aten("view"), a, [16, 16], name="v")
    >>> graph = b.output(b.call(aten("neg"), b.call(aten("exp"), v, name="b"), name="c"))
    >>> live = liveness(graph)             # the graph's order; or liveness(graph, schedule=[...])
    >>> live.peak_bytes, sorted(live.live_at(live.step_of["b"])), live.bytes_at("b")
    (2048, ['a', 'b'], 2048)

An op returning several fresh tensors (``native_batch_norm``,
``max_pool2d_with_indices``) allocates one buffer per element (:class:`Buffers`):
the element a ``getitem`` picks dies after its own last reader, not with the
tuple's last element, which is what generated fx code and the interpreter do
(holding every element to the last would keep batch-norm outputs alive until the
backward reads the saved mean).  ``workspace``
adds a kernel's scratch at its own step (:mod:`mlcomp.analysis.workspace`).

``groups`` runs each group of nodes as one unit (a fused kernel, scheduled
where its last member was): values produced and read only inside a group never
reach memory, though the kernel holds the largest of them transiently where
that exceeds what it writes out.  Graph inputs and parameters are not counted
unless ``count_inputs``/``count_params``.  Everything is O(n log n).
"""
from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from mlcomp.base.errors import IRError
from mlcomp.ir import Graph, Node, Ref, TensorMeta
from mlcomp.ir.ops import GETITEM, INPUT, OUTPUT, PARAM, Namespace
from mlcomp.ir.opsets import VIEW_LIKE

__all__ = ["Buffers", "Liveness", "buffers", "is_view", "live_bytes_per_node", "liveness", "peak_bytes",
           "storage_roots", "value_bytes"]

# every ATen op (any overload) whose result may share its input's storage: the view ops
# of mlcomp.ir.opsets plus the overloads of the same names (squeeze.default, split.sizes, ...)
_VIEW_NAMES = frozenset({op.name for op in VIEW_LIKE if op.namespace is Namespace.ATEN}) | frozenset({
    "view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "unsqueeze", "squeeze",
    "alias", "detach", "select", "slice", "as_strided", "split", "split_with_sizes", "unbind", "chunk",
    "lift_fresh_copy", "narrow", "diagonal"})
_OTHER_VIEWS = frozenset(op for op in VIEW_LIKE if op.namespace is not Namespace.ATEN)   # mlcomp's own


def is_view(node: Node) -> bool:
    """Whether ``node``'s result aliases its first input's buffer (moves no data, allocates nothing)."""
    op = node.op
    return op.name in _VIEW_NAMES if op.namespace is Namespace.ATEN else op in _OTHER_VIEWS


def _is_getitem(op) -> bool:
    return op.name == "getitem" and op == GETITEM      # the name first: an Op's == compares three fields


def value_bytes(graph: Graph, node: Node) -> int:
    """Bytes of the tensor(s) ``node`` produces (symbolic sizes at their example values)."""
    metas = node.meta if isinstance(node.meta, tuple) else (node.meta,)
    return sum(m.nbytes(graph.symbols) for m in metas if isinstance(m, TensorMeta))


def _is_alias(node: Node) -> bool:
    return (is_view(node) or _is_getitem(node.op)) and bool(node.inputs) and isinstance(node.inputs[0], Ref)


def _element(graph: Graph, node: Node) -> tuple[str, int] | None:
    """``(tuple node, index)`` when ``node`` picks one tensor out of an op's fresh tuple result."""
    if not _is_getitem(node.op) or len(node.inputs) < 2 or not isinstance(node.inputs[0], Ref) \
            or not isinstance(node.inputs[1], int):
        return None
    src = graph.node(node.inputs[0].name)
    if not isinstance(src.meta, tuple) or is_view(src) or _is_getitem(src.op) or src.op.is_structural:
        return None
    k = node.inputs[1]
    return (src.name, k) if 0 <= k < len(src.meta) and isinstance(src.meta[k], TensorMeta) else None


@dataclass(frozen=True)
class Buffers:
    """Which buffer each value lives in, the size of each buffer and the node that allocates it.

    A view (or a projection of a view's tuple) lives in its base's buffer.  An op
    returning several fresh tensors (``native_batch_norm``, ``max_pool2d_with_indices``)
    allocates one buffer per element: the element some ``getitem`` picks is named
    after that (first) ``getitem``, the elements nobody picks are charged to the
    tuple node itself.  ``tuple_of`` maps an element buffer to its tuple node: the
    tuple holds every element until its last ``getitem`` has read it.
    """

    storage: Mapping[str, str]     # value -> root value owning its buffer
    size: Mapping[str, int]        # root -> bytes
    allocator: Mapping[str, str]   # root -> the node whose execution allocates it
    tuple_of: Mapping[str, str]    # element root -> tuple node holding it


def buffers(graph: Graph, *, exclude: Iterable[str] = ()) -> Buffers:
    """The :class:`Buffers` of ``graph``; nodes in ``exclude`` (members of a fused group,
    which writes fresh buffers) own theirs.  O(n)."""
    skip = set(exclude)
    root: dict[str, str] = {}
    size: dict[str, int] = {}
    allocator: dict[str, str] = {}
    tuple_of: dict[str, str] = {}
    picked: dict[tuple[str, int], str] = {}
    for node in graph.nodes():
        elem = _element(graph, node) if node.name not in skip else None
        if elem is not None:
            first = picked.setdefault(elem, node.name)
            root[node.name] = first
            if first == node.name:
                tup = elem[0]
                size[first] = graph.node(tup).meta[elem[1]].nbytes(graph.symbols)
                size[tup] -= size[first]
                allocator[first], tuple_of[first] = tup, tup
            continue
        base = node.inputs[0].name if _is_alias(node) and node.name not in skip else None
        if base is not None:
            root[node.name] = root.get(base, base)
        else:
            root[node.name] = node.name
            size[node.name] = value_bytes(graph, node)
            allocator[node.name] = node.name
    return Buffers(root, size, allocator, tuple_of)


def storage_roots(graph: Graph, *, exclude: Iterable[str] = ()) -> dict[str, str]:
    """Value → the value whose computation made its buffer: a view (or a projection of a tuple) → its base.

    This is the unit a rewrite recomputes (a ``getitem`` follows the op that made
    the tuple); for the unit memory is freed in, one buffer per tuple element, see
    :func:`buffers`.  Nodes in ``exclude`` (members of a fused group, which writes
    fresh buffers) own theirs.
    """
    skip = set(exclude)
    root: dict[str, str] = {}
    for node in graph.nodes():
        base = node.inputs[0].name if _is_alias(node) and node.name not in skip else None
        root[node.name] = root.get(base, node.name) if base is not None else node.name
    return root


@dataclass(frozen=True)
class Liveness:
    """Live buffers over a schedule.  Steps index ``schedule`` (one node, or one group)."""

    schedule: tuple[tuple[str, ...], ...]   # the nodes each step runs
    step_of: Mapping[str, int]              # node -> its step
    storage: Mapping[str, str]              # value -> root value owning its buffer
    sizes: Mapping[str, int]                # counted root -> bytes
    born: Mapping[str, int]                 # counted root -> step allocating it
    dies: Mapping[str, int]                 # counted root -> last step holding it
    live_bytes: tuple[int, ...]             # bytes held while each step runs
    peak_bytes: int

    def live_at(self, step: int) -> frozenset[str]:
        """Counted buffers (root value names) held while ``step`` runs."""
        return frozenset(r for r, b in self.born.items() if b <= step <= self.dies[r])

    def bytes_at(self, node: str) -> int:
        """Bytes held while ``node`` (or the group it belongs to) runs."""
        return self.live_bytes[self.step_of[node]]

    def interval(self, value: str) -> tuple[int, int] | None:
        """(first, last) step the buffer of ``value`` is held; ``None`` if it is not counted."""
        r = self.storage[value]
        return (self.born[r], self.dies[r]) if r in self.born else None


def liveness(graph: Graph, schedule: Sequence[str] | None = None, *, groups: Sequence[Sequence[str]] = (),
             count_inputs: bool = False, count_params: bool = False,
             workspace: Mapping[str, int] | None = None) -> Liveness:
    """Liveness of every buffer when the graph runs in ``schedule`` (default: its order).

    ``schedule`` lists every node once (structural nodes may be left out) in an
    order that respects data dependencies; ``groups`` cannot be combined with it.
    ``workspace`` (node → bytes, :func:`mlcomp.analysis.workspace.op_workspaces`) is
    scratch a kernel holds during its own step only.
    """
    order = graph.order()
    nodes = {n.name: n for n in graph.nodes()}
    if schedule is not None:
        if groups:
            raise ValueError("liveness takes a schedule or groups, not both")
        steps = [(n,) for n in _checked_schedule(graph, nodes, order, schedule)]
    elif groups:
        steps = _group_steps(nodes, order, groups)
    else:                  # the graph's order is topological: every node its own step, in that order
        steps = [(n,) for n in order]
    grouped = frozenset(n for members in groups for n in members)
    fused = [len(ms) > 1 or ms[0] in grouped for ms in steps] if groups else None    # steps that are kernels
    step_of = {n: i for i, ms in enumerate(steps) for n in ms}
    bufs = buffers(graph, exclude=grouped)
    storage = bufs.storage
    last_use: dict[str, int] = {}
    for i, ms in enumerate(steps):
        for name in ms:
            for s in nodes[name].input_names():
                if step_of[s] != i:
                    last_use[storage[s]] = i       # steps ascend: the last reader's step wins
    # an element of a tuple result is held by the tuple until the tuple's last reader
    for elem, tup in bufs.tuple_of.items():
        if tup in last_use:
            last_use[elem] = max(last_use.get(elem, -1), last_use[tup])
    allocates: dict[str, list[str]] = {}
    for r, by in bufs.allocator.items():
        allocates.setdefault(by, []).append(r)
    readers_of: dict[str, list[str]] = {}
    if groups:
        for name, r in storage.items():
            readers_of.setdefault(r, []).append(name)
    outputs = {storage[r.name] for r in graph.output_refs}
    end = len(steps) - 1
    skip = {OUTPUT} | ({INPUT} if not count_inputs else set()) | ({PARAM} if not count_params else set())
    sizes: dict[str, int] = {}
    born: dict[str, int] = {}
    dies: dict[str, int] = {}
    live_bytes: list[int] = []
    frees: dict[int, list[str]] = {}
    live = 0
    for i, ms in enumerate(steps):
        transient = made = 0
        for name in ms:
            op = nodes[name].op
            if op.namespace is Namespace.GRAPH and op in skip:
                continue
            for r in allocates.get(name, ()):
                size = bufs.size[r]
                if fused and fused[i] and all(step_of[x.name] == i for a in readers_of[r] for x in graph.users(a)):
                    transient = max(transient, size)     # produced and consumed inside the kernel
                    continue
                sizes[r], born[r] = size, i
                dies[r] = end if r in outputs or r not in last_use else max(last_use[r], i)
                frees.setdefault(dies[r], []).append(r)
                live += size
                made += size
        scratch = max((workspace.get(n, 0) for n in ms), default=0) if workspace else 0
        # a kernel overwrites its intermediates in place, so its outputs reuse their buffer
        live_bytes.append(live + max(0, transient - made) + scratch)
        for r in frees.get(i, ()):
            if i < end or r not in outputs:
                live -= sizes[r]
    return Liveness(tuple(steps), {n: step_of[n] for n in order}, storage,
                    sizes, born, dies, tuple(live_bytes), max(live_bytes, default=0))


def _group_steps(nodes: Mapping[str, Node], order: list[str],
                 groups: Sequence[Sequence[str]]) -> list[tuple[str, ...]]:
    """The nodes of each step: every group one step, scheduled where its last member stood; every other
    node its own step; in topological order (ties: graph order)."""
    unit_of = {n: f"#group{i}" for i, members in enumerate(groups) for n in members}
    of = lambda n: unit_of.get(n, n)    # noqa: E731
    members: dict[str, list[str]] = {}
    for name in order:
        members.setdefault(of(name), []).append(name)
    return [tuple(members[u]) for u in _unit_schedule(nodes, order, of)]


def _unit_schedule(nodes: Mapping[str, Node], order: list[str], of) -> list[str]:
    """Units in topological order, each group where its last member stood (ties: graph order)."""
    pos = {n: i for i, n in enumerate(order)}
    deps: dict[str, set[str]] = {}
    first: dict[str, int] = {}
    for name in order:
        u = of(name)
        first[u] = max(first.get(u, pos[name]), pos[name])
        deps.setdefault(u, set()).update(of(s) for s in nodes[name].input_names() if of(s) != u)
    users: dict[str, list[str]] = {u: [] for u in deps}
    for u, ds in deps.items():
        for d in ds:
            users[d].append(u)
    indeg = {u: len(ds) for u, ds in deps.items()}
    heap = [(first[u], u) for u, k in indeg.items() if k == 0]
    heapq.heapify(heap)
    units: list[str] = []
    while heap:
        _, u = heapq.heappop(heap)
        units.append(u)
        for v in users[u]:
            indeg[v] -= 1
            if indeg[v] == 0:
                heapq.heappush(heap, (first[v], v))
    if len(units) != len(deps):
        raise IRError("the fusion groups given to liveness form a cycle between groups",
                      hint="a group must be convex: no path may leave it and come back")
    return units


def _checked_schedule(graph: Graph, nodes: Mapping[str, Node], order: list[str],
                      schedule: Sequence[str]) -> list[str]:
    given = list(schedule)
    seen: set[str] = set()
    for name in given:
        if name not in nodes or name in seen:
            raise IRError(f"schedule names %{name} " + ("twice" if name in seen else "which is not in the graph"),
                          where=f"graph {graph.name}", hint="list every node of the graph once")
        seen.add(name)
    missing = [n for n in order if n not in seen and not nodes[n].op.is_structural]
    if missing:
        raise IRError(f"schedule leaves out {len(missing)} node(s), first %{missing[0]}",
                      where=f"graph {graph.name}", hint="list every compute node of the graph once")
    # structural nodes the caller left out run where the graph order has them (inputs first, output last)
    full = [n for n in order if n not in seen and nodes[n].op in (INPUT, PARAM)] + given \
        + [n for n in order if n not in seen and nodes[n].op == OUTPUT]
    done: set[str] = set()
    for name in full:
        for s in nodes[name].input_names():
            if s not in done:
                raise IRError(f"schedule runs %{name} before %{s}, which it reads",
                              where=f"graph {graph.name}", hint="the schedule must respect data dependencies")
        done.add(name)
    return full


def peak_bytes(graph: Graph, schedule: Sequence[str] | None = None, *,
               groups: Sequence[Sequence[str]] = ()) -> int:
    """The most bytes held at once when the graph runs in ``schedule`` (or with ``groups`` fused)."""
    return liveness(graph, schedule, groups=groups).peak_bytes


def live_bytes_per_node(graph: Graph, schedule: Sequence[str] | None = None) -> dict[str, int]:
    """Node → bytes held while it runs, in schedule order."""
    live = liveness(graph, schedule)
    return {name: live.live_bytes[i] for i, names in enumerate(live.schedule) for name in names}
