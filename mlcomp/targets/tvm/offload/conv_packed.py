"""TVM's convolutions on prepacked oneDNN kernels, channels-last, epilogues fused.

Two steps of the untuned CPU build (:mod:`mlcomp.targets.tvm.offload.rewrite` runs the second):

:func:`to_channels_last` turns the Relax module NHWC around its convolutions (Relax's
``ConvertLayout`` with conv2d → NHWC/OHWI; the weights' transposes are constant-folded; a
``clip`` that ConvertLayout leaves NCHW between two permutes is moved back inside), so every
conv reads and writes contiguous NHWC tensors and the permutes are left only at the edges.

:func:`pack_convs` replaces each NHWC conv2d, with the bias add (BatchNorm's folded shift),
a residual add and an activation that follow it, by one ``call_pure_packed`` to a
``mlcomp.torch.conv2d_cl[_add][_act]`` kernel (:func:`~mlcomp.targets.tvm.kernels.channels_last_kernel`):
``mkldnn._convolution_pointwise`` (``.binary`` with the add) on a channels-last view of the
NHWC input, its weight packed by oneDNN once, at build time (:data:`~mlcomp.targets.tvm.kernels.PACKED_WEIGHTS`,
keyed by a hash of the weight, the conv's parameters and the input shape; a loaded artifact packs
at its first call)::

    before:  lv5 = R.nn.conv2d(lv3, W_ohwi, strides=[1, 1], padding=[1, 1, 1, 1], data_layout="NHWC", …)
             lv10 = R.add(lv5, b)                    # [1, 1, 1, 64]: BatchNorm's shift
             lv11 = R.add(lv10, lv3)                 # the residual
             lv12 = R.nn.relu(lv11)
    after:   lv12 = R.call_pure_packed("mlcomp.torch.conv2d_cl_add_relu", lv3, W_oihw, b[64], lv3,
                                       1, 1, 1, 1, 1, 1, 1, <key>, ty_args=R.Tensor((1, 32, 32, 64)))

Where it pays (measured, one thread, thread CPU time, AVX2 EPYC, median of 200 calls; µs for
NCHW ``F.conv2d`` / channels-last ``F.conv2d`` / packed channels-last, relu fused): batch 1:
depthwise 32ch@32² 120/82/69, 96ch s2 128/79/69; 1×1 32→16@32² 33/30/66; lenet 1→6 5×5 81/81/69,
6→16 81/74/58; 64ch@32² 1036/938/883; 512ch@4² 1907/3802/907.  Batch 32: depthwise 1258/817/659,
1×1 998/527/493, lenet 1→6 410/411/572, 6→16 366/300/279, 64ch 44163/25682/25090, 512ch
33504/30183/23499.  The packed call wins or ties per conv except on single-channel inputs; whole
models measured in ``benchmarks/tvm_schedules.py`` (see docs/ARCHITECTURE.md).  The rule
(:func:`channels_last_reason`): convert when torch has the fused kernel (probed), every conv is
float32, 2-D, symmetric padding, and at least :data:`MIN_CONV_CHANNELS` input channels on average
weighted by MACs (a stack of single-channel convs, where the packed call lost, stays NCHW).
Otherwise the module keeps the NCHW ``mlcomp.torch.conv2d`` path.  Each step is one pass over
the bindings (O(n); hashing a weight is linear in its size).
"""
from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from mlcomp.targets.tvm.offload.chains import single_use, static_shape, ty_of
from mlcomp.targets.tvm.kernels import PACKED_WEIGHTS, Unary, channels_last_kernel, packed_conv_available
from mlcomp.targets.tvm.offload.policy import HostFacts, rule

__all__ = ["MIN_MEAN_CONV_MACS", "PACK_1X1_MIN_MACS", "channels_last_reason", "pack_convs", "to_channels_last",
           "weight_key", "worth_packing"]

_CONV = "relax.nn.conv2d"
# a module goes channels-last when its convs average this many multiply-adds (policy row conv2d-packed)
MIN_MEAN_CONV_MACS = rule("conv2d-packed").min_size
# 1×1 convs below this many multiply-adds run unpacked (F.conv2d; policy row conv2d-1x1-unpacked): the packed call's fixed cost
# outweighs its gain there (figures in benchmarks/RESULTS.md)
PACK_1X1_MIN_MACS = rule("conv2d-1x1-unpacked").max_size + 1
_UNARY = {"relax.nn.relu": Unary.RELU, "relax.sigmoid": Unary.SIGMOID, "relax.nn.gelu": Unary.GELU,
          "relax.nn.gelu_tanh": Unary.GELU_TANH, "relax.clip": Unary.HARDTANH}


