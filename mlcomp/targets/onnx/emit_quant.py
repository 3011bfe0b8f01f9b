"""ONNX rows of the quantization ops, the integer matrix products, and the softmax between int8 products.

* ``mlcomp.quantize_linear``/``dequantize_linear`` → ``QuantizeLinear``/``DequantizeLinear``
  (one scale per tensor, 0-d, or per slice along ``axis``); ORT fuses the pairs around an op
  into its ``QLinear*`` kernel.
* ``mlcomp.dynamic_quantize_linear`` → ``DynamicQuantizeLinear`` and its ``DequantizeLinear``.
* ``addmm``/``mm`` reading a per-call quantized activation and an int8 weight
  (``permute(dequantize_linear(W int8 [N, K], scale, 0, axis 0))``) →
  ``MatMulInteger(xq, Wᵀ, xz, 0) → Cast → Mul(x scale × w scale) [→ Add bias]``, the pattern ORT
  fuses into ``DynamicQuantizeMatMul`` (a ``DequantizeLinear → MatMul`` after
  ``DynamicQuantizeLinear`` it leaves a float ``Gemm``).
* ``addmm``/``mm`` reading a statically quantized activation and an int8 weight → ORT's
  ``com.microsoft.MatMulIntegerToFloat(xq, Wᵀ, x scale, w scale, x zero, —, bias)``: float output, the
  bias (the pass's int32 bias, dequantized here) added in the kernel; an int8 reader quantizes it
  again.  ORT turns the same graph written as ``DequantizeLinear → Gemm`` into the slower ``QGemm``
  (it broadcasts the bias into the int32 product buffer and accumulates onto it); written as
  ``MatMul → Add``, its ``MatMulAddFusion`` makes a float ``Gemm`` before its quantization transforms
  run; no fusion makes ``MatMulIntegerToFloat`` with a bias from standard ops for a static activation,
  so the emitter writes the kernel by name::

      %addmm = addmm(dequantize_linear(%bias_i32, s_b), dequantize_linear(%xq, s_x, z_x), permute(%w_dq))
                                          addmm = MatMulIntegerToFloat(xq, w_int8ᵀ, s_x, s_w, z_x, '', bias)

* ``_softmax`` of a per-tensor dequantize whose every reader quantizes it → ``Softmax(Cast(xq) × s)``:
  ORT fuses ``DequantizeLinear → Softmax → QuantizeLinear`` into ``QLinearSoftmax``, whose CPU kernel
  is slower than the float ``Softmax`` with its cast and quantize (docs/decisions/0035-*).
  Softmax does not change when a row is shifted, so the zero point drops out: ``softmax(s·(q − z)) =
  softmax(s·q)``, and no ``DequantizeLinear`` is left for the fusion to take.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from mlcomp.ir import Node, Ref
from mlcomp.ir.quant import DEQUANTIZE, DYNAMIC_QUANTIZE, QUANTIZE
from mlcomp.ir.ops import aten
from mlcomp.targets.onnx.emit_ops import OPS_RULES, Rule, normalize_dim

if TYPE_CHECKING:
    from mlcomp.targets.onnx.emit import Emitter

__all__ = ["MS_DOMAIN", "QUANT_RULES", "dynamic_gemm", "static_gemm"]

_FLOAT = 1      # onnx.TensorProto.FLOAT
MS_DOMAIN = "com.microsoft"     # ONNX Runtime's contrib ops


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


def _float_softmax(plain: Rule) -> Rule:
    """``Softmax(Cast(xq) × s)`` for a softmax of a per-tensor dequantize that only quantizes read (the module
    docstring), else ``plain``."""
    def rule(em: "Emitter", node: Node, a: dict[str, Any]) -> None:
        x, readers = a["self"], em.graph.users(node.name)
        pair = em.node_of(x) if isinstance(x, Ref) and not a["half_to_float"] else None
        made = em.source_of(em.value(x), "DequantizeLinear") if pair is not None and pair.op == DEQUANTIZE else None
        if made is None or em.meta(pair.inputs[1]).shape != () or not readers \
                or any(r.op != QUANTIZE for r in readers):
            plain(em, node, a)
            return
        (xq, xs, _), _ = made
        as_float = em.add("Cast", [xq], hint=f"{node.name}/f32", to=_FLOAT)
        scaled = em.add("Mul", [as_float, xs], hint=f"{node.name}/scaled")
        em.add("Softmax", [scaled], out=node.name, axis=normalize_dim(a["dim"], len(node.tensor_meta.shape)))
    return rule


_SOFTMAX = aten("_softmax")
QUANT_RULES: dict[Any, Rule] = {QUANTIZE: _qdq("QuantizeLinear"), DEQUANTIZE: _qdq("DequantizeLinear"),
                                DYNAMIC_QUANTIZE: _dynamic, _SOFTMAX: _float_softmax(OPS_RULES[_SOFTMAX])}


def _int8_weight(em: "Emitter", weight: Any, axis: int = 0) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(int8 2-D, scales) of ``dequantize_linear(W, scale, 0, axis)`` over constants (per tensor, or per
    slice along ``axis``), else ``None``."""
    node = em.node_of(weight) if isinstance(weight, Ref) else None
    if node is None or node.op != DEQUANTIZE:
        return None
    q, scale, zero = (em.constant(r) if isinstance(r, Ref) else None for r in node.inputs[:3])
    along = node.inputs[3] if len(node.inputs) > 3 else node.attrs.get("axis", 1)
    if q is None or scale is None or zero is None or q.dtype != torch.int8 or q.dim() != 2 \
            or bool(torch.count_nonzero(zero)) or (scale.dim() == 1 and along % 2 != axis):
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


