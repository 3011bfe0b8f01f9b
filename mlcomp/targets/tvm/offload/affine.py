"""Per-channel arithmetic after a convolution folded into its weight and one bias add.

TVM's ``FoldBatchnormToConv2D`` folds a BatchNorm only when it reads the conv directly; a conv with
a bias (``nn.Conv2d(..., bias=True)``, usual in UNets) puts an ``add`` between them, and after
``DecomposeOpsForInference`` the BatchNorm is four elementwise ops with per-channel constants that
stay TVM code: a serial loop over the conv's whole output, and the conv's packed call loses its
bias/activation epilogue.  :func:`fold_affine` walks each function once and folds every chain of
``add``/``subtract``/``multiply``/``divide`` by per-channel (or scalar) constants that follows a
float32 ``conv2d`` or ``conv2d_transpose`` with a constant weight (each intermediate read only by
the next op) into the weight and a single bias add::

    before:  lv64 = R.nn.conv2d(lv63, W)           # [1, 16, 64, 64]
             lv66 = R.add(lv64, b)                 # conv bias [1, 16, 1, 1]
             lv81 = R.subtract(lv66, mean); lv85 = R.divide(lv81, std)
             lv87 = R.multiply(lv85, gamma); lv89 = R.add(lv87, beta)
    after:   lv89 = R.add(R.nn.conv2d(lv63, W * s), t)      # s = gamma / std, t = (b - mean) * s + beta

The output is ``s · conv(x, W) + t`` with ``s``, ``t`` per output channel, so ``conv(x, W · s) + t``
is the same value up to rounding.  One pass over the bindings: O(n) (plus the weights' sizes).
"""
from __future__ import annotations

from typing import Any

import numpy as np

from mlcomp.targets.tvm.offload.chains import bindings_of, is_op, rebuild, static_shape, ty_of

__all__ = ["fold_affine", "fold_affine_module"]

# conv op -> (data layout, kernel layout, the weight's output-channel axis)
_CONVS = {"relax.nn.conv2d": ("NCHW", "OIHW", 0), "relax.nn.conv2d_transpose": ("NCHW", "IOHW", 1)}
_STEPS = ("relax.add", "relax.subtract", "relax.multiply", "relax.divide")


def _channel_const(expr: Any, channels: int) -> np.ndarray | None:
    """The ``[C]`` values of a float32 constant that broadcasts per output channel of NCHW, or None."""
    shape = static_shape(expr)
    if not hasattr(expr, "value") or str(ty_of(expr).dtype) != "float32" or shape is None:
        return None
    if shape in ((), (1,)):
        return np.full(channels, float(np.from_dlpack(expr.value).reshape(-1)[0]), dtype=np.float64)
    if shape in ((channels, 1, 1), (1, channels, 1, 1)):
        return np.from_dlpack(expr.value).reshape(-1).astype(np.float64)
    return None


def _foldable_conv(value: Any) -> int | None:
    """The output channels of a float32 NCHW conv with a constant weight that can take a per-channel scale."""
    if not is_op(value, *_CONVS):
        return None
    data, kernel, axis = _CONVS[value.op.name]
    a, out = value.attrs, static_shape(value)
    if (str(a.data_layout), str(a.kernel_layout)) != (data, kernel) or str(a.out_layout) not in (data, "") \
            or out is None or len(out) != 4 or not hasattr(value.args[1], "value"):
        return None
    if {str(ty_of(e).dtype) for e in (*value.args, value)} != {"float32"}:
        return None
    if axis == 1 and int(a.groups) != 1:     # a grouped transposed weight is [I, O/groups, …]
        return None
    return out[1]


def _step(value: Any, source: Any, channels: int, scale: np.ndarray, shift: np.ndarray):
    """(scale, shift) after ``value`` (an add/subtract/multiply/divide of ``source`` and a constant), or None."""
    lhs, rhs = value.args
    if lhs.same_as(source):
        const = _channel_const(rhs, channels)
    elif value.op.name in ("relax.add", "relax.multiply"):
        const = _channel_const(lhs, channels)
    else:
        return None
    if const is None or static_shape(value) != static_shape(source):
        return None
    op = value.op.name
    if op == "relax.add":
        return scale, shift + const
    if op == "relax.subtract":
        return scale, shift - const
    if op == "relax.multiply":
        return scale * const, shift * const
    if np.any(const == 0):
        return None
    return scale / const, shift / const


def fold_affine(func: Any) -> Any:
    """``func`` with each conv's per-channel affine tail folded into its weight and one bias add (module doc)."""
    from tvm import relax

    bound, users, outputs = bindings_of(func)
    chains: dict = {}       # var -> (conv call, channels, scale, shift, steps)
    absorbed: set = set()
    for var, value in bound.items():
        channels = _foldable_conv(value)
        if channels is not None:
            chains[var] = (value, channels, np.ones(channels), np.zeros(channels), 0)
            continue
        if not is_op(value, *_STEPS):
            continue
        source = next((a for a in value.args if isinstance(a, relax.Var) and a in chains), None)
        if source is None or users[source] != 1 or source in outputs:
            continue
        conv, channels, scale, shift, steps = chains[source]
        after = _step(value, source, channels, scale, shift)
        if after is not None:
            chains[var] = (conv, channels, *after, steps + 1)
            absorbed.add(source)
    new = {}
    for var, (conv, channels, scale, shift, steps) in chains.items():
        if var in absorbed or steps == 0 or (steps == 1 and is_op(bound[var], "relax.add")):
            continue    # nothing to fold: a conv alone, or conv + bias already
        axis = _CONVS[conv.op.name][2]
        w = np.from_dlpack(conv.args[1].value).astype(np.float64)
        w = w * scale.reshape([-1 if i == axis else 1 for i in range(w.ndim)])
        scaled = relax.Call(conv.op, [conv.args[0], relax.const(w.astype(np.float32))], conv.attrs)
        new[var] = relax.op.add(scaled, relax.const(shift.astype(np.float32).reshape(1, channels, 1, 1)))
    return rebuild(func, new)


def fold_affine_module(mod: Any) -> Any:
    """:func:`fold_affine` of every Relax function of ``mod``."""
    import tvm
    from tvm import relax

    out = tvm.IRModule(dict(mod.functions), attrs=mod.attrs) if mod.attrs is not None else mod
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            out[gv] = fold_affine(func)
    return out
