"""``split-projections``: a packed projection read only in parts becomes one projection per part.

A linear whose output features are only ever read as separate blocks (the packed
q/k/v in-projection of ``nn.MultiheadAttention``, GPT-2's ``c_attn(x).split(E, dim=2)``)
is computed as one linear per block, on slices of its weight and bias, so each part
comes out in its own tensor and the layout chain that picked the parts apart
(``view → permute → squeeze → clone → select``) shrinks to reshapes per part::

    %add = aten.add(aten.bmm(%x, aten.expand(%w, [8, 32, 96])), %b)        # w: [32, 96], b: [96]
    %v5 = aten.view(%add, [1, 8, 2, 3, 32]);  %p = aten.permute(%v5, [3, 1, 2, 0, 4])
    %sq = aten.squeeze.dims(%p, [-2]);  %q = aten.select(%sq, 0, 0) ... %v = aten.select(%sq, 0, 2)
  becomes, per part i (w_i = w[:, 32i:32i+32], b_i = b[32i:32i+32]: new constants, w and b removed)
    %add_i = aten.add(aten.bmm(%x, aten.expand(%w_i, [8, 32, 32])), %b_i)
    %q = aten.reshape(aten.permute(aten.reshape(%add_i, [1, 8, 2, 32]), [1, 2, 0, 3]), [8, 2, 32])

The product is ``addmm``/``mm`` (optionally followed by a bias ``add``) or a ``bmm``
against an expanded 2-d weight, its weight a constant (``[K, N]``, or ``[N, K]``
behind a ``permute``/``t``) and its bias a ``[N]`` constant, none read elsewhere.
From it the walk follows the only reader through reshapes (``view``, ``reshape``,
``squeeze``, ``unsqueeze``), ``permute`` and ``clone``, tracking the axis that holds
the parts, and stops at the reader that picks them: ``select`` or ``unbind`` along a
parts axis a reshape made (``[.., 3E] → [.., 3, E]``), or ``split_with_sizes``/``slice``
along the feature axis itself.  Any other reader anywhere on the chain (an output too)
keeps the projection packed.  A part nobody picks is not computed.  Sizes must be
concrete.  Then a linear whose rows are permuted before and after it runs them in the order its reader
wants, the two permutes composed into one (:func:`~mlcomp.passes.rows.reorder_rows`: attention's
out-projection).  The rewrite keeps the names of the values the parts replace (``builder.substitute``);
shared (:func:`split_projections`) so that a pass of any family can run it first.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar

import torch

from mlcomp.ir import Graph, Mode, Node, Ref
from mlcomp.ir.builder import new_node, remove_dead, substitute
from mlcomp.ir.ops import GETITEM, PARAM, aten
from mlcomp.passes import patterns as P
from mlcomp.passes.layouts import compose
from mlcomp.passes.rows import reorder_rows
from mlcomp.pipeline.pass_base import Pass, PassContext, PassResult

__all__ = ["SplitProjections", "split_projections"]

SELECT, UNBIND, SPLIT_SIZES = aten("select.int"), aten("unbind.int"), aten("split_with_sizes")
RESHAPES = P.SHAPE_OPS | P.SQUEEZE_OPS | {P.UNSQUEEZE}


@dataclass(frozen=True)
class SplitProjections(Pass):
    """Split a packed projection read only in parts (q/k/v) into one projection per part."""

    name: ClassVar[str] = "split-projections"
    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        if graph.mode is Mode.TRAINING:      # the optimizer updates the packed weight: a training graph keeps it
            return PassResult(graph, False, {"projections_split": 0, "parts": 0, "rows_reordered": 0})
        whole = ctx.target.whole_modules if ctx.target is not None else frozenset()   # converted from its weights
        stats = split_projections(graph, leave=lambda node: node.origin.module_type in whole)
        return PassResult(graph, stats["projections_split"] > 0, stats)


@dataclass
class _Packed:
    """One packed projection: its product, weight, bias and the chain from it to the part pickers."""

    product: Node
    weight: Node                    # the PARAM
    rows: bool                      # the PARAM is [N, K] (read through a permute/t), else [K, N]
    weight_view: Node | None        # that permute/t
    expand: Node | None             # bmm's expand of the weight
    bias: Node | None               # the bias PARAM
    bias_add: Node | None           # the add that applies it (None: addmm's own)
    chain: list[tuple[Node, int]] = field(default_factory=list)   # each step, with the parts axis after it
    parts: list[tuple[int, int]] = field(default_factory=list)    # feature ranges [a, b)
    picks: list[tuple[Node, int]] = field(default_factory=list)   # reader → part index
    splitter: Node | None = None
    split_at: int = -1              # chain index after which the parts axis is a separate axis (-1: never)


def split_projections(graph: Graph, leave: Callable[[Node], bool] | None = None) -> dict[str, int]:
    """Split every packed projection of ``graph`` in place (see the module docstring); the counts.
    ``leave``: a projection whose product it names stays packed (``quantize``'s ``exclude``)."""
    stats = {"projections_split": 0, "parts": 0}
    for node in graph.nodes():
        if node.name in graph and node.op in (P.ADDMM, P.MM, P.BMM) and not (leave and leave(node)):
            packed = _match(graph, node)
            if packed is not None:
                _rewrite(graph, packed)
                stats["projections_split"] += 1
                stats["parts"] += len(packed.parts)
    stats["rows_reordered"] = reorder_rows(graph, leave)
    return stats


def _only(graph: Graph, node: Node | None, reader: Node) -> bool:
    return node is not None and [u.name for u in graph.users(node.name)] == [reader.name]


def _param(graph: Graph, value: Any) -> Node | None:
    node = graph.node(value.name) if isinstance(value, Ref) and value.name in graph else None
    return node if node is not None and node.op == PARAM and node.name in graph.constants else None


def _shape(graph: Graph, value: Any) -> tuple[int, ...] | None:
    meta = P.meta_of(graph, value)
    return tuple(meta.shape) if meta is not None and all(isinstance(d, int) for d in meta.shape) else None


def _weight(graph: Graph, value: Any, reader: Node) -> tuple[Node, bool, Node | None] | None:
    """The constant behind a ``[K, N]`` weight operand: (PARAM, stored as [N, K], the permute/t)."""
    src = graph.node(value.name) if isinstance(value, Ref) else None
    if src is None or not _only(graph, src, reader):
        return None
    if _param(graph, value) is not None:
        return src, False, None
    flip = src.op in P.PERMUTE_OPS and P.perm_of(src, 2) == [1, 0]
    param = _param(graph, src.inputs[0]) if flip else None
    return (param, True, src) if param is not None and _only(graph, param, src) else None


def _through_noops(graph: Graph, value: Any, reader: Node) -> tuple[Any, Node]:
    """``value`` behind the views and expands to its own shape that only ``reader``'s chain reads, and the
    node that reads it (a graph not cleaned up yet has them around every weight)."""
    while isinstance(value, Ref) and (node := graph.node(value.name)).op in RESHAPES | {P.EXPAND} \
            and _only(graph, node, reader) and _shape(graph, value) == _shape(graph, node.inputs[0]):
        value, reader = node.inputs[0], node
    return value, reader


def _match(graph: Graph, product: Node) -> _Packed | None:
    """The packed projection ``product`` heads, when it is one whose parts are all its readers take."""
    if product.op == P.ADDMM:
        if len(product.inputs) != 3 or any(product.attrs.get(k, 1) != 1 for k in ("beta", "alpha")):
            return None
        bias, x, w_value = product.inputs
    elif len(product.inputs) == 2:
        x, w_value, bias = product.inputs[0], product.inputs[1], None
    else:
        return None
    expand = None
    w_value, reader = _through_noops(graph, w_value, product)
    if product.op == P.BMM:
        expand = graph.node(w_value.name) if isinstance(w_value, Ref) else None
        if expand is None or expand.op != P.EXPAND or not _only(graph, expand, reader):
            return None
        w_value, reader = _through_noops(graph, expand.inputs[0], expand)
    weight = _weight(graph, w_value, reader)
    shape = _shape(graph, Ref(product.name))
    if weight is None or shape is None or not isinstance(x, Ref):
        return None
    n = shape[-1]
    bias_node, bias_add, head = _param(graph, bias) if bias is not None else None, None, product
    if bias is not None and (bias_node is None or not _only(graph, bias_node, product) or
                             _shape(graph, bias) != (n,)):
        return None
    if bias is None:
        last = product
        while len(users := graph.users(last.name)) == 1 and users[0].op in RESHAPES \
                and _shape(graph, Ref(users[0].name)) == shape:
            last = users[0]                     # views to the product's own shape: none in a part
        add = users[0] if len(users) == 1 and users[0].op == P.ADD[0] else None
        if add is not None:
            side = _param(graph, add.inputs[1] if add.inputs[0] == Ref(last.name) else add.inputs[0])
            if side is not None and _only(graph, side, add) and _shape(graph, Ref(side.name)) == (n,) \
                    and _shape(graph, Ref(add.name)) == shape:
                bias_node, bias_add, head = side, add, add
    packed = _Packed(product, weight[0], weight[1], weight[2], expand, bias_node, bias_add)
    return packed if _walk(graph, head, shape, packed) else None


def _reshaped(shape: tuple[int, ...], axis: int, k: int | None, n: int,
              out: tuple[int, ...]) -> tuple[int, int | None] | None:
    """Where the parts axis is after a reshape to ``out`` (and the parts count once a reshape made the
    parts an axis of their own), or None when the reshape mixes it with other axes."""
    before, prefix = math.prod(shape[:axis]), 1
    for q, size in enumerate(out):
        if prefix == before and size != 1:
            if k is not None:
                return (q, k) if size == k else None
            rest = math.prod(out[q + 1:])
            if axis != len(shape) - 1 or size * rest != n:
                return None
            if rest == 1:
                return (q, None) if q == len(out) - 1 else None
            return q, size
        prefix *= size
    return None


def _step(graph: Graph, node: Node, shape: tuple[int, ...], axis: int, k: int | None,
          n: int) -> tuple[int, int | None] | None:
    """The parts axis (and count) after ``node``, a reshape, permute or clone of the chain's value."""
    out = _shape(graph, Ref(node.name))
    if out is None:
        return None
    if node.op in RESHAPES:
        return _reshaped(shape, axis, k, n, out)
    perm = P.perm_of(node, len(shape))
    if perm is not None:
        return perm.index(axis), k
    return (axis, k) if node.op == P.CLONE else None


def _walk(graph: Graph, head: Node, shape: tuple[int, ...], packed: _Packed) -> bool:
    """Follow the only reader of each value from ``head`` to the readers that pick the parts."""
    value, axis, k, n = head, len(shape) - 1, None, shape[-1]
    while True:
        users = graph.users(value.name)
        if users and _picks(graph, value, users, axis, k, n, packed):
            return True
        if len(users) != 1 or not users[0].inputs or users[0].inputs[0] != Ref(value.name) \
                or Ref(value.name) in users[0].inputs[1:]:
            return False
        step = _step(graph, users[0], shape, axis, k, n)
        if step is None:
            return False
        if k is None and step[1] is not None:
            packed.split_at = len(packed.chain)
        value, shape = users[0], _shape(graph, Ref(users[0].name))
        axis, k = step
        packed.chain.append((value, axis))


def _dim(node: Node, index: int, rank: int) -> int | None:
    d = node.inputs[index] if len(node.inputs) > index else node.attrs.get("dim", 0)
    return d % rank if isinstance(d, int) else None


def _picks(graph: Graph, value: Node, users: list[Node], axis: int, k: int | None, n: int,
           packed: _Packed) -> bool:
    """Whether ``users`` (all of ``value``'s readers) only pick parts along ``axis``; records them."""
    rank, ref = len(value.meta.shape), Ref(value.name)
    if any(u.inputs[:1] != (ref,) or ref in u.inputs[1:] for u in users):
        return False
    if k is not None and all(u.op == SELECT and _dim(u, 1, rank) == axis for u in users):
        packed.parts = [(i * n // k, (i + 1) * n // k) for i in range(k)]
        packed.picks = [(u, u.inputs[2] % k) for u in users]
        return True
    one = users[0] if len(users) == 1 else None
    items = graph.users(one.name) if one is not None else []
    if not items or any(i.op != GETITEM for i in items):
        return k is None and _slices(users, axis, rank, n, packed)
    if k is not None and one.op == UNBIND and _dim(one, 1, rank) == axis:
        packed.parts = [(i * n // k, (i + 1) * n // k) for i in range(k)]
    elif k is None and one.op == SPLIT_SIZES and _dim(one, 2, rank) == axis and sum(one.inputs[1]) == n:
        ends = [sum(one.inputs[1][:i + 1]) for i in range(len(one.inputs[1]))]
        packed.parts = list(zip([0, *ends[:-1]], ends))
    else:
        return False
    packed.splitter, packed.picks = one, [(i, i.inputs[1]) for i in items]
    return True


def _slices(users: list[Node], axis: int, rank: int, n: int, packed: _Packed) -> bool:
    """``slice`` readers along the feature axis, step 1, over ranges that do not overlap."""
    ranges = []
    for u in users:
        given = list(u.inputs[2:5])
        start, end, step = given + [None, None, 1][len(given):]
        start, end = 0 if start is None else start, n if end is None else end
        if u.op != P.SLICE or _dim(u, 1, rank) != axis or step != 1 or not isinstance(start, int) \
                or not isinstance(end, int) or start < 0 or end < 0:
            return False
        ranges.append((min(n, start), min(n, end)))
    parts = sorted(set(ranges))
    if any(a >= b for a, b in parts) or any(parts[i][1] > parts[i + 1][0] for i in range(len(parts) - 1)):
        return False
    packed.parts, packed.picks = parts, [(u, parts.index(r)) for u, r in zip(users, ranges)]
    return True


def _rewrite(graph: Graph, packed: _Packed) -> None:
    """One projection per picked part; the packed one, its chain and the layout ops after the picks removed."""
    once = len({index for _, index in packed.picks}) == len(packed.picks)
    old = [packed.product, packed.bias_add, *(n for n, _ in packed.chain), packed.splitter]
    for pick, index in packed.picks:
        tail = _tail(graph, pick) if once else []
        old += [pick, *tail]
        _part(graph, packed, index, pick, tail)
    remove_dead(graph, [n.name for n in old if n is not None and n.name in graph])


def _tail(graph: Graph, pick: Node) -> list[Node]:
    """The reshapes and permutes after ``pick``, each the only reader of the one before (folded into the part),
    up to a transpose of the last two axes (the keys' transpose: attention and products take it themselves)."""
    tail, node = [], pick
    while len(users := graph.users(node.name)) == 1 and _layout_op(graph, users[0]):
        node = users[0]
        tail.append(node)
    return tail


def _layout_op(graph: Graph, node: Node) -> bool:
    if _shape(graph, Ref(node.name)) is None:
        return False
    if node.op in RESHAPES:
        return True
    perm = P.perm_of(node, len(node.meta.shape))
    return perm is not None and perm[-2:] != [len(perm) - 1, len(perm) - 2]


def _part(graph: Graph, packed: _Packed, index: int, pick: Node, tail: list[Node]) -> Node:
    """Part ``index``'s projection, then its layout as at most reshape → permute → reshape; the last node takes
    over the name of the last node of ``tail`` (``pick`` when there is none)."""
    a, b = packed.parts[index]
    w = graph.constants[packed.weight.name]
    value: Any = Ref(_constant(graph, packed.weight, w[a:b] if packed.rows else w[:, a:b], index).name)
    steps: list[tuple[Any, list[Any], dict[str, Any]]] = []     # op, inputs (None: the value before), attrs
    if packed.weight_view is not None:
        steps.append((P.PERMUTE, [value, [1, 0]], {}))
        value = None
    x, perm = _unpermuted(graph, packed)
    if packed.expand is not None:
        steps.append((P.EXPAND, [value, [_shape(graph, x)[0], *packed.expand.meta.shape[1:-1], b - a]], {}))
        value = None
    bias = None
    if packed.bias is not None:
        bias = Ref(_constant(graph, packed.bias, graph.constants[packed.bias.name][a:b], index).name)
    inputs = [bias, x, value] if packed.product.op == P.ADDMM else [x, value]
    steps.append((packed.product.op, inputs, dict(packed.product.attrs)))
    if packed.bias_add is not None:
        steps.append((packed.bias_add.op, [None, bias], {}))
    shape = list(_shape(graph, x)[:-1]) + [b - a] if packed.product.op != P.ADDMM else [packed.product.meta.shape[0], b - a]
    layout = ([("permute", perm)] if perm else []) + _layout(packed, b - a) + _layout_of(tail)
    steps += _layout_ops(compose(shape, [s for s in layout if s[0] != "op"]) if all(s[0] != "op" for s in layout)
                         else None, layout)
    return _emit(graph, steps, tail[-1] if tail else pick, packed.product.name)


def _unpermuted(graph: Graph, packed: _Packed) -> tuple[Any, list[int] | None]:
    """The product's input, or what it permutes when ``bmm`` reads a permute that keeps the feature axis last
    (a product over rows commutes with it: the part reads the input as it is and permutes its result)."""
    x = packed.product.inputs[1 if packed.product.op == P.ADDMM else 0]
    src = graph.node(x.name)
    perm = P.perm_of(src, len(src.meta.shape)) if packed.product.op == P.BMM else None
    if perm is None or perm[-1] != len(perm) - 1 or _shape(graph, src.inputs[0]) is None:
        return x, None
    return src.inputs[0], perm


def _layout(packed: _Packed, size: int) -> list[tuple[str, Any]]:
    """The chain as it applies to one part of ``size`` features: reshapes, permutes, and other ops as they are."""
    steps: list[tuple[str, Any]] = []
    axis = len(packed.product.meta.shape) - 1
    for j, (node, out_axis) in enumerate(packed.chain):
        full = list(node.meta.shape)
        split = packed.split_at != -1 and j >= packed.split_at
        out = full[:out_axis] + full[out_axis + 1:] if split else full[:out_axis] + [size] + full[out_axis + 1:]
        perm = P.perm_of(node, len(full))
        if node.op in RESHAPES:
            steps.append(("reshape", out))
        elif perm is not None:
            steps.append(("permute", [d - (d > axis) for d in perm if d != axis] if split else perm))
        else:
            steps.append(("op", node))
        axis = out_axis
    return steps


def _layout_of(tail: list[Node]) -> list[tuple[str, Any]]:
    return [("reshape", list(n.meta.shape)) if n.op in RESHAPES else ("permute", P.perm_of(n, len(n.meta.shape)))
            for n in tail]


def _layout_ops(composed: list[tuple[str, list[int]]] | None,
                layout: list[tuple[str, Any]]) -> list[tuple[Any, list[Any], dict[str, Any]]]:
    """The steps to emit: the composed layout, else (a clone in the way) every step as it is."""
    ops = []
    for kind, arg in (composed if composed is not None else layout):
        if kind == "op":
            ops.append((arg.op, [None, *arg.inputs[1:]], dict(arg.attrs)))
        else:
            ops.append((P.RESHAPE if kind == "reshape" else P.PERMUTE, [None, list(arg)], {}))
    return ops


def _emit(graph: Graph, steps: list[tuple[Any, list[Any], dict[str, Any]]], target: Node, before: str) -> Node:
    """Add ``steps`` (each reading the one before where its inputs say None); the last replaces ``target``."""
    previous = None
    for i, (op, inputs, attrs) in enumerate(steps):
        inputs = [previous if v is None and previous is not None else v for v in inputs]
        if i == len(steps) - 1:
            return substitute(graph, target.name, op, inputs, attrs, origin=target.origin)
        previous = Ref(new_node(graph, op, inputs, attrs, name=f"{target.name}_{op.name}", origin=target.origin,
                                before=before).name)
    raise AssertionError("a part has at least its product")


def _constant(graph: Graph, param: Node, value: Any, index: int) -> Node:
    return graph.add_constant(graph.fresh_name(f"{param.name}_{index}"), value.clone(memory_format=torch.contiguous_format),
                              origin=param.origin)
