"""Layout chains read off Relax: what :mod:`mlcomp.targets.tvm.offload.views` walks, and the ``*_views`` integer spec.

A value reached from a tensor ``x`` through Relax layout ops (reshape, permute_dims, expand_dims,
squeeze, take of one index, broadcast_to, a piece of a split; for attention's q and k also a
multiply by a scalar constant) is ``x`` plus a :class:`~mlcomp.targets.tvm.offload.layouts.Layout`
(:func:`chain`, memoised: O(n) per pass).  A ``*_views`` kernel call carries that as leading
integers (:func:`encode` / :func:`decode`)::

    before:  lv8 = reshape(lv5, [128, 32, 3, 256]); lv9 = take(lv8, 0, axis=2)     # lv5 [128, 32, 768]
             lv10 = permute_dims(lv9, [1, 0, 2])
    after:   chain(lv10, …) == (lv5, Layout(dims=(((32, 768),), ((128, 24576),), ((256, 1),)), offset=0), 1.0, 3)
             encode([(0, (32, 128, 256), (768, 24576, 1), 0)], None) == [9, 0, 3, 32, 128, 256, 768, 24576, 1, 0, 0]

Also the binding-level plumbing the rewrites share: the bindings of a function, who reads each
value, and rebuilding a function with some bindings replaced (then its dead ones removed).
"""
from __future__ import annotations

from collections import Counter
from typing import Any

from mlcomp.targets.tvm.kernels import KERNELS
from mlcomp.targets.tvm.offload.layouts import Layout, LayoutError

__all__ = ["Gather", "ViewSpec", "bindings_of", "chain", "decode", "encode", "is_layout", "is_op", "kernel_name",
           "maybe", "packed_call", "readers_of", "rebuild", "scalar_value", "single_use", "static_shape", "step", "ty_of"]

_PACKED = "relax.call_pure_packed"
_LAYOUT_OPS = frozenset({"relax.reshape", "relax.permute_dims", "relax.expand_dims", "relax.squeeze",
                         "relax.take", "relax.broadcast_to"})

ViewSpec = tuple[int, tuple[int, ...], tuple[int, ...], int]   # argument position, sizes, strides, offset
Gather = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # F, P, S


def encode(views: list[ViewSpec], gather: Gather | None) -> list[int]:
    """The integers a ``*_views`` kernel reads first: ``n_in, (pos, rank, sizes, strides, offset)…,
    n_out, (rank F, F, P, rank S, S)``."""
    inner = [i for pos, sizes, strides, off in views for i in (pos, len(sizes), *sizes, *strides, off)]
    out = [] if gather is None else [len(gather[0]), *gather[0], *gather[1], len(gather[2]), *gather[2]]
    return [len(inner), *inner, len(out), *out]


def decode(value: Any) -> tuple[list[ViewSpec], Gather | None, list[Any]]:
    """A ``*_views`` call back into (input views, output gather, the kernel's own arguments)."""
    args = list(value.args[1:])
    ints = lambda lo, hi: [int(a.value) for a in args[lo:hi]]
    n_in = int(args[0].value)
    flat, views, at = ints(1, 1 + n_in), [], 0
    while at < n_in:
        pos, rank = flat[at], flat[at + 1]
        views.append((pos, tuple(flat[at + 2:at + 2 + rank]), tuple(flat[at + 2 + rank:at + 2 + 2 * rank]),
                      flat[at + 2 + 2 * rank]))
        at += 3 + 2 * rank
    n_out = int(args[1 + n_in].value)
    out, gather = ints(2 + n_in, 2 + n_in + n_out), None
    if n_out:
        rf = out[0]
        gather = (tuple(out[1:1 + rf]), tuple(out[1 + rf:1 + 2 * rf]), tuple(out[2 + 2 * rf:]))
    return views, gather, args[2 + n_in + n_out:]


def ty_of(expr: Any) -> Any:
    return expr.ty if hasattr(expr, "ty") else expr.struct_info


