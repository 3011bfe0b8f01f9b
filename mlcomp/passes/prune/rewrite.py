"""Pruning's graph surgery: the physically smaller graph, its masked reference, and weight masks.

Given the channel groups (:mod:`mlcomp.passes.prune.channel_groups`) and the channels
to keep per group, :func:`shrink` slices every constant on every axis the group
reaches (a channel flattened into a Linear keeps its whole spatial block), updates
every literal size (view/reshape/expand, a depthwise convolution's ``groups``) and
re-infers every shape::

    before                                                 after (keep 3 of 6 channels)
    %features.0.weight: f32[6, 1, 5, 5] = param            %features.0.weight: f32[3, 1, 5, 5] = param
    %convolution: f32[1, 6, 28, 28] = convolution(…)       %convolution: f32[1, 3, 28, 28] = convolution(…)
    %view: f32[1, 400] = view(%avg_pool2d_1, [1, 400])     %view: f32[1, 200] = view(%avg_pool2d_1, [1, 200])

:func:`masked` builds the reference the pruned graph must equal: the original
with the dropped channels zeroed where they leave their group (every input of a
contraction — convolution, matmul, bmm — that carries them).
"""
from __future__ import annotations

import math
from typing import Any, Mapping, Sequence

import torch

from mlcomp.passes.prune.channel_groups import ChannelGroups, flat_index
from mlcomp.base.errors import IRError
from mlcomp.ir import Graph, Node, Ref, TensorMeta
from mlcomp.ir.builder import new_node
from mlcomp.ir.interpreter import Interpreter
from mlcomp.ir.meta import infer_meta
from mlcomp.ir.ops import PARAM, aten
from mlcomp.passes import patterns as P

__all__ = ["axis_index", "shrink", "masked", "magnitude_masks", "two_four_mask", "recalibrate_bn"]

_SPLITS_SIZES = aten("split_with_sizes")
_SPLITS = frozenset({aten("split.Tensor"), _SPLITS_SIZES})
_GROUP_NORM = aten("native_group_norm")

Keep = Mapping[int, torch.Tensor]     # group id -> sorted indices of the channels kept


def axis_index(layout: list[tuple[int | None, int]], keep: Keep) -> torch.Tensor | None:
    """Flat indices an axis keeps, given its (group, size) factors; None when no factor is pruned."""
    return flat_index(layout, keep)


def _new_size(layout: list[tuple[int | None, int]], keep: Keep) -> int:
    return math.prod(len(keep[g]) if g in keep else s for g, s in layout)


def shrink(graph: Graph, groups: ChannelGroups, keep: Keep) -> int:
    """Make ``graph`` physically smaller in place; returns the number of constants rewritten."""
    rewritten = 0
    for node in graph.nodes(PARAM):
        t = graph.constants[node.name]
        out = t
        for axis in range(t.dim()):
            idx = axis_index(groups.layout(node.name, axis), keep)
            if idx is not None:
                out = out.index_select(axis, idx)
        if out is not t:
            graph.constants[node.name] = out.contiguous()
            graph.replace(node.with_(meta=TensorMeta.of(graph.constants[node.name])))
            rewritten += 1
    for node in graph.call_nodes():
        node = _update_literals(graph, groups, keep, node)
        meta = infer_meta(graph, node)
        if meta is NotImplemented:
            raise IRError(f"cannot re-infer the shape of %{node.name} ({node.op}) after pruning",
                          where=str(node.origin), hint="exclude this module from pruning (exclude=...)")
        if meta != node.meta:
            graph.replace(node.with_(meta=_keep_symbols(graph, node.meta, meta)))
    return rewritten


