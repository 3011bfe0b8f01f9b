"""The graph the ``onnxruntime`` target exports: core ATen rewritten into what ORT's fusions match.

Capture leaves some layers in shapes that a direct ``torch.onnx.export`` of the
eager module never has, and ORT's optimiser then cannot fuse them.
:func:`ort_friendly` rewrites them on a copy of the graph before export:

* **unrolled RNN layers** (:mod:`mlcomp.targets.onnx_recompose`): one ONNX ``GRU``;
* **batched linear** — ``nn.Linear`` on a 3-D input that is not viewable as 2-D
  decomposes to ``bmm`` with the weight broadcast over the batch (ONNX: a 3-D
  ``MatMul`` against an expanded weight, then ``Add``).  It becomes one ``addmm``
  on the input reshaped to 2-D (ONNX ``Gemm``, bias included, the weight an
  initializer)::

      before: %bmm = aten.bmm(view(expand(%x, [B,S,K])), view(expand(permute(%w, [1,0]), [B,K,N])))
              %add = aten.add.Tensor(aten.view(%bmm, [B,S,N]), %bias)
      after:  %add = aten.view(aten.addmm(%bias, aten.reshape(%x, [B*S,K]), permute(%w, [1,0])), [B,S,N])

* **safe softmax** — attention's ``_safe_softmax`` guard (rows that are all
  ``-inf`` give 0, not NaN) decomposes to eq/not/any/not/full_like/where (ONNX:
  Equal, Not, Cast, ReduceMax, Not, Where).  The same value is ``max(x) == -inf``::

      before: %where_1 = where(not(any(not(eq(%x, -inf)), -1, True)), full_like(%sm, 0), %sm)
      after:  %where_1 = where(eq(amax(%x, [-1], True), -inf), scalar_tensor(0.0), %sm)

Each rewrite computes the value it replaces (it takes over that value's name).
The rewritten graph must reproduce the original on the example inputs, else the
original is exported and the stats say so.  Every rewrite is one pass over the
nodes (O(n)).
"""
from __future__ import annotations

from typing import Any

import torch

from mlcomp.ir import Graph, Node, Ref, TensorMeta
from mlcomp.ir.builder import new_node, remove_dead, substitute
from mlcomp.ir.ops import PARAM, aten
from mlcomp.targets.codegen import to_fx
from mlcomp.targets.onnx_recompose import RecomposeStats, recompose_rnns

__all__ = ["cheap_safe_softmax", "linearize_batched_matmuls", "ort_friendly"]

_BMM, _VIEW, _EXPAND, _PERMUTE, _ADD = aten("bmm"), aten("view"), aten("expand"), aten("permute"), aten("add.Tensor")
_WHERE, _NOT, _ANY, _EQ = aten("where.self"), aten("logical_not"), aten("any.dim"), aten("eq.Scalar")


def _producer(graph: Graph, value: Any, op: Any) -> Node | None:
    """The node behind ``value`` if it is a Ref produced by ``op``."""
    if not isinstance(value, Ref):
        return None
    node = graph.node(value.name)
    return node if node.op == op else None


def _noop_view(graph: Graph, value: Any) -> Ref | None:
    """``x`` for ``view(expand(x, s), s)`` where both keep ``x``'s shape (how matmul broadcasts)."""
    view = _producer(graph, value, _VIEW)
    expand = view and _producer(graph, view.inputs[0], _EXPAND)
    if expand is None:
        return None
    base = expand.inputs[0]
    shape = tuple(graph.node(base.name).tensor_meta.shape) if isinstance(base, Ref) else None
    if shape is None or tuple(expand.inputs[1]) != shape or tuple(view.inputs[1]) != shape:
        return None
    return base


def _broadcast_weight(graph: Graph, value: Any) -> Ref | None:
    """``permute(w)`` for ``view(expand(permute(w, [1,0]), [B,K,N]), [B,K,N])``, ``w`` a 2-D parameter."""
    view = _producer(graph, value, _VIEW)
    expand = view and _producer(graph, view.inputs[0], _EXPAND)
    permute = expand and _producer(graph, expand.inputs[0], _PERMUTE)
    if permute is None or list(permute.inputs[1]) != [1, 0] or graph.node(permute.inputs[0].name).op != PARAM:
        return None
    k, n = permute.tensor_meta.shape
    target = tuple(expand.inputs[1])
    if len(target) != 3 or target[1:] != (k, n) or tuple(view.inputs[1]) != target:
        return None
    return Ref(permute.name)


def _sole_user(graph: Graph, name: str) -> Node | None:
    users = graph.users(name)
    return users[0] if len(users) == 1 else None


