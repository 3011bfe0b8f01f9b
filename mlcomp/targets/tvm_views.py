"""Layout chains next to a torch kernel run in torch: strided views in, one torch copy out (issue 14).

A build that calls torch's kernels keeps TVM's loops serial (``tvm_schedules``), so a layout copy
TVM makes between two torch calls (a permute, splitting q/k/v out of a fused projection, merging
heads back) runs on one core.  :func:`absorb_views` moves those chains into the kernel calls:

* **commute**: a linear whose input only rearranges whole rows of ``x`` (the sequence-first
  permute before MultiheadAttention's in-projection) runs on ``x``; the rearrangement moves after
  it as layout ops, which the next step absorbs (q/k/v then read batch-first: SDPA on CPU reads
  those strides as fast as contiguous ones, sequence-first strides cost it 20-30 %).
* **in**: a kernel argument reached from a tensor ``x`` through reshape / permute_dims /
  expand_dims / squeeze / take-one-index / broadcast_to / a piece of a split (and, for
  attention's q and k, a multiply by a scalar constant, which becomes SDPA's ``scale``) is ``x``
  plus a ``torch.as_strided`` spec (:class:`~mlcomp.targets.tvm_layouts.Layout`).  Attention's
  q/k/v become 4-D views ``[b1, b2, L, D]`` (the batch axis split where its modes split: batch ×
  heads), which SDPA reads in place: splitting q/k/v out of the in-projection copies nothing.
  Other kernels take a view only where the chain moves at least :data:`VIEW_MIN_ELEMENTS`
  (a plain reshape is free in TVM too); torch then copies, if at all, on its own threads.
* **out**: a chain of single-use layout ops after a kernel's result is applied in torch
  (``reshape(F).permute(P).reshape(S)``, one copy, none where the memory already matches: SDPA's
  output is ``[b1, L, b2, D]`` in memory, which is what merging heads batch-first wants).

    before:  lv = permute_dims(x, [1, 0, 2])                                         # x [32, 128, 256]
             lv5 = call_pure_packed("mlcomp.torch.linear", lv, W, b)                # [128, 32, 768]
             lv9 = squeeze(permute_dims(expand_dims(reshape(lv5, …))))             # TVM copies, serial
             lv10 = take(lv9, 0, axis=0); … lv26 = reshape(multiply(…, 0.35), …)   #   (three of each)
             lv44 = call_pure_packed("mlcomp.torch.attention", lv26, lv3, lv43)
             lv49 = reshape(permute_dims(reshape(lv44, …)), [4096, 256])           # TVM copy
    after:   lv = call_pure_packed("mlcomp.torch.linear", x, W, b)                  # [32, 128, 768]
             lv49 = call_pure_packed("mlcomp.torch.attention_views", <ints>, lv, lv, lv, 0.125)
             # q = lv.as_strided((32, 4, 128, 64), (98304, 64, 768, 1), 0), k at +256, v at +512;
             # result: out.reshape(32, 4, 128, 64).permute(2, 0, 1, 3).reshape(4096, 256)

The spec is a run of integers before the kernel's own arguments (:func:`encode`; the kernels
decode it, ``tvm_kernels._views``).  Each pass is O(n): a value's layout is computed once from
its input's (memoised), and each layout op belongs to at most one output chain (single use).
"""
from __future__ import annotations

from collections import Counter
from math import prod
from typing import Any

from mlcomp.targets.tvm_kernels import KERNELS, views_kernel
from mlcomp.targets.tvm_layouts import Layout, LayoutError

__all__ = ["VIEW_MIN_ELEMENTS", "ViewSpec", "absorb_views", "encode"]

_PACKED = "relax.call_pure_packed"
_LAYOUT_OPS = frozenset({"relax.reshape", "relax.permute_dims", "relax.expand_dims", "relax.squeeze",
                         "relax.take", "relax.broadcast_to"})
_ATTENTION = "mlcomp.torch.attention"
# A copy moved into a torch call pays the call's argument decoding (~15 µs, one thread) and gains only
# torch's threads (a serial TVM transpose: 0.35 ms per 1M floats, torch's 0.25-0.33 at one thread):
# below this many elements it stays in TVM (HF BERT-tiny's 8×32×64 head splits: 1.4 -> 1.7 ms moved).
# Attention's q/k/v views copy nothing and are always taken.
VIEW_MIN_ELEMENTS = 1 << 17

