"""Layout chains next to a torch kernel run in torch: strided views in, one torch copy out.

A build that calls torch's kernels keeps TVM's loops serial (``tvm.schedules``), so a layout copy
TVM makes between two torch calls (a permute, splitting q/k/v out of a fused projection, merging
heads back) runs on one core.  :func:`absorb_views` moves those chains into the kernel calls:

* **commute**: a linear whose input only rearranges whole rows of ``x`` (the sequence-first
  permute before MultiheadAttention's in-projection) runs on ``x``; the rearrangement moves after
  it as layout ops, which the next step absorbs (q/k/v then read batch-first: SDPA on CPU reads
  those strides as fast as contiguous ones, sequence-first strides cost it 20-30 %).
* **in**: a kernel argument reached from a tensor ``x`` through reshape / permute_dims /
  expand_dims / squeeze / take-one-index / broadcast_to / a piece of a split (and, for
  attention's q and k, a multiply by a scalar constant, which becomes SDPA's ``scale``) is ``x``
  plus a ``torch.as_strided`` spec (:class:`~mlcomp.targets.tvm.offload.layouts.Layout`).  Attention's
  q/k/v become 4-D views ``[b1, b2, L, D]`` (the batch axis split where its modes split: batch ×
  heads), which SDPA reads in place: splitting q/k/v out of the in-projection copies nothing.
  Other kernels take a view only where the chain moves at least :data:`VIEW_MIN_ELEMENTS`
  (a plain reshape is free in TVM too); torch then copies, if at all, on its own threads.
* **out**: a chain of single-use layout ops after a kernel's result is applied in torch
  (``reshape(F).permute(P).reshape(S)``, one copy, none where the memory already matches: SDPA's
  output is ``[b1, L, b2, D]`` in memory, which is what merging heads batch-first wants).
* **merge** (before the other kernels' views): a linear reading the heads merged in another row
  order (sequence-first ``[L·N, H·D]``) reads them as SDPA left them, and the reorder moves past it
  where the layout ops after it undo it (the permute back to batch-first): no copy either side.
* **reuse**: ``add_layer_norm(a, b)`` with ``b`` a torch kernel's result nobody else reads writes
  the sum over ``b`` (``add_layer_norm_reuse``: eager's in-place ``add_``, no fresh buffer).

    before:  lv = permute_dims(x, [1, 0, 2])                                         # x [32, 128, 256]
             lv5 = call_pure_packed("mlcomp.torch.linear", lv, W, b)                # [128, 32, 768]
             lv9 = squeeze(permute_dims(expand_dims(reshape(lv5, …))))             # TVM copies, serial
             lv10 = take(lv9, 0, axis=0); … lv26 = reshape(multiply(…, 0.35), …)   #   (three of each)
             lv44 = call_pure_packed("mlcomp.torch.attention", lv26, lv3, lv43)
             lv49 = reshape(permute_dims(reshape(lv44, …)), [4096, 256])           # TVM copy
    after:   lv = call_pure_packed("mlcomp.torch.linear", x, W, b)                  # [32, 128, 768]
             lv49 = call_pure_packed("mlcomp.torch.attention_views", <ints>, lv, lv, lv, 0.125)
             # q = lv.as_strided((32, 4, 128, 64), (98304, 64, 768, 1), 0), k at +256, v at +512;
             # result: out.reshape(32, 4, 128, 64).permute(0, 2, 1, 3).reshape(4096, 256): SDPA's memory,
             # free (merge: the out-projection reads it, its sequence-first reorder cancelled)

The spec is a run of integers before the kernel's own arguments (:func:`encode`; the kernels
decode it, ``tvm.kernels._views``; :mod:`mlcomp.targets.tvm.offload.chains` reads the chains off Relax).
Each pass is O(n): a value's layout is computed once from its input's (memoised), and each layout
op belongs to at most one output chain (single use).
"""
from __future__ import annotations

from collections import Counter
from math import prod
from typing import Any

from mlcomp.targets.tvm.offload.chains import (
    ViewSpec,
    bindings_of,
    chain,
    decode,
    encode,
    is_layout,
    is_op,
    kernel_name,
    packed_call,
    readers_of,
    rebuild,
    static_shape,
    step,
    ty_of,
)
from mlcomp.targets.tvm.kernels import views_kernel
from mlcomp.targets.tvm.offload.layouts import Layout, LayoutError
from mlcomp.targets.tvm.offload.policy import rule

