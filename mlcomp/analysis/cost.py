"""One cost model of the machine, shared by inspect, fusion, remat, partition and roofline.

* FLOPs per node come from ``torch.utils.flop_counter.FlopCounterMode`` run on
  meta tensors (no hand-written formulas, no real data);
* bytes per node from :class:`~mlcomp.ir.graph.TensorMeta`: every tensor input read
  once, every output written once (views move nothing);
* time on a :class:`HardwareSpec` by the roofline:
  ``max(flops / peak, bytes / bandwidth) + launch overhead``.

    >>> from mlcomp.ir.builder import linear_relu_graph
    >>> graph = linear_relu_graph(batch=2, features=512, out=256)     # relu(x @ W.T + b)
    >>> c = node_cost(graph, graph.node("addmm"))
    >>> c.flops, c.bytes, c.intensity
    (524288, 531456, 0.98...)
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from mlcomp.analysis.liveness import is_view
from mlcomp.hardware.spec import DEFAULT_CPU, SPEC_SHEETS, HardwareSpec  # noqa: F401 - re-exported
from mlcomp.ir import Graph, Node, Ref, TensorMeta, map_refs, tensor_metas
from mlcomp.ir.dtypes import itemsize
from mlcomp.ir.ops import GETITEM, INPUT, OUTPUT, PARAM, Category, Op, category


@dataclass(frozen=True)
class NodeCost:
    flops: int = 0
    bytes_read: int = 0
    bytes_written: int = 0

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved (arithmetic intensity)."""
        return self.flops / self.bytes if self.bytes else 0.0

    def __add__(self, other: "NodeCost") -> "NodeCost":
        return NodeCost(self.flops + other.flops, self.bytes_read + other.bytes_read,
                        self.bytes_written + other.bytes_written)


# ops that only re-describe memory move no data: the same notion liveness uses for aliasing
_is_view = is_view




def node_flops(graph: Graph, node: Node) -> int:
    """FLOPs of one node as ``FlopCounterMode`` counts them (0 for ops it does not count)."""
    if node.op in (INPUT, PARAM, OUTPUT, GETITEM) or node.op.namespace.value == "operator":
        return 0
    if node.op.is_composite:
        body = node.attrs.get("body")
        if isinstance(body, Graph):
            return sum(node_flops(body, n) for n in body.call_nodes())
    return _flops_on_meta(graph, node)


def _flops_on_meta(graph: Graph, node: Node) -> int:
    """``FlopCounterMode`` over meta tensors, once per (op, argument shapes and dtypes, literals) in this
    process: a model's layers repeat the same few calls, and every pass that counts FLOPs asks again."""
    try:
        args, kwargs = _frozen(node.inputs, graph), _frozen(dict(node.attrs), graph)
    except LookupError:
        return 0
    except TypeError:                   # an unhashable literal: counted without the memo
        return _count(node.op, node.inputs, dict(node.attrs), graph)
    return _counted(node.op, args, kwargs)


