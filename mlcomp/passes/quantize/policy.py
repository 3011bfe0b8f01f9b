"""Which ops ``quantize`` computes in int8, and what each of their inputs is.

One row per op that ONNX Runtime has an int8 kernel for, the ops its own
``quantize_static`` (QDQ format) puts pairs around; ORT fuses
``DequantizeLinear → op → QuantizeLinear`` into the kernel named in the row:

========================  ============================  =================================
op                        ORT kernel                    inputs quantized
========================  ============================  =================================
convolution               QLinearConv                   input; weight per channel; bias int32
addmm / mm                QGemm / QLinearMatMul         input; weight per channel; bias int32
bmm                       QLinearMatMul                 both operands (attention's products)
add.Tensor                QLinearAdd                    both operands (residual connections)
mul.Tensor                QLinearMul                    both operands, when both are tensors
_softmax                  QLinearSoftmax                input; output on the fixed grid [0, 1]
mean.dim (over H, W)      QLinearGlobalAveragePool      input (a global average pool, kept 4-d)
========================  ============================  =================================

Each row says which arguments are activations (quantized per tensor, uint8, range
observed on calibration data; the two operands of a product of activations on the
grids the target needs: :mod:`~mlcomp.passes.quantize.grids`), whether its kernel can write float
(a linear's: its output then gets a pair only when an int8 op reads it), which one is the weight (int8, symmetric, one scale
per output channel) and which is the bias (int32 with scale ``input scale × weight
scale``, what the integer kernels accumulate in), and a fixed output range when the
op's is known without observing (softmax's ``[0, 1]``, as ORT's quantizer uses).
Layer norm, GELU, reductions and everything else keep float (ORT has no int8 kernel
for them).  A target can add rows its lowering alone has (:data:`TARGET_ROWS`): openvino's
``scaled_dot_product_attention``, its ``q`` and ``k`` quantized and ``v`` float (the CPU plugin's
int8 attention kernel); ``quantize`` then first recovers attention from its decomposition::

    >>> rule = int8_rule(aten("convolution"))
    >>> rule.activations, rule.weight, rule.weight_axis, rule.bias
    ((0,), 1, 0, 2)
    >>> int8_rule(aten("_softmax")).fixed_output
    (0.0, 1.0)
    >>> int8_rule(aten("native_layer_norm")) is None
    True
    >>> sdpa = aten("scaled_dot_product_attention")
    >>> int8_rule(sdpa) is None, int8_rule(sdpa, "openvino").activations
    (True, (0, 1))
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping

from mlcomp.ir.ops import Op, aten

__all__ = ["Int8Rule", "INT8_POLICY", "TARGET_ROWS", "int8_rule"]


@dataclass(frozen=True)
class Int8Rule:
    activations: tuple[int, ...]     # argument positions quantized per tensor (uint8)
    weight: int | None = None        # argument position of the weight (int8 per channel) when it is a constant
    weight_axis: int = 0             # the output-channel axis of the weight as the op reads it
    bias: int | None = None          # argument position of the bias (int32), when a constant
    fixed_output: tuple[float, float] | None = None   # the output's range when known without observing
    product: bool = False            # a matrix product: two activation operands take the target's product grids
    float_output: bool = False       # its int8 kernel can write float (QGemm, MatMulIntegerToFloat, FullyConnected)


INT8_POLICY: Mapping[Op, Int8Rule] = MappingProxyType({
    aten("convolution"): Int8Rule(activations=(0,), weight=1, weight_axis=0, bias=2),
    aten("addmm"): Int8Rule(activations=(1,), weight=2, weight_axis=1, bias=0, product=True, float_output=True),
    aten("mm"): Int8Rule(activations=(0,), weight=1, weight_axis=1, product=True, float_output=True),
    aten("bmm"): Int8Rule(activations=(0, 1), product=True),
    aten("add.Tensor"): Int8Rule(activations=(0, 1)),
    aten("mul.Tensor"): Int8Rule(activations=(0, 1)),
    aten("_softmax"): Int8Rule(activations=(0,), fixed_output=(0.0, 1.0)),
    aten("mean.dim"): Int8Rule(activations=(0,)),
})


TARGET_ROWS: Mapping[str, Mapping[Op, Int8Rule]] = MappingProxyType({
    "openvino": MappingProxyType({
        aten("scaled_dot_product_attention"): Int8Rule(activations=(0, 1), product=True, float_output=True),
    }),
})
"""Target -> rows only its lowering has: OpenVINO's CPU plugin runs a whole attention (``Q·Kᵀ``, softmax,
``P·V``) as one kernel that takes ``Q`` and ``K`` in int8 and ``V`` in float, and writes float."""


def int8_rule(op: Op, target: str | None = None) -> Int8Rule | None:
    """The row for ``op`` (on ``target``, whose own rows count too), or ``None`` (the op keeps float)."""
    return INT8_POLICY.get(op) or TARGET_ROWS.get(target or "", {}).get(op)
