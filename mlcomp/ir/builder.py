"""Writing IR: a builder for hand-made graphs and the rewrite helpers passes share.

Meta (shape/dtype) of every new node is inferred by running its op on meta
tensors, so neither tests nor passes spell shapes out::

    >>> from mlcomp.ir.ops import aten
    >>> b = GraphBuilder("tiny")
    >>> x = b.input("x", (2, 8))
    >>> w = b.param("fc.weight", torch.randn(4, 8))
    >>> y = b.call(aten("relu"), b.call(aten("mm"), x, b.call(aten("t"), w)))
    >>> graph = b.output(y)
    >>> print(graph)
    graph tiny(%x: f32[2, 8]) {
      %fc.weight: f32[4, 8] = param   # fc
      %t: f32[8, 4] = aten.t.default(%fc.weight)
      %mm: f32[2, 4] = aten.mm.default(%x, %t)
      %relu: f32[2, 4] = aten.relu.default(%mm)
      return (%relu,)
    }

Rewrites follow one naming rule that ``--verify`` relies on: a node that keeps a
name keeps its value.  :func:`substitute` makes a new computation of an existing
value take over that value's name; anything that computes something new gets a
fresh name.
"""
from __future__ import annotations

from typing import Any, Iterable, Mapping

import torch

from mlcomp.base.errors import IRError
from mlcomp.ir import Graph, Mode, Node, Origin, Ref, TensorMeta
from mlcomp.ir.meta import infer_meta
from mlcomp.ir.ops import INPUT, OUTPUT, PARAM, Namespace, Op, aten
from mlcomp.ir.opsets import is_pure


def new_node(graph: Graph, op: Op, inputs: Iterable[Any], attrs: Mapping[str, Any] | None = None, *,
             name: str, origin: Origin | None = None, before: str | None = None, meta: Any = None) -> Node:
    """Add ``op(*inputs, **attrs)`` as ``name`` (made unique); meta is inferred unless given."""
    probe = Node(name, op, tuple(inputs), dict(attrs or {}), origin=origin or Origin())
    if meta is None and not _scalar_op(op):
        meta = infer_meta(graph, probe)
        if graph.symbols and meta is not NotImplemented:
            meta = _symbolic(graph, probe, meta)
    if meta is NotImplemented or meta is None and not _scalar_op(op):
        raise IRError(f"cannot infer the shape of new node {op}({', '.join(map(str, probe.inputs))})",
                      hint="this is a bug in the pass that builds it")
    node = probe.with_(name=graph.fresh_name(name), meta=meta)
    return graph.add(node, before=before)


def _symbolic(graph: Graph, node: Node, meta: Any) -> Any:
    """Inferred (concrete) meta with the symbolic sizes of the node's first input put back.

    Meta tensors only have the example sizes; where an output dim has the same
    size as the first input's symbolic dim at the same position (counted from the
    front, then from the back), it is that symbol.
    """
    first = next((graph.node(n).meta for n in node.input_names()
                  if isinstance(graph.node(n).meta, TensorMeta)), None)
    if not isinstance(first, TensorMeta) or not first.is_dynamic:
        return meta
    concrete = first.concrete_shape(graph.symbols)

    def fix(m: Any) -> Any:
        if isinstance(m, tuple):
            return tuple(fix(x) for x in m)
        if not isinstance(m, TensorMeta):
            return m
        dims = list(m.shape)
        for i, d in enumerate(dims):
            for j in (i, len(first.shape) - len(dims) + i):
                if 0 <= j < len(first.shape) and isinstance(first.shape[j], str) and concrete[j] == d:
                    dims[i] = first.shape[j]
                    break
        return TensorMeta(tuple(dims), m.dtype, m.device, m.requires_grad)

    return fix(meta)


def _scalar_op(op: Op) -> bool:
    """Ops whose value is a Python number (shape arithmetic): they carry no tensor meta."""
    return op.namespace is Namespace.OPERATOR or op.name in ("sym_size", "sym_numel")