__all__ = ["VIEW_MIN_ELEMENTS", "ViewSpec", "absorb_views", "encode"]

_ATTENTION = "mlcomp.torch.attention"
_LINEAR = "mlcomp.torch.linear"
_ADD_NORM = "mlcomp.torch.add_layer_norm"
# kernels whose result is always a tensor of their own (never an argument or a view of one)
_FRESH = ("mlcomp.torch.linear", "mlcomp.torch.matmul", "mlcomp.torch.attention")
# A copy moved into a torch call pays the call's argument decoding and gains only torch's threads:
# below this many elements it stays in TVM (figures in benchmarks/RESULTS.md).
# Attention's q/k/v views copy nothing and are always taken.
VIEW_MIN_ELEMENTS = rule("views").min_size   # policy row views
SMALL_GEMM_MACS = rule("small-gemm").max_size   # products the small-GEMM probe may keep as TVM code


def _attention_views(call: Any, bound: dict, memo: dict) -> tuple[list[ViewSpec], list[Any], float] | None:
    """q, k, v of an attention call as 4-D strided views of their sources (one batch split for all)."""
    args = call.args[1:4]
    chains = [chain(a, bound, i < 2, memo) for i, a in enumerate(args)]
    if not any(n for *_, n in chains) or len({str(ty_of(src).dtype) for src, *_ in chains}) != 1:
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


def _in_views(bound: dict, min_elements: int, attention: bool) -> dict:
    """var -> the kernel call with its layout-chained arguments read as views (see the module doc).

    ``attention``: only attention calls (q/k/v as 4-D views, result ``[b1, b2, L, Dv]`` reshaped to
    the call's type: the gather's ``F`` keeps the batch split for :func:`_commute_merges`), else
    only the other kernels.
    """
    from tvm import relax

    new, memo = {}, {}
    for var, value in bound.items():
        name = kernel_name(value)
        if name is None or (name == _ATTENTION) != attention:
            continue
        if attention:
            got = _attention_views(value, bound, memo)
            if got is not None:
                specs, sources, scale = got
                shape = static_shape(value)
                split = (*specs[0][1][:3], specs[2][1][3])   # b1, b2, L, Dv
                new[var] = packed_call(views_kernel(name), encode(specs, (split, (0, 1, 2, 3), shape)),
                                 [*sources, relax.prim_value(float(scale))], value)
            continue
        specs, args = [], list(value.args[1:])
        for pos, arg in enumerate(args):
            if hasattr(arg, "value") or static_shape(arg) is None:   # constants and scalars stay
                continue
            src, layout, _, n = chain(arg, bound, False, memo)
            strided = layout.strided()
            if n and strided is not None and not layout.is_contiguous and prod(layout.shape) >= min_elements:
                specs.append((pos, strided[0], strided[1], layout.offset))
                args[pos] = src
        if specs:
            new[var] = packed_call(views_kernel(name), encode(specs, None), args, value)
    return new


def _out_views(bound: dict, users: Counter, outputs: set, min_elements: int) -> dict:
    """end of a chain -> its kernel's call with the chain applied in torch to the kernel's output."""
    readers = readers_of(bound)
    new = {}
    for var, value in bound.items():
        name = kernel_name(value)
        if name is None or not static_shape(value):
            continue
        views, gather, args = decode(value) if name.endswith("_views") else ([], None, list(value.args[1:]))
        if gather is not None and gather[1] != tuple(range(len(gather[1]))):
            continue   # it already ends in a permutation
        layout, node, end = Layout.contiguous(static_shape(value)), var, None
        while users[node] == 1 and node not in outputs and len(readers.get(node, ())) == 1:
            nxt = next(iter(readers[node]))
            call = bound[nxt]
            if not (is_layout(call) and call.args[0].same_as(node)):
                break
            try:
                layout = step(layout, call)
            except LayoutError:
                break
            node = nxt
            gather = layout.gather(prod(static_shape(value)))
            if gather is not None and not layout.is_contiguous and \
                    (name == views_kernel(_ATTENTION) or prod(layout.shape) >= min_elements):
                end = (node, gather)
        if end is not None:
            target = name if name.endswith("_views") else views_kernel(name)
            new[end[0]] = packed_call(target, encode(views, end[1]), args, bound[end[0]])
    return new


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
        name = kernel_name(value)
        if name is None or name.endswith("_views") or not name.startswith("mlcomp.torch.linear"):
            continue
        src, layout, _, n = chain(value.args[1], bound, False, memo)
        shape, out = static_shape(src), static_shape(value)
        if not n or layout.is_contiguous or not shape or not out or \
                any(not is_layout(bound.get(r)) for r in readers.get(var, ())) or var not in readers:
            continue
        rows = layout.rows(shape[-1])
        gather = None if rows is None else rows.gather(prod(shape[:-1]))
        if gather is None:
            continue
        f, p, s = gather
        ty = relax.TensorType((*shape[:-1], out[-1]), str(ty_of(value).dtype))
        y = relax.call_pure_packed(name, src, *value.args[2:], ty_args=ty)
        moved = relax.op.permute_dims(relax.op.reshape(y, (*f, out[-1])), [*p, len(f)])
        new[var] = relax.op.reshape(moved, (*s, out[-1]))
    return new


