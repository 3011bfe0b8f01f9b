"""Which nodes ``quantize`` computes in int8: the policy row, the user's ``exclude``, and the cases that keep float.

A node is quantized when its op has a row in :data:`~mlcomp.passes.quantize.policy.INT8_POLICY`
and no row of :data:`KEEP_FLOAT` holds for it (checked in order, the first reason recorded):

* it matches an ``exclude`` pattern: its node name, its op (``add``, ``aten.add.Tensor``,
  ``convolution``) or a module-path glob (``layer4.*``, ``fc``; a path also matches its
  submodules);
* an activation argument is not a computed float tensor (a literal, an integer index, a
  parameter: ORT's integer kernels take both operands from quantize/dequantize pairs);
* it is a transposed convolution (its weight's output channels lie on another axis);
* an ``add`` scaled by ``alpha`` (no int8 kernel scales an operand);
* a ``mean`` that is not a global average pool (over both spatial axes of a 4-d tensor, kept 4-d);
* an ``add`` or ``mul`` none of whose operands an op with a row (the target's too) computed (through element
  moves and ReLU): the sum of a model's embedding lookups, say; no int8 kernel reads its inputs, so
  quantizing it adds only rounding (on BERT the one error that matters most: ``Add`` has no int8
  kernel on OpenVINO either, which NNCF's transformer preset keeps float for the same reason);
* an ``add`` whose only reader is a layer norm: a transformer's residual stream, whose rounding costs
  agreement (ORT's own ``quantize_static`` quantizes it) and
  which the norm reads in float anyway; ORT runs a float ``Add`` and ``LayerNormalization`` (the
  ``onnxruntime`` target writes both on ``[rows, width]``, where ORT's slower ``SkipLayerNormalization``
  does not take them).

After observing, a node whose activation range is not finite (a ``-inf`` mask) keeps float too, and so
does an ``add`` whose operands' observed spans differ more than :data:`SPAN_RATIO` times (attention scores
plus a padding mask of ``finfo.min`` or ``-1e4``: one 8-bit grid for the sum would leave the scores less
than a step) (:func:`uncarried`).  Each keep-float reason is recorded per node in the pass's stats::

    >>> from mlcomp.ir.builder import GraphBuilder
    >>> from mlcomp.ir.ops import aten
    >>> b = GraphBuilder("g")
    >>> x = b.input("x", (3, 3))
    >>> g = b.output(b.call(aten("add.Tensor"), b.call(aten("mm"), x, x), b.call(aten("relu"), x)))
    >>> [n.name for n, _ in choose(g, ())[0]], choose(g, ("add",))[1]
    (['mm', 'add'], {'add': 'excluded by add'})
    >>> b = GraphBuilder("g")
    >>> x = b.input("x", (3, 3))
    >>> choose(b.output(b.call(aten("add.Tensor"), b.call(aten("relu"), x), x)), ())[1]["add"][:35]
    'no operand comes from an int8 op (a'
"""
from __future__ import annotations

import math
from typing import Any, Callable, Sequence

from mlcomp.ir import Graph, Node, Ref, TensorMeta
from mlcomp.ir.ops import PARAM, aten
from mlcomp.passes import patterns as P
from mlcomp.passes.quantize.absorb import ELEMENT_MOVES
from mlcomp.passes.quantize.policy import Int8Rule, int8_rule
from mlcomp.passes.quantize.write import moved_from

__all__ = ["choose", "finite", "uncarried", "KEEP_FLOAT", "SPAN_RATIO", "excluded_by", "unmatched"]

_LAYER_NORMS = frozenset({aten("native_layer_norm"), aten("layer_norm")})
_ADD, _MUL, _MEAN = aten("add.Tensor"), aten("mul.Tensor"), aten("mean.dim")


def excluded_by(node: Node, patterns: Sequence[str]) -> str | None:
    """The first ``exclude`` pattern naming ``node`` (its name, its op, or a glob of its module path)."""
    return next((p for p in patterns if p == node.name or P.names_op_or_module(p, node)), None)


