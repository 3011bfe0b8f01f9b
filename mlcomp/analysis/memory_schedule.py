"""A memory-aware order of a graph's nodes: greedy list scheduling by the bytes each step adds.

Among the nodes whose inputs have all run, the next to run is the one that adds
the fewest bytes to what is live: the buffers it allocates, less the buffers it
is the last remaining reader of (which then die).  A node becomes the last
reader of a buffer when that buffer's other readers have run, so its priority
only improves over time; the heap is updated lazily (a fresh entry each time,
stale ones skipped), each buffer giving at most one update: O(n log n).  Ties
go to the node placed earlier in the graph, so a graph whose order is already
greedy-optimal keeps it.  This is the classic heuristic of "run what frees
memory first, delay what allocates until it is needed" (the list schedulers of
compilers for register pressure, and memory-aware orderings of dataflow graphs),
which in a joint graph sinks recomputation to just before its readers and runs
a gradient's reader before unrelated allocations.

With ``fused`` the parameter updates of a step with the optimizer in the
backward are modelled too: a gradient (a graph output) dies at its update,
which may run once the gradient and every reader of the parameter have run.

    >>> from mlcomp.analysis.liveness import peak_bytes
    >>> from mlcomp.ir.builder import GraphBuilder
    >>> from mlcomp.ir.ops import aten
    >>> b = GraphBuilder("branches")
    >>> x = b.input("x", (256,))                          # three 1 KiB branches, each reduced to a scalar
    >>> a = [b.call(aten(op), x, name=f"a{i}") for i, op in enumerate(("relu", "neg", "exp"))]
    >>> g = b.output(*[b.call(aten("sum"), v, name=f"s{i}") for i, v in enumerate(a)])
    >>> order = memory_order(g)
    >>> order[1:-1]                                      # each branch reduced before the next one starts
    ['a0', 's0', 'a1', 's1', 'a2', 's2']
    >>> peak_bytes(g), peak_bytes(g, order)
    (3076, 1036)
"""
from __future__ import annotations

import heapq
from collections.abc import Iterable
from dataclasses import dataclass

from mlcomp.analysis.liveness import buffers
from mlcomp.ir import Graph
from mlcomp.ir.ops import INPUT, OUTPUT, PARAM

__all__ = ["memory_order", "reverse_memory_order"]


def _readers(graph: Graph, storage: dict[str, str], tuple_of: dict[str, str]) -> dict[str, set[str]]:
    """Buffer root → the nodes that read it (an element of a tuple is also held by the tuple's readers)."""
    readers: dict[str, set[str]] = {}
    for node in graph.nodes():
        for s in node.input_names():
            readers.setdefault(storage[s], set()).add(node.name)
    for elem, tup in tuple_of.items():
        readers.setdefault(elem, set()).update(readers.get(tup, ()))
    return readers


@dataclass
class _Problem:
    """What both orders need: buffers, each node's inputs and users, each buffer's readers."""

    storage: dict[str, str]
    tuple_of: dict[str, str]
    readers: dict[str, set[str]]
    held: set[str]                       # buffers the graph never frees (its outputs)
    deps: dict[str, set[str]]
    users: dict[str, list[str]]
    size: dict[str, int]
    allocates: dict[str, list[str]]
    pos: dict[str, int]                  # graph position (virtual update nodes after every node)
    skip: set[str]                       # inputs, parameters and the output: allocate nothing


def _problem(graph: Graph, fused: bool, grads: Iterable[tuple[str, str]]) -> _Problem:
    bufs = buffers(graph)
    storage, tuple_of = dict(bufs.storage), dict(bufs.tuple_of)
    readers = _readers(graph, storage, tuple_of)
    held = {storage[r.name] for r in graph.output_refs}       # never freed by the graph
    deps: dict[str, set[str]] = {n.name: set(n.input_names()) for n in graph.nodes()}
    if fused:
        for param, grad in grads:           # a virtual update node: reads the gradient, after the param's readers
            update = f"<update {param}>"
            deps[update] = {grad} | set(readers.get(storage[param], ()))
            readers.setdefault(storage[grad], set()).add(update)
            held.discard(storage[grad])
    allocates: dict[str, list[str]] = {}
    for r, by in bufs.allocator.items():
        allocates.setdefault(by, []).append(r)
    users: dict[str, list[str]] = {n: [] for n in deps}
    for n, ds in deps.items():
        for d in ds:
            users[d].append(n)
    pos = {n: i for i, n in enumerate(graph.order())}
    pos.update({n: len(pos) + i for i, n in enumerate(n for n in deps if n not in pos)})
    skip = {n.name for n in graph.nodes() if n.op in (INPUT, PARAM, OUTPUT)}
    return _Problem(storage, tuple_of, readers, held, deps, users, dict(bufs.size), allocates, pos, skip)