@dataclass(frozen=True)
class _Meta:
    """A tensor argument in a memo key: its concrete shape and dtype."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class _Seq:
    items: tuple
    kind: type                          # list or dict (items as pairs): rebuilt as such


@dataclass(frozen=True)
class _Lit:
    kind: type                          # 1 and 1.0 (and True) hash alike: the type keeps them apart
    value: object


def _frozen(value, graph: Graph):  # noqa: ANN001, ANN202 - a nested literal tree
    """A hashable key for an argument tree: refs as :class:`_Meta` (tuple results as tuples of them), literals
    with their type (``1`` and ``1.0`` differ); ``LookupError`` for a ref without a tensor meta."""
    if isinstance(value, Ref):
        meta = graph.node(value.name).meta
        if isinstance(meta, TensorMeta):
            return _Meta(meta.concrete_shape(graph.symbols), meta.dtype)
        if isinstance(meta, tuple):
            return tuple(None if m is None else _Meta(m.concrete_shape(graph.symbols), m.dtype) for m in meta)
        raise LookupError(value.name)
    if isinstance(value, tuple):
        return tuple(_frozen(v, graph) for v in value)
    if isinstance(value, list):
        return _Seq(tuple(_frozen(v, graph) for v in value), list)
    if isinstance(value, dict):
        return _Seq(tuple((k, _frozen(v, graph)) for k, v in value.items()), dict)
    if isinstance(value, torch.Tensor):
        raise TypeError("a tensor literal")
    hash(value)                         # TypeError when unhashable
    return _Lit(type(value), value)


def _thawed(key):  # noqa: ANN001, ANN202
    """Meta tensors and literals from a :func:`_frozen` key."""
    if isinstance(key, _Meta):
        return torch.empty(key.shape, dtype=key.dtype, device="meta")
    if isinstance(key, _Seq):
        return [_thawed(v) for v in key.items] if key.kind is list else {k: _thawed(v) for k, v in key.items}
    if isinstance(key, _Lit):
        return key.value
    return None if key is None else tuple(_thawed(v) for v in key)


@functools.lru_cache(maxsize=8192)
def _counted(op: Op, args, kwargs) -> int:  # noqa: ANN001
    return _run_counter(op, _thawed(args), _thawed(kwargs))


def _count(op: Op, inputs, attrs, graph: Graph) -> int:  # noqa: ANN001
    def make(ref):  # noqa: ANN001
        return _thawed(_frozen(ref, graph))

    try:
        return _run_counter(op, map_refs(inputs, make), map_refs(attrs, make))
    except LookupError:
        return 0


def _run_counter(op: Op, args, kwargs) -> int:  # noqa: ANN001
    from torch.utils.flop_counter import FlopCounterMode

    try:
        counter = FlopCounterMode(display=False)
        with counter:
            op.resolve()(*args, **kwargs)
        return int(counter.get_total_flops())
    except (LookupError, NotImplementedError, RuntimeError, TypeError, ValueError):
        return 0


def node_bytes(graph: Graph, node: Node) -> tuple[int, int]:
    """(bytes read, bytes written) assuming every operand crosses main memory once."""
    if node.op in (INPUT, PARAM, OUTPUT, GETITEM) or _is_view(node) or node.op.namespace.value == "operator":
        return 0, 0
    read = 0
    for name in node.input_names():
        for m in tensor_metas(graph.node(name).meta):
            read += m.nbytes(graph.symbols)
    written = sum(m.nbytes(graph.symbols) for m in tensor_metas(node.meta))
    if isinstance(node.meta, tuple):  # only the primary output of norm ops is a real result
        first = next(iter(tensor_metas(node.meta)), None)
        written = first.nbytes(graph.symbols) if first else 0
    return read, written


def node_cost(graph: Graph, node: Node) -> NodeCost:
    r, w = node_bytes(graph, node)
    return NodeCost(node_flops(graph, node), r, w)


def graph_cost(graph: Graph) -> dict[str, NodeCost]:
    """Cost of every compute node, by name, in topological order."""
    return {n.name: node_cost(graph, n) for n in graph.call_nodes()}


def total(costs: Mapping[str, NodeCost]) -> NodeCost:
    out = NodeCost()
    for c in costs.values():
        out = out + c
    return out


def fused_bytes_saved(graph: Graph, members: Iterable[str]) -> int:
    """Bytes no longer moved when ``members`` run as one kernel.

    Every value produced and consumed only inside the group stays in registers
    or cache: its write and each internal read disappear.
    """
    group = set(members)
    saved = 0
    for name in group:
        node = graph.node(name)
        users = graph.users(name)
        if not users or any(u.name not in group for u in users) or _is_view(node):
            continue
        size = sum(m.nbytes(graph.symbols) for m in tensor_metas(node.meta))
        saved += size * (1 + len(users))
    return saved


def is_cheap(node: Node) -> bool:
    """Elementwise/broadcast/injective ops: recomputing them is cheaper than storing them."""
    return category(node.op) <= Category.INJECTIVE


def dtype_bytes(dtype: torch.dtype) -> int:
    """Bytes per element (the dtype table's :func:`~mlcomp.ir.dtypes.itemsize`)."""
    return itemsize(dtype)
