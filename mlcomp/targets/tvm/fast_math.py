"""Vectorisable softmax and gelu for the TVM code of a CPU build.

TVM 0.27 legalizes ``R.nn.softmax`` and ``R.nn.gelu``/``R.erf`` to ``T.exp``/``T.erf``, which LLVM
emits as one scalar libm call per element, several times slower than torch's vectorised kernels.
:func:`fast_math` rewrites the float32 ones to TOPI's polynomial ``fast_softmax`` / ``fast_erf``,
which vectorise.  Their error against torch's own softmax and exact gelu is at the level of the
exact TVM kernels' (below 1e-6; figures in ``benchmarks/RESULTS.md``), within every verification
tolerance mlcomp uses.  Other dtypes are left alone::

    before:  lv27 = R.nn.softmax(lv26, axis=-1)
             lv2 = R.nn.gelu(lv1)
    after:   lv27 = R.call_tir(fast_softmax, (lv26,), out_sinfo=R.Tensor((2, 4, 32, 32), "float32"))
             lv = R.multiply(lv1, R.const(0.70710678, "float32")); e = R.call_tir(fast_erf, (lv,), …)
             lv2 = R.multiply(R.multiply(lv1, R.const(0.5)), R.add(R.const(1.0), e))

Where a GEMM with a gelu after it stays in TVM (:mod:`mlcomp.targets.tvm.offload.gemm`), TVM fuses this
gelu into the GEMM's epilogue.  One pass over the bindings: O(n).
"""
from __future__ import annotations

from typing import Any

from mlcomp.targets.tvm.offload.chains import ty_of

__all__ = ["fast_math", "gelu_exact"]

_SQRT_HALF = 0.7071067811865476


_REWRITTEN = ("relax.nn.softmax", "relax.nn.gelu", "relax.erf", "relax.tanh", "relax.power")


def _small_power(exponent: Any) -> int | None:
    """2 or 3 when ``exponent`` is that scalar constant (torch computes ``x ** 3`` as ``x * x * x`` too)."""
    import numpy as np

    if not hasattr(exponent, "value"):
        return None
    value = np.from_dlpack(exponent.value)
    if value.size != 1:
        return None
    got = float(value.reshape(-1)[0])
    return int(got) if got in (2.0, 3.0) else None


def _float32(expr: Any) -> bool:
    return str(getattr(ty_of(expr), "dtype", "")) == "float32"


def gelu_exact(bb: Any, x: Any) -> Any:
    """``0.5·x·(1 + erf(x/√2))`` on ``bb`` with TOPI's ``fast_erf`` (torch's exact gelu, vectorisable)."""
    from tvm import relax, topi

    scaled = bb.emit(relax.op.multiply(x, relax.const(_SQRT_HALF, "float32")))
    erf = bb.emit_te(topi.fast_erf, scaled)
    half = bb.emit(relax.op.multiply(x, relax.const(0.5, "float32")))
    return relax.op.multiply(half, relax.op.add(relax.const(1.0, "float32"), erf))


def fast_math(mod: Any) -> tuple[Any, dict[str, int]]:
    """``mod`` with its float32 softmax, exact gelu and erf as TOPI's fast kernels, and how many of each."""
    from tvm import relax, topi
    from tvm.relax import PyExprMutator, expr_functor

    counts = {"softmax": 0, "gelu": 0, "erf": 0, "tanh": 0, "power": 0}

    @expr_functor.mutator
    class FastMath(PyExprMutator):
        def visit_call_(self, call: Any) -> Any:
            call = super().visit_call_(call)
            name = getattr(call.op, "name", "")
            if name not in _REWRITTEN or not _float32(call):
                return call
            if name == "relax.power":
                cube = _small_power(call.args[1])
                if cube is None:
                    return call
                counts["power"] += 1
                x = call.args[0]
                return relax.op.multiply(x, x) if cube == 2 else relax.op.multiply(relax.op.multiply(x, x), x)
            if name == "relax.tanh":
                counts["tanh"] += 1
                return self.builder_.call_te(topi.fast_tanh, call.args[0])
            if name == "relax.nn.softmax":
                counts["softmax"] += 1
                return self.builder_.call_te(topi.nn.fast_softmax, call.args[0], int(call.attrs.axis))
            if name == "relax.erf":
                counts["erf"] += 1
                return self.builder_.call_te(topi.fast_erf, call.args[0])
            counts["gelu"] += 1
            return gelu_exact(self.builder_, call.args[0])

    mutator = FastMath(mod)
    for gv, func in mod.functions_items():
        if isinstance(func, relax.Function):
            mutator.builder_.update_func(gv, mutator.visit_expr(func))
    return mutator.builder_.get(), counts
