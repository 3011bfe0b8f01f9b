"""Large linears on oneDNN with the weight packed at build time and the activation in the GEMM's epilogue.

After the offload (and the small-GEMM probe), each ``mlcomp.torch.linear`` / ``linear_<act>`` call whose
weight is a constant, whose shapes are static and whose GEMM is at least the policy row ``linear-packed``'s
size (:func:`~mlcomp.targets.tvm.offload.policy.decide` with its multiply-adds) becomes a call of
``mlcomp.torch.linear_packed[_<act>]`` (:func:`~mlcomp.targets.tvm.kernels.packed_linear_kernel`):
``mkldnn._linear_pointwise`` on the weight oneDNN packed for this row count, once, now
(:data:`~mlcomp.targets.tvm.kernels.PACKED_WEIGHTS`, keyed by a hash of the weight and the input shape;
a loaded artifact packs at its first call); bias and activation run inside the GEMM::

    before:  lv7 = R.call_pure_packed("mlcomp.torch.linear_relu", lv6, W[1024, 256], b[1024],
                                      ty_args=(R.Tensor((32, 128, 1024), "float32"),))
    after:   lv7 = R.call_pure_packed("mlcomp.torch.linear_packed_relu", lv6, W[1024, 256], b[1024], <key>,
                                      ty_args=(R.Tensor((32, 128, 1024), "float32"),))

oneDNN's GEMM on a packed weight beats ``torch.mm``/``addmm`` on large linears and loses under the bound to
its fixed cost per call (figures: decision 53, ``benchmarks/RESULTS.md``).
A ``*_views`` linear (strided arguments) is left as it is.  One pass over the bindings: O(n) (hashing a
weight is linear in its size).
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import numpy as np

from mlcomp.targets.tvm.kernels import PACKED_WEIGHTS, Activation, Unary, packed_linear_kernel
from mlcomp.targets.tvm.offload.chains import kernel_name, static_shape, ty_of
from mlcomp.targets.tvm.offload.conv_packed import weight_key
from mlcomp.targets.tvm.offload.policy import HostFacts, decide

__all__ = ["PACKABLE", "pack_linears"]

# the linear kernels this pass moves, and the activation their packed call fuses
PACKABLE: dict[str, Unary] = {"mlcomp.torch.linear": Unary.NONE,
                              **{f"mlcomp.torch.linear_{a.value}": Unary(a.value) for a in Activation}}


def _packable(call: Any, host: HostFacts) -> tuple[Unary, int, np.ndarray] | None:
    """(activation, rows, weight) of a linear call the policy sends to the packed kernel, or None."""
    name = kernel_name(call)
    if name not in PACKABLE or not hasattr(call.args[2], "value"):
        return None
    x, w, out = static_shape(call.args[1]), static_shape(call.args[2]), static_shape(call)
    if None in (x, w, out) or len(w) != 2 or {str(ty_of(e).dtype) for e in (*call.args[1:4], call)} != {"float32"}:
        return None
    rows = int(np.prod(x[:-1]))
    if decide("linear", host, "float32", rows * w[0] * w[1]).name != "linear-packed":
        return None
    return PACKABLE[name], rows, np.from_dlpack(call.args[2].value)


def pack_linears(mod: Any, host: HostFacts, report: Any) -> tuple[Any, dict[str, int]]:
    """``mod`` with its large constant-weight linears on packed oneDNN weights (module doc), the weights packed
    now; ``report`` (the offload's :class:`~mlcomp.targets.tvm.offload.rewrite.OffloadReport`) gets their keys
    and counts the moved calls under their new kernels; and how many calls of each kernel moved."""
    import torch
    import tvm
    from tvm import relax

    count: Counter = Counter()

    @relax.expr_functor.mutator
    class _Pack(relax.PyExprMutator):
        def visit_call_(self, call: Any) -> Any:
            call = super().visit_call_(call)
            found = _packable(call, host)
            if found is None:
                return call
            unary, rows, weight = found
            key = weight_key(weight, [], (rows, weight.shape[1]))
            PACKED_WEIGHTS.pack_linear(key, torch.from_numpy(np.ascontiguousarray(weight)), rows)
            report.packed.append(key)
            count[kernel_name(call)] += 1
            return relax.call_pure_packed(packed_linear_kernel(unary), *call.args[1:4], relax.prim_value(key),
                                          ty_args=ty_of(call))

    funcs = {gv: _Pack().visit_expr(f) if isinstance(f, relax.Function) else f for gv, f in mod.functions.items()}
    for name, n in count.items():
        report.kernels[name] -= n
        report.kernels[packed_linear_kernel(PACKABLE[name])] += n
    report.kernels = +report.kernels      # kernels no call uses any more dropped
    return tvm.IRModule(funcs, attrs=mod.attrs, global_infos=mod.global_infos), dict(sorted(count.items()))