def _update_literals(graph: Graph, groups: ChannelGroups, keep: Keep, node: Node) -> Node:
    """Literal sizes in views, expands and depthwise convolutions, after the channels they name shrank."""
    ins = list(node.inputs)
    if node.op in P.SHAPE_OPS or node.op == P.EXPAND:
        sizes = list(ins[1])
        for i, s in enumerate(sizes):
            if isinstance(s, int) and s != -1:
                sizes[i] = _new_size(groups.layout(node.name, i), keep) if groups.layout(node.name, i) else s
        ins[1] = type(node.inputs[1])(sizes)
    elif node.op == P.CONVOLUTION and ins[8] != 1:
        before = node.tensor_meta.shape[1]
        if ins[8] == before and groups.layout(node.name, 1):        # depthwise: one group per channel
            ins[8] = _new_size(groups.layout(node.name, 1), keep)
    elif node.op in _SPLITS or node.op == P.SLICE:
        return _update_offsets(graph, groups, keep, node)
    elif node.op == _GROUP_NORM and isinstance(ins[0], Ref):
        channels = _new_size(groups.layout(ins[0].name, 1), keep) if groups.layout(ins[0].name, 1) else ins[4]
        ins[6] = ins[6] * channels // ins[4]                          # whole groups only: per-group size stays
        ins[4] = channels
    else:
        return node
    if tuple(ins) == node.inputs:
        return node
    return graph.replace(node.with_(inputs=tuple(ins)))


def _update_offsets(graph: Graph, groups: ChannelGroups, keep: Keep, node: Node) -> Node:
    """Split sizes and slice bounds on a pruned axis: count the kept channels before each offset."""
    ins = list(node.inputs)
    d = ins[1] if node.op == P.SLICE else (ins[2] if len(ins) > 2 else 0)
    if not isinstance(ins[0], Ref):
        return node
    d %= len(graph.node(ins[0].name).tensor_meta.shape)
    idx = axis_index(groups.layout(ins[0].name, d), keep)
    if idx is None:
        return node
    size = graph.node(ins[0].name).tensor_meta.concrete_shape(graph.symbols)[d]

    def kept_before(offset: int) -> int:
        return int((idx < offset).sum())

    if node.op == P.SLICE:
        start, end = (ins[2] if len(ins) > 2 else 0), (ins[3] if len(ins) > 3 else size)
        start, end = (max(0, min(size, v + size if v < 0 else v)) for v in (start, end))
        ins[2:4] = [kept_before(start), kept_before(max(start, end))]
    else:
        metas = node.meta if isinstance(node.meta, tuple) else (node.meta,)
        bounds = [0]
        for m in metas:
            bounds.append(bounds[-1] + m.concrete_shape(graph.symbols)[d])
        sizes = [kept_before(b) - kept_before(a) for a, b in zip(bounds, bounds[1:])]
        if node.op == _SPLITS_SIZES or len(set(sizes[:-1])) > 1 or sizes[-1] > sizes[0]:
            kind = type(node.inputs[1]) if isinstance(node.inputs[1], (list, tuple)) else list
            return graph.replace(node.with_(op=_SPLITS_SIZES, inputs=(ins[0], kind(sizes), d)))
        ins[1] = sizes[0]
    return graph.replace(node.with_(inputs=tuple(ins)))


def _keep_symbols(graph: Graph, old: object, new: object) -> object:
    """New meta with the old symbolic sizes kept where the size did not change."""
    if isinstance(old, TensorMeta) and isinstance(new, TensorMeta) and len(old.shape) == len(new.shape):
        conc = old.concrete_shape(graph.symbols)
        dims = tuple(o if isinstance(o, str) and c == n else n for o, c, n in zip(old.shape, conc, new.shape))
        return TensorMeta(dims, new.dtype, new.device, new.requires_grad)
    if isinstance(old, tuple) and isinstance(new, tuple) and len(old) == len(new):
        return tuple(_keep_symbols(graph, o, n) for o, n in zip(old, new))
    return new


