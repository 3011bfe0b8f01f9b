"""Vendor kernels for the TVM target: torch's oneDNN/MKL convolution and GEMM behind TVM packed functions.

TVM 0.27's Relax has no default CPU schedule for matmul or convolution and the PyPI wheel no DNNL/BLAS runtime, so
the heavy ops are offloaded (:mod:`mlcomp.targets.tvm.offload.rewrite`) to the functions below, called by the VM by
their ``mlcomp.`` names; arguments and results cross by DLPack without a copy (a ``*_into`` variant writes into the
tensor the VM passes last: :mod:`mlcomp.targets.tvm.offload.destinations`)::

    before (Relax):  lv = R.nn.conv2d(x, metadata["relax.expr.Constant"][0], strides=[2, 2], padding=[3, 3, 3, 3])
    after:           lv = R.call_pure_packed("mlcomp.torch.conv2d", x, metadata[...][0], bias, R.prim_value(2),
                                             …, R.prim_value(1), ty_args=R.Tensor((1, 64, 112, 112), "float32"))

:func:`register_kernels` registers the names (process-wide) once, before a build and a load; besides them only
:data:`PACKED_WEIGHTS` is state.  A module exported with kernels needs torch to load; :data:`KERNELS` lists them.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

import torch
import torch.nn.functional as F

__all__ = ["Activation", "GEMM_ATTENTION_THREADS", "INTO_KERNELS", "Kernel", "KERNELS", "KernelLibrary",
           "PACKED_WEIGHTS", "Unary", "attention_from_packed", "channels_last_kernel", "epilogue_kernel",
           "packed_conv_available", "packed_linear_available", "packed_linear_kernel", "packed_qkv", "register_kernels",
           "views_kernel"]


class KernelLibrary(Enum):
    """Where an offloaded op runs."""
    TORCH = "torch"

    def describe(self) -> str:
        return f"torch {torch.__version__} (oneDNN/MKL CPU kernels)"


def _t(x: Any) -> torch.Tensor:
    return x if isinstance(x, torch.Tensor) else torch.from_dlpack(x)


def _conv2d(x: Any, w: Any, bias: Any, sh: int, sw: int, pt: int, pl: int, pb: int, pr: int,
            dh: int, dw: int, groups: int) -> torch.Tensor:
    """NCHW/OIHW convolution; asymmetric padding is applied to the input first."""
    x = _t(x)
    if (pt, pl) != (pb, pr):
        x, pt, pl = F.pad(x, (pl, pr, pt, pb)), 0, 0
    b = _t(bias)
    out = F.conv2d(x, _t(w), b if b.numel() else None, (sh, sw), (pt, pl), (dh, dw), groups)
    return out if out.is_contiguous() else out.contiguous()


def _conv_transpose2d(x: Any, w: Any, bias: Any, sh: int, sw: int, ph: int, pw: int, oph: int, opw: int,
                      dh: int, dw: int, groups: int, nhwc: int) -> torch.Tensor:
    """Transposed convolution, weight IOHW; ``nhwc``: ``x`` and the result NHWC (as channels-last NCHW views)."""
    xv = _t(x).permute(0, 3, 1, 2) if nhwc else _t(x)
    b = _t(bias)
    out = F.conv_transpose2d(xv, _t(w), b if b.numel() else None, (sh, sw), (ph, pw), (oph, opw), groups, (dh, dw))
    out = out.permute(0, 2, 3, 1) if nhwc else out
    return out if out.is_contiguous() else out.contiguous()


def _matmul(a: Any, b: Any) -> torch.Tensor:
    """``a @ b`` with numpy broadcasting of the leading axes (Relax ``matmul``)."""
    return torch.matmul(_t(a), _t(b))


def _linear(a: Any, w: Any, bias: Any, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ w.T + bias`` (``w`` ``[N, K]``, empty ``bias``: none) by ``F.linear``, or into ``out`` by ``addmm``/``mm``
    on the rows; a strided ``a`` is copied first (one parallel copy and the plain GEMM beat a strided matmul)."""
    a, b = _t(a).contiguous(), _t(bias)
    if out is None:
        return F.linear(a, _t(w), b if b.numel() else None)
    rows, into, wt = a.view(-1, a.shape[-1]), out.view(-1, out.shape[-1]), _t(w).t()
    torch.addmm(b, rows, wt, out=into) if b.numel() else torch.mm(rows, wt, out=into)
    return out