def _float_bias(em: "Emitter", bias: Any) -> str | None:
    """The float bias of a static integer product: ``""`` for none, a constant for the pass's
    ``dequantize_linear(int32 bias, scale)`` (its values), the value itself for a float tensor;
    ``None`` for anything else (a computed dequantize)."""
    if bias is None:
        return ""
    node = em.node_of(bias) if isinstance(bias, Ref) else None
    if node is None:
        return None
    if node.op != DEQUANTIZE:
        return em.value(bias, torch.float32) if em.meta(bias).dtype == torch.float32 else None
    q, scale, zero = (em.constant(r) if isinstance(r, Ref) else None for r in node.inputs[:3])
    if q is None or scale is None or zero is None:
        return None
    values = (q.double() - zero.double()) * scale.double()
    return em.const(values.float(), torch.float32, f"{node.name}/f32")


def static_gemm(em: "Emitter", node: Node, mat1: Any, mat2: Any, weight: Ref | None, bias: Any) -> bool:
    """Write ``node`` (``mat1 @ mat2 + bias``; ``mat2`` is ``weightᵀ`` where ``weight`` is given) as
    ``MatMulIntegerToFloat`` when ``mat1`` dequantizes a static per-tensor quantize and the weight is an int8
    dequantize (``[N, K]`` per row, or ``mat2`` itself ``[K, N]`` per column); ``False`` (nothing written)
    otherwise."""
    found = _int8_weight(em, weight) if weight is not None else _int8_weight(em, mat2, axis=1)
    if found is None or not isinstance(mat1, Ref) or em.node_of(mat1).op != DEQUANTIZE:
        return False
    source = em.source_of(em.value(mat1), "DequantizeLinear")
    scale_in = em.node_of(mat1).inputs[1]
    if source is None or not isinstance(scale_in, Ref) or em.meta(scale_in).shape != ():
        return False
    added = _float_bias(em, bias)
    if added is None:
        return False
    (xq, xs, xz), _ = source
    q, scale = found
    wt = em.const(q.t().contiguous() if weight is not None else q, torch.int8, f"{node.name}/w_int8")
    ws = em.const(scale.float(), torch.float32, f"{node.name}/w_scale")
    inputs = [xq, wt, xs, ws, xz, "", added] if added else [xq, wt, xs, ws, xz]
    em.add("MatMulIntegerToFloat", inputs, out=node.name, domain=MS_DOMAIN)
    return True
