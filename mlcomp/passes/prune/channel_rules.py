"""The channel walk's per-op rules: op -> how its inputs' and outputs' axes share atoms.

:data:`RULES` maps each op the walk understands to a :class:`Rule`; the walk
(:mod:`mlcomp.passes.prune.channel_walk`) looks the op up and applies it once per
node.  A rule reads the layout of the node's first input (``x``, a list of atoms
per axis) and the layouts of its other inputs, joins atoms that are one index
space, fixes the ones that cannot be pruned and sets the node's own layout::

    rule         op                                    what it joins
    conv         convolution(%x, %w, %b, …, groups)    x axis 1 = w axis 1; output axis 1 = w axis 0
    linear       addmm(%b, %x, %w^T), mm(%x, %w^T)     x's last axis = w's rows; output = w's columns
    permute      permute/transpose/t                   the output's axes are the input's, reordered
    reshape      view/reshape/_unsafe_view             all atoms of the input = all atoms of the output
    reduce       mean.dim, sum.dim_IntList, amax …      reduced axes fixed; kept axes go on

Ops not in :data:`RULES` take :func:`rule_for`'s default: elementwise and
broadcasting ops (by :func:`~mlcomp.ir.ops.category`) join their inputs'
right-aligned axes with the output's; any other op fixes every axis it reads
and writes.  A rule that ``needs_meta`` runs only on a node with a tensor value,
one that ``needs_input`` only when the first input has a layout; otherwise the
node's axes are fixed ("``op`` is not understood").
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from mlcomp.passes.prune.channel_atoms import Role
from mlcomp.ir import Node, Ref, TensorMeta
from mlcomp.ir.ops import GETITEM, Category, Op, aten, category
from mlcomp.ir.opsets import (ADDMM, BATCH_NORM_EVAL, BMM, CONVOLUTION, EXPAND, LAYER_NORM, MM, PERMUTE,
                              PERMUTE_OPS, SHAPE_OPS, SLICE, SQUEEZE_OPS, TRANSPOSE, UNSQUEEZE)

if TYPE_CHECKING:
    from mlcomp.passes.prune.channel_walk import ChannelWalk, Layout

__all__ = ["RULES", "Rule", "rule_for"]

LIKE = frozenset({aten("full_like"), aten("zeros_like"), aten("ones_like"), aten("empty_like")})
REDUCE = frozenset({aten("mean.dim"), aten("sum.dim_IntList"), aten("amax"), aten("amin"), aten("any.dim"),
                    aten("var.correction"), aten("prod.dim_int")})
POOL = frozenset({aten("avg_pool2d"), aten("_adaptive_avg_pool2d"), aten("adaptive_avg_pool2d"),
                  aten("max_pool2d_with_indices"), aten("max_pool2d")})
SOFTMAX = frozenset({aten("_softmax"), aten("_log_softmax"), aten("_safe_softmax")})
SPLIT = frozenset({aten("split.Tensor"), aten("split_with_sizes")})
SELECT, CAT, SDPA = aten("select.int"), aten("cat"), aten("scaled_dot_product_attention")
GROUP_NORM, EMBEDDING = aten("native_group_norm"), aten("embedding")


@dataclass(frozen=True)
class Rule:
    """How one op joins atoms: ``apply(walk, node, x)`` with ``x`` the first input's layout."""

    apply: Callable[["ChannelWalk", Node, "Layout | None"], None]
    needs_meta: bool = True      # the node must have a tensor (or tuple) value
    needs_input: bool = True     # the first input must have a layout


# -- projections and concat: no precondition --------------------------------------
def getitem(w: ChannelWalk, n: Node, x: Layout | None) -> None:
    """Element i of a tuple value: the layout the producer set for its output i."""
    src = n.inputs[0].name if isinstance(n.inputs[0], Ref) else None
    found = w.lay.get((src, n.inputs[1])) if src is not None else None
    w.set(n, found) if found is not None else w.fix_all(n, "an unknown value")