def _attention(q: Any, k: Any, v: Any, scale: float = 1.0, bias: Any = None) -> torch.Tensor:
    """``softmax(scale · q @ k.T) @ v`` over 3-D ``[B, L, D]`` or 4-D ``[b1, b2, L, D]`` views: torch's SDPA (its flash
    kernel reads strided q/k/v); from :data:`GEMM_ATTENTION_THREADS` threads one packed projection's heads
    (:func:`packed_qkv`) run eager's steps (:func:`attention_from_packed`); ``bias``: that projection's, added here."""
    q, k, v = _t(q), _t(k), _t(v)
    if q.dim() == 4:
        qkv, b = packed_qkv(q, k, v), None if bias is None else _t(bias)
        if torch.get_num_threads() >= GEMM_ATTENTION_THREADS and qkv is not None:
            return attention_from_packed(qkv, q.shape[1], float(scale), b)
        parts = () if b is None else [(qkv, b)] if qkv is not None else zip((q, k, v), b.view(3, q.shape[1], 1, -1))
        for t, part in parts:   # views of one fresh tensor: disjoint, added in place
            t.add_(part)
        return F.scaled_dot_product_attention(q, k, v, scale=float(scale))
    return F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), scale=float(scale))[0]

GEMM_ATTENTION_THREADS = 2   # policy row attention-gemms (this file is copied into artifacts: torch only)


def packed_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor | None:
    """The ``[b1, L, 3·E]`` rows holding q, k, v side by side (``E = b2·D``) when the ``[b1, b2, L, D]`` views are
    their heads (a packed in-projection, batch-first), else None; a size-1 axis's stride is not read."""
    if q.dtype != torch.float32 or q.shape != k.shape or q.shape != v.shape:
        return None
    b1, b2, length, depth = q.shape
    e, at = b2 * depth, q.storage_offset()
    rows = (length * 3 * e, depth, 3 * e, 1)        # the stride of a size-1 axis is not read
    if any(n != 1 and s != want for t in (q, k, v) for n, s, want in zip(t.shape, t.stride(), rows)) or \
            (k.storage_offset() - at, v.storage_offset() - at) != (e, 2 * e) or \
            len({t.untyped_storage().data_ptr() for t in (q, k, v)}) != 1:
        return None
    return q.as_strided((b1, length, 3 * e), (length * 3 * e, 3 * e, 1), at)


def attention_from_packed(qkv: torch.Tensor, heads: int, scale: float, bias: Any = None) -> torch.Tensor:
    """Attention over a packed ``[B, L, 3·E]`` projection's heads as eager's multi-head attention runs it: ``bias``
    added and q, k, v split in one pass, a batched GEMM, softmax in place, a batched GEMM; ``[B, heads, L, D]``."""
    batch, length, width = qkv.shape
    depth = width // (3 * heads)
    q, k, v = (t.view(batch * heads, length, depth) for t in
               torch._transform_bias_rescale_qkv(qkv, qkv.new_zeros(width) if bias is None else bias, heads))
    scores = torch.baddbmm(q.new_empty(batch * heads, length, length), q, k.transpose(1, 2), beta=0.0,
                           alpha=scale * depth ** 0.5)
    return torch.bmm(torch.ops.aten._softmax.out(scores, -1, False, out=scores), v).view(batch, heads, length, depth)