ViewSpec = tuple[int, tuple[int, ...], tuple[int, ...], int]   # argument position, sizes, strides, offset
Gather = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]  # F, P, S


def encode(views: list[ViewSpec], gather: Gather | None) -> list[int]:
    """The integers a ``*_views`` kernel reads first: ``n_in, (pos, rank, sizes, strides, offset)…,
    n_out, (rank F, F, P, rank S, S)``."""
    inner = [i for pos, sizes, strides, off in views for i in (pos, len(sizes), *sizes, *strides, off)]
    out = [] if gather is None else [len(gather[0]), *gather[0], *gather[1], len(gather[2]), *gather[2]]
    return [len(inner), *inner, len(out), *out]


def _ty(expr: Any) -> Any:
    return expr.ty if hasattr(expr, "ty") else expr.struct_info


def _shape(expr: Any) -> tuple[int, ...] | None:
    shape = getattr(_ty(expr), "shape", None)
    try:
        return None if shape is None else tuple(int(d) for d in shape)
    except TypeError:
        return None


def _kernel_name(value: Any) -> str | None:
    """The :data:`KERNELS` name a bound value calls, or None."""
    import tvm
    from tvm import relax

    if isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name == _PACKED \
            and isinstance(value.args[0], relax.ExternFunc) and str(value.args[0].global_symbol) in KERNELS:
        return str(value.args[0].global_symbol)
    return None


def _scalar(expr: Any) -> float | None:
    """The value of a float32 scalar constant, or None."""
    import numpy as np

    if not hasattr(expr, "value") or _shape(expr) not in ((), (1,)) or str(_ty(expr).dtype) != "float32":
        return None
    return float(np.from_dlpack(expr.value).reshape(-1)[0])


def _step(layout: Layout, call: Any) -> Layout:
    """``layout`` after one Relax layout op (raises :class:`LayoutError` where it is not a pure re-indexing)."""
    import numpy as np

    if isinstance(call, tuple):
        name, attrs = "relax.split", None
    else:
        name, attrs = call.op.name, call.attrs
    if name in ("relax.reshape", "relax.broadcast_to"):
        shape = _shape(call)
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
    if not hasattr(index, "value") or _shape(index) != () or attrs.axis is None:
        raise LayoutError("take of a tensor of indices")
    return layout.select(int(attrs.axis), int(np.from_dlpack(index.value)))


def _link(node: Any, bound: dict, scaled: bool) -> tuple[Any, Any, float | None] | None:
    """(input, op, scalar) when ``node`` is one layout link of a chain (or a scalar multiply if ``scaled``)."""
    from tvm import relax

    value = bound.get(node)
    if isinstance(value, relax.TupleGetItem) and _is_op(bound.get(value.tuple_value), "relax.split"):
        split = bound[value.tuple_value]
        return split.args[0], (split, int(value.index)), None
    if _is_layout(value):
        return value.args[0], value, None
    if scaled and _is_op(value, "relax.multiply") and str(_ty(value).dtype) == "float32" \
            and _shape(value) == _shape(value.args[0]) and _scalar(value.args[1]) is not None:
        return value.args[0], value, _scalar(value.args[1])
    return None


def _chain(expr: Any, bound: dict, scaled: bool, memo: dict) -> tuple[Any, Layout, float, int]:
    """Follow ``expr`` back through layout ops (and scalar multiplies if ``scaled``) to its source.

    Returns (source, layout of ``expr`` over the source, product of the scalars, links followed).
    A link that is not a pure re-indexing (a reshape splitting a mode unevenly) starts the chain
    again after it: that link stays in TVM.  ``memo`` (one per pass) keeps every value's answer,
    so chains sharing a prefix (q, k and v of one projection) walk it once: O(n) per pass.
    """
    path, node = [], expr
    while (node, scaled) not in memo:
        link = _link(node, bound, scaled)
        if link is None:
            shape = _shape(node)
            memo[node, scaled] = None if shape is None else (node, Layout.contiguous(shape), 1.0, 0)
            break
        path.append((node, link))
        node = link[0]
    for var, (parent, call, factor) in reversed(path):
        base, shape = memo[parent, scaled], _shape(var)
        fresh = None if shape is None else (var, Layout.contiguous(shape), 1.0, 0)
        if base is None:
            memo[var, scaled] = fresh
            continue
        source, layout, scale, n = base
        try:
            layout = layout if factor is not None else _step(layout, call)
            memo[var, scaled] = (source, layout, scale * (factor or 1.0), n + 1)
        except LayoutError:
            memo[var, scaled] = fresh
    got = memo[expr, scaled]
    return got if got is not None else (expr, Layout.contiguous(()), 1.0, 0)