def _commute_merges(bound: dict, users: Counter, outputs: set) -> dict:
    """A linear on heads merged in another row order -> the linear on the heads as SDPA left them.

    SDPA's ``[b1, b2, L, D]`` result follows q's strides: for q read out of an in-projection it lies
    in memory as ``[b1, L, b2, D]``, rows of ``b2·D`` merged heads, free to read.  A linear whose input is those rows rearranged (sequence-first: ``[L·b1,
    b2·D]``, a copy) runs on the free rows instead and the rearrangement moves to its output, where
    it is applied only if it cancels: the single-use layout ops after the linear undo it (the
    permute back to batch-first), so no copy is left on either side and the next kernel reads a
    contiguous value.  Otherwise nothing changes.
    """
    from tvm import relax

    readers, new = readers_of(bound), {}
    single = lambda node: users[node] == 1 and node not in outputs and len(readers.get(node, ())) == 1
    for var, value in bound.items():
        name = kernel_name(value)
        if name is None or name.endswith("_views") or not name.startswith(_LINEAR):
            continue
        calls, node = [], value.args[1]
        while is_layout(bound.get(node)) and single(node):
            calls.append(bound[node])
            node = bound[node].args[0]
        source, att = node, bound.get(node)
        if not calls or kernel_name(att) != views_kernel(_ATTENTION) or not single(node):
            continue
        views, gather, args = decode(att)
        q_strides = next((strides for pos, _, strides, _ in views if pos == 0), None)
        if gather is None or len(gather[0]) != 4 or gather[1] != (0, 1, 2, 3) or q_strides is None \
                or not q_strides[1] < q_strides[2]:   # q (so SDPA's result) not laid out [b1, L, b2, D]
            continue
        b1, b2, length, dv = gather[0]
        try:   # the linear's input over SDPA's memory [b1, L, b2, Dv]
            layout = Layout.contiguous((b1, length, b2, dv)).permute((0, 2, 1, 3)).reshape(static_shape(att))
            for call in reversed(calls):
                layout = step(layout, call)
        except LayoutError:
            continue
        width, out = layout.shape[-1], static_shape(value)
        rows = layout.rows(width)
        n_rows = prod(layout.shape) // width
        if rows is None or rows.is_contiguous or rows.gather(n_rows) is None or out is None:
            continue
        ahead, end = rows.widen(out[-1]), None   # the linear's result over the linear of the free rows
        node = var
        while single(node) and is_layout(bound[next(iter(readers[node]))]):
            node = next(iter(readers[node]))
            try:
                ahead = step(ahead, bound[node])
            except LayoutError:
                break
            if ahead.is_contiguous:
                end = node
                break
        if end is None:
            continue
        dtype = str(ty_of(att).dtype)
        new[source] = packed_call(views_kernel(_ATTENTION), encode(views, (gather[0], (0, 2, 1, 3),
                                         (n_rows, width))), args, relax.TensorType((n_rows, width), dtype))
        y = relax.call_pure_packed(name, source, *value.args[2:],
                                   ty_args=relax.TensorType((n_rows, out[-1]), str(ty_of(value).dtype)))
        new[end] = relax.op.reshape(y, static_shape(bound[end]))
    return new


def _private(node: Any, bound: dict, users: Counter, outputs: set) -> bool:
    """Whether ``node`` is (a reshape, which TVM runs as a view, of) a :data:`_FRESH` kernel's result that
    only one binding reads."""
    while users[node] == 1 and node not in outputs and is_op(bound.get(node), "relax.reshape"):
        node = bound[node].args[0]
    producer = kernel_name(bound.get(node)) or ""
    return users[node] == 1 and node not in outputs and producer.startswith(_FRESH)