def _not_tensor_operand(graph: Graph, node: Node, rule: Int8Rule, target: str | None) -> str | None:
    for i in rule.activations:
        value = node.inputs[i] if i < len(node.inputs) else None
        src = graph.node(value.name) if isinstance(value, Ref) else None
        meta = src.meta if src is not None else None
        if src is not None and src.op == PARAM:
            return f"argument {i} is a constant, not an activation (its row folds no weight there)"
        if src is None or not isinstance(meta, TensorMeta) or not meta.dtype.is_floating_point:
            return f"argument {i} is not a computed float tensor"
        if _param_through_views(graph, src):
            return f"argument {i} is a parameter read through views (a batched linear's weight, not folded to int8)"
    return None


def _param_through_views(graph: Graph, node: Node, depth: int = 6) -> bool:
    """Whether ``node`` is a PARAM reshaped, permuted or expanded (at most ``depth`` such ops)."""
    for _ in range(depth):
        if node.op not in P.VIEW_LIKE or not isinstance(node.inputs[0], Ref):
            return False
        node = graph.node(node.inputs[0].name)
        if node.op == PARAM:
            return True
    return False


def _transposed(graph: Graph, node: Node, rule: Int8Rule, target: str | None) -> str | None:
    conv = node.op == aten("convolution") and len(node.inputs) > 6 and node.inputs[6]
    return "a transposed convolution" if conv else None


def _scaled_add(graph: Graph, node: Node, rule: Int8Rule, target: str | None) -> str | None:
    alpha = node.attrs.get("alpha", node.inputs[2] if len(node.inputs) > 2 else 1)
    return f"an add scaled by alpha={alpha}" if node.op == _ADD and alpha != 1 else None


def _not_global_pool(graph: Graph, node: Node, rule: Int8Rule, target: str | None) -> str | None:
    if node.op != _MEAN:
        return None
    meta = P.meta_of(graph, node.inputs[0])
    rank = len(meta.shape) if meta is not None else 0
    dims = node.inputs[1] if len(node.inputs) > 1 else None
    keep = node.inputs[2] if len(node.inputs) > 2 else node.attrs.get("keepdim", False)
    axes = sorted(d % rank for d in dims) if rank and isinstance(dims, (list, tuple)) else None
    return None if rank == 4 and axes == [2, 3] and keep else "a mean other than a 4-d global average pool"


_PASS_THROUGH = ELEMENT_MOVES | {aten("relu")}


def _from_int8_op(graph: Graph, value: Any, target: str | None, depth: int = 8) -> bool:
    """Whether ``value`` (through at most ``depth`` element moves and ReLUs) is the output of an op with a row
    (on ``target``: its own rows too)."""
    node = P.producer(graph, value)
    while node is not None and depth and node.op in _PASS_THROUGH and node.inputs:
        node, depth = P.producer(graph, node.inputs[0]), depth - 1
    return node is not None and int8_rule(node.op, target) is not None


def _no_int8_operand(graph: Graph, node: Node, rule: Int8Rule, target: str | None) -> str | None:
    if node.op not in (_ADD, _MUL) or any(_from_int8_op(graph, node.inputs[i], target) for i in rule.activations):
        return None
    return "no operand comes from an int8 op (an embedding sum, a mask): quantizing it would only add rounding"


def _add_before_layer_norm(graph: Graph, node: Node, rule: Int8Rule, target: str | None) -> str | None:
    users = graph.users(node.name)
    if node.op == _ADD and len(users) == 1 and users[0].op in _LAYER_NORMS:
        return "an add read only by a layer norm (the residual stream: rounding it costs accuracy; the norm reads float)"
    return None


