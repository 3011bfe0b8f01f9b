"""Products the cpu target hands TorchScript as ``aten::linear``, so its executor keeps eager's fused GEMM.

TorchScript's graph executor decomposes every ``aten::addmm`` whose ``alpha`` and ``beta`` are 1 into
``aten::mm`` + ``aten::add`` when it optimises a frozen graph (a rewrite meant for its own fusers): the
bias then costs a second pass over the product, a fresh buffer and a kernel call.  ``aten::linear``
is left alone and runs the very ``addmm`` (bias in the GEMM) eager runs.  So, before tracing, a
product of the input with a transposed 2-D tensor and a 1-D bias is written as a linear of the
untransposed tensor — the same numbers, one kernel::

    before:  %permute_1 = aten.permute.default(%w, [1, 0])
             %addmm = aten.addmm.default(%b, %x, %permute_1)
    after:   %addmm = aten.linear.default(%x, %w, %b)

:data:`TRANSPOSES` says which producers of ``mat2`` name a weight transposed (rules as data).  One
pass over the nodes; the caller's graph is never modified (a copy is, when anything changes).
"""
from __future__ import annotations

from typing import Any, Callable

from mlcomp.ir import Graph, TensorMeta
from mlcomp.ir.builder import remove_dead
from mlcomp.ir.node import Node, Ref
from mlcomp.ir.ops import aten

__all__ = ["TRANSPOSES", "addmm_as_linear"]

_ADDMM, _LINEAR = aten("addmm"), aten("linear")
# op of mat2's producer -> whether that node is its 2-D input transposed (its arguments after the input)
TRANSPOSES: dict[Any, Callable[[tuple[Any, ...]], bool]] = {
    aten("t"): lambda args: True,
    aten("permute"): lambda args: bool(args) and list(args[0]) == [1, 0],
    aten("transpose", "int"): lambda args: len(args) == 2 and sorted(int(a) % 2 for a in args) == [0, 1],
}


def _weight(graph: Graph, mat2: Any) -> Ref | None:
    """The 2-D tensor that ``mat2`` transposes, or None."""
    if not isinstance(mat2, Ref):
        return None
    node = graph.node(mat2.name)
    rule = TRANSPOSES.get(node.op)
    if rule is None or not node.inputs or not isinstance(node.inputs[0], Ref) or not rule(node.inputs[1:]):
        return None
    source = graph.node(node.inputs[0].name).meta
    return node.inputs[0] if isinstance(source, TensorMeta) and len(source.shape) == 2 else None


def _as_linear(graph: Graph, node: Node) -> Node | None:
    if node.attrs.get("beta", 1) != 1 or node.attrs.get("alpha", 1) != 1 or len(node.inputs) != 3:
        return None
    bias, x, mat2 = node.inputs
    weight = _weight(graph, mat2)
    meta = graph.node(bias.name).meta if isinstance(bias, Ref) else None
    if weight is None or not isinstance(meta, TensorMeta) or len(meta.shape) != 1:
        return None
    return node.with_(op=_LINEAR, inputs=(x, weight, bias), attrs={})


def addmm_as_linear(graph: Graph) -> Graph:
    """``graph``, or a copy with each ``addmm(b, x, wᵀ)`` (1-D ``b``, alpha = beta = 1) as ``linear(x, w, b)``."""
    found = [(n, new) for n in graph.nodes_of(_ADDMM) if (new := _as_linear(graph, n)) is not None]
    if not found:
        return graph
    graph = graph.copy()
    for _, new in found:
        graph.replace(new)
    remove_dead(graph, [n.inputs[2].name for n, _ in found])
    return graph