def _reuse_sums(bound: dict, users: Counter, outputs: set) -> dict:
    """``add_layer_norm(a, b)`` -> ``add_layer_norm_reuse``, which adds one summand into the other in place: one
    that is a linear/matmul/attention result nothing else reads (``b`` first; ``a`` then goes second, the
    sum is the same).  Those kernels return a tensor of their own (:data:`_FRESH`), so writing over one
    only its reader sees is safe; the out-of-place sum cost a fresh buffer per residual (transformer@32:
    8 × 4 MB; BERT writes ``dense(x) + residual``, the zoo transformer ``residual + out_proj(x)``).
    """
    from tvm import relax

    new = {}
    for var, value in bound.items():
        name = kernel_name(value)
        if name not in (_ADD_NORM, views_kernel(_ADD_NORM)):
            continue
        views, gather, args = decode(value) if name.endswith("_views") else ([], None, list(value.args[1:]))
        viewed = {pos for pos, *_ in views}
        for into in (1, 0):
            if into not in viewed and _private(args[into], bound, users, outputs):
                break
        else:
            continue
        if into == 0:   # the private summand goes second: swap the two (a view of the other moves with it)
            args[0], args[1] = args[1], args[0]
            views = [(0 if pos == 1 else pos, *rest) for pos, *rest in views]
        kernel = _ADD_NORM + "_reuse"
        new[var] = (packed_call(views_kernel(kernel), encode(views, gather), args, value) if name.endswith("_views")
                    else relax.call_pure_packed(kernel, *args, ty_args=ty_of(value)))
    return new


def _bias_into_split(bound: dict, users: Counter, outputs: set) -> dict:
    """An attention reading q/k/v as the heads of one in-projection (``[b1, L, 3·E]`` rows, q/k/v side by side)
    that nothing else reads takes that projection's bias: the projection runs without it (its GEMM writes
    the product directly instead of over a broadcast copy of the bias) and the kernel adds it in its split
    pass (``tvm.kernels._attention``).  A GEMM the small-GEMM probe may keep as TVM code keeps its bias.
    """
    import numpy as np
    import tvm
    from tvm import relax

    new = {}
    for var, value in bound.items():
        if kernel_name(value) != views_kernel(_ATTENTION):
            continue
        views, gather, args = decode(value)
        src, proj = args[0], bound.get(args[0])
        if len(args) != 4 or not all(a.same_as(src) for a in args[1:3]) or kernel_name(proj) != _LINEAR or \
                users[src] != 1 or src in outputs or not isinstance(proj.args[3], tvm.ir.expr.Constant):
            continue
        (a, w, b), shape, a_shape = proj.args[1:], static_shape(src), static_shape(proj.args[1])
        sizes = {sz for _, sz, _, _ in views}
        if len(sizes) != 1 or len(views) != 3 or not shape or not a_shape or \
                prod(shape) * a_shape[-1] <= SMALL_GEMM_MACS:     # multiply-adds of the projection
            continue
        b1, b2, length, depth = sizes.pop()
        e = b2 * depth
        if shape[-1] != 3 * e or prod(shape) != b1 * length * 3 * e or \
                [(pos, st, off) for pos, _, st, off in views] != [(i, (length * 3 * e, depth, 3 * e, 1), i * e)
                                                                  for i in range(3)]:
            continue
        empty = relax.const(np.zeros((0,), str(ty_of(b).dtype)))
        new[src] = relax.call_pure_packed(_LINEAR, a, w, empty, ty_args=ty_of(src))
        new[var] = packed_call(views_kernel(_ATTENTION), encode(views, gather), [*args, b], value)
    return new


def absorb_views(func: Any, min_elements: int = VIEW_MIN_ELEMENTS) -> Any:
    """``func`` with the layout chains around its torch kernel calls moved into them (module doc).

    ``min_elements``: the smallest copy moved into a torch call other than attention's.
    """
    bound, _, _ = bindings_of(func)
    func = rebuild(func, _commute_linears(bound, readers_of(bound)))
    bound, _, _ = bindings_of(func)
    func = rebuild(func, _in_views(bound, min_elements, attention=True))
    func = rebuild(func, _commute_merges(*bindings_of(func)))
    bound, _, _ = bindings_of(func)
    func = rebuild(func, _in_views(bound, min_elements, attention=False))
    func = rebuild(func, _out_views(*bindings_of(func), min_elements))
    func = rebuild(func, _reuse_sums(*bindings_of(func)))
    return rebuild(func, _bias_into_split(*bindings_of(func)))