def masked(graph: Graph, groups: ChannelGroups, keep: Keep) -> Graph:
    """A copy of ``graph`` with the dropped channels zeroed at every contraction that reads them."""
    ref = graph.copy()
    for name, pos, axis in groups.contractions:
        node = ref.node(name)
        value = node.inputs[pos]
        if not isinstance(value, Ref):
            continue
        src = ref.node(value.name)
        layout = groups.layout(src.name, axis)
        idx = axis_index(layout, keep)
        if idx is None:
            continue
        rank = len(src.tensor_meta.shape)
        size = math.prod(s for _, s in layout)
        mask = torch.zeros(size, dtype=src.tensor_meta.dtype)
        mask[idx] = 1
        shape = [1] * rank
        shape[axis] = size
        mname = ref.fresh_name(f"{name}.prune_mask")
        ref.add_constant(mname, mask.reshape(shape), origin=node.origin)
        mul = new_node(ref, aten("mul.Tensor"), (value, Ref(mname)), name=f"{value.name}_masked",
                       origin=node.origin, before=name)
        ins = list(node.inputs)
        ins[pos] = Ref(mul.name)
        ref.replace(node.with_(inputs=tuple(ins)))
    return ref


def magnitude_masks(tensors: Mapping[str, torch.Tensor], sparsity: float, *, per_layer: bool) -> dict[str, torch.Tensor]:
    """Boolean keep-masks zeroing the ``sparsity`` fraction of smallest magnitudes (global or per tensor)."""
    if not tensors:
        return {}
    if per_layer:
        return {n: _keep_largest(t.abs().reshape(-1), sparsity).reshape(t.shape) for n, t in tensors.items()}
    flat = torch.cat([t.abs().reshape(-1) for t in tensors.values()])
    keep = _keep_largest(flat, sparsity)
    out, start = {}, 0
    for n, t in tensors.items():
        out[n] = keep[start:start + t.numel()].reshape(t.shape)
        start += t.numel()
    return out


def _keep_largest(values: torch.Tensor, sparsity: float) -> torch.Tensor:
    drop = int(math.floor(values.numel() * sparsity))
    keep = torch.ones(values.numel(), dtype=torch.bool)
    if drop > 0:
        keep[torch.argsort(values, stable=True)[:drop]] = False
    return keep


def two_four_mask(weight: torch.Tensor) -> torch.Tensor | None:
    """Keep the 2 largest of every 4 consecutive weights along the reduction axis (None: not a multiple of 4)."""
    rows = weight.reshape(weight.shape[0], -1)
    if rows.shape[1] % 4:
        return None
    quads = rows.abs().reshape(rows.shape[0], -1, 4)
    top = quads.topk(2, dim=-1).indices
    keep = torch.zeros_like(quads, dtype=torch.bool).scatter_(-1, top, True)
    return keep.reshape(weight.shape)


def recalibrate_bn(pruned: Graph, reference: Graph, groups: ChannelGroups, keep: Keep,
                   batches: Sequence[Any]) -> int:
    """Re-estimate every eval batch norm's running mean/var from ``batches`` run through ``pruned``.

    The masked reference gets the same statistics on the kept channels (its other
    channels are zeroed downstream), so the two graphs stay equal.  Returns the
    number of batch norms updated.
    """
    sums: dict[str, list[torch.Tensor]] = {}
    bns = [n for n in pruned.nodes(P.BATCH_NORM_EVAL) if all(isinstance(v, Ref) for v in n.inputs[3:5])]
    with torch.no_grad():
        for batch in batches:
            xs = batch if isinstance(batch, (tuple, list)) else (batch,)
            values = Interpreter(pruned).run_all(*xs)
            for bn in bns:
                x = values[bn.inputs[0].name].double()
                dims = [d for d in range(x.dim()) if d != 1]
                part = sums.setdefault(bn.name, [torch.zeros(x.shape[1], dtype=torch.float64)] * 2 + [0])
                part[0] = part[0] + x.sum(dims)
                part[1] = part[1] + (x * x).sum(dims)
                part[2] += x.numel() // x.shape[1]
    for bn in bns:
        total, squares, count = sums[bn.name]
        mean = total / count
        var = (squares / count - mean * mean).clamp_min(0) * count / max(count - 1, 1)
        for ref, value in ((bn.inputs[3], mean), (bn.inputs[4], var)):
            dtype = pruned.constants[ref.name].dtype
            pruned.constants[ref.name] = value.to(dtype)
            full = reference.writable_constant(ref.name)
            idx = axis_index(groups.layout(ref.name, 0), keep)
            full[idx if idx is not None else slice(None)] = value.to(dtype)
    return len(bns)
