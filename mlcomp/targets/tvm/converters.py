"""Converters mlcomp gives TVM's PyTorch importer for ops whose operands may differ in dtype.

torch promotes the operands of ``where`` and of ``div`` (with a rounding mode) to one dtype
(the result's, recorded in the node's ``meta["val"]``); TVM's importer passes them through
unchanged, and Relax rejects binary operators whose operands differ ("Binary operators must
have the same datatype"), e.g. ``where(mask, f32 scores, bf16 constant)`` in a mixed-precision
graph or ``int64 // 2`` (the ``2`` becomes an ``int32`` constant).  These converters cast each
operand to the result dtype torch computed first, which is what torch does:

=====================  =====================================================================
op                     Relax
=====================  =====================================================================
``where.self``         ``where(cond, astype(x, out), astype(y, out))``
``div.Tensor_mode``    ``divide`` / ``floor_divide`` / ``trunc(divide)`` on operands cast to
                       ``out`` (a Python number becomes a constant of ``out``)
=====================  =====================================================================

``CONVERTERS`` is passed as ``from_exported_program(custom_convert_map=...)``; each takes
``(node, importer)``.
"""
from __future__ import annotations

from typing import Any, Callable

__all__ = ["CONVERTERS"]


def _out_dtype(node: Any, importer: Any) -> str:
    return importer._convert_data_type(str(node.meta["val"].dtype))


def _as(value: Any, dtype: str, importer: Any) -> Any:
    """``value`` (a Relax expression or a Python number) as a Relax value of ``dtype``."""
    from tvm import relax

    if not isinstance(value, relax.Expr):
        return relax.const(value, dtype)
    if getattr(value.ty, "dtype", dtype) == dtype:
        return value
    return importer.block_builder.emit(relax.op.astype(value, dtype))


def _where(node: Any, importer: Any) -> Any:
    from tvm import relax

    cond, x, y = importer.retrieve_args(node)[:3]
    out = _out_dtype(node, importer)
    return importer.block_builder.emit(relax.op.where(cond, _as(x, out, importer), _as(y, out, importer)))


def _div(node: Any, importer: Any) -> Any:
    from tvm import relax

    args = importer.retrieve_args(node)
    mode = args[2] if len(args) > 2 else node.kwargs.get("rounding_mode")
    out = _out_dtype(node, importer)
    lhs, rhs = _as(args[0], out, importer), _as(args[1], out, importer)
    emit = importer.block_builder.emit
    if mode == "floor":
        return emit(relax.op.floor_divide(lhs, rhs))
    if mode == "trunc":
        return emit(relax.op.trunc(emit(relax.op.divide(lhs, rhs))))
    return emit(relax.op.divide(lhs, rhs))


CONVERTERS: dict[str, Callable[[Any, Any], Any]] = {"where.self": _where, "div.Tensor_mode": _div}