def static_shape(expr: Any) -> tuple[int, ...] | None:
    shape = getattr(ty_of(expr), "shape", None)
    try:
        return None if shape is None else tuple(int(d) for d in shape)
    except TypeError:
        return None


def kernel_name(value: Any) -> str | None:
    """The :data:`KERNELS` name a bound value calls, or None."""
    import tvm
    from tvm import relax

    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == _PACKED \
            and isinstance(value.args[0], relax.ExternFunc) and str(value.args[0].global_symbol) in KERNELS:
        return str(value.args[0].global_symbol)
    return None


def scalar_value(expr: Any) -> float | None:
    """The value of a float32 scalar constant, or None."""
    import numpy as np

    if not hasattr(expr, "value") or static_shape(expr) not in ((), (1,)) or str(ty_of(expr).dtype) != "float32":
        return None
    return float(np.from_dlpack(expr.value).reshape(-1)[0])


def is_op(value: Any, *names: str) -> bool:
    """Whether ``value`` is a call of one of the Relax ops ``names``."""
    import tvm
    from tvm import relax

    return isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name in names


def is_layout(value: Any) -> bool:
    return is_op(value, *_LAYOUT_OPS)


def readers_of(bound: dict) -> dict:
    from tvm import relax

    readers: dict = {}
    for var, value in bound.items():
        for a in relax.analysis.free_vars(value):
            readers.setdefault(a, set()).add(var)
    return readers


def bindings_of(func: Any) -> tuple[dict, Counter, set]:
    from tvm import relax

    bound, users = {}, Counter()
    for block in func.body.blocks:
        for b in block.bindings:
            bound[b.var] = b.value
            users.update(relax.analysis.free_vars(b.value))
    outputs = set(relax.analysis.free_vars(func.body.body))
    return bound, users, outputs


def rebuild(func: Any, new: dict) -> Any:
    """``func`` with the values of the bindings in ``new`` replaced, then its dead bindings removed."""
    import tvm
    from tvm import relax

    if not new:
        return func
    blocks = []
    for block in func.body.blocks:
        bindings = [relax.VarBinding(b.var, new[b.var]) if b.var in new else b for b in block.bindings]
        blocks.append(type(block)(bindings))
    body = relax.SeqExpr(blocks, func.body.body)
    out = relax.Function(func.params, body, ty_of(func).ret, func.is_pure, func.attrs)
    out = relax.transform.Normalize()(tvm.IRModule({"main": out}))["main"]   # nested calls -> bindings
    return relax.analysis.remove_all_unused(out)


