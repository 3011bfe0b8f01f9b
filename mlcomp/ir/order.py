"""The node order of a :class:`~mlcomp.ir.graph.Graph`: a linked list with order labels.

Every node name sits in a doubly linked list and carries an integer *label*
that grows along the list, so "is ``a`` before ``b``" is one comparison and
inserting before or after any node is O(1) amortised::

    >>> order = NodeOrder()
    >>> for name in ("x", "relu", "out"):
    ...     order.append(name)
    >>> order.insert_before("neg", "relu")      # before: x relu out
    >>> list(order)                             # after:  x neg relu out
    ['x', 'neg', 'relu', 'out']
    >>> order.precedes("neg", "relu")
    True

A new label is the midpoint of its neighbours' labels.  When two neighbours
have no integer between them, the smallest enclosing aligned label range whose
density is below a threshold that tightens with the range size is spread out
evenly (the order-maintenance scheme of Bender, Cole, Demaine, Farach-Colton
and Zito), which costs O(log n) label writes per insertion amortised, however
many nodes are inserted at the same place.  Appends step far past the last
label, so building a graph front to back never relabels.

:func:`topo_repair` re-sorts one contiguous span of the list topologically
(ties broken by the current order); the graph uses it when an edit made a node
read a value that sits later in the list.
"""
from __future__ import annotations

import heapq
from typing import Callable, Iterable, Iterator

__all__ = ["NodeOrder", "topo_repair"]

_UNIVERSE_BITS = 64            # labels live in [0, 2**64)
_APPEND_STEP = 1 << 24         # gap left after the last node by an append
_DENSITY = 1.3                 # a range of 2**i labels may hold (2 / _DENSITY)**i nodes


class NodeOrder:
    """Names in a linked list, each with an integer label increasing along the list."""

    def __init__(self) -> None:
        self._prev: dict[str, str | None] = {}
        self._next: dict[str, str | None] = {}
        self._label: dict[str, int] = {}
        self.head: str | None = None
        self.tail: str | None = None
        self.relabelled = 0    # labels rewritten by spreading (work counter, for tests and benchmarks)

    # -- queries ------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._label)

    def __contains__(self, name: object) -> bool:
        return name in self._label

    def __iter__(self) -> Iterator[str]:
        return self.walk(self.head)

    def walk(self, start: str | None, stop: str | None = None) -> Iterator[str]:
        """Names from ``start`` on (to ``stop`` inclusive, or to the end)."""
        name = start
        while name is not None:
            yield name
            if name == stop:
                return
            name = self._next[name]

    def label(self, name: str) -> int:
        return self._label[name]

    def precedes(self, a: str, b: str) -> bool:
        """True if ``a`` sits before ``b``."""
        return self._label[a] < self._label[b]

    def prev(self, name: str) -> str | None:
        return self._prev[name]

    def next(self, name: str) -> str | None:
        return self._next[name]

    # -- edits --------------------------------------------------------------
    def append(self, name: str) -> None:
        last = self.tail
        label = 0 if last is None else self._label[last] + _APPEND_STEP
        if label >> _UNIVERSE_BITS:
            self._spread(last)
            label = self._label[last] + (((1 << _UNIVERSE_BITS) - self._label[last]) >> 1)
        self._link(name, last, None, label)

    def insert_before(self, name: str, anchor: str) -> None:
        prev = self._prev[anchor]
        low = -1 if prev is None else self._label[prev]
        if self._label[anchor] - low < 2:
            self._spread(anchor)
            low = -1 if prev is None else self._label[prev]
        self._link(name, prev, anchor, (low + self._label[anchor]) >> 1)

    def remove(self, name: str) -> None:
        prev, nxt = self._prev.pop(name), self._next.pop(name)
        del self._label[name]
        if prev is None:
            self.head = nxt
        else:
            self._next[prev] = nxt
        if nxt is None:
            self.tail = prev
        else:
            self._prev[nxt] = prev

    def copy(self) -> "NodeOrder":
        new = NodeOrder()
        new._prev, new._next, new._label = dict(self._prev), dict(self._next), dict(self._label)
        new.head, new.tail = self.head, self.tail
        return new

    def rearrange(self, span: list[str], new_order: list[str]) -> None:
        """Put the names of the contiguous ``span`` (in list order) into ``new_order``, in place."""
        labels = [self._label[n] for n in span]
        before, after = self._prev[span[0]], self._next[span[-1]]
        prev = before
        for name, label in zip(new_order, labels):
            self._label[name] = label
            self._prev[name] = prev
            if prev is None:
                self.head = name
            else:
                self._next[prev] = name
            prev = name
        self._next[prev] = after  # type: ignore[index]
        if after is None:
            self.tail = prev
        else:
            self._prev[after] = prev

    # -- internals ------------------------------------------------------------
    def _link(self, name: str, prev: str | None, nxt: str | None, label: int) -> None:
        self._prev[name], self._next[name], self._label[name] = prev, nxt, label
        if prev is None:
            self.head = name
        else:
            self._next[prev] = name
        if nxt is None:
            self.tail = name
        else:
            self._prev[nxt] = name

    def _spread(self, pivot: str) -> None:
        """Relabel the smallest sparse-enough aligned range around ``pivot``: gaps of 2 or more on both sides."""
        base = self._label[pivot]
        first = last = pivot
        count = 1
        for bits in range(1, _UNIVERSE_BITS + 1):
            size = 1 << bits
            lo = (base >> bits) << bits
            hi = lo + size
            while (p := self._prev[first]) is not None and self._label[p] >= lo:
                first, count = p, count + 1
            while (n := self._next[last]) is not None and self._label[n] < hi:
                last, count = n, count + 1
            step = size // (count + 1)
            if step >= 2 and (count + 1 <= (2 / _DENSITY) ** bits or bits == _UNIVERSE_BITS):
                label = lo
                for name in self.walk(first, last):
                    label += step
                    self._label[name] = label
                self.relabelled += count
                return
        raise OverflowError("node order labels exhausted")  # pragma: no cover - needs ~1e11 nodes


def topo_repair(order: NodeOrder, first: str, last: str,
                inputs_of: Callable[[str], Iterable[str]]) -> list[str] | None:
    """Sort the span ``first``..``last`` topologically, ties broken by the current order.

    Every edge that points backwards in the list must lie inside the span; then
    the span's nodes only wait on each other, and the result equals a full
    lexicographic topological sort keyed by list position.  Returns the names
    left over when the span holds a cycle (the list is then unchanged), else ``None``.
    """
    span = list(order.walk(first, last))
    index = {n: i for i, n in enumerate(span)}
    waits = [0] * len(span)
    users: list[list[int]] = [[] for _ in span]
    for i, name in enumerate(span):
        for src in inputs_of(name):
            j = index.get(src)
            if j is not None:
                waits[i] += 1
                users[j].append(i)
    ready = [i for i, w in enumerate(waits) if w == 0]
    heapq.heapify(ready)
    out: list[str] = []
    while ready:
        i = heapq.heappop(ready)
        out.append(span[i])
        for j in users[i]:
            waits[j] -= 1
            if waits[j] == 0:
                heapq.heappush(ready, j)
    if len(out) < len(span):
        done = set(out)
        return [n for n in span if n not in done]
    order.rearrange(span, out)
    return None
