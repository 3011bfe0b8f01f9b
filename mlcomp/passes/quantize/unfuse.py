"""Fused groups put back as their ops, so ``quantize`` sees every convolution, matrix product and add.

``fuse`` (in ``-O2``) turns a convolution and its ReLU into one composite node whose body
is a small graph (:func:`mlcomp.ir.composites.fused_body`); an int8 runtime needs the
quantize/dequantize pairs *between* those ops.  :func:`inline_fused` splices each body
back in place of its node: the rewrites fusion made that change ops (batch norm folded
into the weights, layer norm and GELU recomposed, attention as one op) stay, only the
grouping goes.  Before/after::

    %relu = mlcomp.fused_convolution_relu_9ee7(%x, %w, %b)
                 ↓ inline_fused
    %convolution = aten.convolution.default(%x, %w, %b, ...)
    %relu = aten.relu.default(%convolution)

The ops of a group carry the group's origin (its convolution's module path): fusion kept no other.

O(nodes + body nodes).
"""
from __future__ import annotations

from mlcomp.ir import Graph, Node, Ref, map_refs
from mlcomp.ir.builder import rename
from mlcomp.ir.composites import fused_body
from mlcomp.ir.ops import GETITEM

__all__ = ["inline_fused"]


def inline_fused(graph: Graph) -> int:
    """Replace every fused node of ``graph`` by its body's nodes; the number of nodes inlined."""
    count = 0
    for node in list(graph.call_nodes()):
        body = fused_body(node.op)
        if body is not None:
            _inline(graph, node, body)
            count += 1
    return count


def _inline(graph: Graph, node: Node, body: Graph) -> None:
    local: dict[str, Ref] = {i.name: arg for i, arg in zip(body.input_nodes, node.inputs)}

    def outer(r: Ref) -> Ref:
        return local[r.name]

    for inner in body.call_nodes():
        added = graph.add(inner.with_(name=graph.fresh_name(inner.op.name.split(".")[0]),
                                      inputs=map_refs(inner.inputs, outer), attrs=map_refs(dict(inner.attrs), outer),
                                      origin=node.origin), before=node.name)
        local[inner.name] = Ref(added.name)
    outs = [local[r.name] for r in body.output_refs]
    if len(outs) == 1:
        graph.replace_all_uses(node.name, outs[0])
        graph.erase(node.name)
        rename(graph, outs[0].name, node.name)      # the value keeps the name later passes and users know
        return
    for user in graph.users(node.name):
        if user.op == GETITEM:
            graph.replace_all_uses(user.name, outs[user.inputs[1]])
            graph.erase(user.name)
            rename(graph, outs[user.inputs[1]].name, user.name)
    graph.erase(node.name)
