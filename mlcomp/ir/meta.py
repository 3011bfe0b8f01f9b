"""Shape/dtype inference on meta tensors, used by ``Graph.verify`` and by passes.

``infer_meta(graph, node)`` runs the node's op on ``device="meta"`` tensors
built from its inputs' :class:`TensorMeta` and returns what comes out; no real
data is touched, so it costs microseconds per node.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Mapping

import torch

from mlcomp.ir.node import Ref, TensorMeta, map_refs
from mlcomp.ir.ops import GETITEM, INPUT, OUTPUT, PARAM

if TYPE_CHECKING:
    from mlcomp.ir.graph import Graph
    from mlcomp.ir.node import Node


def _placeholder(graph: "Graph", name: str) -> Any:

    meta = graph.node(name).meta
    if isinstance(meta, TensorMeta):
        return torch.empty(meta.concrete_shape(graph.symbols), dtype=meta.dtype, device="meta")
    if isinstance(meta, tuple):
        return tuple(None if m is None else
                     torch.empty(m.concrete_shape(graph.symbols), dtype=m.dtype, device="meta")
                     for m in meta)
    raise LookupError(name)


def infer_meta(graph: "Graph", node: "Node") -> Any:
    """Meta of ``node`` recomputed from its inputs; ``NotImplemented`` when it cannot be inferred.

    Results are remembered in ``graph.meta_cache`` keyed by the op, its literal
    arguments and the shapes/dtypes of its inputs (the only things the answer
    depends on), so a model of repeated blocks runs each op's meta kernel once
    per distinct signature.  Fused composites are not remembered (their bodies
    are not part of the key).
    """

    if node.op in (INPUT, PARAM, OUTPUT):
        return node.meta
    cache = graph.meta_cache
    key = None if node.op.is_composite else _signature(graph, node)
    if key is not None:
        hit = cache.get(key, _MISSING)
        if hit is not _MISSING:
            return hit
    out = _infer(graph, node)
    if key is not None:
        cache[key] = out
    return out


_MISSING = object()


def _signature(graph: "Graph", node: "Node") -> Any:
    """A hashable key for everything ``_infer`` reads, or ``None`` when there is none."""

    def meta_sig(m: Any) -> Any:
        if isinstance(m, TensorMeta):
            return (m.concrete_shape(graph.symbols), m.dtype)
        if isinstance(m, tuple):
            return tuple(None if x is None else meta_sig(x) for x in m)
        return "?"                       # _placeholder refuses it: the answer is NotImplemented

    def lit(v: Any) -> Any:
        if isinstance(v, Ref):
            return ("%", meta_sig(graph.node(v.name).meta))
        if isinstance(v, (tuple, list)):
            return (type(v).__name__, tuple(lit(x) for x in v))
        if isinstance(v, Mapping):
            return ("{", tuple((k, lit(x)) for k, x in v.items()))
        if isinstance(v, torch.Tensor):
            raise TypeError("tensor literal")
        return (type(v).__name__, v)     # 1, 1.0 and True stay apart

    try:
        key = (node.op, lit(node.inputs), lit(node.attrs), _device(node))
        hash(key)
    except (TypeError, LookupError):
        return None
    return key


def _infer(graph: "Graph", node: "Node") -> Any:
    try:
        args = map_refs(node.inputs, lambda r: _placeholder(graph, r.name))
        kwargs = map_refs(dict(node.attrs), lambda r: _placeholder(graph, r.name))
        if node.op.is_composite:
            kwargs = dict(kwargs)
        out = node.op.resolve()(*args, **kwargs)
    except LookupError:
        return NotImplemented  # an input carries a symbolic scalar: nothing to check
    except (NotImplementedError, RuntimeError, TypeError, ValueError):
        return NotImplemented  # op has no meta kernel or needs real data
    if node.op == GETITEM and out is None:
        return None

    def to_meta(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            return TensorMeta(tuple(int(d) for d in v.shape), v.dtype, _device(node))
        if isinstance(v, (tuple, list)):
            return tuple(to_meta(x) for x in v)
        return None

    return to_meta(out)


def _device(node: "Node") -> str:

    m = node.meta
    if isinstance(m, TensorMeta):
        return m.device
    return "cpu"


def check_node_meta(graph: "Graph", node: "Node") -> str | None:
    """A description of how the node's meta is wrong, or ``None`` if it agrees."""

    inferred = infer_meta(graph, node)
    if inferred is NotImplemented:
        return None
    declared = node.meta

    def same(a: Any, b: Any) -> bool:
        if isinstance(a, TensorMeta) and isinstance(b, TensorMeta):
            return a.concrete_shape(graph.symbols) == b.concrete_shape(graph.symbols) and a.dtype == b.dtype
        if isinstance(a, tuple) and isinstance(b, tuple):
            # secondary outputs (saved statistics of norm ops) legitimately differ between
            # the meta kernel and the real one; only the primary value must agree.
            return len(a) == len(b) and (a[0] is None or b[0] is None or same(a[0], b[0]))
        return a is None or b is None

    if not same(declared, inferred):
        return f"declared meta {declared} but its op produces {inferred}"
    return None