def substitute(graph: Graph, old: str, op: Op, inputs: Iterable[Any],
               attrs: Mapping[str, Any] | None = None, *, origin: Origin | None = None) -> Node:
    """Replace the value ``old`` with ``op(*inputs)``, which takes over the name ``old``.

    Users of ``old`` read the new node; ``old`` itself is erased (its now-unused
    producers are left for :func:`remove_dead`).  The new value must have the
    same shape and dtype as the old one.
    """
    previous = graph.node(old)
    tmp = new_node(graph, op, inputs, attrs, name=f"{old}__new", origin=origin or previous.origin, before=old)
    if not _same_meta(graph, previous.meta, tmp.meta):
        graph.erase(tmp.name)
        raise IRError(f"rewrite of %{old} would change its meta from {previous.meta} to {tmp.meta}")
    graph.replace(tmp.with_(meta=previous.meta))   # keeps symbolic sizes the inference cannot know
    graph.replace_all_uses(old, tmp.name)      # the output node is a user like any other
    graph.erase(old)
    return rename(graph, tmp.name, old)


def rename(graph: Graph, old: str, new: str) -> Node:
    """Give node ``old`` the (unused) name ``new``; its users follow."""
    node = graph.node(old)
    if node.op == PARAM:
        final = graph.add_constant(new, graph.constants[old], origin=node.origin, before=old)
    else:
        final = graph.add(node.with_(name=new), before=old)
    graph.replace_all_uses(old, new)
    graph.erase(old)
    return final


def _same_meta(graph: Graph, a: Any, b: Any) -> bool:
    if isinstance(a, TensorMeta) and isinstance(b, TensorMeta):
        return a.concrete_shape(graph.symbols) == b.concrete_shape(graph.symbols) and a.dtype == b.dtype
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(x is None or y is None or _same_meta(graph, x, y) for x, y in zip(a, b))
    return a == b


def remove_dead(graph: Graph, names: Iterable[str]) -> int:
    """Erase the pure nodes among ``names`` (and then their producers) that nobody reads."""
    stack = list(names)
    removed = 0
    while stack:
        name = stack.pop()
        if name not in graph:
            continue
        node = graph.node(name)
        if node.op in (INPUT, OUTPUT) or graph.users(name) or not (node.op == PARAM or is_pure(node.op)):
            continue
        producers = node.input_names()
        graph.erase(name)
        removed += 1
        stack.extend(producers)
    return removed


class GraphBuilder:
    """Build a :class:`Graph` node by node; see the module docstring."""

    def __init__(self, name: str = "graph", *, mode: Mode = Mode.INFERENCE) -> None:
        self.graph = Graph(name, mode=mode)

    def input(self, name: str, shape: tuple[int, ...], dtype: torch.dtype = torch.float32) -> Ref:
        self.graph.add(Node(name, INPUT, meta=TensorMeta(tuple(shape), dtype)))
        return Ref(name)

    def param(self, name: str, value: torch.Tensor) -> Ref:
        self.graph.add_constant(name, value)
        return Ref(name)

    def call(self, op: Op, *inputs: Any, name: str | None = None, origin: str | Origin | None = None,
             meta: TensorMeta | None = None, **attrs: Any) -> Ref:
        where = Origin(origin) if isinstance(origin, str) else origin
        node = new_node(self.graph, op, inputs, attrs, name=name or op.name, origin=where, meta=meta)
        return Ref(node.name)

    def output(self, *values: Ref) -> Graph:
        self.graph.add(Node("output", OUTPUT, inputs=(tuple(values),)))
        return self.graph


def linear_relu_graph(batch: int = 2, features: int = 8, out: int = 4) -> Graph:
    """The smallest graph the docstring examples compile: ``relu(x @ W.T + b)``, parameters ``0.weight``/``0.bias``.

    >>> print(linear_relu_graph().format().splitlines()[-2].strip())
    return (%relu,)
    """
    b = GraphBuilder("mlp")
    x = b.input("x", (batch, features))
    bias, w = b.param("0.bias", torch.zeros(out)), b.param("0.weight", torch.randn(out, features))
    return b.output(b.call(aten("relu"), b.call(aten("addmm"), bias, x, b.call(aten("t"), w))))
