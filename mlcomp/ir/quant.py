"""Quantize/dequantize as IR ops: ``mlcomp.quantize_linear`` and ``mlcomp.dequantize_linear``.

Both are composite ops (:func:`mlcomp.ir.ops.composite`) whose torch implementation computes
exactly what ONNX's ``QuantizeLinear``/``DequantizeLinear`` compute, so the interpreter's
numbers are the numbers an int8 runtime produces (fake quantization in float32)::

    quantize_linear(x, scale, zero_point, axis)   = saturate(round_half_even(x / scale) + zero_point)
    dequantize_linear(q, scale, zero_point, axis) = (q - zero_point) * scale

``scale`` (float32) and ``zero_point`` (whose dtype, int8/uint8/int32, is the quantized
dtype) are tensors: 0-d for one scale per tensor, 1-d for one per slice along ``axis``::

    >>> x = torch.tensor([0.25, 0.75, -3.0, 400.0])
    >>> q = QUANTIZE.resolve()(x, torch.tensor(0.5), torch.tensor(0, dtype=torch.int8), 1)
    >>> q                                        # 0.5 and 1.5 round to even; 800 saturates
    tensor([  0,   2,  -6, 127], dtype=torch.int8)
    >>> DEQUANTIZE.resolve()(q, torch.tensor(0.5), torch.tensor(0, dtype=torch.int8), 1)
    tensor([ 0.0000,  1.0000, -3.0000, 63.5000])

``mlcomp.dynamic_quantize_linear(x)`` is ``DynamicQuantizeLinear`` then its dequantize: the
uint8 grid is measured on each call (ONNX's rounding and saturation), so no calibration::

    >>> DYNAMIC_QUANTIZE.resolve()(torch.tensor([-1.0, 0.0, 3.0]))      # grid step 4/255, 0 exact
    tensor([-1.0039,  0.0000,  2.9961])
"""
from __future__ import annotations

from typing import Any

import torch

from mlcomp.ir.ops import Category, Op, composite

__all__ = ["QUANTIZE", "DEQUANTIZE", "DYNAMIC_QUANTIZE", "quantize_linear", "dequantize_linear",
           "dynamic_quantize_linear", "is_qdq", "QDQ_ARGUMENTS", "QUANT_RANGES"]

QDQ_ARGUMENTS = ("x", "scale", "zero_point", "axis")      # both ops, in this order
QUANT_RANGES = {torch.int8: (-128, 127), torch.uint8: (0, 255), torch.int32: (-2 ** 31, 2 ** 31 - 1)}


def _along(t: torch.Tensor, axis: int, rank: int) -> torch.Tensor:
    """A per-axis vector shaped to broadcast along ``axis`` of a rank-``rank`` tensor; 0-d stays."""
    if t.dim() == 0:
        return t
    shape = [1] * rank
    shape[axis % rank] = t.numel()
    return t.reshape(shape)


def quantize_linear(x: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int = 1) -> Any:
    """``saturate(round_half_even(x / scale) + zero_point)`` in ``zero_point``'s dtype."""
    lo, hi = QUANT_RANGES[zero_point.dtype]
    s = _along(scale, axis, x.dim()).to(torch.float32)
    z = _along(zero_point, axis, x.dim()).to(torch.float32)
    return torch.clamp(torch.round(x.to(torch.float32) / s) + z, lo, hi).to(zero_point.dtype)


def dequantize_linear(q: torch.Tensor, scale: torch.Tensor, zero_point: torch.Tensor, axis: int = 1) -> Any:
    """``(q - zero_point) * scale`` in float32."""
    s = _along(scale, axis, q.dim()).to(torch.float32)
    z = _along(zero_point, axis, q.dim())
    return (q.to(torch.int32) - z.to(torch.int32)).to(torch.float32) * s


def dynamic_quantize_linear(x: torch.Tensor) -> Any:
    """``dequantize(DynamicQuantizeLinear(x))``: uint8 over ``[min(x, 0), max(x, 0)]`` measured on this call."""
    x = x.to(torch.float32)
    lo = torch.clamp(x.amin(), max=0.0)
    hi = torch.clamp(x.amax(), min=0.0)
    scale = (hi - lo) / 255.0
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    zero = torch.clamp(torch.round(-lo / scale), 0, 255)
    q = torch.clamp(torch.round(x / scale) + zero, 0, 255)
    return (q - zero) * scale


# plain functions (code generators name them by module and qualified name) with the composite attributes
for _fn in (quantize_linear, dequantize_linear):
    _fn.category = Category.ELEMWISE            # type: ignore[attr-defined]
    _fn.arguments = QDQ_ARGUMENTS               # type: ignore[attr-defined]
dynamic_quantize_linear.category = Category.ELEMWISE    # type: ignore[attr-defined]
dynamic_quantize_linear.arguments = ("x",)              # type: ignore[attr-defined]

QUANTIZE = composite("quantize_linear", quantize_linear)
DEQUANTIZE = composite("dequantize_linear", dequantize_linear)
DYNAMIC_QUANTIZE = composite("dynamic_quantize_linear", dynamic_quantize_linear)


def is_qdq(op: Op) -> bool:
    """Whether ``op`` is one of the quantization ops."""
    return op == QUANTIZE or op == DEQUANTIZE or op == DYNAMIC_QUANTIZE
