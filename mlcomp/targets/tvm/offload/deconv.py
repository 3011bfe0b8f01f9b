"""Transposed convolutions of a TVM build sent to torch's kernel (``F.conv_transpose2d``, oneDNN).

TVM 0.27 legalizes ``conv2d_transpose`` to a naive TIR loop nest (NCHW only) that no default CPU
schedule covers: on a UNet's two upsampling layers it took longer than all ten of its convolutions
in torch's kernels together.  :func:`conv_transposes` replaces each float32 ``conv2d_transpose``
with a constant IOHW weight and symmetric padding (NCHW, or NHWC where the channels-last layout
of :mod:`~mlcomp.targets.tvm.offload.conv_packed` reached it), with the bias add that follows it,
by one call to ``mlcomp.torch.conv_transpose2d``::

    before:  lv60 = R.nn.conv2d_transpose(lv59, W, strides=[2, 2], padding=[0, 0, 0, 0], data_layout="NHWC",
                                          kernel_layout="IOHW", out_layout="NHWC")
             lv62 = R.add(lv60, b)                                     # [1, 1, 1, 16]
    after:   lv62 = R.call_pure_packed("mlcomp.torch.conv_transpose2d", lv59, W, b[16], 2, 2, 0, 0, 0, 0,
                                       1, 1, 1, 1, ty_args=R.Tensor((1, 64, 64, 16)))   # … groups, nhwc

One ``rewrite_call`` over the bindings: O(n).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from mlcomp.targets.tvm.offload.chains import single_use, static_shape, ty_of

__all__ = ["KERNEL", "conv_transpose_reason", "conv_transposes"]

KERNEL = "mlcomp.torch.conv_transpose2d"
_OP = "relax.nn.conv2d_transpose"


def conv_transpose_reason(call: Any) -> str | None:
    """Why this ``conv2d_transpose`` stays TVM code (None: it goes to torch's kernel)."""
    a = call.attrs
    layout = str(a.data_layout)
    if layout not in ("NCHW", "NHWC") or str(a.kernel_layout) != "IOHW" or str(a.out_layout) not in (layout, ""):
        return f"layout {a.data_layout}/{a.kernel_layout}"
    dtypes = {str(ty_of(e).dtype) for e in (*call.args, call)}
    if dtypes != {"float32"}:
        return f"dtype {'/'.join(sorted(dtypes))}"
    if static_shape(call) is None or not hasattr(call.args[1], "value"):
        return "symbolic shape or a weight that is not a constant"
    pad = [int(p) for p in a.padding]
    if pad[:2] != pad[2:]:
        return f"asymmetric padding {pad}"
    return None


def conv_transposes(func: Any) -> Any:
    """``func`` with its float32 ``conv2d_transpose`` (+ bias add) as torch calls (module doc)."""
    from tvm import relax
    from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

    empty = relax.const(np.zeros((0,), dtype="float32"))
    deconv, bias = is_op(_OP)(wildcard(), is_const()), is_const()
    biased = is_op("relax.add")(deconv, bias)
    once = single_use(func)

    def rewrite(call: Any, m: Any) -> Any:
        d = m[deconv]
        if conv_transpose_reason(d):
            return call
        a, out = d.attrs, static_shape(d)
        nhwc = str(a.data_layout) == "NHWC"
        channels = out[3] if nhwc else out[1]
        b = empty
        if biased in m:
            shapes = ((1, 1, 1, channels), (channels,)) if nhwc else ((1, channels, 1, 1), (channels, 1, 1))
            if d not in once or static_shape(m[bias]) not in shapes or str(ty_of(m[bias]).dtype) != "float32":
                return call
            b = relax.const(np.ascontiguousarray(np.from_dlpack(m[bias].value).reshape(-1)))
        pad = [int(p) for p in a.padding]
        ints = [*[int(s) for s in a.strides], pad[0], pad[1], *[int(p) for p in a.output_padding],
                *[int(x) for x in a.dilation], int(a.groups), int(nhwc)]
        return relax.call_pure_packed(KERNEL, d.args[0], d.args[1], b, *[relax.prim_value(i) for i in ints],
                                      ty_args=ty_of(call))

    func = rewrite_call(biased, rewrite, func)
    return rewrite_call(deconv, rewrite, func)