def _attention_views(call: Any, bound: dict, memo: dict) -> tuple[list[ViewSpec], list[Any], float] | None:
    """q, k, v of an attention call as 4-D strided views of their sources (one batch split for all)."""
    args = call.args[1:4]
    chains = [_chain(a, bound, i < 2, memo) for i, a in enumerate(args)]
    if not any(n for *_, n in chains) or len({str(_ty(src).dtype) for src, *_ in chains}) != 1:
        return None
    batch = chains[0][1].shape[0]
    splits = [(1, batch)] + [(m, batch // m) for _, lay, _, _ in chains for m, _ in lay.dims[0][:1]]
    for b1, b2 in splits:
        specs = []
        for pos, (_, layout, _, _) in enumerate(chains):
            try:
                strided = layout.reshape((b1, b2, *layout.shape[1:])).strided()
            except LayoutError:
                strided = None
            if strided is None:
                break
            lay = layout.reshape((b1, b2, *layout.shape[1:]))
            specs.append((pos, strided[0], strided[1], lay.offset))
        if len(specs) == 3:
            return specs, [src for src, *_ in chains], chains[0][2] * chains[1][2]
    return None


def _in_views(func: Any, bound: dict, min_elements: int) -> dict:
    """var -> the kernel call with its layout-chained arguments read as views (see the module doc)."""
    from tvm import relax

    new, memo = {}, {}
    for var, value in bound.items():
        name = _kernel_name(value)
        if name is None:
            continue
        if name == _ATTENTION:
            got = _attention_views(value, bound, memo)
            if got is not None:
                specs, sources, scale = got
                shape = _shape(value)
                new[var] = _call(views_kernel(name), encode(specs, (shape, tuple(range(len(shape))), shape)),
                                 [*sources, relax.prim_value(float(scale))], value)
            continue
        specs, args = [], list(value.args[1:])
        for pos, arg in enumerate(args):
            if hasattr(arg, "value") or _shape(arg) is None:   # constants and scalars stay
                continue
            src, layout, _, n = _chain(arg, bound, False, memo)
            strided = layout.strided()
            if n and strided is not None and not layout.is_contiguous and prod(layout.shape) >= min_elements:
                specs.append((pos, strided[0], strided[1], layout.offset))
                args[pos] = src
        if specs:
            new[var] = _call(views_kernel(name), encode(specs, None), args, value)
    return new


def _call(kernel: str, spec: list[int], args: list[Any], like: Any) -> Any:
    from tvm import relax

    return relax.call_pure_packed(kernel, *[relax.prim_value(int(i)) for i in spec], *args, ty_args=_ty(like))


def _out_views(bound: dict, users: Counter, outputs: set, min_elements: int) -> dict:
    """end of a chain -> its kernel's call with the chain applied in torch to the kernel's output."""
    readers = _readers(bound)
    new = {}
    for var, value in bound.items():
        name = _kernel_name(value)
        if name is None or not _shape(value):
            continue
        views, gather, args = _decode(value) if name.endswith("_views") else ([], None, list(value.args[1:]))
        if gather is not None and gather[1] != tuple(range(len(gather[1]))):
            continue   # it already ends in a permutation
        layout, node, end = Layout.contiguous(_shape(value)), var, None
        while users[node] == 1 and node not in outputs and len(readers.get(node, ())) == 1:
            nxt = next(iter(readers[node]))
            call = bound[nxt]
            if not (_is_layout(call) and call.args[0].same_as(node)):
                break
            try:
                layout = _step(layout, call)
            except LayoutError:
                break
            node = nxt
            gather = layout.gather(prod(_shape(value)))
            if gather is not None and not layout.is_contiguous and \
                    (name == views_kernel(_ATTENTION) or prod(layout.shape) >= min_elements):
                end = (node, gather)
        if end is not None:
            target = name if name.endswith("_views") else views_kernel(name)
            new[end[0]] = _call(target, encode(views, end[1]), args, bound[end[0]])
    return new


def _decode(value: Any) -> tuple[list[ViewSpec], Gather | None, list[Any]]:
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


def _rebuild(func: Any, new: dict) -> Any:
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
    out = relax.Function(func.params, body, _ty(func).ret, func.is_pure, func.attrs)
    out = relax.transform.Normalize()(tvm.IRModule({"main": out}))["main"]   # nested calls -> bindings
    return relax.analysis.remove_all_unused(out)


def _bindings(func: Any) -> tuple[dict, Counter, set]:
    from tvm import relax

    bound, users = {}, Counter()
    for block in func.body.blocks:
        for b in block.bindings:
            bound[b.var] = b.value
            users.update(relax.analysis.free_vars(b.value))
    outputs = set(relax.analysis.free_vars(func.body.body))
    return bound, users, outputs


def _commute_linears(bound: dict, readers: dict) -> dict:
    """``linear(rearranged rows of x)`` -> the same rearrangement of ``linear(x)``, as Relax layout ops.

    A linear maps each row on its own, so it commutes with any rearrangement of whole rows (the
    sequence-first permute before an in-projection).  Applied when every reader of the result is a
    layout op (the q/k/v split the attention views then absorb): the rows stay where ``x`` had
    them, and the attention reads q/k/v batch-first (SDPA on CPU reads those strides as fast as
    contiguous ones; the sequence-first strides cost it 20-30 %).
    """
    from tvm import relax

    new, memo = {}, {}
    for var, value in bound.items():
        name = _kernel_name(value)
        if name is None or name.endswith("_views") or not name.startswith("mlcomp.torch.linear"):
            continue
        src, layout, _, n = _chain(value.args[1], bound, False, memo)
        shape, out = _shape(src), _shape(value)
        if not n or layout.is_contiguous or not shape or not out or \
                any(not _is_layout(bound.get(r)) for r in readers.get(var, ())) or var not in readers:
            continue
        rows = layout.rows(shape[-1])
        gather = None if rows is None else rows.gather(prod(shape[:-1]))
        if gather is None:
            continue
        f, p, s = gather
        ty = relax.TensorType((*shape[:-1], out[-1]), str(_ty(value).dtype))
        y = relax.call_pure_packed(name, src, *value.args[2:], ty_args=ty)
        moved = relax.op.permute_dims(relax.op.reshape(y, (*f, out[-1])), [*p, len(f)])
        new[var] = relax.op.reshape(moved, (*s, out[-1]))
    return new


def _is_op(value: Any, *names: str) -> bool:
    """Whether ``value`` is a call of one of the Relax ops ``names``."""
    import tvm
    from tvm import relax

    return isinstance(value, relax.Call) and isinstance(value.op, tvm.ir.Op) and value.op.name in names


def _is_layout(value: Any) -> bool:
    return _is_op(value, *_LAYOUT_OPS)


def _readers(bound: dict) -> dict:
    from tvm import relax

    readers: dict = {}
    for var, value in bound.items():
        for a in relax.analysis.free_vars(value):
            readers.setdefault(a, set()).add(var)
    return readers


def absorb_views(func: Any, min_elements: int = VIEW_MIN_ELEMENTS) -> Any:
    """``func`` with the layout chains around its torch kernel calls moved into them (module doc).

    ``min_elements``: the smallest copy moved into a torch call other than attention's.
    """
    bound, _, _ = _bindings(func)
    func = _rebuild(func, _commute_linears(bound, _readers(bound)))
    bound, _, _ = _bindings(func)
    func = _rebuild(func, _in_views(func, bound, min_elements))
    return _rebuild(func, _out_views(*_bindings(func), min_elements))