def cat(w: ChannelWalk, n: Node, x: Layout | None) -> None:
    """Channel c of input i is channel offset_i + c of the output; other axes are shared."""
    ins = n.inputs
    parts = [w.of(v) for v in ins[0] if not (isinstance(v, Ref) and w.empty(v))]   # legacy cat([], x)
    if not parts or any(p is None for p in parts) or not isinstance(n.meta, TensorMeta):
        return w.fix_all(n, "a concat of unknown values")
    rank = len(parts[0])
    d = (ins[1] if len(ins) > 1 else n.attrs.get("dim", 0)) % rank
    out = list(parts[0])
    for p in parts[1:]:
        for i in range(rank):
            if i != d:
                w.A.unify(out[i], p[i])
    out[d] = [w.A.cat([w.piece(p[d]) for p in parts])]
    return w.set(n, out)


# -- contractions: the weight's axes name the channels ------------------------------
def conv(w: ChannelWalk, n: Node, x: Layout) -> None:
    """Input channels contract with the weight's axis 1 (depthwise: its axis 0); outputs are its axis 0."""
    A, ins = w.A, n.inputs
    wl = w.of(ins[1])
    if ins[6]:
        return w.fix_all(n, "transposed convolution")
    out = w.fresh(n.meta)
    out[0] = x[0]
    groups = ins[8]
    if groups == 1:
        A.unify(x[1], wl[1])
        w.contractions.append((n.name, 0, 1))
    elif wl is not None and n.tensor_meta.shape[1] == groups and w.g.node(ins[1].name).meta.shape[1] == 1:
        A.unify(x[1], wl[0])               # depthwise: input channel c makes output channel c
    else:
        A.fix(x[1] + wl[0], "grouped convolution")
    out[1] = wl[0]
    if isinstance(ins[2], Ref):
        A.unify(w.of(ins[2])[0], wl[0])
    A.mark(wl[0], Role.CONV_OUT)
    w.weight(ins[1], w.weights, n.op)
    return w.set(n, out)


def addmm(w: ChannelWalk, n: Node, x: Layout | None) -> None:
    """addmm(bias, m1, m2): m1's columns contract with m2's rows; the bias follows m2's columns."""
    A, ins = w.A, n.inputs
    m1, m2 = w.of(ins[1]), w.of(ins[2])
    out = [m1[0], m2[1]]
    A.unify(m1[1], m2[0])
    w.contractions.append((n.name, 1, 1))
    b = w.of(ins[0])
    if b is not None and b and w.g.node(ins[0].name).tensor_meta.shape[-1] != 1:
        A.unify(b[-1], m2[1])
    A.mark(m2[1], Role.LINEAR_OUT)
    w.weight(ins[2], w.weights, n.op)
    return w.set(n, out)


def mm(w: ChannelWalk, n: Node, x: Layout) -> None:
    """mm(x, w^T): a Linear without bias on 2-d input."""
    m2 = w.of(n.inputs[1])
    w.A.unify(x[1], m2[0])
    w.contractions.append((n.name, 0, 1))
    w.A.mark(m2[1], Role.LINEAR_OUT)
    w.weight(n.inputs[1], w.weights, n.op)
    return w.set(n, [x[0], m2[1]])


def bmm(w: ChannelWalk, n: Node, x: Layout) -> None:
    """A Linear on 3-d input (bmm(x, expand(weight))), or attention scores (the batch axis holds heads)."""
    A = w.A
    y = w.of(n.inputs[1])
    A.unify(x[0], y[0])
    A.unify(x[2], y[1])
    w.contractions.append((n.name, 0, 2))
    linear: dict[str, Any] = {}
    w.weight(n.inputs[1], linear, n.op)
    if linear:
        A.mark(y[2], Role.LINEAR_OUT)
        w.weights.update(linear)
    else:
        A.mark(x[0], Role.HEAD)
        for axes in (x[1], x[2], y[2]):
            A.mark(axes, Role.BMM_INNER)
    return w.set(n, [x[0], x[1], y[2]])


