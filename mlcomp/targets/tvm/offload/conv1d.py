"""1-d convolutions of a TVM build as 2-d ones over a height of 1, so that torch's conv2d kernel runs them.

TVM 0.27 legalizes ``conv1d`` to a TIR loop nest that no default CPU schedule covers: as TVM code a
wav2vec2's positional convolution (32 channels, 16 taps, 2 groups) takes longer than eager's whole
call (decision 55).
:func:`conv1ds` rewrites each float32 ``conv1d`` (NCW data, OIW weight) into a reshape to NCHW with a
height of 1, a ``conv2d`` (strides ``[1, s]``, padding ``[0, l, 0, r]``, dilation ``[1, d]``, the same
groups) and a reshape back; the plain conv2d offload (:mod:`~mlcomp.targets.tvm.offload.rewrite`) that
runs next sends that ``conv2d`` to ``mlcomp.torch.conv2d`` (``F.conv2d``, oneDNN)::

    before:  lv3 = R.nn.conv1d(lv2, W, strides=[1], padding=[8, 8], dilation=[1], groups=2)   # [2,32,159] -> [2,32,160]
    after:   lv3 = R.reshape(R.nn.conv2d(R.reshape(lv2, R.shape([2, 32, 1, 159])), W4, strides=[1, 1],
                                         padding=[0, 8, 0, 8], dilation=[1, 1], groups=2), R.shape([2, 32, 160]))

``W4`` is ``W`` as ``[O, I, 1, K]`` (a constant reshaped at build time; any other weight through a
``reshape``).  The reshapes move no element.  One ``rewrite_call`` over the bindings: O(n).
"""
from __future__ import annotations

from typing import Any

from mlcomp.targets.tvm.offload.chains import static_shape, ty_of

__all__ = ["conv1d_reason", "conv1ds"]

_OP = "relax.nn.conv1d"


def conv1d_reason(call: Any) -> str | None:
    """Why this ``conv1d`` stays TVM code (None: it becomes a conv2d for torch's kernel)."""
    a = call.attrs
    if str(a.data_layout) != "NCW" or str(a.kernel_layout) != "OIW" or str(a.out_layout) not in ("NCW", ""):
        return f"layout {a.data_layout}/{a.kernel_layout}"
    dtypes = {str(ty_of(e).dtype) for e in (*call.args, call)}
    if dtypes != {"float32"}:
        return f"dtype {'/'.join(sorted(dtypes))}"
    if any(static_shape(e) is None for e in (*call.args, call)):
        return "symbolic shape"
    return None


def conv1ds(func: Any) -> Any:
    """``func`` with each float32 NCW ``conv1d`` as a height-1 ``conv2d`` between two reshapes (module doc)."""
    import numpy as np
    from tvm import relax
    from tvm.relax.dpl import is_op, rewrite_call, wildcard

    def rewrite(call: Any, _matches: Any) -> Any:
        if conv1d_reason(call):
            return call
        a = call.attrs
        (n, c, length), (o, i, k), out = (static_shape(e) for e in (*call.args, call))
        x = relax.op.reshape(call.args[0], (n, c, 1, length))
        w = call.args[1]
        w = (relax.const(np.ascontiguousarray(np.from_dlpack(w.value).reshape(o, i, 1, k)))
             if hasattr(w, "value") else relax.op.reshape(w, (o, i, 1, k)))
        left, right = (int(p) for p in a.padding)
        y = relax.op.nn.conv2d(x, w, strides=(1, int(a.strides[0])), padding=(0, left, 0, right),
                               dilation=(1, int(a.dilation[0])), groups=int(a.groups), out_dtype="float32")
        return relax.op.reshape(y, out)

    return rewrite_call(is_op(_OP)(wildcard(), wildcard()), rewrite, func)
