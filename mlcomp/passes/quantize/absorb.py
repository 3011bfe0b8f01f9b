"""A positive scalar multiply after a dequantize becomes the dequantize's scale.

Attention scales q and k by ``d ** -0.25`` between the input projection (whose output is
quantized) and the score product: in float, between pairs, where ONNX Runtime runs a
``Mul`` on dequantized data.  Views, permutes, expands and selects only move elements, so
the multiply's input still lies on the grid ``(q − z) · s`` and quantizing it again with
``(s, z)`` gives back ``q`` exactly; since ``c · (q − z) · s = (q − z) · (s · c)`` for ``c > 0``,
the multiply becomes that quantize and a dequantize with scale ``s · c``.  ORT then sees
equal scales around the moves (it drops the pair and moves the uint8 data), and, when the
value next reaches a quantize with the same zero point and scale ``s · c`` (to 1e-5), that
quantize's own scale constant is used, so that pair is dropped too::

    %addmm_dq = dequantize_linear(%addmm_q, %s, %z)
    %view = view(%addmm_dq, ...);  %mul = mul.Scalar(%view, 0.59)
                 ↓ absorb_scalar_muls
    %view = view(%addmm_dq, ...)
    %mul_q = quantize_linear(%view, %s, %z);  %mul = dequantize_linear(%mul_q, %s·0.59, %z)

O(muls × chain length) with chains of at most 8 moves.
"""
from __future__ import annotations

import math

import torch

from mlcomp.ir import Graph, Node, Ref, TensorMeta
from mlcomp.ir.builder import new_node, remove_dead
from mlcomp.ir.quant import DEQUANTIZE, QUANTIZE
from mlcomp.passes import patterns as P

__all__ = ["ELEMENT_MOVES", "absorb_scalar_muls"]

ELEMENT_MOVES = (P.VIEW_LIKE | P.INFERENCE_IDENTITY_OPS) - {P.AS_STRIDED}
"""Ops that only move elements (views, permutes, identities): a value's grid passes through them."""
_MOVES = ELEMENT_MOVES
_LONGEST = 8


def _moves_up(graph: Graph, value: object) -> tuple[list[Node], Node | None]:
    """The element-moving ops from ``value`` up to the dequantize they read, and that dequantize."""
    chain: list[Node] = []
    node = graph.node(value.name) if isinstance(value, Ref) else None
    while node is not None and node.op in _MOVES and len(chain) < _LONGEST \
            and isinstance(node.meta, TensorMeta) and isinstance(node.inputs[0], Ref):
        chain.append(node)
        node = graph.node(node.inputs[0].name)
    return chain, node if node is not None and node.op == DEQUANTIZE else None


def _quantize_below(graph: Graph, name: str) -> Node | None:
    """The quantize ``name`` reaches through single-reader element moves, if any."""
    for _ in range(_LONGEST + 1):
        users = graph.users(name)
        if len(users) != 1:
            return None
        if users[0].op == QUANTIZE:
            return users[0]
        if users[0].op not in _MOVES:
            return None
        name = users[0].name
    return None


def _scale_ref(graph: Graph, mul: Node, dq: Node, c: float) -> Ref | None:
    """The downstream quantize's scale when it equals ``s · c`` with the same zero point, else a new constant."""
    scale, zero = graph.constants.get(dq.inputs[1].name), graph.constants.get(dq.inputs[2].name)
    if scale is None or zero is None or scale.dim() != 0:
        return None
    want = float(scale) * c
    below = _quantize_below(graph, mul.name)
    if below is not None:
        s2, z2 = graph.constants.get(below.inputs[1].name), graph.constants.get(below.inputs[2].name)
        if s2 is not None and z2 is not None and s2.dim() == 0 and torch.equal(z2, zero) \
                and abs(float(s2) - want) <= 1e-5 * want:
            return below.inputs[1]
    node = graph.add_constant(graph.fresh_name(f"{mul.name}.scale"), torch.tensor(want, dtype=torch.float32))
    return Ref(node.name)


def absorb_scalar_muls(graph: Graph) -> int:
    """Turn every positive scalar multiply of a dequantized value (through element moves) into a quantize and
    a dequantize with the scale times the scalar; the number turned."""
    done = 0
    for mul in [n for n in graph.call_nodes() if n.op in P.MUL]:
        c = P.scalar(mul.inputs[1]) if len(mul.inputs) > 1 else None
        if c is None or not (c > 0 and math.isfinite(c)):
            continue
        _, dq = _moves_up(graph, mul.inputs[0])
        scale = _scale_ref(graph, mul, dq, c) if dq is not None else None
        if dq is None or scale is None:
            continue
        _, s, zero, axis = dq.inputs
        q = new_node(graph, QUANTIZE, (mul.inputs[0], s, zero, axis), name=f"{mul.name}_q", before=mul.name,
                     origin=mul.origin)
        out = new_node(graph, DEQUANTIZE, (Ref(q.name), scale, zero, axis), name=f"{mul.name}_dq",
                       before=mul.name, origin=mul.origin)
        graph.replace_all_uses(mul.name, Ref(out.name))
        remove_dead(graph, [mul.name])
        done += 1
    return done