# -- norms ----------------------------------------------------------------------------
def batch_norm(w: ChannelWalk, n: Node, x: Layout) -> None:
    """Weight, bias and running statistics follow the channel axis; the gamma is remembered."""
    ins = n.inputs
    for v in ins[1:5]:
        if isinstance(v, Ref):
            w.A.unify(w.of(v)[0], x[1])
    if isinstance(ins[1], Ref):
        w.bn[ins[1].name] = None
    w.set(n, x, 0)
    for i in (1, 2):
        if isinstance(n.meta, tuple) and isinstance(n.meta[i], TensorMeta):
            w.set(n, w.fresh(n.meta[i], "batch-norm statistics"), i)


def layer_norm(w: ChannelWalk, n: Node, x: Layout) -> None:
    """The normalised (last k) axes are fixed; weight and bias follow them."""
    ins = n.inputs
    k = len(ins[1])
    w.A.fix([a for axis in x[-k:] for a in axis], "normalised by a layer norm")
    for v in ins[2:4]:
        if isinstance(v, Ref):
            for a, b in zip(w.of(v), x[-k:]):
                w.A.unify(a, b)
    w.set(n, x, 0)
    for i in (1, 2):
        w.set(n, x[:-k] + w.fresh(n.meta[i])[-k:], i)


