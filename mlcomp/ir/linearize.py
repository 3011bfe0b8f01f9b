"""Batched linears back to one matrix product: ``bmm`` against a weight broadcast over the batch.

``nn.Linear`` on a 3-D input that is not viewable as 2-D (a permuted activation, as
in ``nn.MultiheadAttention``'s input projection) decomposes to ``bmm`` with the weight
expanded over the batch.  Read that way the weight is no longer a layer's weight: an
ONNX exporter writes a 3-D ``MatMul`` against an ``Expand`` (which a runtime folds into a
``[B, K, N]`` constant, B copies of the weight), and ``quantize`` cannot fold it to int8.
:func:`linearize_batched_matmuls` writes it as one ``addmm`` on the input reshaped to 2-D
(the bias add included when it follows), the weight a plain parameter again.  Capture wraps
both operands in no-op ``view(expand(·))`` pairs; after ``cleanup`` they are gone, and
both forms match; the weight is ``permute(w, [1, 0])`` of a 2-D parameter or, once
``fold-constants`` has folded that transpose, the 2-D ``[K, N]`` parameter itself::

    before: %bmm = aten.bmm(%x, aten.expand(aten.permute(%w, [1,0]), [B,K,N]))
            %add = aten.add.Tensor(%bmm, %bias)
    after:  %add = aten.view(aten.addmm(%bias, aten.reshape(%x, [B*S,K]), permute(%w, [1,0])), [B,S,N])

The rewrite is an exact identity (the same sums in the same order per output element);
it takes over the replaced value's name.  One pass over the ``bmm`` nodes (O(n)).
"""
from __future__ import annotations

from typing import Any

from mlcomp.ir import Graph, Node, Ref, TensorMeta
from mlcomp.ir.builder import new_node, remove_dead, substitute
from mlcomp.ir.graph_tools import producer
from mlcomp.ir.ops import PARAM, aten

__all__ = ["linearize_batched_matmuls"]

_BMM, _VIEW, _EXPAND, _PERMUTE, _ADD = aten("bmm"), aten("view"), aten("expand"), aten("permute"), aten("add.Tensor")


def _batched_operand(graph: Graph, value: Any) -> Ref | None:
    """The 3-D value a ``bmm`` multiplies: ``x`` itself, or ``x`` for ``view(expand(x, s), s)`` where both keep
    ``x``'s shape (how matmul broadcasts before cleanup drops the no-op pair)."""
    if not isinstance(value, Ref):
        return None
    view = producer(graph, value, _VIEW)
    expand = view and producer(graph, view.inputs[0], _EXPAND)
    source = expand and producer(graph, expand.inputs[0])
    if source is not None:
        shape = tuple(source.tensor_meta.shape)
        if tuple(expand.inputs[1]) == shape and tuple(view.inputs[1]) == shape:
            return expand.inputs[0]
    meta = graph.node(value.name).meta
    return value if isinstance(meta, TensorMeta) and len(meta.shape) == 3 else None


def _weight_2d(graph: Graph, value: Any) -> Node | None:
    """The ``[K, N]`` weight node: ``permute(w, [1, 0])`` of a 2-D parameter, or a 2-D parameter."""
    node = producer(graph, value)
    if node is None or not isinstance(node.meta, TensorMeta) or len(node.meta.shape) != 2:
        return None
    if node.op == PARAM:
        return node
    if node.op == _PERMUTE and list(node.inputs[1]) == [1, 0] and producer(graph, node.inputs[0], PARAM) is not None:
        return node
    return None


def _broadcast_weight(graph: Graph, value: Any) -> Ref | None:
    """The 2-D ``[K, N]`` weight for ``[view](expand(weight, [B,K,N]), [B,K,N])`` (the no-op view is gone after
    cleanup)."""
    view = producer(graph, value, _VIEW)
    expand = producer(graph, view.inputs[0], _EXPAND) if view is not None else producer(graph, value, _EXPAND)
    weight = _weight_2d(graph, expand.inputs[0]) if expand is not None else None
    if weight is None:
        return None
    k, n = weight.tensor_meta.shape
    target = tuple(expand.inputs[1])
    if len(target) != 3 or target[1:] != (k, n) or (view is not None and tuple(view.inputs[1]) != target):
        return None
    return Ref(weight.name)


def _sole_user(graph: Graph, name: str) -> Node | None:
    users = graph.users(name)
    return users[0] if len(users) == 1 else None


def _bias_add(graph: Graph, out: Node, n: int) -> tuple[Node | None, Any]:
    """The add of a 1-D ``[n]`` parameter that is ``out``'s only reader, and that parameter; else ``(None, None)``."""
    add = _sole_user(graph, out.name)
    if add is None or add.op != _ADD or len(add.inputs) != 2 or add.inputs[0] != Ref(out.name):
        return None, None
    other = add.inputs[1]
    node = producer(graph, other, PARAM)
    if node is not None and tuple(node.tensor_meta.shape) == (n,):
        return add, other
    return None, None


def linearize_batched_matmuls(graph: Graph) -> int:
    """Rewrite ``bmm`` against a broadcast 2-D weight (plus its bias add) as ``addmm``/``mm``; returns the count."""
    done = 0
    for bmm in graph.nodes(_BMM):
        x = _batched_operand(graph, bmm.inputs[0])
        w_t = _broadcast_weight(graph, bmm.inputs[1])
        if x is None or w_t is None or not isinstance(bmm.meta, TensorMeta):
            continue
        batch, rows, k = graph.node(x.name).tensor_meta.shape
        n = bmm.tensor_meta.shape[2]
        if any(not isinstance(d, int) for d in (batch, rows, k, n)):
            continue           # symbolic sizes: leave it to the exporter
        out = bmm              # the product, or the no-op view of it that capture leaves
        view = _sole_user(graph, bmm.name)
        if view is not None and view.op == _VIEW and tuple(view.inputs[1]) == (batch, rows, n):
            out = view
        add, bias = _bias_add(graph, out, n)
        stale = [out.name, bmm.name, *bmm.input_names()]
        flat = new_node(graph, aten("reshape"), [x, [batch * rows, k]], name=f"{bmm.name}_flat",
                        origin=bmm.origin, before=bmm.name)
        if bias is not None:
            mm = new_node(graph, aten("addmm"), [bias, Ref(flat.name), w_t], name=f"{bmm.name}_addmm",
                          origin=bmm.origin, before=bmm.name)
            substitute(graph, add.name, _VIEW, [Ref(mm.name), [batch, rows, n]], origin=add.origin)
        else:
            mm = new_node(graph, aten("mm"), [Ref(flat.name), w_t], name=f"{bmm.name}_mm",
                          origin=bmm.origin, before=bmm.name)
            substitute(graph, out.name, _VIEW, [Ref(mm.name), [batch, rows, n]], origin=out.origin)
        remove_dead(graph, stale)
        done += 1
    return done
