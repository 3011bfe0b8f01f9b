"""Operators of the IR.

A node's ``op`` is an :class:`Op` value, never a free string: an ATen overload
(``aten.addmm.default``), a Python operator used for symbolic shape arithmetic
(``operator.mul``), one of the graph's structural ops (:data:`INPUT`,
:data:`PARAM`, :data:`OUTPUT`, :data:`GETITEM`) or one of mlcomp's own
composite ops (``mlcomp.fused``…), which carry a torch implementation so the
interpreter can always run them.

Ops compare by value, so passes write ``node.op == ops.aten("relu")`` or use the
module constants (``ops.RELU``); :func:`category` gives the fusion class in the
spirit of TVM's ``OpPattern``::

    >>> category(aten("relu"))
    <Category.ELEMWISE: 1>
"""
from __future__ import annotations

import enum
import operator as _operator
from dataclasses import dataclass, field
from typing import Any, Callable

__all__ = [
    "Op", "Category", "aten", "category", "category_names", "composite",
    "INPUT", "PARAM", "OUTPUT", "GETITEM",
]


class Namespace(enum.Enum):
    GRAPH = "graph"        # structural: input, param, output, getitem
    ATEN = "aten"          # torch.ops.aten.<name>.<overload>
    PRIMS = "prims"        # torch.ops.prims (rare in core ATen graphs)
    OPERATOR = "operator"  # python operator.* on symbolic sizes
    MLCOMP = "mlcomp"      # mlcomp composite ops (fused regions, precision casts…)
    LIBRARY = "library"    # torch.ops.<lib>.<name> from torch.library, kept undecomposed; name is "lib::name"


@dataclass(frozen=True, order=True)
class Op:
    namespace: Namespace
    name: str
    overload: str = "default"
    impl: Callable[..., Any] | None = field(default=None, compare=False, hash=False, repr=False)
    impl: Callable[..., Any] | None = field(default=None, compare=False, hash=False, repr=False)

    @property
    def qualname(self) -> str:
        if self.namespace in (Namespace.GRAPH, Namespace.OPERATOR, Namespace.MLCOMP):
            return f"{self.namespace.value}.{self.name}"
        if self.namespace is Namespace.LIBRARY:
            return f"{self.name}.{self.overload}"
        return f"{self.namespace.value}.{self.name}.{self.overload}"

    def __str__(self) -> str:
        return self.qualname

    def __repr__(self) -> str:
        return f"Op({self.qualname})"

    @property
    def is_structural(self) -> bool:
        return self.namespace is Namespace.GRAPH and self.name != "getitem"

    @property
    def is_composite(self) -> bool:
        return self.namespace is Namespace.MLCOMP

    def resolve(self) -> Callable[..., Any]:
        """The torch callable that computes this op (not for INPUT/PARAM/OUTPUT)."""
        ns = self.namespace
        if ns is Namespace.ATEN or ns is Namespace.PRIMS:
            import torch

            packet = getattr(getattr(torch.ops, ns.value), self.name)
            return getattr(packet, self.overload)
        if ns is Namespace.LIBRARY:
            import torch

            lib, _, name = self.name.partition("::")
            return getattr(getattr(getattr(torch.ops, lib), name), self.overload)
        if ns is Namespace.OPERATOR:
            return getattr(_operator, self.name)
        if self == GETITEM:
            return _operator.getitem
        if ns is Namespace.MLCOMP:
            if self.impl is None:
                raise TypeError(f"composite {self.qualname} carries no implementation")
            return self.impl
        raise TypeError(f"{self.qualname} is structural and has no callable")

    @classmethod
    def from_torch(cls, target: Any) -> "Op":
        """Map an FX ``call_function`` target to an Op; raises ``KeyError`` if unknown."""
        import torch

        if isinstance(target, torch._ops.OpOverload):
            ns = target.namespace
            if ns not in ("aten", "prims"):
                return cls(Namespace.LIBRARY, f"{ns}::{target._opname}", target._overloadname)
            return cls(Namespace(ns), target._opname, target._overloadname)
        if target is _operator.getitem:
            return GETITEM
        module = getattr(target, "__module__", None)
        name = getattr(target, "__name__", None)
        if module in ("_operator", "operator") and name and hasattr(_operator, name):
            return cls(Namespace.OPERATOR, name)
        if name == "sym_size" or name == "sym_numel":  # torch.ops.aten.sym_size is an OpOverload
            return cls(Namespace.ATEN, name, "int")
        raise KeyError(getattr(target, "__qualname__", repr(target)))


