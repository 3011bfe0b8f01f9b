"""mlcomp's composite ops: fused groups, each compiled to one torch function.

The fusion pass turns a group of nodes into one node whose op is a fused
kernel, e.g. ``mlcomp.fused_convolution_relu_3fa2c1d07b44``; the group's body is a
small :class:`~mlcomp.ir.graph.Graph` kept by the kernel (``fused_body(op)``).  Every
distinct body is its own composite op, so a node's attrs stay plain literals and
the torch code generator, ``torch.jit.trace`` and ``torch.export`` all call the
kernel like any function and see the ATen ops it runs::

    op = register_fused(body)           # body: a Graph with inputs a0, a1 and one output
    op.resolve()(x, w)                  # runs the generated function
    print(fused_kernel(op).source)
    def fused_mul_add_relu_3fa2c1d07b44(a0, a1):
        v0 = _f0(a0, a1)                    # aten.mul.Tensor
        v1 = _f1(v0, 1.0)                   # aten.add_.Tensor: in place, v0 is dead
        v2 = _f2(v1)                        # aten.relu_.default
        return v2

What makes the kernel cheaper than the nodes it replaces:

* intermediates that die inside the group are overwritten in place (``relu_``,
  ``add_``) instead of allocated, unless autograd needs them;
* a purely elementwise group on a large tensor runs tile by tile (``Tiling``):
  each tile stays in cache while all the group's ops run on it, so memory is
  read and written once instead of once per op.  In eager Python the tiles are a
  Python loop; under ``torch.jit.trace`` the loop is a TorchScript function, so
  a frozen TorchScript module runs it as a real loop; under ``torch.export``
  the plain straight-line code is used.
"""
from __future__ import annotations

import hashlib
from typing import Any


from mlcomp.ir import Graph
from mlcomp.ir.kernel_plan import KernelPlan, Tiling
from mlcomp.ir.ops import GETITEM, Category, Op, category, composite

__all__ = ["Tiling", "FusedKernel", "register_fused", "fused_kernel", "fused_body", "is_fused"]


def register_fused(body: Graph, tiling: Tiling | None = None) -> Op:
    """The composite op running ``body``: equal bodies give equal ops (the name holds a digest).

    The op carries its :class:`FusedKernel`, so it belongs to the node (and graph)
    that uses it; nothing is registered process-wide.
    """
    key = _kernel_key(body, tiling)
    digest = hashlib.sha1(key.encode()).hexdigest()[:12]
    names = [n.op.name.strip("_") for n in body.call_nodes() if n.op != GETITEM]
    label = "_".join(dict.fromkeys(names))
    if len(label) > 48:
        label = label[:48].rsplit("_", 1)[0]
    name = f"fused_{label}_{digest}"
    cat = max((category(n.op) for n in body.call_nodes() if n.op != GETITEM), default=Category.ELEMWISE)
    return composite(name, FusedKernel(body, name, tiling, cat))


def _kernel_key(body: Graph, tiling: Tiling | None) -> str:
    return f"{body.format()}\n{body.mode.value}\n{tiling!r}"


def fused_kernel(op: Op) -> "FusedKernel | None":
    return op.impl if op.is_composite and isinstance(op.impl, FusedKernel) else None


def fused_body(op: Op) -> Graph | None:
    kernel = fused_kernel(op)
    return kernel.body if kernel else None


def is_fused(op: Op) -> bool:
    return fused_kernel(op) is not None


class FusedKernel:
    """Callable running a fused body; named so FX code generation can refer to it."""

    def __init__(self, body: Graph, name: str, tiling: Tiling | None = None,
                 category: Category = Category.ELEMWISE) -> None:
        self.body = body
        self.tiling = tiling
        self.category = category
        self.__name__ = self.__qualname__ = name
        self.__module__ = __name__
        self._plan: KernelPlan | None = None

    def __call__(self, *args: Any) -> Any:
        plan = self._plan or self._build()
        return plan(args)

    def _build(self) -> "KernelPlan":
        self._plan = KernelPlan(self.body, self.__name__, self.tiling)
        return self._plan

    @property
    def source(self) -> str:
        """The generated Python source (in-place variant)."""
        return (self._plan or self._build()).source

    @property
    def tiled(self) -> bool:
        return (self._plan or self._build()).tile is not None

    def __reduce__(self) -> tuple[Any, ...]:
        return (FusedKernel, (self.body, self.__name__, self.tiling, self.category))

    def __repr__(self) -> str:
        return f"<fused kernel {self.__name__}: {len(self.body.call_nodes())} ops>"
