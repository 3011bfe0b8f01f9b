"""Constant folding of Relax's weight arithmetic in numpy, before TVM's own ``FoldConstant``.

TVM's ``FoldConstant`` evaluates each call whose operands are all constants by legalizing it to a
PrimFunc, compiling that with LLVM and running it: one LLVM build per distinct op and shape.
The weight arithmetic of a build is made of such calls: ``FoldBatchnormToConv2D`` leaves, per
BatchNorm, ``sqrt``/``divide``/``multiply``/``subtract`` of its statistics and a ``reshape`` and
``multiply`` of the conv's weight; ``ConvertLayout`` leaves a ``permute_dims`` per weight.  On a
ResNet-18 that is about two hundred LLVM builds, most of a TVM build's seconds.

:func:`fold_constants` walks each Relax function's bindings once and evaluates, in numpy, every
call of an op in :data:`FOLDERS` whose operands are constants (or values it folded already);
each such binding becomes the constant, and TVM's ``FoldConstant`` afterwards only substitutes
them (and still folds any constant call of an op not in the table).  Every op of the table is
exactly rounded in IEEE arithmetic (``+ - * /``, ``sqrt``, negation) or moves values without
arithmetic (reshape, transpose, …), so numpy computes the same bits TVM's build would::

    before:  lv3 = R.sqrt(R.add(var, eps));  lv4 = R.divide(gamma, lv3)
             lv6 = R.reshape(lv4, [64, 1, 1, 1]);  lv7 = R.multiply(W, lv6)      # W: [64, 3, 7, 7]
    after:   lv7 = metadata["relax.expr.Constant"][k]                            # W * gamma / sqrt(var + eps)

A result whose shape or dtype differs from the call's static type is left to TVM.  One pass over
the bindings: O(n) calls plus the constants' sizes.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from mlcomp.targets.tvm.offload.chains import rebuild, static_shape, ty_of

__all__ = ["FOLDERS", "fold_constants", "fold_constants_module"]

Folder = Callable[[list[np.ndarray], Any], np.ndarray]


def _axes(call: Any, name: str) -> tuple[int, ...] | None:
    value = getattr(call.attrs, name)
    return None if value is None else tuple(int(a) for a in value)


# Relax op -> numpy evaluation (operands, the call for its attributes and static shape)
FOLDERS: dict[str, Folder] = {
    "relax.add": lambda a, c: np.add(a[0], a[1]),
    "relax.subtract": lambda a, c: np.subtract(a[0], a[1]),
    "relax.multiply": lambda a, c: np.multiply(a[0], a[1]),
    "relax.divide": lambda a, c: np.divide(a[0], a[1]),
    "relax.sqrt": lambda a, c: np.sqrt(a[0]),
    "relax.negative": lambda a, c: np.negative(a[0]),
    "relax.reshape": lambda a, c: a[0].reshape(static_shape(c)),
    "relax.broadcast_to": lambda a, c: np.broadcast_to(a[0], static_shape(c)).copy(),
    "relax.permute_dims": lambda a, c: np.ascontiguousarray(np.transpose(a[0], _axes(c, "axes"))),
    "relax.expand_dims": lambda a, c: a[0].reshape(static_shape(c)),
    "relax.squeeze": lambda a, c: a[0].reshape(static_shape(c)),
    "relax.astype": lambda a, c: a[0].astype(str(ty_of(c).dtype)),
}
# operands beyond the data that a folder reads from the call's attributes or static shape instead
_SHAPE_OPERAND = frozenset({"relax.reshape", "relax.broadcast_to"})
# dtypes numpy computes as TVM does (bfloat16 and the float8s have no numpy dtype)
_DTYPES = frozenset({"float16", "float32", "float64", "int8", "int16", "int32", "int64", "uint8", "bool"})


def _dtype(expr: Any) -> str:
    """The dtype of a tensor or scalar expression, as text (``float32``)."""
    ty = ty_of(expr)
    return str(getattr(ty, "dtype", ty))


def _operand(expr: Any, folded: dict) -> np.ndarray | None:
    """The numpy value of a constant operand or a value folded before; None otherwise."""
    from tvm import relax

    if isinstance(expr, relax.Var):
        return folded.get(expr)
    if isinstance(getattr(expr, "value", None), (int, float)) and _dtype(expr) in _DTYPES:
        return np.asarray(expr.value, dtype=_dtype(expr))      # a scalar immediate (a BatchNorm's eps)
    if hasattr(expr, "value") and hasattr(expr.value, "__dlpack__") and _dtype(expr) in _DTYPES:
        return np.from_dlpack(expr.value)
    return None


def _evaluate(value: Any, folded: dict) -> np.ndarray | None:
    """``value`` evaluated in numpy when it is a call of a table op on constants of a plain dtype."""
    import tvm
    from tvm import relax

    if not (isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op)) or value.op.name not in FOLDERS:
        return None
    args = value.args[:1] if value.op.name in _SHAPE_OPERAND else value.args
    operands = [_operand(a, folded) for a in args]
    shape, dtype = static_shape(value), _dtype(value)
    if not operands or any(o is None for o in operands) or shape is None or dtype not in _DTYPES:
        return None
    with np.errstate(all="ignore"):      # inf/nan fold as TVM's build computes them
        out = np.asarray(FOLDERS[value.op.name](operands, value))
    return out if out.shape == shape and str(out.dtype) == dtype else None


def fold_constants(func: Any) -> tuple[Any, int]:
    """``func`` with every table op on constants replaced by its value; (function, calls folded)."""
    from tvm import relax

    folded: dict = {}
    for block in func.body.blocks:
        for b in block.bindings:
            if isinstance(b, relax.VarBinding):
                out = _evaluate(b.value, folded)
                if out is not None:
                    folded[b.var] = out
    # the dtype said: relax.const narrows an int64 (float64) array to int32 (float32) on its own
    return rebuild(func, {var: relax.const(out, str(out.dtype)) for var, out in folded.items()}), len(folded)


def fold_constants_module(mod: Any) -> tuple[Any, int]:
    """:func:`fold_constants` of every Relax function of ``mod``; (module, calls folded)."""
    import tvm
    from tvm import relax

    out = tvm.IRModule(dict(mod.functions), attrs=mod.attrs) if mod.attrs is not None else mod
    count = 0
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            out[gv], n = fold_constants(func)
            count += n
    return out, count
