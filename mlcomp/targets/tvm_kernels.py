"""Vendor kernels for the TVM target: torch's oneDNN/MKL convolution and GEMM behind TVM packed functions.

TVM 0.27's Relax has no default CPU schedule for matmul or convolution (DLight's CPU
rules cover GEMV and reductions), and the PyPI wheel carries no DNNL/BLAS runtime
(``tvm.contrib.cblas``/``mkl``/``dnnl`` are absent; see ``tvm_backend``).  So the heavy
ops are offloaded (:mod:`mlcomp.targets.tvm_offload`) to the functions below, which
TVM's VM calls as ordinary packed functions by their ``mlcomp.`` names; every
argument crosses by DLPack without a copy and the result is handed back the same way::

    before (Relax):  lv = R.nn.conv2d(x, metadata["relax.expr.Constant"][0], strides=[2, 2], padding=[3, 3, 3, 3])
    after:           lv = R.call_pure_packed("mlcomp.torch.conv2d", x, metadata[...][0], bias,
                                             R.prim_value(2), R.prim_value(2), R.prim_value(3), R.prim_value(3),
                                             R.prim_value(1), R.prim_value(1), R.prim_value(1),
                                             ty_args=R.Tensor((1, 64, 112, 112), "float32"))

The names are process-wide (TVM's global function table is, and a loaded ``model.so``
resolves them when its VM starts), so :func:`register_kernels` registers them once,
idempotently, before a build and before a load; that registration is the only state
this module leaves behind and it is never changed afterwards.  A module exported
with kernels needs torch at load time; :data:`KERNELS` lists what each name runs.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from enum import Enum
from typing import Any, Callable

import torch
import torch.nn.functional as F

__all__ = ["Activation", "Kernel", "KERNELS", "KernelLibrary", "register_kernels", "kernel_library", "epilogue_kernel",
           "views_kernel"]


class KernelLibrary(Enum):
    """Where an offloaded op runs."""

    TORCH = "torch"

    def describe(self) -> str:
        return {"torch": f"torch {torch.__version__} (oneDNN/MKL CPU kernels)"}[self.value]


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


def _matmul(a: Any, b: Any) -> torch.Tensor:
    """``a @ b`` with numpy broadcasting of the leading axes (Relax ``matmul``)."""
    return torch.matmul(_t(a), _t(b))


def _linear(a: Any, w: Any, bias: Any) -> torch.Tensor:
    """``a @ w.T + bias`` with ``w`` of shape ``[N, K]``: ``F.linear``, eager's GEMM with the bias in it.

    A strided ``a`` (a ``*_views`` argument) is copied first: one parallel copy and the plain GEMM
    beat torch's strided matmul (32×128×256 permuted by 768×256, one thread: 18.9 + 0.3 vs 22.7 ms).
    """
    a = _t(a)
    return F.linear(a if a.is_contiguous() else a.contiguous(), _t(w), _t(bias))


def _attention(q: Any, k: Any, v: Any, scale: float = 1.0) -> torch.Tensor:
    """``softmax(scale · q @ k.T) @ v`` over ``[B, L, D]``, ``[B, S, D]``, ``[B, S, Dv]`` (q and k already
    scaled by the graph: ``scale`` 1), or over 4-D ``[b1, b2, L, D]`` views (``*_views``, scale given).

    torch's fused ``scaled_dot_product_attention``: on CPU its flash kernel needs 4-D inputs
    with unit last stride, so a 3-D batch becomes the heads axis; it never materialises the
    ``[L, S]`` scores, reads strided q/k/v in place and runs on torch's threads.
    """
    q, k, v = _t(q), _t(k), _t(v)
    if q.dim() == 4:
        return F.scaled_dot_product_attention(q, k, v, scale=float(scale))
    out = F.scaled_dot_product_attention(q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), scale=float(scale))
    return out.squeeze(0)


def _layer_norm(x: Any, weight: Any, bias: Any, eps: float) -> torch.Tensor:
    """Layer norm over the last axis (``F.layer_norm``, torch's threads)."""
    x = _t(x)
    return F.layer_norm(x, x.shape[-1:], _t(weight), _t(bias), eps)


def _add_layer_norm(a: Any, b: Any, weight: Any, bias: Any, eps: float) -> torch.Tensor:
    """``layer_norm(a + b)`` over the last axis: a residual add and the norm after it."""
    x = torch.add(_t(a), _t(b))
    return F.layer_norm(x, x.shape[-1:], _t(weight), _t(bias), eps)


class Activation(Enum):
    """An activation applied in place to a kernel's fresh output (``linear_gelu``, ``conv2d_sigmoid``)."""

    SIGMOID = "sigmoid"
    GELU = "gelu"
    GELU_TANH = "gelu_tanh"
    RELU = "relu"

    def apply(self, out: torch.Tensor) -> torch.Tensor:
        if self is Activation.SIGMOID:
            return out.sigmoid_()
        if self is Activation.RELU:
            return out.relu_()
        return F.gelu(out, approximate="tanh" if self is Activation.GELU_TANH else "none")


def _with(fn: Callable[..., torch.Tensor], act: Activation) -> Callable[..., torch.Tensor]:
    def run(*args: Any) -> torch.Tensor:
        return act.apply(fn(*args))

    run.__doc__ = f"{fn.__doc__} Then {act.value}, in place, on torch's threads."
    return run


def _views(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """``fn`` reading some tensor arguments as strided views and rearranging its result (``tvm_views``).

    Leading integers: ``n_in, (pos, rank, sizes, strides, offset)…`` (argument ``pos`` is
    ``as_strided`` of the tensor passed), then ``n_out, (rank F, F, P, rank S, S)``: the result is
    ``out.reshape(F).permute(P).reshape(S)``; then ``fn``'s own arguments.  Returned contiguous.
    """
    def run(*args: Any) -> torch.Tensor:
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
        out = fn(*rest)
        if n_out:
            rf = out_spec[0]
            out = out.reshape(out_spec[1:1 + rf]).permute(out_spec[1 + rf:1 + 2 * rf]).reshape(out_spec[2 + 2 * rf:])
        return out if out.is_contiguous() else out.contiguous()

    run.__doc__ = f"{fn.__doc__} Arguments read as strided views, the result rearranged (tvm_views)."
    return run


@dataclass(frozen=True)
class Kernel:
    """One packed function: its TVM name, what it runs, and the Python callable."""

    name: str
    op: str
    library: KernelLibrary
    fn: Callable[..., torch.Tensor]


_BASE: tuple[Kernel, ...] = (
    Kernel("mlcomp.torch.conv2d", "conv2d", KernelLibrary.TORCH, _conv2d),
    Kernel("mlcomp.torch.matmul", "matmul", KernelLibrary.TORCH, _matmul),
    Kernel("mlcomp.torch.linear", "linear", KernelLibrary.TORCH, _linear),
    Kernel("mlcomp.torch.attention", "attention", KernelLibrary.TORCH, _attention),
    Kernel("mlcomp.torch.layer_norm", "layer_norm", KernelLibrary.TORCH, _layer_norm),
    Kernel("mlcomp.torch.add_layer_norm", "add+layer_norm", KernelLibrary.TORCH, _add_layer_norm),
    *(Kernel(f"mlcomp.torch.{op}_{act.value}", f"{op}+{act.value}", KernelLibrary.TORCH, _with(fn, act))
      for op, fn in (("conv2d", _conv2d), ("linear", _linear)) for act in Activation),
)
# every kernel also reads strided views / rearranges its result when called as ``<name>_views``
KERNELS: dict[str, Kernel] = {k.name: k for base in _BASE for k in (
    base, Kernel(f"{base.name}_views", f"{base.op} (views)", base.library, _views(base.fn)))}


def views_kernel(name: str) -> str:
    """The packed function running kernel ``name`` with strided-view arguments (``tvm_views``)."""
    return f"{name}_views"


def epilogue_kernel(name: str, act: Activation) -> str:
    """The packed function running kernel ``name`` (``mlcomp.torch.linear``) followed by ``act``."""
    return f"{name}_{act.value}"

_REGISTER_LOCK = threading.Lock()


def register_kernels() -> None:
    """Register every :data:`KERNELS` entry with TVM's global function table (once per process).

    Where torch offers DLPack's C exchange API (``torch.Tensor.__dlpack_c_exchange_api__``),
    tvm_ffi converts the tensor arguments to ``torch.Tensor`` in C before the Python body
    runs: measured on mlp's first layer (1×512 by 512×256, one thread, best of 25 rounds on a
    busy machine), the packed call cost 85 µs through ``torch.from_dlpack`` in Python and 36 µs
    this way, against 31 µs for ``F.linear`` itself.  Without it the functions convert the arguments themselves (:func:`_t`).
    """
    import tvm_ffi

    fast = hasattr(torch.Tensor, "__dlpack_c_exchange_api__") and hasattr(tvm_ffi, "convert_func")
    with _REGISTER_LOCK:
        for kernel in KERNELS.values():
            if tvm_ffi.get_global_func(kernel.name, allow_missing=True) is None:
                fn = tvm_ffi.convert_func(kernel.fn, tensor_cls=torch.Tensor) if fast else kernel.fn
                tvm_ffi.register_global_func(kernel.name, fn)


def kernel_library(name: str) -> KernelLibrary:
    """The library behind the packed function ``name`` (a :data:`KERNELS` key)."""
    return KERNELS[name].library
