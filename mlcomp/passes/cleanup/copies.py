"""Copies a training graph does not need: a clone that keeps its input's layout, of a buffer an op computed.

A dropout with ``p=0`` (dropout turned off for a deterministic training step) is
decomposed at capture into ``clone`` of its input; eager's ``dropout`` returns the
input itself.  In a joint graph each such copy is a buffer as large as the
activation it copies, saved for the backward or recomputed next to it::

    %relu: f32[32, 128, 1024] = aten.relu.default(%view_12)
    %clone_3: f32[32, 128, 1024] = aten.clone.default(%relu)      # 16 MiB, the same values
    %view_13 = aten.view.default(%clone_3, [4096, 1024])

becomes ``%view_13 = aten.view.default(%relu, [4096, 1024])``.  The clone is
dropped only when the result is the same tensor -- same values, same strides --
so every kernel after it sees what it saw before and gradients stay bit-identical:
no memory format asked for (``preserve_format`` keeps a dense tensor's strides),
its input reached through views that keep a tensor dense (reshapes, permutes,
squeezes) from an op's freshly computed buffer (not an input or parameter, not a
slice or an expand), and no in-place op writes either one, and neither is a graph
output (two outputs would share a buffer).
"""
from __future__ import annotations

import torch

from mlcomp.ir import Graph, Node
from mlcomp.ir.ops import INPUT, PARAM
from mlcomp.passes import patterns as P

__all__ = ["DENSE_VIEWS", "training_copy"]

DENSE_VIEWS = P.SHAPE_OPS | P.PERMUTE_OPS | P.SQUEEZE_OPS | frozenset({P.UNSQUEEZE, P.ALIAS})   # dense in, dense out


def _computed(graph: Graph, name: str, outputs: set[str]) -> Node | None:
    """The op that computed ``name``'s buffer through dense-keeping views (``None``: an input, a parameter,
    another view, or a graph output on the way)."""
    node = graph.node(name)
    while node.op in DENSE_VIEWS:
        if node.name in outputs:
            return None
        node = graph.node(node.inputs[0].name)
    if node.op in (INPUT, PARAM) or node.op in P.VIEW_LIKE or node.name in outputs:
        return None
    return node


def _written(graph: Graph, name: str) -> bool:
    """Whether an in-place op (``copy_``, ``add_``, ...) reads ``name``."""
    return any(u.op.name.endswith("_") and not u.op.name.startswith("_") for u in graph.users(name))


def training_copy(graph: Graph, node: Node) -> bool:
    """Drop ``node`` when it is a clone that gives back the same tensor (module doc); whether it did."""
    if node.op != P.CLONE or node.attrs.get("memory_format", torch.preserve_format) != torch.preserve_format:
        return False
    outputs = {r.name for r in graph.output_refs}
    source = node.inputs[0].name
    if node.name in outputs or _computed(graph, source, outputs) is None:
        return False
    if _written(graph, node.name) or _written(graph, source):
        return False
    graph.replace_all_uses(node.name, node.inputs[0])
    graph.erase(node.name)
    return True
