"""The ONNX emitter's rules for elementwise and reduction ops (IR node → ONNX nodes), and their helpers.

Each rule reads the node's bound arguments and the metas the IR already has, and matches
ATen exactly: scalars take the dtype ATen's type promotion gives (the node's own output dtype
for arithmetic, ``torch.result_type`` of the operands for comparisons), dims are normalised,
no dims reduce every axis.  What a rule does not match it declines (:class:`Decline`)::

    %sub = aten.sub.Tensor(1, %sigmoid_1)          sub/self = initializer f32[] 1.0;  sub = Sub(sub/self, sigmoid_1)
    %gelu = aten.gelu.default(%x)                  gelu = Gelu(x)   (opset 20; below, the Erf form ORT fuses)

Shape ops are in :mod:`mlcomp.targets.onnx.emit_shapes`, layers (Gemm, Conv, pools, norms,
GRU) in :mod:`mlcomp.targets.onnx.emit_nn`.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mlcomp.ir import Node, Ref
from mlcomp.ir.ops import aten

if TYPE_CHECKING:
    from mlcomp.targets.onnx.emit import Emitter

__all__ = ["OPS_RULES", "Decline", "Rule", "normalize_dim", "out_dtype", "promoted"]

Rule = Callable[["Emitter", Node, dict[str, Any]], None]


class Decline(Exception):
    """The emitter does not match ATen here; the message says why (the export falls back)."""


def normalize_dim(dim: int, rank: int) -> int:
    """``dim`` in ``[0, rank)`` (a 0-d tensor counts as rank 1, as in ATen's wrap_dim)."""
    r = max(rank, 1)
    if not -r <= dim < r:
        raise Decline(f"dim {dim} is out of range for rank {rank}")
    return dim % r


def out_dtype(node: Node) -> torch.dtype:
    """The dtype of the node's value (of its first element for a tuple node)."""
    meta = node.meta[0] if isinstance(node.meta, tuple) else node.meta
    if meta is None:
        raise Decline(f"%{node.name} has no tensor value")
    return meta.dtype


def promoted(em: Emitter, *values: Any) -> torch.dtype:
    """ATen's result type of ``values`` (tensors by their metas on the meta device, scalars as they are)."""
    args = [torch.empty(em.meta(v).shape, dtype=em.meta(v).dtype, device="meta") if isinstance(v, Ref) else v
            for v in values]
    dtype = torch.result_type(args[0], args[1]) if len(args) > 1 else args[0].dtype
    for extra in args[2:]:
        dtype = torch.promote_types(dtype, extra.dtype if isinstance(extra, torch.Tensor) else
                                    torch.result_type(torch.empty((), dtype=dtype), extra))
    return dtype


def _unary(op_type: str) -> Rule:
    def rule(em: Emitter, node: Node, a: dict[str, Any]) -> None:
        em.add(op_type, [em.value(a["self"], out_dtype(node))], out=node.name)
    return rule


def _predicate(op_type: str) -> Rule:
    """Ops whose bool output says something about their input (IsNaN, Not)."""
    def rule(em: Emitter, node: Node, a: dict[str, Any]) -> None:
        dtype = torch.bool if op_type == "Not" else None
        em.add(op_type, [em.value(a["self"], dtype)], out=node.name)
    return rule


def _identity(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    if a.get("memory_format") not in (None, torch.contiguous_format, torch.preserve_format):
        raise Decline(f"memory_format {a['memory_format']} is not emitted")
    em.alias(node, em.value(a["self"]))


def _binary(op_type: str) -> Rule:
    """Arithmetic in the output's dtype (ATen promotes both operands to it; ``alpha`` scales ``other``)."""
    def rule(em: Emitter, node: Node, a: dict[str, Any]) -> None:
        if a.get("rounding_mode") is not None:
            raise Decline(f"rounding_mode={a['rounding_mode']!r} is not emitted")
        dtype = out_dtype(node)
        x = em.value(a["self"], dtype, hint=f"{node.name}/self")
        y = em.value(a["other"], dtype, hint=f"{node.name}/other")
        alpha = a.get("alpha", 1)
        if alpha != 1:
            y = em.add("Mul", [y, em.value(alpha, dtype, hint=f"{node.name}/alpha")], hint=f"{node.name}/scaled")
        em.add(op_type, [x, y], out=node.name)
    return rule


def _rsub(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    dtype = out_dtype(node)
    x = em.value(a["self"], dtype)
    if a["alpha"] != 1:
        x = em.add("Mul", [x, em.value(a["alpha"], dtype, hint=f"{node.name}/alpha")], hint=f"{node.name}/scaled")
    em.add("Sub", [em.value(a["other"], dtype, hint=f"{node.name}/other"), x], out=node.name)


def _compare(op_type: str, negate: bool = False) -> Rule:
    def rule(em: Emitter, node: Node, a: dict[str, Any]) -> None:
        dtype = promoted(em, a["self"], a["other"])
        x = em.value(a["self"], dtype)
        y = em.value(a["other"], dtype, hint=f"{node.name}/other")
        if negate:
            em.add("Not", [em.add(op_type, [x, y], hint=f"{node.name}/eq")], out=node.name)
        else:
            em.add(op_type, [x, y], out=node.name)
    return rule


def _logical(op_type: str) -> Rule:
    def rule(em: Emitter, node: Node, a: dict[str, Any]) -> None:
        em.add(op_type, [em.value(a["self"], torch.bool), em.value(a["other"], torch.bool)], out=node.name)
    return rule


def _where(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    dtype = out_dtype(node)
    em.add("Where", [em.value(a["condition"], torch.bool), em.value(a["self"], dtype, hint=f"{node.name}/self"),
                     em.value(a["other"], dtype, hint=f"{node.name}/other")], out=node.name)


def _pow(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    dtype = out_dtype(node)
    base = em.value(a["self"], dtype, hint=f"{node.name}/base")
    em.add("Pow", [base, em.value(a["exponent"], dtype, hint=f"{node.name}/exponent")], out=node.name)


def _rsqrt(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    root = em.add("Sqrt", [em.value(a["self"], out_dtype(node))], hint=f"{node.name}/sqrt")
    em.add("Reciprocal", [root], out=node.name)


def _silu(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    x = em.value(a["self"], out_dtype(node))
    em.add("Mul", [x, em.add("Sigmoid", [x], hint=f"{node.name}/sigmoid")], out=node.name)


def _clip(low_key: str | None, high_key: str | None, fixed: tuple[Any, Any] = (None, None)) -> Rule:
    """``Clip(x, min, max)`` with the bounds in the tensor's dtype (hardtanh, clamp, clamp_min/max)."""
    def rule(em: Emitter, node: Node, a: dict[str, Any]) -> None:
        dtype = out_dtype(node)
        low = a[low_key] if low_key else fixed[0]
        high = a[high_key] if high_key else fixed[1]
        if isinstance(low, Ref) or isinstance(high, Ref):
            raise Decline("tensor bounds are not emitted")
        if low is not None and high is not None and low > high:
            raise Decline("min > max (ATen then returns max everywhere)")
        em.add("Clip", [em.value(a["self"], dtype), em.value(low, dtype, hint=f"{node.name}/min"),
                        em.value(high, dtype, hint=f"{node.name}/max")], out=node.name)
    return rule


def _leaky_relu(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    em.add("LeakyRelu", [em.value(a["self"], out_dtype(node))], out=node.name, alpha=float(a["negative_slope"]))


def _hardsigmoid(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    em.add("HardSigmoid", [em.value(a["self"], out_dtype(node))], out=node.name, alpha=1.0 / 6, beta=0.5)


def _gelu(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    """ONNX ``Gelu`` from opset 20; below, the Erf/Tanh form ORT's optimiser fuses back into one kernel."""
    approximate, dtype = a["approximate"], out_dtype(node)
    if approximate not in ("none", "tanh"):
        raise Decline(f"approximate={approximate!r}")
    x = em.value(a["self"], dtype)
    if em.opset >= 20:
        em.add("Gelu", [x], out=node.name, approximate=approximate)
        return
    c = lambda v, h: em.value(v, dtype, hint=f"{node.name}/{h}")
    if approximate == "none":
        inner = em.add("Erf", [em.add("Div", [x, c(2 ** 0.5, "sqrt2")], hint=f"{node.name}/scaled")])
    else:
        cube = em.add("Mul", [em.add("Pow", [x, c(3.0, "three")]), c(0.044715, "k")])
        inner = em.add("Tanh", [em.add("Mul", [em.add("Add", [x, cube]), c((2 / np.pi) ** 0.5, "s")])])
    half = em.add("Mul", [x, c(0.5, "half")])
    em.add("Mul", [half, em.add("Add", [inner, c(1.0, "one")])], out=node.name)


def _to_copy(em: Emitter, node: Node, a: dict[str, Any]) -> None:
    device = a.get("device")
    if device is not None and torch.device(device).type != "cpu":
        raise Decline(f"a copy to {device}")
    if a.get("layout") not in (None, torch.strided):
        raise Decline(f"layout {a['layout']}")
    em.alias(node, em.value(a["self"], out_dtype(node)))


def _softmax(op_type: str) -> Rule:
    def rule(em: Emitter, node: Node, a: dict[str, Any]) -> None:
        if a["half_to_float"]:
            raise Decline("half_to_float")
        axis = normalize_dim(a["dim"], len(node.tensor_meta.shape))
        em.add(op_type, [em.value(a["self"])], out=node.name, axis=axis)
    return rule


def _reduce(op_type: str, cast: bool = True) -> Rule:
    """``ReduceX(x, axes, keepdims)``; no dims (None or ``[]``) reduces every axis, as ATen does.  A mean over
    both spatial axes of an NCHW tensor, kept 4-d, is written ``GlobalAveragePool`` (ORT's
    ``QLinearGlobalAveragePool`` when it reads and feeds quantize/dequantize pairs)."""
    def rule(em: Emitter, node: Node, a: dict[str, Any]) -> None:
        rank = len(em.meta(a["self"]).shape)
        dims = a.get("dim")
        if isinstance(dims, int):
            dims = [dims]
        if a.get("dtype") is not None and a["dtype"] != out_dtype(node):
            raise Decline(f"dtype={a['dtype']}")
        x = em.value(a["self"], out_dtype(node) if cast else None)
        axes = sorted({normalize_dim(d, rank) for d in dims}) if dims else None
        if op_type == "ReduceMean" and rank == 4 and axes == [2, 3] and a.get("keepdim", False):
            em.add("GlobalAveragePool", [x], out=node.name)    # the same mean; ORT has an int8 kernel for it
            return
        inputs = [x]
        if dims:
            inputs.append(em.ints(sorted({normalize_dim(d, rank) for d in dims}), f"{node.name}/axes"))
        em.add(op_type, inputs, out=node.name, keepdims=int(bool(a.get("keepdim", False))))
    return rule


def _any_all(op_type: str) -> Rule:
    """``any``/``all``: whether some/every element is nonzero, as ``ReduceMax``/``ReduceMin`` over 0/1 int32."""
    def rule(em: Emitter, node: Node, a: dict[str, Any]) -> None:
        x, meta = em.value(a["self"]), em.meta(a["self"])
        if meta.dtype is not torch.bool:
            x = em.add("Not", [em.add("Equal", [x, em.value(0, meta.dtype, hint=f"{node.name}/zero")])],
                       hint=f"{node.name}/nonzero")
        ints = em.add("Cast", [x], hint=f"{node.name}/i32", to=6)
        dims = a.get("dim")
        dims = [dims] if isinstance(dims, int) else dims
        inputs = [ints] + ([em.ints(sorted({normalize_dim(d, len(meta.shape)) for d in dims}), f"{node.name}/axes")]
                           if dims else [])
        reduced = em.add(op_type, inputs, hint=f"{node.name}/reduced", keepdims=int(bool(a.get("keepdim", False))))
        em.add("Cast", [reduced], out=node.name, to=9)
    return rule


_UNARY = {"relu": "Relu", "sigmoid": "Sigmoid", "tanh": "Tanh", "exp": "Exp", "log": "Log", "sqrt": "Sqrt",
          "neg": "Neg", "abs": "Abs", "erf": "Erf", "reciprocal": "Reciprocal", "sin": "Sin", "cos": "Cos",
          "floor": "Floor", "ceil": "Ceil", "hardswish": "HardSwish", "sign": "Sign"}

OPS_RULES: dict[Any, Rule] = {
    **{aten(name): _unary(op_type) for name, op_type in _UNARY.items()},
    aten("isnan"): _predicate("IsNaN"), aten("logical_not"): _predicate("Not"),
    aten("rsqrt"): _rsqrt, aten("silu"): _silu, aten("gelu"): _gelu, aten("leaky_relu"): _leaky_relu,
    aten("hardsigmoid"): _hardsigmoid, aten("hardtanh"): _clip("min_val", "max_val"),
    aten("clamp"): _clip("min", "max"), aten("clamp_min"): _clip("min", None), aten("clamp_max"): _clip(None, "max"),
    aten("relu6"): _clip(None, None, (0, 6)),
    **{aten(f"{name}.{overload}"): _binary(op_type)
       for name, op_type in (("add", "Add"), ("sub", "Sub"), ("mul", "Mul"), ("div", "Div"))
       for overload in ("Tensor", "Scalar")},
    aten("div.Tensor_mode"): _binary("Div"), aten("rsub.Scalar"): _rsub, aten("rsub.Tensor"): _rsub,
    aten("maximum"): _binary("Max"), aten("minimum"): _binary("Min"),
    aten("pow.Tensor_Scalar"): _pow, aten("pow.Tensor_Tensor"): _pow,
    **{aten(f"{name}.{overload}"): _compare(op_type, name == "ne")
       for name, op_type in (("eq", "Equal"), ("ne", "Equal"), ("lt", "Less"), ("le", "LessOrEqual"),
                             ("gt", "Greater"), ("ge", "GreaterOrEqual"))
       for overload in ("Tensor", "Scalar")},
    aten("logical_and"): _logical("And"), aten("logical_or"): _logical("Or"),
    aten("where.self"): _where,
    **{aten(name): _identity for name in ("clone", "alias", "detach", "lift_fresh_copy")},
    aten("_to_copy"): _to_copy,
    aten("_softmax"): _softmax("Softmax"), aten("_log_softmax"): _softmax("LogSoftmax"),
    aten("mean.dim"): _reduce("ReduceMean"), aten("sum.dim_IntList"): _reduce("ReduceSum"),
    aten("amax"): _reduce("ReduceMax"), aten("amin"): _reduce("ReduceMin"),
    **{aten(f"{name}.{overload}"): _any_all(op_type) for name, op_type in (("any", "ReduceMax"), ("all", "ReduceMin"))
       for overload in ("dim", "dims", "default")},
}
