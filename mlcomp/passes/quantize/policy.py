"""Which ops ``quantize`` computes in int8, and what each of their inputs is.

One row per op that int8 runtimes have kernels for (ONNX Runtime fuses
``DequantizeLinear → Conv/Gemm/MatMul → QuantizeLinear`` into ``QLinearConv``,
``QGemm``, ``QLinearMatMul``): which arguments are activations (quantized per
tensor, uint8, range observed on calibration data), which one is the weight
(int8, symmetric, one scale per output channel) and which is the bias (int32 with
scale ``input scale × weight scale``, what the integer kernels accumulate in).
Every other op keeps float::

    >>> rule = int8_rule(aten("convolution"))
    >>> rule.activations, rule.weight, rule.weight_axis, rule.bias
    ((0,), 1, 0, 2)
    >>> int8_rule(aten("_softmax")) is None
    True
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from mlcomp.ir.ops import Op, aten

__all__ = ["Int8Rule", "INT8_POLICY", "int8_rule"]


@dataclass(frozen=True)
class Int8Rule:
    activations: tuple[int, ...]     # argument positions quantized per tensor (uint8)
    weight: int | None = None        # argument position of the weight (int8 per channel) when it is a constant
    weight_axis: int = 0             # the output-channel axis of the weight as the op reads it
    bias: int | None = None          # argument position of the bias (int32), when a constant


INT8_POLICY: Mapping[Op, Int8Rule] = MappingProxyType({
    aten("convolution"): Int8Rule(activations=(0,), weight=1, weight_axis=0, bias=2),
    aten("addmm"): Int8Rule(activations=(1,), weight=2, weight_axis=1, bias=0),
    aten("mm"): Int8Rule(activations=(0,), weight=1, weight_axis=1),
    aten("bmm"): Int8Rule(activations=(0, 1)),
})


def int8_rule(op: Op) -> Int8Rule | None:
    """The row for ``op``, or ``None`` (the op keeps float)."""
    return INT8_POLICY.get(op)
