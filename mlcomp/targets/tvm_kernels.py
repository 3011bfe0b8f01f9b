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

__all__ = ["Kernel", "KERNELS", "KernelLibrary", "register_kernels", "kernel_library"]


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
    """``a @ w.T + bias`` with ``w`` of shape ``[N, K]``: ``F.linear``, eager's GEMM with the bias in it."""
    return F.linear(_t(a), _t(w), _t(bias))


@dataclass(frozen=True)
class Kernel:
    """One packed function: its TVM name, what it runs, and the Python callable."""

    name: str
    op: str
    library: KernelLibrary
    fn: Callable[..., torch.Tensor]


KERNELS: dict[str, Kernel] = {k.name: k for k in (
    Kernel("mlcomp.torch.conv2d", "conv2d", KernelLibrary.TORCH, _conv2d),
    Kernel("mlcomp.torch.matmul", "matmul", KernelLibrary.TORCH, _matmul),
    Kernel("mlcomp.torch.linear", "linear", KernelLibrary.TORCH, _linear),
)}

_REGISTER_LOCK = threading.Lock()


def register_kernels() -> None:
    """Register every :data:`KERNELS` entry with TVM's global function table (once per process)."""
    import tvm_ffi

    with _REGISTER_LOCK:
        for kernel in KERNELS.values():
            if tvm_ffi.get_global_func(kernel.name, allow_missing=True) is None:
                tvm_ffi.register_global_func(kernel.name, kernel.fn)


def kernel_library(name: str) -> KernelLibrary:
    """The library behind the packed function ``name`` (a :data:`KERNELS` key)."""
    return KERNELS[name].library
