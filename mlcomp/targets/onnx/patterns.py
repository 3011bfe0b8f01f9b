"""The graph the ``onnxruntime`` target exports: core ATen rewritten into what ORT's fusions match.

Capture leaves some layers in shapes that a direct ``torch.onnx.export`` of the
eager module never has, and ORT's optimiser then cannot fuse them.
:func:`ort_friendly` rewrites them on a copy of the graph before export:

* **unrolled RNN layers** (:mod:`mlcomp.targets.onnx.recompose`): one ONNX ``GRU``;
* **batched linear** — ``nn.Linear`` on a 3-D input that is not viewable as 2-D
  decomposes to ``bmm`` with the weight broadcast over the batch (ONNX: a 3-D
  ``MatMul`` against an expanded weight, which ORT folds into a ``[B, K, N]``
  initializer, then ``Add``).  It becomes one ``addmm`` on the input reshaped to
  2-D (ONNX ``Gemm``, bias included, the weight an initializer).  Capture wraps
  both operands in no-op ``view(expand(·))`` pairs; after ``cleanup`` (-O2) they
  are gone, and both forms match::

      before: %bmm = aten.bmm(%x, aten.expand(aten.permute(%w, [1,0]), [B,K,N]))
              %add = aten.add.Tensor(%bmm, %bias)
      after:  %add = aten.view(aten.addmm(%bias, aten.reshape(%x, [B*S,K]), permute(%w, [1,0])), [B,S,N])

* **safe softmax** — attention's ``_safe_softmax`` guard (rows that are all
  ``-inf`` give 0, not NaN) decomposes to eq/not/any/not/full_like/where (ONNX:
  Equal, Not, Cast, ReduceMax, Not, Where: a row reduction that costs ORT as much
  as the softmax).  It becomes the guard torch.onnx emits for SDPA (IsNaN, Where)::

      before: %where_1 = where(not(any(not(eq(%x, -inf)), -1, True)), full_like(%sm, 0), %sm)
      after:  %where_1 = where(isnan(%sm), scalar_tensor(0.0), %sm)

  An all ``-inf`` row is NaN after softmax, so both give 0 there and are equal
  wherever the guard's value is not NaN; a row holding NaN or ``+inf`` (NaN for
  the guard) gives 0 — what plain ``torch.onnx.export`` + ORT computes too.

Each rewrite computes the value it replaces (it takes over that value's name;
the safe softmax wherever that value is not NaN).
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
from mlcomp.runtime.codegen import to_fx
from mlcomp.targets.onnx.recompose import RecomposeStats, recompose_rnns

__all__ = ["cheap_safe_softmax", "linearize_batched_matmuls", "ort_friendly"]

_BMM, _VIEW, _EXPAND, _PERMUTE, _ADD = aten("bmm"), aten("view"), aten("expand"), aten("permute"), aten("add.Tensor")
_WHERE, _NOT, _ANY, _EQ = aten("where.self"), aten("logical_not"), aten("any.dim"), aten("eq.Scalar")


def _producer(graph: Graph, value: Any, op: Any) -> Node | None:
    """The node behind ``value`` if it is a Ref produced by ``op``."""
    if not isinstance(value, Ref):
        return None
    node = graph.node(value.name)
    return node if node.op == op else None


def _batched_operand(graph: Graph, value: Any) -> Ref | None:
    """The 3-D value a ``bmm`` multiplies: ``x`` itself, or ``x`` for ``view(expand(x, s), s)`` where both keep
    ``x``'s shape (how matmul broadcasts before cleanup drops the no-op pair)."""
    if not isinstance(value, Ref):
        return None
    view = _producer(graph, value, _VIEW)
    expand = view and _producer(graph, view.inputs[0], _EXPAND)
    if expand is not None and isinstance(expand.inputs[0], Ref):
        shape = tuple(graph.node(expand.inputs[0].name).tensor_meta.shape)
        if tuple(expand.inputs[1]) == shape and tuple(view.inputs[1]) == shape:
            return expand.inputs[0]
    meta = graph.node(value.name).meta
    return value if isinstance(meta, TensorMeta) and len(meta.shape) == 3 else None