Check = Callable[[Graph, Node, Int8Rule, str | None], str | None]      # (graph, node, row, target) -> why
KEEP_FLOAT: tuple[Check, ...] = (
    _not_tensor_operand, _transposed, _scaled_add, _not_global_pool, _no_int8_operand, _add_before_layer_norm)
"""Why a node with a policy row keeps float (``None``: it does not), in the order they are checked."""


def choose(graph: Graph, exclude: Sequence[str], target: str | None = None
           ) -> tuple[list[tuple[Node, Int8Rule]], dict[str, str]]:
    """The nodes to quantize with their rows (``target``'s own rows too), and each other node with a row: why it
    keeps float. O(n)."""
    picked: list[tuple[Node, Int8Rule]] = []
    kept: dict[str, str] = {}
    for node in graph.call_nodes():
        rule = int8_rule(node.op, target)
        if rule is None:
            continue
        pattern = excluded_by(node, exclude)
        reason = f"excluded by {pattern}" if pattern is not None else next(
            (r for check in KEEP_FLOAT if (r := check(graph, node, rule, target)) is not None), None)
        if reason is None:
            picked.append((node, rule))
        else:
            kept[node.name] = reason
    return picked, kept


def unmatched(graph: Graph, exclude: Sequence[str]) -> list[str]:
    """The ``exclude`` patterns that name no node (a typo, or a module the model does not have)."""
    hit = {p for n in graph.call_nodes() for p in exclude if p == n.name or P.names_op_or_module(p, n)}
    return [p for p in exclude if p not in hit]


def finite(ranges: dict[str, tuple[float, float]], values: Sequence[Any]) -> bool:
    """Whether every observed range of ``values`` (refs or names) is finite."""
    names = [v.name if isinstance(v, Ref) else v for v in values]
    return all(math.isfinite(ranges[n][0]) and math.isfinite(ranges[n][1]) for n in names if n in ranges)


SPAN_RATIO = 16.0
"""An add's operand spans may differ this much: one 256-step grid for the sum then gives the narrower 16 steps."""


def uncarried(graph: Graph, node: Node, ranges: dict[str, tuple[float, float]], values: Sequence[Any],
              wide: frozenset[str] | set[str] = frozenset()) -> str | None:
    """Why one int8 grid cannot carry ``node``'s observed ``values`` (refs or names), or None; ``wide``: the
    adds kept float for it before (a node reading one, through element moves, gets its range: kept too).

        >>> from mlcomp.ir.builder import GraphBuilder
        >>> b = GraphBuilder("g")
        >>> s, m = b.input("s", (2, 2)), b.input("m", (2, 2))
        >>> g = b.output(b.call(aten("add.Tensor"), s, m))
        >>> add = g.node("add")
        >>> uncarried(g, add, {"s": (-8.0, 8.0), "m": (-3.4e38, 0.0), "add": (-3.4e38, 8.0)}, ["s", "m", "add"])[:44]
        'operands whose observed spans differ 2.1e+37'
        >>> uncarried(g, add, {"s": (-8.0, 8.0), "m": (-1.0, 1.0), "add": (-9.0, 9.0)}, ["s", "m", "add"]) is None
        True
    """
    if not finite(ranges, values):
        return "an activation with a non-finite range (an -inf mask)"
    for value in node.inputs:
        source = moved_from(graph, value.name) if isinstance(value, Ref) and value.name in graph else None
        if source in wide:
            return f"it reads {source}, an add kept float for its operands' spans (a mask): one grid cannot carry it"
    if node.op != _ADD:
        return None
    spans = [ranges[v.name][1] - ranges[v.name][0] for v in node.inputs[:2]
             if isinstance(v, Ref) and v.name in ranges]
    if len(spans) == 2 and min(spans) > 0 and max(spans) > SPAN_RATIO * min(spans):
        return (f"operands whose observed spans differ {max(spans) / min(spans):.2g}x (a mask or an offset): one "
                f"8-bit grid for the sum would leave the narrower fewer than {256 / SPAN_RATIO:.0f} steps")
    return None

