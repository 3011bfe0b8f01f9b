"""Matrix products over a contraction of length 1 as broadcast multiplies, before TVM lowers them.

A ``matmul`` whose shared dimension is 1 (``Linear(1, N)``, MobileViT's one-channel attention
``[B, M, 1] @ [B, 1, N]``) legalizes to a reduction block whose reduction loop TVM drops as a
unit loop, leaving a block with an ``init`` but no reduction axis.  Schedules then mistake it
for a spatial block: DLight's GEMV rule stops on an ``assert`` (no reduction loop to
normalise), and inlining a bias ``add`` into it applies the bias in the ``init`` and again in
the update (wrong numbers).  The product over one term is the outer product, so it becomes
the elementwise multiply of the broadcast operands, the same value exactly (``0 + a * b``)::

    before:  lv1 = R.matmul(x: [4, 1], w: [1, 8], out_dtype="float32")
    after:   lv1 = R.multiply(x: [4, 1], w: [1, 8])                   # [4, 8], broadcast

Operands are cast to ``out_dtype`` first when it differs (a bf16 product is exact in fp32).
"""
from __future__ import annotations

from typing import Any

__all__ = ["unit_k_matmuls"]


def _dims(expr: Any) -> list[Any] | None:
    shape = getattr(getattr(expr, "ty", None), "shape", None)
    return None if shape is None else list(shape.values)


def _unit(dim: Any) -> bool:
    from tvm import tirx

    return isinstance(dim, tirx.IntImm) and int(dim) == 1


def unit_k_matmuls(mod: Any) -> Any:
    """``mod`` with every ``R.matmul`` of 2-D or higher operands whose shared dimension is 1 a ``R.multiply``."""
    from tvm import relax
    from tvm.relax.dpl import is_op, rewrite_call, wildcard

    lhs, rhs = wildcard(), wildcard()
    pattern = is_op("relax.matmul")(lhs, rhs)

    def rewrite(call: Any, found: dict) -> Any:
        a, b = found[lhs], found[rhs]
        da, db = _dims(a), _dims(b)
        if da is None or db is None or len(da) < 2 or len(db) < 2 or not (_unit(da[-1]) and _unit(db[-2])):
            return call
        out = str(call.attrs.out_dtype) if call.attrs.out_dtype is not None else ""
        if out and out != "void":
            a = a if a.ty.dtype == out else relax.op.astype(a, out)
            b = b if b.ty.dtype == out else relax.op.astype(b, out)
        return relax.op.multiply(a, b)

    for gvar, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            mod[gvar] = rewrite_call(pattern, rewrite, func)
    return mod