def _convs(mod: Any) -> list[Any]:
    from tvm import relax

    found: list[Any] = []
    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, lambda e: found.append(e) if isinstance(e, relax.Call) and
                                            getattr(e.op, "name", None) == _CONV else None)
    return found


def channels_last_reason(mod: Any, host: HostFacts | None = None) -> str | None:
    """Why ``mod``'s convolutions stay NCHW (None: they go channels-last and packed); see the module doc.

    ``host``: the machine's facts (default: probed), of which ``packed_conv`` matters here.
    """
    convs = _convs(mod)
    if not convs:
        return "no conv2d"
    if not (host.packed_conv if host is not None else packed_conv_available()):
        return "this torch has no oneDNN fused convolution (mkldnn._convolution_pointwise)"
    macs = 0
    for c in convs:
        a, x, w, out = c.attrs, static_shape(c.args[0]), static_shape(c.args[1]), static_shape(c)
        if str(a.data_layout) != "NCHW" or str(a.kernel_layout) != "OIHW" or None in (x, w, out):
            return f"a conv2d with layout {a.data_layout}/{a.kernel_layout} or a symbolic shape"
        if {str(ty_of(e).dtype) for e in (*c.args, c)} != {"float32"} or not hasattr(c.args[1], "value"):
            return "a conv2d that is not float32 with a constant weight"
        pad = [int(p) for p in a.padding]
        if pad[:2] != pad[2:]:
            return f"a conv2d with asymmetric padding {pad}"
        macs += int(np.prod(out)) * int(np.prod(w[1:]))
    if macs < MIN_MEAN_CONV_MACS * len(convs):
        return (f"convolutions of {macs / len(convs) / 1e6:.1f} M multiply-adds on average, under "
                f"{MIN_MEAN_CONV_MACS / 1e6:.1f} M: the packed calls' fixed cost measured slower")
    return None


def to_channels_last(mod: Any) -> Any:
    """``mod`` with every conv2d NHWC/OHWI and the layout propagated (call inside the build's target)."""
    import tvm
    from tvm import relax

    from mlcomp.targets.tvm.const_fold import fold_constants_module

    mod = relax.transform.ConvertLayout({_CONV: ["NHWC", "OHWI"]})(mod)
    out = tvm.IRModule(dict(mod.functions), attrs=mod.attrs) if mod.attrs is not None else mod
    for gv, func in list(mod.functions.items()):
        if isinstance(func, relax.Function):
            out[gv] = _clip_inside(func)
    out, _ = fold_constants_module(out)          # the weights' transposes, in numpy
    return tvm.transform.Sequential([relax.transform.FoldConstant(),
                                     relax.transform.DeadCodeElimination(["main"])])(out)


def _clip_inside(func: Any) -> Any:
    """``clip(permute(y))`` → ``permute(clip(y))``, then ``permute(permute(z))`` that cancel → ``z``.

    ConvertLayout leaves ``clip`` (relu6) NCHW between two permutes; moved before its permute, it
    reaches the conv's epilogue and the permutes meet and cancel.
    """
    from tvm import relax
    from tvm.relax.dpl import is_op, rewrite_call, wildcard

    axes = lambda e: [int(i) for i in e.attrs.axes]  # noqa: E731
    y = wildcard()
    inner = is_op("relax.permute_dims")(y)
    once = single_use(func)

    def swap(call: Any, m: Any) -> Any:
        if m[inner] not in once or static_shape(m[y]) is None:
            return call
        return relax.op.permute_dims(relax.Call(call.op, [m[y], *call.args[1:]], call.attrs), axes(m[inner]))

    func = rewrite_call(is_op("relax.clip")(inner, wildcard(), wildcard()), swap, func)
    once = single_use(func)

    def cancel(call: Any, m: Any) -> Any:
        first, second = axes(m[inner]), axes(call)
        if m[inner] not in once or [first[i] for i in second] != list(range(len(first))):
            return call
        return m[y]

    return rewrite_call(is_op("relax.permute_dims")(inner), cancel, func)



def worth_packing(weight_shape: tuple[int, ...], out_nhwc: tuple[int, ...]) -> bool:
    """Whether a conv runs packed (else ``F.conv2d`` on the channels-last view): all but 1×1 convs under
    :data:`PACK_1X1_MIN_MACS` multiply-adds, where the packed call's fixed cost outweighs its gain (module doc)."""
    o, i, kh, kw = weight_shape
    return (kh, kw) != (1, 1) or int(np.prod(out_nhwc)) * i >= PACK_1X1_MIN_MACS


