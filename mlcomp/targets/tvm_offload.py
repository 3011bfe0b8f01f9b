"""Which Relax ops of a TVM build run in a vendor kernel, and the rewrite that sends them there.

:func:`offload` walks each Relax function (after BatchNorm folding and constant
folding, before legalization) and replaces every float32 ``conv2d`` (NCHW/OIHW, any
stride, padding, dilation or groups, so depthwise too) and every float32 ``matmul``
by a ``call_pure_packed`` to a :mod:`mlcomp.targets.tvm_kernels` function; a
``matmul`` by a constant ``[K, N]`` weight followed by the ``add`` of a constant
``[N]`` bias becomes one ``linear`` (``F.linear`` with the weight stored back in torch's
``[N, K]`` layout, as eager calls it: the bias rides in the GEMM).
Everything else (activations, residual adds, norms, softmax, pooling, the shift a
folded BatchNorm leaves after a convolution) stays in Relax, so TVM legalizes and
fuses it as before: ``add`` + ``relu`` after a convolution is one fused TVM kernel.
Matrix–vector products go to torch too: measured on the zoo (mlp and gru at batch 1,
one thread), DLight's GEMV schedule was 3× and 2× slower than ``addmm`` there.  A
low-precision op stays in TVM (its dtype rules are TVM's).

    before:  lv3 = R.matmul(lv2, metadata["relax.expr.Constant"][4], out_dtype="void")   # [32, 512] x [512, 10]
             lv4 = R.add(lv3, metadata["relax.expr.Constant"][5])
    after:   lv4 = R.call_pure_packed("mlcomp.torch.linear", lv2, <metadata[4] transposed: [10, 512]>, metadata[5],
                                      ty_args=(R.Tensor((32, 10), dtype="float32"),))

The returned :class:`OffloadReport` counts each op by where it runs and why
(``conv2d ×20 → torch (oneDNN/MKL CPU kernels)``); it goes into the build's stats, the
manifest and ``--explain``.  One pass over the bindings: O(n).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from mlcomp.targets.tvm_kernels import KERNELS, kernel_library

__all__ = ["OffloadReport", "offload"]

_CONV = "relax.nn.conv2d"
_MATMUL = "relax.matmul"


@dataclass
class OffloadReport:
    """Per op kind: how many ran in a kernel (by packed-function name) and how many stayed in TVM (by reason)."""

    kernels: Counter = field(default_factory=Counter)          # packed-function name -> count
    kept: Counter = field(default_factory=Counter)             # (op, reason) -> count

    def to_json(self) -> dict[str, Any]:
        return {"kernels": {name: {"op": KERNELS[name].op, "count": n, "runs_in": kernel_library(name).describe()}
                            for name, n in sorted(self.kernels.items())},
                "kept_in_tvm": [{"op": op, "count": n, "reason": why}
                                for (op, why), n in sorted(self.kept.items())]}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "OffloadReport":
        return cls(Counter({name: int(v["count"]) for name, v in data.get("kernels", {}).items()}),
                   Counter({(k["op"], k["reason"]): int(k["count"]) for k in data.get("kept_in_tvm", [])}))

    def lines(self) -> list[str]:
        """``conv2d ×20 → torch 2.x (oneDNN/MKL CPU kernels)`` and ``matmul ×3 → TVM (…reason)``."""
        out = [f"{KERNELS[name].op} ×{n} → {kernel_library(name).describe()} via packed function {name}"
               for name, n in sorted(self.kernels.items())]
        out += [f"{op} ×{n} → TVM codegen ({why})" for (op, why), n in sorted(self.kept.items())]
        return out


def _ty(expr: Any) -> Any:
    return expr.ty if hasattr(expr, "ty") else expr.struct_info


def _static_shape(expr: Any) -> tuple[int, ...] | None:
    shape = getattr(_ty(expr), "shape", None)
    if shape is None:
        return None
    try:
        return tuple(int(d) for d in shape)
    except TypeError:
        return None


def _conv_reason(call: Any) -> str | None:
    """Why this conv2d stays in TVM (None: it goes to the kernel)."""
    attrs = call.attrs
    if str(attrs.data_layout) != "NCHW" or str(attrs.kernel_layout) != "OIHW" or \
            str(attrs.out_layout) not in ("NCHW", ""):
        return f"layout {attrs.data_layout}/{attrs.kernel_layout}"
    dtypes = {str(_ty(a).dtype) for a in call.args} | {str(_ty(call).dtype)}
    if dtypes != {"float32"}:
        return f"dtype {'/'.join(sorted(dtypes))}"
    return None


def _matmul_reason(call: Any) -> str | None:
    dtypes = {str(_ty(a).dtype) for a in call.args} | {str(_ty(call).dtype)}
    if dtypes != {"float32"}:
        return f"dtype {'/'.join(sorted(dtypes))}"
    if _static_shape(call.args[0]) is None or _static_shape(call.args[1]) is None:
        return "symbolic shape"
    return None


def _bias_of(add: Any, product: Any, bias: Any) -> bool:
    """Whether ``add = product + bias`` is a linear layer's bias: a constant ``[N]`` row added to ``x @ w``."""
    w, b = _static_shape(product.args[1]), _static_shape(bias)
    return (w is not None and len(w) == 2 and b in ((w[1],), (1, w[1]))
            and str(_ty(bias).dtype) == "float32" and _static_shape(add) == _static_shape(product))


