"""Elementwise work between torch kernel calls of a TVM build, moved into those calls.

TVM's own loops run serially next to torch's kernels (their thread pools would contend), so work
that sits between two torch calls is cheaper on torch's threads when it is large enough.  The
rewrites of :func:`mlcomp.targets.tvm.offload.rewrite.offload` after the conv/matmul offload:

* :func:`epilogues` (``Fusion.EPILOGUE``): a conv's bias add and a sigmoid/gelu (relu after a large
  linear) into the kernel's call::

      before:  lv60 = <linear>(lv57, w, b); lv62 = R.nn.relu(R.reshape(lv60, …))
      after:   lv = R.call_pure_packed("mlcomp.torch.linear_relu", lv57, w, b, …); lv62 = R.reshape(lv, …)

* :func:`layer_norms` (``Fusion.LAYER_NORM``): (residual add +) layer norm → ``F.layer_norm``;
* :func:`means` (``Fusion.MEAN``): a large mean of a kernel's result → ``torch.mean``.

Each is one ``rewrite_call`` over the function's bindings: O(n).
"""
from __future__ import annotations

from typing import Any

from mlcomp.targets.tvm.offload.chains import maybe, single_use, static_shape, ty_of
from mlcomp.targets.tvm.kernels import KERNELS, Activation, epilogue_kernel
from mlcomp.targets.tvm.offload.policy import rule

__all__ = ["MEAN_MIN_ELEMENTS", "RELU_MIN_ELEMENTS", "epilogues", "layer_norms", "means"]

_PACKED = "relax.call_pure_packed"
_LINEAR = "mlcomp.torch.linear"
# relu after a conv stays in TVM: fused with the conv's bias/BatchNorm shift it is one cheap pass, and
# torch's extra relu_ pass is slower.  After a linear with at least RELU_MIN_ELEMENTS outputs it goes in
# place on torch's threads, where TVM's serial relu would be a visible share of the step.
_ACTIVATIONS = {"relax.sigmoid": Activation.SIGMOID, "relax.nn.gelu": Activation.GELU,
                "relax.nn.gelu_tanh": Activation.GELU_TANH, "relax.nn.relu": Activation.RELU}
RELU_MIN_ELEMENTS = rule("relu-after-linear").min_size   # policy row relu-after-linear
# A float32 mean reading a torch kernel's result goes to torch from MEAN_MIN_ELEMENTS inputs (TVM's
# reduction is serial there); a smaller one stays (a packed call has a fixed cost), and so does one
# after TVM's own loops (they fuse into the reduction).
MEAN_MIN_ELEMENTS = rule("mean").min_size   # policy row mean


def epilogues(func: Any) -> Any:
    """A sigmoid/gelu right after a conv2d/linear kernel (and a conv's bias add before it) go into its call.

    ``act(add(conv2d(x, w, ∅), b[1,C,1,1]))`` → ``conv2d_act(x, w, b)``; ``act(reshape?(k(args)))`` →
    ``reshape?(k_act(args))`` when the kernel's result has no other reader: the activation then
    runs in place on torch's threads, not in a serial TVM loop.
    """
    import numpy as np
    from tvm import relax
    from tvm.relax.dpl import ExternFuncPattern, is_const, is_op, rewrite_call, wildcard

    def kernel(name: str) -> Any:
        return is_op(_PACKED)(ExternFuncPattern(name), varg_default_wildcard=True)

    conv, bias = kernel("mlcomp.torch.conv2d"), is_const()
    biased = is_op("relax.add")(conv, bias)
    inner = kernel("mlcomp.torch.conv2d") | kernel("mlcomp.torch.linear")
    view = is_op("relax.reshape")(inner, wildcard())
    once = single_use(func)
    for op, act in _ACTIVATIONS.items():
        def fuse(call: Any, m: Any, act: Activation = act) -> Any:
            if act is Activation.RELU and (biased in m or str(m[inner].args[0].global_symbol) != _LINEAR
                                           or int(np.prod(static_shape(call) or (0,))) < RELU_MIN_ELEMENTS):
                return call
            if biased in m:   # conv + bias add + act: the bias rides in the conv, the act after it
                c = m[conv]
                channels = static_shape(c)[1] if static_shape(c) else None
                if (c not in once or m[biased] not in once or static_shape(c.args[3]) != (0,)
                        or str(ty_of(m[bias]).dtype) != "float32"
                        or static_shape(m[bias]) not in ((1, channels, 1, 1), (channels, 1, 1))):
                    return call
                b = relax.const(np.ascontiguousarray(np.from_dlpack(m[bias].value).reshape(-1)))
                return relax.call_pure_packed(epilogue_kernel("mlcomp.torch.conv2d", act), c.args[1], c.args[2],
                                              b, *c.args[4:], ty_args=ty_of(c))
            k = m[inner]
            if k not in once or (view in m and m[view] not in once):
                return call
            new = relax.call_pure_packed(epilogue_kernel(str(k.args[0].global_symbol), act), *k.args[1:],
                                         ty_args=ty_of(k))
            return relax.op.reshape(new, m[view].args[1]) if view in m else new

        func = rewrite_call(is_op(op)(biased | view | inner), fuse, func)
        once = single_use(func)
    return func