def step(layout: Layout, call: Any) -> Layout:
    """``layout`` after one Relax layout op (raises :class:`LayoutError` where it is not a pure re-indexing)."""
    import numpy as np

    if isinstance(call, tuple):
        name, attrs = "relax.split", None
    else:
        name, attrs = call.op.name, call.attrs
    if name in ("relax.reshape", "relax.broadcast_to"):
        shape = static_shape(call)
        if shape is None:
            raise LayoutError("symbolic shape")
        return layout.reshape(shape) if name == "relax.reshape" else layout.broadcast(shape)
    if name == "relax.permute_dims":
        return layout.permute(None if attrs.axes is None else tuple(int(a) for a in attrs.axes))
    if name == "relax.expand_dims":
        return layout.expand_dims(tuple(int(a) for a in attrs.axis))
    if name == "relax.squeeze":
        return layout.squeeze(None if attrs.axis is None else tuple(int(a) for a in attrs.axis))
    if name == "relax.split":   # (split, piece index): a TupleGetItem of a split
        split, piece = call
        axis = int(split.attrs.axis)
        size = layout.shape[axis]
        cuts = split.attrs.indices_or_sections
        if not hasattr(cuts, "__len__"):   # n equal sections
            n = int(cuts)
            if size % n:
                raise LayoutError("uneven split")
            bounds = [size // n * i for i in range(n + 1)]
        else:
            bounds = [0, *(int(c) for c in cuts), size]
        return layout.narrow(axis, bounds[piece], bounds[piece + 1] - bounds[piece])
    index = call.args[1]
    if not hasattr(index, "value") or static_shape(index) != () or attrs.axis is None:
        raise LayoutError("take of a tensor of indices")
    return layout.select(int(attrs.axis), int(np.from_dlpack(index.value)))


def link_of(node: Any, bound: dict, scaled: bool) -> tuple[Any, Any, float | None] | None:
    """(input, op, scalar) when ``node`` is one layout link of a chain (or a scalar multiply if ``scaled``)."""
    from tvm import relax

    value = bound.get(node)
    if isinstance(value, relax.TupleGetItem) and is_op(bound.get(value.tuple_value), "relax.split"):
        split = bound[value.tuple_value]
        return split.args[0], (split, int(value.index)), None
    if is_layout(value):
        return value.args[0], value, None
    if scaled and is_op(value, "relax.multiply") and str(ty_of(value).dtype) == "float32" \
            and static_shape(value) == static_shape(value.args[0]) and scalar_value(value.args[1]) is not None:
        return value.args[0], value, scalar_value(value.args[1])
    return None


def chain(expr: Any, bound: dict, scaled: bool, memo: dict) -> tuple[Any, Layout, float, int]:
    """Follow ``expr`` back through layout ops (and scalar multiplies if ``scaled``) to its source.

    Returns (source, layout of ``expr`` over the source, product of the scalars, links followed).
    A link that is not a pure re-indexing (a reshape splitting a mode unevenly) starts the chain
    again after it: that link stays in TVM.  ``memo`` (one per pass) keeps every value's answer,
    so chains sharing a prefix (q, k and v of one projection) walk it once: O(n) per pass.
    """
    path, node = [], expr
    while (node, scaled) not in memo:
        link = link_of(node, bound, scaled)
        if link is None:
            shape = static_shape(node)
            memo[node, scaled] = None if shape is None else (node, Layout.contiguous(shape), 1.0, 0)
            break
        path.append((node, link))
        node = link[0]
    for var, (parent, call, factor) in reversed(path):
        base, shape = memo[parent, scaled], static_shape(var)
        fresh = None if shape is None else (var, Layout.contiguous(shape), 1.0, 0)
        if base is None:
            memo[var, scaled] = fresh
            continue
        source, layout, scale, n = base
        try:
            layout = layout if factor is not None else step(layout, call)
            memo[var, scaled] = (source, layout, scale * (factor or 1.0), n + 1)
        except LayoutError:
            memo[var, scaled] = fresh
    got = memo[expr, scaled]
    return got if got is not None else (expr, Layout.contiguous(()), 1.0, 0)


def packed_call(kernel: str, spec: list[int], args: list[Any], like: Any) -> Any:
    """``kernel(spec…, args…)`` typed as ``like`` (an expression, or a ``TensorType``)."""
    from tvm import relax

    ty = like if isinstance(like, relax.TensorType) else ty_of(like)
    return relax.call_pure_packed(kernel, *[relax.prim_value(int(i)) for i in spec], *args, ty_args=ty)


def single_use(func: Any) -> set:
    """The values (bound calls) of ``func`` whose variable exactly one binding reads and the output does not."""
    from tvm import relax

    uses: Counter = Counter()
    bound = {}
    for block in func.body.blocks:
        for binding in block.bindings:
            bound[binding.var] = binding.value
            uses.update(relax.analysis.free_vars(binding.value))
    uses.update({v: 2 for v in relax.analysis.free_vars(func.body.body)})
    return {value for var, value in bound.items() if uses[var] == 1}


def maybe(pattern: Any, *ops: str) -> Any:
    """``pattern``, optionally wrapped by each of ``ops`` in turn (``reshape(broadcast_to(p))`` or less)."""
    from tvm.relax.dpl import is_op, wildcard

    for op in ops:
        pattern = is_op(op)(pattern, wildcard()) | pattern
    return pattern
