"""The 8-bit grid each quantized activation goes on, per target: where a zero point is allowed.

Most activations go on ONNX's asymmetric uint8 grid over their observed ``[min, max]``
(with 0 in it): its zero point places 0.0 exactly, every level is used.  A product of
two activations (attention's ``Q·Kᵀ`` and ``P·V``: ``bmm``, or ``mm`` whose weight is not
a constant) is where runtimes differ:

==============  ======================  ======================  =========================================
target          first operand           second operand          why
==============  ======================  ======================  =========================================
openvino        zero point 0            int8, zero point 0      its CPU plugin runs a ``MatMul`` of two
                                                                activations in u8/i8 × i8 only when
                                                                neither operand has a zero point; else f32
onnxruntime     uint8 min-max           uint8 min-max           ``QLinearMatMul`` takes zero points on
                                                                both operands (``quantize_static``'s u8×u8)
==============  ======================  ======================  =========================================

``zero point 0`` is uint8 over ``[0, max]`` when the operand is never negative (a softmax's
probabilities: no level lost), else int8 over ``[-a, a]``, ``a = max(|min|, |max|)``;
``int8, zero point 0`` is always the latter (the plugin's second operand is signed).
The two rows are the schemes :data:`PRODUCT_SCHEMES` names (``quantize{products=...}`` picks one
whatever the target); a target without a row takes ``minmax``::

    >>> operand_grids("openvino")
    (<Grid.ZERO_FREE: 'zero-free'>, <Grid.SIGNED: 'signed'>)
    >>> grid_params(-1.0, 3.0, Grid.MINMAX)        # 255 steps over [-1, 3]; 0.0 is level 64
    (0.01568627543747425, 64, torch.uint8)
    >>> grid_params(0.0, 0.5, Grid.ZERO_FREE)      # never negative: uint8 from 0
    (0.0019607844296842813, 0, torch.uint8)
    >>> grid_params(-1.0, 3.0, Grid.ZERO_FREE)     # int8 over [-3, 3]
    (0.023622047156095505, 0, torch.int8)
"""
from __future__ import annotations

import enum
from types import MappingProxyType
from typing import Mapping

import torch

from mlcomp.passes.quantize.observe import uint8_params

__all__ = ["Grid", "PRODUCT_SCHEMES", "PRODUCT_OPERANDS", "PLAIN_GRIDS", "operand_grids", "plain_grid", "grid_params"]


class Grid(enum.Enum):
    """How an activation's range becomes an 8-bit grid."""

    MINMAX = "minmax"         # uint8 over [min(lo, 0), max(hi, 0)]: a zero point unless lo >= 0
    UNSIGNED = "unsigned"     # minmax, its zero point never 128 (127 or 129: the side with room keeps the range)
    ZERO_FREE = "zero-free"   # zero point 0: uint8 over [0, hi] when lo >= 0, else int8 over [-a, a]
    SIGNED = "signed"         # int8 over [-a, a], zero point 0


PRODUCT_SCHEMES: Mapping[str, tuple[Grid, Grid]] = MappingProxyType({
    "minmax": (Grid.MINMAX, Grid.MINMAX),
    "zero-free": (Grid.ZERO_FREE, Grid.SIGNED),
})
"""Scheme name -> the grids of the two operands of an activation × activation product."""

PRODUCT_OPERANDS: Mapping[str, str] = MappingProxyType({"openvino": "zero-free", "onnxruntime": "minmax"})
"""Target -> its scheme for products of two activations (see the table above)."""


def operand_grids(target: str | None) -> tuple[Grid, Grid]:
    """The grids of an activation × activation product's operands on ``target`` (``minmax`` when it has no row)."""
    return PRODUCT_SCHEMES[PRODUCT_OPERANDS.get(target or "", "minmax")]


PLAIN_GRIDS: Mapping[str, Grid] = MappingProxyType({"openvino": Grid.UNSIGNED})
"""Target -> the grid of an activation read by anything but a product of two activations (default min-max).
OpenVINO's CPU plugin reads a uint8 grid whose zero point is 128 (``[-128 s, 127 s]``) as the signed int8
grid and runs its linear with signed activations, a slower kernel on VNNI than uint8 with a zero point."""


def plain_grid(target: str | None) -> Grid:
    """The grid of ``target``'s activations outside products of two activations.

    >>> plain_grid("openvino"), plain_grid("onnxruntime")
    (<Grid.UNSIGNED: 'unsigned'>, <Grid.MINMAX: 'minmax'>)
    >>> grid_params(-1.0, 0.99, Grid.MINMAX)[1], grid_params(-1.0, 0.99, Grid.UNSIGNED)[1]
    (128, 129)
    """
    return PLAIN_GRIDS.get(target or "", Grid.MINMAX)


def grid_params(lo: float, hi: float, grid: Grid, levels: int = 127) -> tuple[float, int, torch.dtype]:
    """Scale, zero point and integer dtype of ``grid`` over the observed range ``[lo, hi]``; an int8 grid spans
    ``[-levels, levels]`` (63 where the CPU's int8 dot product saturates).

        >>> round(grid_params(-1.0, 3.0, Grid.SIGNED, levels=63)[0], 6)    # 3 / 63
        0.047619
    """
    if grid in (Grid.MINMAX, Grid.UNSIGNED) or (grid is Grid.ZERO_FREE and lo >= 0.0):
        scale, zero = uint8_params(max(lo, 0.0) if grid is Grid.ZERO_FREE else lo, hi)
        if grid is Grid.UNSIGNED and zero == 128:
            zero = 127 if -lo <= hi else 129
        return scale, zero, torch.uint8
    a = max(abs(lo), abs(hi))
    scale = float(torch.tensor(a / levels, dtype=torch.float32))
    if scale == 0.0 or not torch.isfinite(torch.tensor(scale)):
        return 1.0, 0, torch.int8
    return scale, 0, torch.int8