def aten(name: str, overload: str = "default") -> Op:
    """Shorthand: ``aten("addmm")`` is ``aten.addmm.default``."""
    if "." in name:
        name, overload = name.split(".", 1)
    return Op(Namespace.ATEN, name, overload)


INPUT = Op(Namespace.GRAPH, "input")
PARAM = Op(Namespace.GRAPH, "param")
OUTPUT = Op(Namespace.GRAPH, "output")
GETITEM = Op(Namespace.GRAPH, "getitem")


class Category(enum.IntEnum):
    """Fusion classes, ordered from most to least fusable (after TVM's OpPattern)."""

    ELEMWISE = 1       # out[i] = f(in[i])
    BROADCAST = 2      # out[i] = f(in[broadcast(i)])
    INJECTIVE = 3      # out[i] = in[g(i)]: reshape, transpose, slice, cat…
    REDUCTION = 4      # sum, mean, amax, softmax's reductions…
    COMPUTE = 5        # matmul/conv: may take an elementwise epilogue
    OPAQUE = 6         # anything else: fusion stops here


_ELEMWISE = """abs neg exp log log1p sqrt rsqrt sigmoid tanh relu gelu silu hardtanh hardswish
hardsigmoid erf sin cos reciprocal sign clamp clamp_min clamp_max leaky_relu elu logical_not
_to_copy clone alias pow floor ceil round trunc isnan bitwise_not""".split()
_BROADCAST = """add sub mul div where maximum minimum eq ne lt le gt ge logical_and logical_or
bitwise_and bitwise_or masked_fill fmod remainder atan2 rsub""".split()
_INJECTIVE = """view reshape _unsafe_view permute transpose t expand unsqueeze squeeze slice select
cat stack flatten split split_with_sizes chunk narrow index_select gather repeat contiguous
full full_like zeros zeros_like ones ones_like empty empty_like scalar_tensor arange
constant_pad_nd pad unbind lift_fresh_copy detach as_strided copy index embedding""".split()
_REDUCTION = """sum mean amax amin max min prod var var_mean std any all argmax argmin
_softmax softmax _log_softmax log_softmax native_layer_norm layer_norm norm
linalg_vector_norm logsumexp cumsum avg_pool2d _adaptive_avg_pool2d adaptive_avg_pool2d
max_pool2d_with_indices max_pool2d native_group_norm""".split()
_COMPUTE = """addmm mm bmm matmul linear convolution conv2d conv1d
_native_batch_norm_legit_no_training native_batch_norm batch_norm baddbmm
scaled_dot_product_attention _scaled_dot_product_flash_attention_for_cpu""".split()
_TABLE: dict[str, Category] = {}
for _names, _cat in ((_ELEMWISE, Category.ELEMWISE), (_BROADCAST, Category.BROADCAST),
                     (_INJECTIVE, Category.INJECTIVE), (_REDUCTION, Category.REDUCTION),
                     (_COMPUTE, Category.COMPUTE)):
    for _n in _names:
        _TABLE[_n] = _cat


def category_names(cat: Category) -> tuple[str, ...]:
    """The ATen op names the table puts in ``cat``.

    >>> "convolution" in category_names(Category.COMPUTE)
    True
    """
    return tuple(name for name, c in _TABLE.items() if c is cat)


def category(op: Op) -> Category:
    """Fusion class of ``op``; unknown ATen ops are OPAQUE (never fused)."""
    if op.namespace is Namespace.ATEN:
        return _TABLE.get(op.name, Category.OPAQUE)
    if op == GETITEM or op.namespace is Namespace.OPERATOR:
        return Category.INJECTIVE
    if op.namespace is Namespace.MLCOMP:
        return getattr(op.impl, "category", Category.OPAQUE)
    return Category.OPAQUE


# ---------------------------------------------------------------------------
# Composite ops: mlcomp's own operators.  A composite Op carries its torch
# implementation (``impl``, excluded from equality and hashing: the name
# identifies it), so the op travels with the node that uses it and belongs to
# that graph; there is no process-wide table.  ``impl.category`` (if present)
# is its fusion category.


def composite(name: str, impl: Callable[..., Any]) -> Op:
    """``mlcomp.<name>`` computed by ``impl``."""
    return Op(Namespace.MLCOMP, name, impl=impl)
