"""Dynamo's symbolic sizes in a region's graph: named after their dimension, with example values.

Dynamo names each symbolic size after the order it met it (``s0``, ``s27``; ``u0`` for an
unbacked one, :func:`torch._dynamo.decorators.mark_unbacked`).  Before a region's graph goes
through the pipeline, each such symbol that is a whole dimension of an input is renamed after
that dimension, so the manifest, the report and ``explain`` say ``batch`` and ``seq``:

* the backend's ``dynamic=`` option names them (``"batch,seq=8..512"``,
  :func:`mlcomp.frontend.dynamic.parse_dynamic`: the entry whose dimension it is, its range
  intersected with the one Dynamo proved);
* otherwise :data:`DIMENSION_NAMES` does, by the input's rank and the dimension.

A name two different symbols would take goes to the first; the second gets a suffix
(``batch_2``), since two inputs' batch sizes Dynamo kept apart may differ.  A symbol that is
not a whole dimension (``s0*s1``) keeps torch's name inside the renamed expression.

    >>> from mlcomp.ir import Graph, Node, TensorMeta
    >>> from mlcomp.ir.ops import INPUT
    >>> g = Graph("g")
    >>> _ = g.add(Node("ids", INPUT, meta=TensorMeta(("s0", "s1"), torch.int64)))
    >>> g.symbols, g.ranges = {"s0": 2, "s1": 16}, {"s0": SizeRange(2), "s1": SizeRange(2, 512)}
    >>> g = name_dimensions(g, ())
    >>> g.input_nodes[0].tensor_meta.shape, sorted(g.ranges.items())
    (('batch', 'seq'), [('batch', SizeRange(lo=2, hi=None)), ('seq', SizeRange(lo=2, hi=512))])

Unbacked sizes carry no example value; :func:`bind_examples` takes it from the region's real
inputs, so the pipeline's shape checks and verification run at the size of the compiling call.
"""
from __future__ import annotations

import re
from typing import Any, Sequence

import torch

from mlcomp.frontend.dynamic import DynamicDim, rename_graph_symbols
from mlcomp.ir import Graph
from mlcomp.ir.symbols import SizeRange, bind

__all__ = ["DIMENSION_NAMES", "bind_examples", "name_dimensions"]

# (rank of the input, dimension) -> the name of a symbolic size there; rank None: any rank
DIMENSION_NAMES: dict[tuple[int | None, int], str] = {
    (None, 0): "batch",
    (2, 1): "seq", (3, 1): "seq",                  # token ids (batch, seq); embeddings (batch, seq, hidden)
    (4, 2): "height", (4, 3): "width",             # images, NCHW
    (5, 2): "depth", (5, 3): "height", (5, 4): "width",
}
TORCH_SYMBOL = re.compile(r"[su]\d+")             # the names Dynamo's shape environment gives


def bind_examples(graph: Graph, inputs: Sequence[Any]) -> Graph:
    """``graph`` with each symbol of its inputs that has no example value bound to its size in ``inputs``."""
    shapes = [n.tensor_meta.shape for n in graph.input_nodes]
    sizes = [tuple(t.shape) if isinstance(t, torch.Tensor) else () for t in inputs]
    for name, size in bind(shapes, sizes).items():
        graph.symbols.setdefault(name, size)
    return graph


def name_dimensions(graph: Graph, dims: Sequence[DynamicDim]) -> Graph:
    """``graph`` with Dynamo's symbols renamed after the dimension of an input they are (see the module)."""
    chosen: dict[str, str] = {}
    base: dict[str, str] = {}
    taken: set[str] = set(graph.ranges) | set(graph.symbols)
    for node in graph.input_nodes:
        shape = node.tensor_meta.shape
        for axis, size in enumerate(shape):
            if not (isinstance(size, str) and TORCH_SYMBOL.fullmatch(size)) or size in chosen:
                continue
            wanted = _wanted(dims, len(shape), axis)
            if wanted is None:
                continue
            name, k = wanted, 2
            while name in taken:
                name, k = f"{wanted}_{k}", k + 1
            chosen[size], base[size] = name, wanted
            taken.add(name)
    if not chosen:
        return graph
    proved = {old: graph.ranges.get(old, SizeRange(0)) for old in chosen}
    renamed = rename_graph_symbols(graph, chosen)
    for old, new in chosen.items():
        given = next((d.range for d in dims if d.name == base[old]), None)
        renamed.ranges[new] = _intersect(proved[old], given) if given is not None else proved[old]
    return renamed


def _wanted(dims: Sequence[DynamicDim], rank: int, axis: int) -> str | None:
    given = next((d.name for d in dims if d.dim == axis), None)
    return given or DIMENSION_NAMES.get((rank, axis), DIMENSION_NAMES.get((None, axis)))


def _intersect(a: SizeRange, b: SizeRange) -> SizeRange:
    hi = b.hi if a.hi is None else a.hi if b.hi is None else min(a.hi, b.hi)
    lo = max(a.lo, b.lo)
    return SizeRange(lo, max(hi, lo) if hi is not None else None)
