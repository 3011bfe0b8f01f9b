"""The graph the ``onnxruntime`` target exports: core ATen rewritten into what ORT's fusions match.

Capture leaves some layers in shapes that a direct ``torch.onnx.export`` of the
eager module never has, and ORT's optimiser then cannot fuse them.
:func:`ort_friendly` rewrites them on a copy of the graph before export:

* **unrolled RNN layers** (:mod:`mlcomp.targets.recurrent`): one ONNX ``GRU``;
* **batched linear** (:func:`mlcomp.ir.linearize.linearize_batched_matmuls`): ``bmm``
  against a weight broadcast over the batch (ONNX: a 3-D ``MatMul`` against an expanded
  weight, which ORT folds into a ``[B, K, N]`` initializer, then ``Add``) becomes one
  ``addmm`` on the input reshaped to 2-D (ONNX ``Gemm``, bias included, the weight an
  initializer);
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

import torch

from mlcomp.ir import Graph, Ref
from mlcomp.ir.builder import new_node, remove_dead, substitute
from mlcomp.ir.graph_tools import producer
from mlcomp.ir.linearize import linearize_batched_matmuls
from mlcomp.ir.ops import aten
from mlcomp.runtime.codegen import to_fx
from mlcomp.targets.recurrent import RecomposeStats, recompose_rnns

__all__ = ["cheap_safe_softmax", "linearize_batched_matmuls", "ort_friendly"]

_WHERE, _NOT, _ANY, _EQ = aten("where.self"), aten("logical_not"), aten("any.dim"), aten("eq.Scalar")


def cheap_safe_softmax(graph: Graph) -> int:
    """Rewrite the ``_safe_softmax`` guard as ``where(isnan(softmax), 0, softmax)``; returns the count."""
    done = 0
    for where in graph.nodes(_WHERE):
        cond, zeros, soft = where.inputs
        not_any = producer(graph, cond, _NOT)
        any_ = not_any and producer(graph, not_any.inputs[0], _ANY)
        not_eq = any_ and producer(graph, any_.inputs[0], _NOT)
        eq = not_eq and producer(graph, not_eq.inputs[0], _EQ)
        full = producer(graph, zeros, aten("full_like"))
        sm = producer(graph, soft, aten("_softmax"))
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