def _broadcast_weight(graph: Graph, value: Any) -> Ref | None:
    """``permute(w)`` for ``[view](expand(permute(w, [1,0]), [B,K,N]), [B,K,N])``, ``w`` a 2-D parameter
    (the no-op view is gone after cleanup)."""
    view = _producer(graph, value, _VIEW)
    expand = _producer(graph, view.inputs[0], _EXPAND) if view is not None else _producer(graph, value, _EXPAND)
    permute = expand and _producer(graph, expand.inputs[0], _PERMUTE)
    if permute is None or list(permute.inputs[1]) != [1, 0] or graph.node(permute.inputs[0].name).op != PARAM:
        return None
    k, n = permute.tensor_meta.shape
    target = tuple(expand.inputs[1])
    if len(target) != 3 or target[1:] != (k, n) or (view is not None and tuple(view.inputs[1]) != target):
        return None
    return Ref(permute.name)


def _sole_user(graph: Graph, name: str) -> Node | None:
    users = graph.users(name)
    return users[0] if len(users) == 1 else None


def linearize_batched_matmuls(graph: Graph) -> int:
    """Rewrite ``bmm`` against a broadcast 2-D weight (plus its bias add) as ``addmm``; returns the count."""
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
        add = _sole_user(graph, out.name)
        bias = None
        if add is not None and add.op == _ADD and len(add.inputs) == 2 and add.inputs[0] == Ref(out.name):
            other = add.inputs[1]
            node = graph.node(other.name) if isinstance(other, Ref) else None
            if node is not None and node.op == PARAM and tuple(node.tensor_meta.shape) == (n,):
                bias = other
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


def cheap_safe_softmax(graph: Graph) -> int:
    """Rewrite the ``_safe_softmax`` guard as ``where(isnan(softmax), 0, softmax)``; returns the count."""
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
        nan = new_node(graph, aten("isnan"), [soft], name=f"{where.name}_nan", origin=where.origin, before=where.name)
        zero = new_node(graph, aten("scalar_tensor"), [0.0], {"dtype": where.tensor_meta.dtype},
                        name=f"{where.name}_zero", origin=where.origin, before=where.name)
        substitute(graph, where.name, _WHERE, [Ref(nan.name), Ref(zero.name), soft], origin=where.origin)
        remove_dead(graph, [not_any.name, full.name])
        done += 1
    return done


def _outputs(graph: Graph, inputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return tuple(to_fx(graph).eval()(*inputs))


def ort_friendly(graph: Graph, inputs: tuple[torch.Tensor, ...] | None = None) -> tuple[Graph, RecomposeStats]:
    """``graph`` rewritten for ORT (a copy; ``graph`` itself is unchanged) and what was rewritten.

    With ``inputs``, a graph with recomposed RNNs is kept only if it reproduces ``graph`` on them (the
    recomposition re-derives a GRU/LSTM from its unrolled cells).  The two local rewrites are exact
    identities (pinned by their tests) and the compiled artifact is verified against eager anyway, so
    they are not re-run here: two extra code generations and runs cost a second on the transformer.
    """
    stats = RecomposeStats(nodes_before=len(graph.order()))
    out = graph.copy()
    recompose_rnns(out, stats)
    stats.rewrites = {"batched_linear": linearize_batched_matmuls(out), "safe_softmax": cheap_safe_softmax(out)}
    if stats.recomposed and inputs is not None:
        expected, actual = _outputs(graph, inputs), _outputs(out, inputs)
        if not all(torch.allclose(a, e, rtol=1e-4, atol=1e-5, equal_nan=True) for a, e in zip(actual, expected)):
            stats.skipped["graph"] = "the rewritten graph did not reproduce the original; exported unchanged"
            stats.recomposed, stats.rewrites = [], {}
            out = graph
    if not stats.changed:
        out = graph
    stats.nodes_after = len(out.order())
    return out, stats