def linearize_batched_matmuls(graph: Graph) -> int:
    """Rewrite ``bmm`` against a broadcast 2-D weight (plus its bias add) as ``addmm``; returns the count."""
    done = 0
    for bmm in graph.nodes(_BMM):
        x = _noop_view(graph, bmm.inputs[0])
        w_t = _broadcast_weight(graph, bmm.inputs[1])
        view = _sole_user(graph, bmm.name)
        if x is None or w_t is None or view is None or view.op != _VIEW or not isinstance(bmm.meta, TensorMeta):
            continue
        batch, rows, k = graph.node(x.name).tensor_meta.shape
        n = bmm.tensor_meta.shape[2]
        if any(not isinstance(d, int) for d in (batch, rows, k, n)):
            continue           # symbolic sizes: leave it to the exporter
        add = _sole_user(graph, view.name)
        bias = None
        if add is not None and add.op == _ADD and len(add.inputs) == 2 and add.inputs[0] == Ref(view.name):
            other = add.inputs[1]
            node = graph.node(other.name) if isinstance(other, Ref) else None
            if node is not None and node.op == PARAM and tuple(node.tensor_meta.shape) == (n,):
                bias = other
        flat = new_node(graph, aten("reshape"), [x, [batch * rows, k]], name=f"{bmm.name}_flat",
                        origin=bmm.origin, before=bmm.name)
        if bias is not None:
            mm = new_node(graph, aten("addmm"), [bias, Ref(flat.name), w_t], name=f"{bmm.name}_addmm",
                          origin=bmm.origin, before=bmm.name)
            substitute(graph, add.name, _VIEW, [Ref(mm.name), [batch, rows, n]], origin=add.origin)
        else:
            mm = new_node(graph, aten("mm"), [Ref(flat.name), w_t], name=f"{bmm.name}_mm",
                          origin=bmm.origin, before=bmm.name)
            substitute(graph, view.name, _VIEW, [Ref(mm.name), [batch, rows, n]], origin=view.origin)
        remove_dead(graph, [view.name, bmm.name])
        done += 1
    return done


def cheap_safe_softmax(graph: Graph) -> int:
    """Rewrite the ``_safe_softmax`` guard as ``amax(x) == -inf``; returns the count."""
    done = 0
    for where in graph.nodes(_WHERE):
        cond, zeros, soft = where.inputs
        not_any = _producer(graph, cond, _NOT)
        any_ = not_any and _producer(graph, not_any.inputs[0], _ANY)
        not_eq = any_ and _producer(graph, any_.inputs[0], _NOT)
        eq = not_eq and _producer(graph, not_eq.inputs[0], _EQ)
        full = _producer(graph, zeros, aten("full_like"))
        sm = _producer(graph, soft, aten("_softmax"))
        if eq is None or full is None or sm is None or eq.inputs[1] != float("-inf") or full.inputs[1] != 0:
            continue
        dim, keep = any_.inputs[1], any_.inputs[2] if len(any_.inputs) > 2 else False
        if eq.inputs[0] != sm.inputs[0] or full.inputs[0] != soft or not keep or dim != sm.inputs[1]:
            continue
        dtype = where.tensor_meta.dtype
        peak = new_node(graph, aten("amax"), [eq.inputs[0], [dim], True], name=f"{where.name}_max",
                        origin=where.origin, before=not_any.name)
        substitute(graph, not_any.name, _EQ, [Ref(peak.name), float("-inf")], origin=not_any.origin)
        zero = new_node(graph, aten("scalar_tensor"), [0.0], {"dtype": dtype}, name=f"{where.name}_zero",
                        origin=where.origin, before=where.name)
        substitute(graph, where.name, _WHERE, [cond, Ref(zero.name), soft], origin=where.origin)
        remove_dead(graph, [any_.name, full.name])
        done += 1
    return done


def _outputs(graph: Graph, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return tuple(to_fx(graph).eval()(*inputs))


def ort_friendly(graph: Graph, inputs: tuple[torch.Tensor, ...] | None = None) -> tuple[Graph, RecomposeStats]:
    """``graph`` rewritten for ORT (a copy; ``graph`` itself is unchanged) and what was rewritten.

    With ``inputs``, the result is kept only if it reproduces ``graph`` on them.
    """
    stats = RecomposeStats(nodes_before=len(graph.order()))
    out = graph.copy()
    recompose_rnns(out, stats)
    stats.rewrites = {"batched_linear": linearize_batched_matmuls(out), "safe_softmax": cheap_safe_softmax(out)}
    if stats.changed and inputs is not None:
        expected, actual = _outputs(graph, inputs), _outputs(out, inputs)
        if not all(torch.allclose(a, e, rtol=1e-4, atol=1e-5, equal_nan=True) for a, e in zip(actual, expected)):
            stats.skipped["graph"] = "the rewritten graph did not reproduce the original; exported unchanged"
            stats.recomposed, stats.rewrites = [], {}
            out = graph
    if not stats.changed:
        out = graph
    stats.nodes_after = len(out.order())
    return out, stats