def _mean(x: Any, keepdim: int, *axes: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x.mean(axes, keepdim)`` on torch's threads (into ``out`` when given)."""
    return torch.mean(_t(x), dim=[int(a) for a in axes], keepdim=bool(keepdim), out=out)


def _layer_norm(x: Any, weight: Any, bias: Any, eps: float) -> torch.Tensor:
    """Layer norm over the last axis (``F.layer_norm``, torch's threads)."""
    return F.layer_norm(_t(x), _t(x).shape[-1:], _t(weight), _t(bias), eps)


def _add_layer_norm(a: Any, b: Any, weight: Any, bias: Any, eps: float) -> torch.Tensor:
    """``layer_norm(a + b)`` over the last axis: a residual add and the norm after it."""
    x = torch.add(_t(a), _t(b))
    return F.layer_norm(x, x.shape[-1:], _t(weight), _t(bias), eps)


def _add_layer_norm_reuse(a: Any, b: Any, weight: Any, bias: Any, eps: float) -> torch.Tensor:
    """``layer_norm(a + b)``, the sum written over ``b``: a fresh result nothing else reads (``views._reuse_sums``)."""
    a, b = _t(a), _t(b)
    x = b.add_(a) if b.is_contiguous() and b.shape == a.shape else torch.add(a, b)
    return F.layer_norm(x, x.shape[-1:], _t(weight), _t(bias), eps)


class Activation(Enum):
    """An activation applied in place to a kernel's fresh output (``linear_gelu``, ``conv2d_sigmoid``)."""

    SIGMOID = "sigmoid"
    GELU = "gelu"
    GELU_TANH = "gelu_tanh"
    RELU = "relu"

    def apply(self, out: torch.Tensor) -> torch.Tensor:
        if self in (Activation.SIGMOID, Activation.RELU):
            return out.sigmoid_() if self is Activation.SIGMOID else out.relu_()
        return torch.ops.aten.gelu_(out, approximate="tanh" if self is Activation.GELU_TANH else "none")


def _with(fn: Callable[..., torch.Tensor], act: Activation) -> Callable[..., torch.Tensor]:
    def run(*args: Any, **out: torch.Tensor) -> torch.Tensor:
        return act.apply(fn(*args, **out))
    run.__doc__ = f"{fn.__doc__} Then {act.value}, in place, on torch's threads."
    return run


def _views(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` reading tensor arguments as strided views, its result rearranged (``tvm.offload.views``): leading ints
    ``n_in, (pos, rank, sizes, strides, offset)…`` (argument ``pos`` as strided), ``n_out, (rank F, F, P, rank S, S)``
    (``out.reshape(F).permute(P).reshape(S)``), then ``fn``'s own; contiguous, or into ``out``."""
    def run(*args: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        n_in = int(args[0])
        spec, at = [int(a) for a in args[1:1 + n_in]], 0
        n_out = int(args[1 + n_in])
        out_spec = [int(a) for a in args[2 + n_in:2 + n_in + n_out]]
        rest = list(args[2 + n_in + n_out:])
        while at < n_in:
            pos, rank = spec[at], spec[at + 1]
            base = _t(rest[pos])
            rest[pos] = base.as_strided(spec[at + 2:at + 2 + rank], spec[at + 2 + rank:at + 2 + 2 * rank],
                                        base.storage_offset() + spec[at + 2 + 2 * rank])
            at += 3 + 2 * rank
        res = fn(*rest) if out is None or n_out else fn(*rest, out=out)
        if n_out:
            rf = out_spec[0]
            shape, perm = out_spec[1:1 + rf], out_spec[1 + rf:1 + 2 * rf]
            res = res.reshape(shape).permute(perm)
            if out is not None:
                return out.view([shape[p] for p in perm]).copy_(res)
            res = res.reshape(out_spec[2 + 2 * rf:])
        return res if res.is_contiguous() else res.contiguous()

    run.__doc__ = f"{fn.__doc__} Arguments read as strided views, the result rearranged (tvm_views)."
    return run


def _into(fn: Callable[..., torch.Tensor]) -> Callable[..., None]:
    """``fn`` writing its result into the tensor passed last (destination passing: the VM allocates it)."""
    def run(*args: Any) -> None:
        fn(*args[:-1], out=_t(args[-1]))
    run.__doc__ = f"{fn.__doc__} Written into the last argument (tvm_into)."
    return run


class Unary(Enum):
    """The activation oneDNN applies to a channels-last convolution's output (its ``attr`` and algorithm)."""

    NONE = "none"
    RELU = "relu"
    SIGMOID = "sigmoid"
    GELU = "gelu"
    GELU_TANH = "gelu_tanh"
    HARDTANH = "hardtanh"     # clip(lo, hi), e.g. relu6; its two bounds follow the integer arguments

    def onednn(self) -> tuple[str, str]:
        return {"gelu": ("gelu", "none"), "gelu_tanh": ("gelu", "tanh")}.get(self.value, (self.value, ""))


class PackedWeights:
    """oneDNN-packed weights of ``conv2d_cl*`` / ``linear_packed*`` by a key hashing the weight, op parameters and
    input shape; packed by the build (a loaded ``model.so``: at its first call); an entry no module holds
    (:meth:`hold`, :meth:`release`) is dropped, a missing one packed again."""

    def __init__(self) -> None:
        self._packed: dict[int, torch.Tensor] = {}
        self._holders: dict[int, int] = {}
        self._lock = threading.Lock()

    def pack(self, key: int, w: torch.Tensor, padding: list[int], stride: list[int], dilation: list[int],
             groups: int, input_size: list[int]) -> torch.Tensor:
        """The packed form of OIHW weight ``w`` for this convolution, packing it if not cached."""
        return self._get(key, lambda: torch._C._nn.mkldnn_reorder_conv2d_weight(
            w.contiguous().to_mkldnn(), padding, stride, dilation, groups, input_size))

    def pack_linear(self, key: int, w: torch.Tensor, rows: int) -> torch.Tensor:
        """The packed form of ``[N, K]`` linear weight ``w`` for a GEMM of ``rows`` rows, packing it if not cached."""
        return self._get(key, lambda: torch.ops.mkldnn._reorder_linear_weight(w.contiguous(), rows))

    def _get(self, key: int, make: Callable[[], torch.Tensor]) -> torch.Tensor:
        found = self._packed.get(key)
        if found is None:
            with self._lock:
                found = self._packed.setdefault(key, make())
        return found

    def hold(self, keys: list[int]) -> None:
        with self._lock:
            for key in keys:
                self._holders[key] = self._holders.get(key, 0) + 1

    def release(self, keys: list[int]) -> None:
        with self._lock:
            for key in keys:
                self._holders[key] = self._holders.get(key, 0) - 1
                if self._holders[key] <= 0:
                    del self._holders[key]
                    self._packed.pop(key, None)


PACKED_WEIGHTS = PackedWeights()


def packed_conv_available() -> bool:
    """Whether this torch has oneDNN's fused convolution (``mkldnn._convolution_pointwise``), probed."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_convolution_pointwise")


def packed_linear_available() -> bool:
    """Whether this torch has oneDNN's linear on a packed weight (``mkldnn._linear_pointwise``), probed."""
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _packed_linear(unary: Unary) -> Callable[..., torch.Tensor]:
    """``unary(a @ w.T + bias)`` in one oneDNN call (``mkldnn._linear_pointwise``); ``w`` ``[N, K]`` packed once per
    :class:`PackedWeights` key (the last argument) for ``a``'s row count; an empty ``bias``: none."""
    attr, algorithm = unary.onednn()

    def run(a: Any, w: Any, bias: Any, key: int) -> torch.Tensor:
        a, b = _t(a).contiguous(), _t(bias)
        packed = PACKED_WEIGHTS.pack_linear(int(key), _t(w), a.numel() // a.shape[-1])
        return torch.ops.mkldnn._linear_pointwise(a, packed, b if b.numel() else None, attr, [], algorithm)

    run.__doc__ = f"Linear on a prepacked oneDNN weight, bias{'' if unary is Unary.NONE else ' + ' + unary.value} fused."
    return run


def packed_linear_kernel(unary: Unary) -> str:
    """The packed function of a linear on a prepacked oneDNN weight with epilogue ``unary``."""
    return "mlcomp.torch.linear_packed" + ("" if unary is Unary.NONE else f"_{unary.value}")


def _unary_in_place(out: torch.Tensor, unary: Unary, scalars: list[float]) -> torch.Tensor:
    if unary is Unary.HARDTANH:
        return out.clamp_(scalars[0], scalars[1])
    return out if unary is Unary.NONE else Activation(unary.value).apply(out)


def _channels_last_conv(unary: Unary, binary: bool) -> Callable[..., torch.Tensor]:
    """NHWC convolution by oneDNN, prepacked weight, fused epilogue: ``x`` (NHWC), ``w`` (OIHW), ``bias`` (empty: none),
    ``other`` (NHWC, added before the activation when ``binary``), stride, padding, dilation (h, w), groups, the weight
    key (:class:`PackedWeights`; 0: ``F.conv2d`` unpacked), ``unary``'s scalars; NHWC read as channels-last NCHW."""
    attr, algorithm = unary.onednn()

    def run(x: Any, w: Any, bias: Any, other: Any, *rest: Any) -> torch.Tensor:
        sh, sw, ph, pw, dh, dw, groups, key = (int(v) for v in rest[:8])
        scalars = [float(v) for v in rest[8:]]
        xv = _t(x).permute(0, 3, 1, 2)
        pad, stride, dil = [ph, pw], [sh, sw], [dh, dw]
        b = _t(bias) if _t(bias).numel() else None
        if key == 0:   # not worth packing (small 1×1): F.conv2d on the channels-last view, epilogue in place
            out = F.conv2d(xv, _t(w), b, stride, pad, dil, groups)
            if binary:
                out.add_(_t(other).permute(0, 3, 1, 2))
            out = _unary_in_place(out, unary, scalars).permute(0, 2, 3, 1)
            return out if out.is_contiguous() else out.contiguous()
        packed = PACKED_WEIGHTS.pack(key, _t(w), pad, stride, dil, groups, list(xv.shape))
        if binary:
            out = torch.ops.mkldnn._convolution_pointwise.binary(
                xv, _t(other).permute(0, 3, 1, 2), packed, b, pad, stride, dil, groups, "add", None,
                None if unary is Unary.NONE else attr, scalars, algorithm)
        else:
            out = torch.ops.mkldnn._convolution_pointwise(xv, packed, b, pad, stride, dil, groups, attr, scalars,
                                                           algorithm)
        out = out.permute(0, 2, 3, 1)
        return out if out.is_contiguous() else out.contiguous()

    run.__doc__ = (f"NHWC convolution, oneDNN, prepacked weight, fused bias{' + residual add' if binary else ''}"
                   f"{'' if unary is Unary.NONE else ' + ' + unary.value}.")
    return run


def channels_last_kernel(unary: Unary, binary: bool) -> str:
    """The packed function of a channels-last convolution with epilogue ``unary`` (after ``+ other``)."""
    return "mlcomp.torch.conv2d_cl" + ("_add" if binary else "") + ("" if unary is Unary.NONE else f"_{unary.value}")


@dataclass(frozen=True)
class Kernel:
    """One packed function: its TVM name, what it runs, and the Python callable."""
    name: str
    op: str
    library: KernelLibrary
    fn: Callable[..., torch.Tensor]
    into: bool = False     # ``fn(..., out=t)`` writes its result into ``t`` with no copy (``*_into``)


_BASE: tuple[Kernel, ...] = (
    Kernel("mlcomp.torch.conv2d", "conv2d", KernelLibrary.TORCH, _conv2d),
    Kernel("mlcomp.torch.conv_transpose2d", "conv2d_transpose", KernelLibrary.TORCH, _conv_transpose2d),
    Kernel("mlcomp.torch.matmul", "matmul", KernelLibrary.TORCH, _matmul),
    Kernel("mlcomp.torch.linear", "linear", KernelLibrary.TORCH, _linear, into=True),
    Kernel("mlcomp.torch.attention", "attention", KernelLibrary.TORCH, _attention),
    Kernel("mlcomp.torch.mean", "mean", KernelLibrary.TORCH, _mean, into=True),
    Kernel("mlcomp.torch.layer_norm", "layer_norm", KernelLibrary.TORCH, _layer_norm),
    Kernel("mlcomp.torch.add_layer_norm", "add+layer_norm", KernelLibrary.TORCH, _add_layer_norm),
    Kernel("mlcomp.torch.add_layer_norm_reuse", "add+layer_norm (in place)", KernelLibrary.TORCH, _add_layer_norm_reuse),
    *(Kernel(f"mlcomp.torch.{op}_{act.value}", f"{op}+{act.value}", KernelLibrary.TORCH, _with(fn, act), op == "linear")
      for op, fn in (("conv2d", _conv2d), ("linear", _linear)) for act in Activation),
)
_CHANNELS_LAST: tuple[Kernel, ...] = tuple(
    Kernel(channels_last_kernel(u, add), "conv2d" + ("+add" if add else "") + ("" if u is Unary.NONE else f"+{u.value}"),
           KernelLibrary.TORCH, _channels_last_conv(u, add)) for add in (False, True) for u in Unary)
_PACKED_LINEAR: tuple[Kernel, ...] = tuple(
    Kernel(packed_linear_kernel(u), "linear" + ("" if u is Unary.NONE else f"+{u.value}"), KernelLibrary.TORCH,
           _packed_linear(u)) for u in (Unary.NONE, Unary.RELU, Unary.SIGMOID, Unary.GELU, Unary.GELU_TANH))
# every kernel also reads strided views / rearranges its result when called as ``<name>_views``
_ALL = tuple(k for base in (*_BASE, *_CHANNELS_LAST) for k in (
    base, Kernel(f"{base.name}_views", f"{base.op} (views)", base.library, _views(base.fn), base.into)))
# and writes into a tensor the VM allocates as ``<name>_into`` (a views kernel: when it rearranges its result)
KERNELS: dict[str, Kernel] = {k.name: k for k in (*_ALL, *_PACKED_LINEAR)}
INTO_KERNELS: dict[str, Kernel] = {f"{k.name}_into": Kernel(f"{k.name}_into", k.op, k.library, _into(k.fn), True)
                                   for k in _ALL if k.into or k.name.endswith("_views")}


def views_kernel(name: str) -> str:
    """The packed function running kernel ``name`` with strided-view arguments (``tvm.offload.views``)."""
    return f"{name}_views"


def epilogue_kernel(name: str, act: Activation) -> str:
    """The packed function running kernel ``name`` (``mlcomp.torch.linear``) followed by ``act``."""
    return f"{name}_{act.value}"


_REGISTER_LOCK = threading.Lock()


def register_kernels() -> None:
    """Register :data:`KERNELS` and :data:`INTO_KERNELS` with TVM's global function table (once per process); with
    torch's DLPack C exchange API tvm_ffi converts tensor arguments in C, else the functions do (:func:`_t`)."""
    import tvm_ffi

    fast = hasattr(torch.Tensor, "__dlpack_c_exchange_api__") and hasattr(tvm_ffi, "convert_func")
    with _REGISTER_LOCK:
        for kernel in (*KERNELS.values(), *INTO_KERNELS.values()):
            if tvm_ffi.get_global_func(kernel.name, allow_missing=True) is None:
                fn = tvm_ffi.convert_func(kernel.fn, tensor_cls=torch.Tensor) if fast else kernel.fn
                tvm_ffi.register_global_func(kernel.name, fn)