def group_norm(w: ChannelWalk, n: Node, x: Layout) -> None:
    """native_group_norm: channels are groups × per-group; only whole groups may go."""
    A, ins = w.A, n.inputs
    groups = ins[6]
    channels = math.prod(A.size[a] for a in x[1])
    g, inner = A.new(groups), A.new(channels // groups, "inside a group-norm group")
    A.unify([g, inner], x[1])
    for v in ins[1:3]:
        if isinstance(v, Ref):
            A.unify(w.of(v)[0], x[1])
    w.set(n, x, 0)
    for i in (1, 2):
        w.set(n, [x[0], [g]], i)


def softmax(w: ChannelWalk, n: Node, x: Layout) -> None:
    """The normalised axis is fixed; the others go on."""
    w.A.fix(x[n.inputs[1] % len(x)], "normalised by a softmax")
    w.set(n, x)


def attention(w: ChannelWalk, n: Node, q: Layout) -> None:
    """scaled_dot_product_attention(q, k, v, mask): [batch, heads, seq, dim]; heads are axis 1."""
    A, ins = w.A, n.inputs
    k, v = w.of(ins[1]), w.of(ins[2])
    if k is None or v is None or not len(q) == len(k) == len(v) == 4:
        return w.fix_all(n, "attention of unknown shape")
    for a, b in ((q[0], k[0]), (q[0], v[0]), (q[1], k[1]), (q[1], v[1]), (q[3], k[3]), (k[2], v[2])):
        A.unify(a, b)
    A.mark(q[1], Role.HEAD)
    for axes in (q[2], q[3], k[2], v[3]):
        A.mark(axes, Role.BMM_INNER)
    out = [q[0], q[1], q[2], v[3]]
    mask = w.of(ins[3]) if len(ins) > 3 else None
    if mask is not None:                      # broadcast onto the scores [batch, heads, q, k]
        scores = [q[0], q[1], q[2], k[2]]
        for i, axis in enumerate(mask):
            if A.leaves(axis):
                A.unify(scores[i + 4 - len(mask)], axis)
    return w.set(n, out, 0 if isinstance(n.meta, tuple) else None)


# -- views: the same atoms, rearranged ------------------------------------------------
def permute(w: ChannelWalk, n: Node, x: Layout) -> None:
    rank, ins = len(x), n.inputs
    if n.op == PERMUTE:
        perm = [d % rank for d in ins[1]]
    elif n.op == TRANSPOSE:
        perm = list(range(rank))
        a, b = ins[1] % rank, ins[2] % rank
        perm[a], perm[b] = perm[b], perm[a]
    else:
        perm = list(range(rank))[::-1]
    w.set(n, [x[p] for p in perm])


def reshape(w: ChannelWalk, n: Node, x: Layout) -> None:
    """Same data, new shape: the input's atoms, refined to fit the output's axes."""
    out = w.fresh(n.meta)
    w.A.unify([a for axis in x for a in axis], [a for axis in out for a in axis])
    w.set(n, out)


def unsqueeze(w: ChannelWalk, n: Node, x: Layout) -> None:
    d = n.inputs[1] % (len(x) + 1)
    w.set(n, x[:d] + [[w.A.new(1)]] + x[d:])


def squeeze(w: ChannelWalk, n: Node, x: Layout) -> None:
    dims = n.inputs[1] if isinstance(n.inputs[1], (list, tuple)) else [n.inputs[1]]
    drop = {d % len(x) for d in dims if w.A.leaves(x[d % len(x)]) == []}
    w.set(n, [a for i, a in enumerate(x) if i not in drop])


def expand(w: ChannelWalk, n: Node, x: Layout) -> None:
    """Axes of size > 1 go on; broadcast (size-1) axes become fresh ones."""
    out = w.fresh(n.meta)
    off = len(out) - len(x)
    for i, axis in enumerate(x):
        if w.A.leaves(axis) or n.tensor_meta.shape[i + off] == 1:
            out[i + off] = axis
    w.set(n, out)


def same(w: ChannelWalk, n: Node, x: Layout) -> None:
    """A value shaped like its input (``full_like`` …): the input's layout."""
    w.set(n, x)


def pool(w: ChannelWalk, n: Node, x: Layout) -> None:
    """Batch and channel axes go on; the pooled (last two) axes are fresh."""
    metas = n.meta if isinstance(n.meta, tuple) else (n.meta,)
    for i, m in enumerate(metas):
        out = w.fresh(m)
        out[:len(x) - 2] = x[:len(x) - 2]
        w.set(n, out, i if isinstance(n.meta, tuple) else None)


# -- split, slice, index, reduce ----------------------------------------------------------
def split(w: ChannelWalk, n: Node, x: Layout) -> None:
    """Output i is a piece of the input's axis: the input's axis is the concat of the outputs'."""
    d = (n.inputs[2] if len(n.inputs) > 2 else n.attrs.get("dim", 0)) % len(x)
    metas = n.meta if isinstance(n.meta, tuple) else ()
    parts = [w.A.new(m.concrete_shape(w.g.symbols)[d]) for m in metas]
    w.A.unify([w.A.cat(parts)], x[d])
    for i, part in enumerate(parts):
        out = list(x)
        out[d] = [part]
        w.set(n, out, i)


def slice_(w: ChannelWalk, n: Node, x: Layout) -> None:
    """A step-1 slice is the middle part of a concat; a strided one indexes (:func:`select`)."""
    ins = n.inputs
    d = ins[1] % len(x)
    size = math.prod(w.A.size[a] for a in x[d])
    start, end = (ins[2] if len(ins) > 2 else 0), (ins[3] if len(ins) > 3 else size)
    step = ins[4] if len(ins) > 4 else 1
    if not all(isinstance(v, int) for v in (start, end, step)) or step != 1:
        return select(w, n, x)
    start, end = (max(0, min(size, v + size if v < 0 else v)) for v in (start, end))
    end = max(start, end)
    if (start, end) == (0, size):
        return w.set(n, x)
    mid = w.A.new(end - start)
    w.A.unify([w.A.cat([w.A.new(start), mid, w.A.new(size - end)])], x[d])
    out = list(x)
    out[d] = [mid]
    return w.set(n, out)


def select(w: ChannelWalk, n: Node, x: Layout) -> None:
    """select.int and strided slices: the indexed axis is fixed (a slice keeps a fresh, fixed axis)."""
    d = n.inputs[1] % len(x)
    w.A.fix(x[d], "indexed")
    if n.op == SLICE:
        out = list(x)
        out[d] = w.fresh(n.meta, "indexed")[d]
        return w.set(n, out)
    return w.set(n, x[:d] + x[d + 1:])


def embedding(w: ChannelWalk, n: Node, x: Layout) -> None:
    """Table rows are indexed by the ids (fixed); the table's columns go on."""
    ids = w.of(n.inputs[1])
    if ids is None or len(x) != 2:
        return w.fix_all(n, "an embedding of unknown shape")
    w.A.fix(x[0], "indexed")
    return w.set(n, ids + [x[1]])


def reduce(w: ChannelWalk, n: Node, x: Layout) -> None:
    """Reduced axes are fixed; with keepdim they stay as fresh size-1 axes."""
    ins = n.inputs
    dims = ins[1] if len(ins) > 1 else list(range(len(x)))
    dims = [dims] if isinstance(dims, int) else (dims or list(range(len(x))))
    red = {d % len(x) for d in dims}
    keep = len(ins) > 2 and bool(ins[2]) or bool(n.attrs.get("keepdim", False))
    w.A.fix([a for d in red for a in x[d]], "reduced over")
    fresh = w.fresh(n.meta if isinstance(n.meta, TensorMeta) else n.meta[0])
    out = [fresh[i] if i in red else x[i] for i in range(len(x))] if keep else \
        [x[i] for i in range(len(x)) if i not in red]
    w.set(n, out)


# -- the defaults ---------------------------------------------------------------------
def broadcast(w: ChannelWalk, n: Node, x: Layout) -> None:
    """Elementwise/broadcasting: each input's axes, right-aligned, join the output's (size-1 axes don't)."""
    if not isinstance(n.meta, TensorMeta):
        return unknown(w, n, x)
    out = w.fresh(n.meta)
    rank = len(out)
    for v in n.inputs:
        lv = w.of(v)
        if lv is None:
            continue
        for i, axis in enumerate(lv):
            if w.A.leaves(axis):
                w.A.unify(out[rank - len(lv) + i], axis)
    return w.set(n, out)


def unknown(w: ChannelWalk, n: Node, x: Layout | None) -> None:
    """Not in :data:`RULES` and not elementwise: every axis it reads and writes is fixed."""
    w.fix_all(n, f"{n.op} is not understood by the channel walk")


BROADCAST, UNKNOWN = Rule(broadcast), Rule(unknown)      # the defaults of rule_for


def _family(ops: frozenset[Op], rule: Rule) -> dict[Op, Rule]:
    return dict.fromkeys(sorted(ops, key=str), rule)


RULES: dict[Op, Rule] = {
    GETITEM: Rule(getitem, needs_meta=False, needs_input=False),
    CAT: Rule(cat, needs_meta=False, needs_input=False),
    ADDMM: Rule(addmm, needs_input=False),       # its first input is the bias, maybe a number
    CONVOLUTION: Rule(conv), MM: Rule(mm), BMM: Rule(bmm),
    BATCH_NORM_EVAL: Rule(batch_norm), LAYER_NORM: Rule(layer_norm), GROUP_NORM: Rule(group_norm),
    SDPA: Rule(attention),
    **_family(PERMUTE_OPS, Rule(permute)), **_family(SHAPE_OPS, Rule(reshape)),
    UNSQUEEZE: Rule(unsqueeze), **_family(SQUEEZE_OPS, Rule(squeeze)), EXPAND: Rule(expand),
    **_family(LIKE, Rule(same)), **_family(POOL, Rule(pool)), **_family(SOFTMAX, Rule(softmax)),
    **_family(SPLIT, Rule(split)), SLICE: Rule(slice_), SELECT: Rule(select), EMBEDDING: Rule(embedding),
    **_family(REDUCE, Rule(reduce)),
}


def rule_for(op: Op) -> Rule:
    """The op's rule; ops not in :data:`RULES`: :data:`BROADCAST` for elementwise and broadcasting
    ops, :data:`UNKNOWN` (every axis fixed) for the rest."""
    rule = RULES.get(op)
    if rule is not None:
        return rule
    return BROADCAST if category(op) in (Category.ELEMWISE, Category.BROADCAST) else UNKNOWN
