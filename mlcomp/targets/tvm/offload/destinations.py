"""Torch kernels that write into tensors the Relax VM allocates (destination passing), not into fresh ones.

A ``call_pure_packed`` torch kernel returns a tensor torch allocated (``malloc``): tens of MB per model
call on a batch-32 transformer, freed again within the call, and where glibc's heap lands (grown, trimmed,
grown again) the pages come back zeroed by the kernel each call.  :func:`to_destinations` turns every call
of a kernel that can write its result into a given tensor (:data:`~mlcomp.targets.tvm.kernels.INTO_KERNELS`:
the GEMM family and ``mean`` run their ``out=`` variants; a ``*_views`` kernel that rearranges its result
does its rearranging copy into it) into a ``call_dps_packed`` of its ``*_into`` variant.  Relax then plans
those tensors as it plans its own kernels' outputs (``StaticPlanBlockMemory``: one storage shared by
values whose lifetimes do not overlap) and the VM takes them from its pooled allocator, which keeps them
from call to call::

    before:  lv = R.call_pure_packed("mlcomp.torch.linear", x, w, b, ty_args=(R.Tensor((32, 128, 768), "float32"),))
    after:   lv = R.call_dps_packed("mlcomp.torch.linear_into", (x, w, b),
                                    out_sinfo=R.Tensor((32, 128, 768), "float32"))

Kept as they are: a result whose shape is not static (its storage could not be planned), a kernel with no
copy-free ``out=`` (SDPA, layer norm, convolutions: torch has none, or one that computes and copies), and a
``*_views`` call whose result is not rearranged by a copy.  One pass over the bindings: O(n).
"""
from __future__ import annotations

from collections import Counter
from typing import Any

from mlcomp.targets.tvm.kernels import INTO_KERNELS, KERNELS
from mlcomp.targets.tvm.offload.chains import decode, kernel_name, static_shape, ty_of

__all__ = ["into_name", "to_destinations"]


def into_name(call: Any) -> str | None:
    """The ``*_into`` kernel that can run torch kernel call ``call`` into a VM-allocated tensor, or None."""
    from tvm import relax

    name = kernel_name(call)
    if name is None or f"{name}_into" not in INTO_KERNELS or static_shape(call) is None \
            or not isinstance(ty_of(call), relax.TensorType):
        return None
    if not KERNELS[name].into and decode(call)[1] is None:
        return None      # no rearranging copy to land in the tensor, and the kernel itself has no out=
    return f"{name}_into"


def to_destinations(mod: Any) -> tuple[Any, dict[str, int]]:
    """``mod`` with every torch kernel call that can write into a VM-allocated tensor doing so (module doc);
    and how many calls of each kernel now do."""
    import tvm
    from tvm import relax

    count: Counter = Counter()

    @relax.expr_functor.mutator
    class _Into(relax.PyExprMutator):
        def visit_call_(self, call: Any) -> Any:
            call = super().visit_call_(call)
            into = into_name(call)
            if into is None:
                return call
            count[kernel_name(call)] += 1
            return relax.call_dps_packed(relax.ExternFunc(into), relax.Tuple(list(call.args[1:])), ty_of(call))

    funcs = {gv: _Into().visit_expr(f) if isinstance(f, relax.Function) else f for gv, f in mod.functions.items()}
    return tvm.IRModule(funcs, attrs=mod.attrs, global_infos=mod.global_infos), dict(sorted(count.items()))