def layer_norms(func: Any) -> Any:
    """float32 ``layer_norm`` over the last axis → ``F.layer_norm``; with the residual ``add`` before it
    when nothing else reads the sum (``add_layer_norm``)."""
    from tvm import relax
    from tvm.relax.dpl import is_op, rewrite_call, wildcard

    a, b, x, gamma, beta = wildcard(), wildcard(), wildcard(), wildcard(), wildcard()
    total = is_op("relax.add")(a, b)
    once = single_use(func)

    def rewrite(call: Any, m: Any) -> Any:
        shape, attrs = static_shape(call), call.attrs
        axes = [int(i) for i in attrs.axes]
        dtypes = {str(ty_of(e).dtype) for e in (call, m[gamma], m[beta])}
        if (shape is None or dtypes != {"float32"} or axes not in ([-1], [len(shape) - 1])
                or not attrs.center or not attrs.scale):
            return call
        eps = relax.prim_value(float(attrs.epsilon))
        if total in m and m[total] in once and static_shape(m[a]) == shape == static_shape(m[b]) \
                and str(ty_of(m[a]).dtype) == str(ty_of(m[b]).dtype) == "float32":
            return relax.call_pure_packed("mlcomp.torch.add_layer_norm", m[a], m[b], m[gamma], m[beta], eps,
                                          ty_args=ty_of(call))
        return relax.call_pure_packed("mlcomp.torch.layer_norm", call.args[0], m[gamma], m[beta], eps,
                                      ty_args=ty_of(call))

    return rewrite_call(is_op("relax.nn.layer_norm")(total | x, gamma, beta), rewrite, func)


def means(func: Any) -> Any:
    """float32 ``mean(reshape?(k(…)))`` of at least :data:`MEAN_MIN_ELEMENTS` inputs, ``k`` a torch kernel →
    ``torch.mean`` (``mlcomp.torch.mean(x, keepdims, *axes)``)."""
    import numpy as np
    from tvm import relax
    from tvm.relax.dpl import is_op, rewrite_call, wildcard

    kernel = is_op(_PACKED)(wildcard(), varg_default_wildcard=True)

    def rewrite(call: Any, m: Any) -> Any:
        shape, k = static_shape(call.args[0]), m[kernel]
        if (shape is None or not isinstance(k.args[0], relax.ExternFunc) or str(k.args[0].global_symbol) not in KERNELS
                or {str(ty_of(call).dtype), str(ty_of(call.args[0]).dtype)} != {"float32"}
                or int(np.prod(shape)) < MEAN_MIN_ELEMENTS):
            return call
        axes = range(len(shape)) if call.attrs.axis is None else (int(a) % len(shape) for a in call.attrs.axis)
        return relax.call_pure_packed("mlcomp.torch.mean", call.args[0], relax.prim_value(int(call.attrs.keepdims)),
                                      *[relax.prim_value(a) for a in axes], ty_args=ty_of(call))

    return rewrite_call(is_op("relax.mean")(maybe(kernel, "relax.reshape")), rewrite, func)
