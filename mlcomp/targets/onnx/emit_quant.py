"""ONNX rows of the quantization ops, and matrix products with per-call activation scales.

* ``mlcomp.quantize_linear``/``dequantize_linear`` → ``QuantizeLinear``/``DequantizeLinear``
  (one scale per tensor, 0-d, or per slice along ``axis``); ORT fuses the pairs around an op
  into its ``QLinear*`` kernel.
* ``mlcomp.dynamic_quantize_linear`` → ``DynamicQuantizeLinear`` and its ``DequantizeLinear``.
* ``addmm``/``mm`` reading a per-call quantized activation and an int8 weight
  (``permute(dequantize_linear(W int8 [N, K], scale, 0, axis 0))``) →
  ``MatMulInteger(xq, Wᵀ, xz, 0) → Cast → Mul(x scale × w scale) [→ Add bias]``, the pattern ORT
  fuses into ``DynamicQuantizeMatMul`` (a ``DequantizeLinear → MatMul`` after
  ``DynamicQuantizeLinear`` it leaves a float ``Gemm``).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mlcomp.ir import Node, Ref
from mlcomp.ir.quant import DEQUANTIZE, DYNAMIC_QUANTIZE, QUANTIZE
from mlcomp.targets.onnx.emit_ops import Rule

if TYPE_CHECKING:
    from mlcomp.targets.onnx.emit import Emitter

__all__ = ["QUANT_RULES", "dynamic_gemm"]

_FLOAT = 1      # onnx.TensorProto.FLOAT


def _qdq(op_type: str) -> Rule:
    """QuantizeLinear/DequantizeLinear: one scale per tensor (0-d) or per slice along ``axis``."""
    def rule(em: "Emitter", node: Node, a: dict[str, Any]) -> None:
        inputs = [em.value(a["x"]), em.value(a["scale"]), em.value(a["zero_point"])]
        per_axis = em.meta(a["scale"]).shape != ()
        em.add(op_type, inputs, out=node.name, **({"axis": a["axis"]} if per_axis else {}))
    return rule


def _dynamic(em: "Emitter", node: Node, a: dict[str, Any]) -> None:
    outs = [em.fresh(f"{node.name}/{part}") for part in ("q", "scale", "zero")]
    em.add_multi("DynamicQuantizeLinear", [em.value(a["x"], torch.float32)], outs)
    em.add("DequantizeLinear", outs, out=node.name)


QUANT_RULES: dict[Any, Rule] = {QUANTIZE: _qdq("QuantizeLinear"), DEQUANTIZE: _qdq("DequantizeLinear"),
                                DYNAMIC_QUANTIZE: _dynamic}


def _int8_weight(em: "Emitter", weight: Any) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 [N, K], scales) of ``dequantize_linear(W, scale, 0, 0)`` over constants, else ``None``."""
    node = em.node_of(weight) if isinstance(weight, Ref) else None
    if node is None or node.op != DEQUANTIZE:
        return None
    q, scale, zero = (em.constant(r) if isinstance(r, Ref) else None for r in node.inputs[:3])
    if q is None or scale is None or zero is None or q.dtype != torch.int8 or q.dim() != 2 \
            or bool(torch.count_nonzero(zero)) or (scale.dim() == 1 and node.inputs[3] != 0):
        return None
    return q, scale


def dynamic_gemm(em: "Emitter", node: Node, mat1: Any, weight: Ref | None, bias: Any) -> bool:
    """Write ``node`` (``mat1 @ weightᵀ + bias``) with integer kernels when ``mat1`` is quantized per call and
    ``weight`` is an int8 dequantize; ``False`` (nothing written) otherwise."""
    found = _int8_weight(em, weight) if weight is not None else None
    if found is None or not isinstance(mat1, Ref) or em.node_of(mat1).op != DYNAMIC_QUANTIZE:
        return False
    source = em.source_of(em.value(mat1), "DequantizeLinear")
    if source is None:
        return False
    (xq, xs, xz), _ = source
    q, scale = found
    wt = em.const(q.t().contiguous(), torch.int8, f"{node.name}/w_int8")
    wz = em.const(torch.zeros(q.shape[0], dtype=torch.int8), torch.int8, f"{node.name}/w_zero")
    acc = em.add("MatMulInteger", [xq, wt, xz, wz], hint=f"{node.name}/int32")
    as_float = em.add("Cast", [acc], hint=f"{node.name}/f32", to=_FLOAT)
    both = em.add("Mul", [xs, em.const(scale.float(), torch.float32, f"{node.name}/w_scale")],
                  hint=f"{node.name}/scale")
    if bias is None:
        em.add("Mul", [as_float, both], out=node.name)
        return True
    scaled = em.add("Mul", [as_float, both], hint=f"{node.name}/scaled")
    em.add("Add", [scaled, em.value(bias, torch.float32)], out=node.name)
    return True