def memory_order(graph: Graph, *, fused: bool = False, grads: Iterable[tuple[str, str]] = ()) -> list[str]:
    """Every node of ``graph`` in a topological order that greedily keeps the live bytes low (module doc).

    ``fused`` with ``grads`` (``(parameter, gradient node)`` pairs) models each gradient dying at its
    parameter's update.
    """
    pb = _problem(graph, fused, grads)
    storage, tuple_of, readers, held = pb.storage, pb.tuple_of, pb.readers, pb.held
    deps, users, size, allocates, pos, skip = pb.deps, pb.users, pb.size, pb.allocates, pb.pos, pb.skip
    elements: dict[str, list[str]] = {}
    for e, t in tuple_of.items():
        elements.setdefault(t, []).append(e)
    last = graph.output_node.name

    def reads(v: str) -> set[str]:
        roots = {storage[s] for s in deps[v] if s in storage}
        return roots.union(*(elements.get(r, ()) for r in list(roots)))

    def delta(v: str) -> tuple[int, int]:
        """(0, bytes added) for a node that lowers the live bytes, else (1, 0): the graph order decides."""
        if v == last:
            return (2, 0)                    # the output node runs last, after every dead value too
        made = sum(size.get(r, 0) for r in allocates.get(v, ())) if v not in skip else 0
        freed = sum(size.get(r, 0) for r in reads(v) if r not in held and readers.get(r) == {v})
        return (0, made - freed) if made < freed else (1, 0)

    indeg = {n: len(ds) for n, ds in deps.items()}
    version = dict.fromkeys(deps, 0)
    heap = [(*delta(n), pos[n], n, 0) for n, k in indeg.items() if k == 0]
    heapq.heapify(heap)
    order: list[str] = []
    while heap:
        *_, v, ver = heapq.heappop(heap)
        if ver != version[v] or indeg[v] < 0:
            continue
        indeg[v] = -1
        order.append(v)
        for r in reads(v):
            left = readers.get(r)
            if left is None:
                continue
            left.discard(v)
            if len(left) == 1:                       # its last reader now frees it: better priority
                (u,) = left
                if indeg.get(u) == 0:
                    version[u] += 1
                    heapq.heappush(heap, (*delta(u), pos[u], u, version[u]))
        for u in users[v]:
            indeg[u] -= 1
            if indeg[u] == 0:
                heapq.heappush(heap, (*delta(u), pos[u], u, version[u]))
    return [n for n in order if n in graph]


def reverse_memory_order(graph: Graph, *, fused: bool = False, grads: Iterable[tuple[str, str]] = ()) -> list[str]:
    """Every node of ``graph`` in a topological order built from the end backwards: of the nodes whose
    readers are all placed, the next placed (the one running just before them) is the one that adds the
    fewest bytes to what is live there -- its inputs that become live, less its outputs, which die
    before it.  Where :func:`memory_order` runs memory-freeing nodes early, this one runs allocating
    nodes late (a recomputation sinks to its first reader, a gradient's producer to just before its
    update).  Ties go to the node placed later in the graph; O(n log n) as :func:`memory_order`.
    """
    pb = _problem(graph, fused, grads)
    elements: dict[str, list[str]] = {}
    for e, t in pb.tuple_of.items():
        elements.setdefault(t, []).append(e)
    outside = {pb.storage[n] for n in pb.skip if n in pb.storage}     # inputs and parameters: never counted
    live = set(pb.held) - outside
    last = graph.output_node.name

    def reads(v: str) -> set[str]:
        roots = {pb.storage[s] for s in pb.deps[v] if s in pb.storage}
        return roots.union(*(elements.get(r, ()) for r in list(roots))) - outside

    def key(v: str) -> tuple[int, int, int]:
        if v == last or v in pb.skip:
            return (0 if v == last else 2, 0, -pb.pos[v])
        added = sum(pb.size.get(r, 0) for r in reads(v) if r not in live)
        freed = sum(pb.size.get(r, 0) for r in pb.allocates.get(v, ()) if r in live)
        return (1, added - freed, -pb.pos[v])

    waiting = {n: len(us) for n, us in pb.users.items()}
    version = dict.fromkeys(pb.deps, 0)
    heap = [(*key(n), n, 0) for n, k in waiting.items() if k == 0]
    heapq.heapify(heap)
    placed: list[str] = []
    while heap:
        *_, v, ver = heapq.heappop(heap)
        if ver != version[v] or waiting[v] < 0:
            continue
        waiting[v] = -1
        placed.append(v)
        fresh = reads(v) - live
        live.update(fresh)
        live.difference_update(pb.allocates.get(v, ()))
        for r in fresh:                     # a ready reader of a buffer now live adds less
            for u in pb.readers.get(r, ()):
                if waiting.get(u) == 0:
                    version[u] += 1
                    heapq.heappush(heap, (*key(u), u, version[u]))
        for d in pb.deps[v]:
            waiting[d] -= 1
            if waiting[d] == 0:
                heapq.heappush(heap, (*key(d), d, version[d]))
    return [n for n in reversed(placed) if n in graph]