def _number(prim: Any) -> float:
    """The float of a ``R.prim_value`` (``T.float64(6.0)``)."""
    v = prim.value
    return float(getattr(v, "value", v))


def weight_key(w: np.ndarray, ints: list[int], input_shape: tuple[int, ...]) -> int:
    """The :data:`PACKED_WEIGHTS` key of a conv: a 62-bit hash of what its packed weight depends on."""
    h = hashlib.blake2b(np.ascontiguousarray(w).tobytes(), digest_size=8)
    h.update(np.asarray([*w.shape, *ints, *input_shape], dtype=np.int64).tobytes())
    return int.from_bytes(h.digest(), "little") >> 2


def pack_convs(func: Any, keys: list[int]) -> Any:
    """``func`` with its NHWC conv2d (+ bias, + residual add, + activation) as packed oneDNN calls.

    Largest match first: ``act(conv + b + other)``, ``conv + b + other``, ``act(conv + b)``,
    ``conv + b``, ``conv``; an intermediate read elsewhere stops the fusion there.  The weights
    are packed now; their keys are appended to ``keys``.
    """
    import torch
    from tvm import relax
    from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

    empty = relax.const(np.zeros((0,), dtype="float32"))
    conv, bias, other = is_op(_CONV)(wildcard(), is_const()), is_const(), wildcard()
    biased = is_op("relax.add")(conv, bias)
    core = biased | conv
    sums = (is_op("relax.add")(core, other), is_op("relax.add")(other, core))
    summed = sums[0] | sums[1]

    def unary_of(call: Any) -> tuple[Unary, list[float]]:
        op = call.op.name
        if op not in _UNARY:
            return Unary.NONE, []
        if op == "relax.clip":
            return Unary.HARDTANH, [_number(call.args[1]), _number(call.args[2])]
        return _UNARY[op], []

    def rewrite(call: Any, m: Any) -> Any:
        once = _single_use_cache[0]
        c = m[conv]
        a, x, w, out = c.attrs, static_shape(c.args[0]), static_shape(c.args[1]), static_shape(c)
        if str(a.data_layout) != "NHWC" or str(a.kernel_layout) != "OHWI" or str(a.out_layout) not in ("NHWC", "") \
                or None in (x, w, out) or {str(ty_of(e).dtype) for e in (*c.args, c)} != {"float32"}:
            return call
        pad = [int(p) for p in a.padding]
        if pad[:2] != pad[2:]:
            return call
        unary, scalars = unary_of(call)
        total = next((m[p] for p in sums if p in m), None)
        chain = [c] + ([m[biased]] if biased in m else []) + ([total] if total is not None else [])
        if any(e not in once for e in chain if not e.same_as(call)):
            return call
        b = empty
        if biased in m:
            if static_shape(m[bias]) not in ((1, 1, 1, out[3]), (out[3],)) or str(ty_of(m[bias]).dtype) != "float32":
                return call
            b = relax.const(np.ascontiguousarray(np.from_dlpack(m[bias].value).reshape(-1)))
        add = total is not None
        if add and (static_shape(m[other]) != out or str(ty_of(m[other]).dtype) != "float32"
                    or hasattr(m[other], "value")):
            return call
        weight = np.ascontiguousarray(np.from_dlpack(c.args[1].value).transpose(0, 3, 1, 2))   # OHWI → OIHW
        ints = [*[int(s) for s in a.strides], pad[0], pad[1], *[int(d) for d in a.dilation], int(a.groups)]
        nchw = (x[0], x[3], x[1], x[2])
        key = 0
        if worth_packing(weight.shape, out):
            key = weight_key(weight, ints, nchw)
            PACKED_WEIGHTS.pack(key, torch.from_numpy(weight), ints[2:4], ints[:2], ints[4:6], ints[6], list(nchw))
            keys.append(key)
        args = [c.args[0], relax.const(weight), b, m[other] if add else empty,
                *[relax.prim_value(i) for i in (*ints, key)], *[relax.prim_value(s) for s in scalars]]
        return relax.call_pure_packed(channels_last_kernel(unary, add), *args, ty_args=ty_of(call))

    _single_use_cache = [single_use(func)]
    for top in (summed, core):
        pattern = is_op("relax.clip")(top, wildcard(), wildcard())
        for act in _UNARY:
            if act != "relax.clip":
                pattern = pattern | is_op(act)(top)
        func = rewrite_call(pattern, rewrite, func)
        _single_use_cache[0] = single_use(func)
        func = rewrite_call(top, rewrite, func)
        _single_use_cache[0] = single_use(func)
    return func