def offload(mod: Any) -> tuple[Any, OffloadReport]:
    """``mod`` with its float32 conv2d and matmul calls sent to the torch kernels; see the module doc."""
    import numpy as np
    import tvm
    from tvm import relax
    from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

    report = OffloadReport()
    empty = relax.const(np.zeros((0,), dtype="float32"))

    def conv(call: Any, _matches: Any) -> Any:
        if _conv_reason(call):
            return call
        a = call.attrs
        ints = [*a.strides, *a.padding, *a.dilation, a.groups]
        return relax.call_pure_packed("mlcomp.torch.conv2d", call.args[0], call.args[1], empty,
                                      *[relax.prim_value(int(i)) for i in ints], ty_args=_ty(call))

    x, w, b = wildcard(), is_const(), is_const()
    product = is_op(_MATMUL)(x, w)

    def linear(call: Any, matches: Any) -> Any:
        mm = matches[product]
        if _matmul_reason(mm) or not _bias_of(call, mm, matches[b]):
            return call
        bias = matches[b]
        if len(_static_shape(bias)) == 2:
            bias = relax.const(np.from_dlpack(bias.value).reshape(-1))
        # the weight back in torch's [N, K] layout: F.linear then runs eager's own GEMM call
        weight = relax.const(np.ascontiguousarray(np.from_dlpack(matches[w].value).T))
        return relax.call_pure_packed("mlcomp.torch.linear", matches[x], weight, bias, ty_args=_ty(call))

    def matmul(call: Any, _matches: Any) -> Any:
        if _matmul_reason(call):
            return call
        return relax.call_pure_packed("mlcomp.torch.matmul", call.args[0], call.args[1], ty_args=_ty(call))

    out = tvm.IRModule(dict(mod.functions), attrs=mod.attrs) if mod.attrs is not None else mod
    for gv, func in list(mod.functions.items()):
        if not isinstance(func, relax.Function):
            continue
        func = rewrite_call(is_op(_CONV)(wildcard(), wildcard()), conv, func)
        func = rewrite_call(is_op("relax.add")(product, b), linear, func)
        func = rewrite_call(is_op(_MATMUL)(wildcard(), wildcard()), matmul, func)
        out[gv] = func
        relax.analysis.post_order_visit(func, lambda e: _count(e, report))
    return out, report


def _count(expr: Any, report: OffloadReport) -> None:
    """Enter one call of the rewritten function in ``report`` (kernel calls and the ops TVM kept)."""
    import tvm
    from tvm import relax

    if not isinstance(expr, relax.Call) or not isinstance(expr.op, tvm.ir.Op):
        return
    name = expr.op.name
    if name == "relax.call_pure_packed" and isinstance(expr.args[0], relax.ExternFunc) \
            and str(expr.args[0].global_symbol) in KERNELS:
        report.kernels[str(expr.args[0].global_symbol)] += 1
    elif name == _CONV:
        report.kept["conv2d", _conv_reason(expr) or "not matched"] += 1
    elif name == _MATMUL:
        report.kept["matmul", _matmul_reason(expr) or "not matched"] += 1
