"""The channel walk: which axes of which values are the same index space (atoms), op by op.

:func:`mlcomp.passes.prune.channel_groups.find_channel_groups` runs it once over the
graph and turns its atoms into groups.  Each op says which atoms of its inputs
and outputs are one index space::

    before (IR)                                              after (atoms of the channel axis)
    %cat = cat([%relu, %convolution_1], 1)                   cat: 24 = a.weight:0 (8) ++ b.weight:0 (16)
    %split_with_sizes = split_with_sizes(%view_2, [64]*3, 2) view_2: 192 = q (64) ++ k (64) ++ v (64)
    %native_group_norm = native_group_norm(%conv, …, 4, …)   conv: 16 = groups (4) x per group (4, fixed)
    %sdpa = scaled_dot_product_attention(%q, %k, %v, …)      q, k, v axis 1: one atom, the heads

Unknown ops, inputs, outputs, indexed and reduced axes are fixed.  One visit per
node with near-constant union-find work (O(n α(n))).
"""
from __future__ import annotations

import math
from typing import Any

from mlcomp.passes.prune.channel_atoms import Atoms, Role
from mlcomp.ir import Graph, Node, Ref, TensorMeta
from mlcomp.ir.ops import GETITEM, INPUT, OUTPUT, PARAM, Category, Op, aten, category
from mlcomp.ir.opsets import (ADDMM, BATCH_NORM_EVAL, BMM, CONVOLUTION, EXPAND, LAYER_NORM, MM, PERMUTE,
                              PERMUTE_OPS, SHAPE_OPS, SLICE, SQUEEZE_OPS, TRANSPOSE, UNSQUEEZE)

__all__ = ["ChannelWalk", "Layout", "excluded"]

_LIKE = frozenset({aten("full_like"), aten("zeros_like"), aten("ones_like"), aten("empty_like")})
_REDUCE = frozenset({aten("mean.dim"), aten("sum.dim_IntList"), aten("amax"), aten("amin"), aten("any.dim"),
                     aten("var.correction"), aten("prod.dim_int")})
_POOL = frozenset({aten("avg_pool2d"), aten("_adaptive_avg_pool2d"), aten("adaptive_avg_pool2d"),
                   aten("max_pool2d_with_indices"), aten("max_pool2d")})
_SOFTMAX = frozenset({aten("_softmax"), aten("_log_softmax"), aten("_safe_softmax")})
_SELECT = aten("select.int")
_CAT = aten("cat")
_SPLIT = frozenset({aten("split.Tensor"), aten("split_with_sizes")})
_SDPA = aten("scaled_dot_product_attention")
_GROUP_NORM = aten("native_group_norm")
_EMBEDDING = aten("embedding")


Layout = list[list[int]]     # per axis: its atoms


def excluded(node: Node, exclude: tuple[str, ...]) -> bool:
    path = node.origin.module_path
    return any(node.name == e or path == e or path.startswith(e + ".") for e in exclude)


class ChannelWalk:
    """One visit per node: the atoms of every axis of every value (see the module docstring)."""

    def __init__(self, graph: Graph, exclude: tuple[str, ...]) -> None:
        self.g = graph
        self.exclude = exclude
        self.A = Atoms()
        self.lay: dict[tuple[str, int | None], Layout] = {}
        self.weights: dict[str, Op] = {}
        self.bn: dict[str, None] = {}
        self.contractions: list[tuple[str, int, int]] = []

    # -- layouts ------------------------------------------------------------
    def fresh(self, meta: Any, fixed: str | None = None) -> Layout:
        shape = meta.concrete_shape(self.g.symbols) if isinstance(meta, TensorMeta) else ()
        return [[self.A.new(d, fixed)] for d in shape]

    def of(self, v: Any) -> Layout | None:
        if not isinstance(v, Ref):
            return None
        return self.lay.get((v.name, None))

    def set(self, node: Node, layout: Layout, index: int | None = None) -> None:
        self.lay[(node.name, index)] = layout

    def fix_all(self, node: Node, why: str) -> None:
        for r in node.input_names():
            for key in [k for k in ((r, None),) if k in self.lay] + [(r, i) for i in range(8) if (r, i) in self.lay]:
                self.A.fix([a for axis in self.lay[key] for a in axis], why)
        if isinstance(node.meta, tuple):
            for i, m in enumerate(node.meta):
                if isinstance(m, TensorMeta):
                    self.set(node, self.fresh(m, why), i)
        elif isinstance(node.meta, TensorMeta):
            self.set(node, self.fresh(node.meta, why))

    def weight(self, v: Any, into: dict[str, Any], op: Any = None) -> None:
        """Remember the PARAM behind ``v`` (through permutes and views) as an importance source."""
        while isinstance(v, Ref):
            n = self.g.node(v.name)
            if n.op == PARAM:
                into[n.name] = op
                return
            if n.op not in PERMUTE_OPS and n.op not in SHAPE_OPS and n.op != EXPAND:
                return
            v = n.inputs[0]

    # -- the walk -------------------------------------------------------------
    def run(self) -> ChannelWalk:
        for node in self.g.nodes():
            if node.op == PARAM:
                self.set(node, self.fresh(node.meta))
            elif node.op == INPUT:
                self.set(node, self.fresh(node.meta, "a graph input"))
            elif node.op == OUTPUT:
                for r in node.input_names():
                    for key in [(r, None)] + [(r, i) for i in range(8)]:
                        if key in self.lay:
                            self.A.fix([a for axis in self.lay[key] for a in axis], "a graph output")
            else:
                self.visit(node)
            if node.op not in (INPUT, OUTPUT) and excluded(node, self.exclude):
                for key in [(node.name, None)] + [(node.name, i) for i in range(8)]:
                    if key in self.lay:
                        self.A.fix([a for axis in self.lay[key] for a in axis], "excluded")
        return self

    def visit(self, n: Node) -> None:  # noqa: C901 - one dispatch over op families
        op, ins, A = n.op, n.inputs, self.A
        x = self.of(ins[0]) if ins else None
        if op == GETITEM:
            src = ins[0].name if isinstance(ins[0], Ref) else None
            found = self.lay.get((src, ins[1])) if src is not None else None
            self.set(n, found) if found is not None else self.fix_all(n, "an unknown value")
            return
        if op == _CAT:
            return self.cat(n)
        if not isinstance(n.meta, (TensorMeta, tuple)) or x is None and op not in (ADDMM,):
            self.fix_all(n, f"{op} is not understood")
            return
        if op == CONVOLUTION:
            w = self.of(ins[1])
            if ins[6]:
                return self.fix_all(n, "transposed convolution")
            out = self.fresh(n.meta)
            out[0] = x[0]
            groups = ins[8]
            if groups == 1:
                A.unify(x[1], w[1])
                self.contractions.append((n.name, 0, 1))
            elif w is not None and n.tensor_meta.shape[1] == groups and self.g.node(ins[1].name).meta.shape[1] == 1:
                A.unify(x[1], w[0])               # depthwise: input channel c makes output channel c
            else:
                A.fix(x[1] + w[0], "grouped convolution")
            out[1] = w[0]
            if isinstance(ins[2], Ref):
                A.unify(self.of(ins[2])[0], w[0])
            A.mark(w[0], Role.CONV_OUT)
            self.weight(ins[1], self.weights, op)
            return self.set(n, out)
        if op == ADDMM:
            m1, m2 = self.of(ins[1]), self.of(ins[2])
            out = [m1[0], m2[1]]
            A.unify(m1[1], m2[0])
            self.contractions.append((n.name, 1, 1))
            b = self.of(ins[0])
            if b is not None and b and self.g.node(ins[0].name).tensor_meta.shape[-1] != 1:
                A.unify(b[-1], m2[1])
            A.mark(m2[1], Role.LINEAR_OUT)
            self.weight(ins[2], self.weights, op)
            return self.set(n, out)
        if op == MM:
            m2 = self.of(ins[1])
            A.unify(x[1], m2[0])
            self.contractions.append((n.name, 0, 1))
            A.mark(m2[1], Role.LINEAR_OUT)
            self.weight(ins[1], self.weights, op)
            return self.set(n, [x[0], m2[1]])
        if op == BMM:
            y = self.of(ins[1])
            A.unify(x[0], y[0])
            A.unify(x[2], y[1])
            self.contractions.append((n.name, 0, 2))
            linear: dict[str, Any] = {}
            self.weight(ins[1], linear, op)
            if linear:                            # a Linear on 3-d input: bmm(x, expand(weight))
                A.mark(y[2], Role.LINEAR_OUT)
                self.weights.update(linear)
            else:                                 # attention: the batch axis holds the heads
                A.mark(x[0], Role.HEAD)
                for axes in (x[1], x[2], y[2]):
                    A.mark(axes, Role.BMM_INNER)
            return self.set(n, [x[0], x[1], y[2]])
        if op == BATCH_NORM_EVAL:
            for v in ins[1:5]:
                if isinstance(v, Ref):
                    A.unify(self.of(v)[0], x[1])
            if isinstance(ins[1], Ref):
                self.bn[ins[1].name] = None
            self.set(n, x, 0)
            for i in (1, 2):
                if isinstance(n.meta, tuple) and isinstance(n.meta[i], TensorMeta):
                    self.set(n, self.fresh(n.meta[i], "batch-norm statistics"), i)
            return None
        if op == LAYER_NORM:
            k = len(ins[1])
            A.fix([a for axis in x[-k:] for a in axis], "normalised by a layer norm")
            for v in ins[2:4]:
                if isinstance(v, Ref):
                    for a, b in zip(self.of(v), x[-k:]):
                        A.unify(a, b)
            self.set(n, x, 0)
            for i in (1, 2):
                self.set(n, x[:-k] + self.fresh(n.meta[i])[-k:], i)
            return None
        if op in PERMUTE_OPS:
            rank = len(x)
            if op == PERMUTE:
                perm = [d % rank for d in ins[1]]
            elif op == TRANSPOSE:
                perm = list(range(rank))
                a, b = ins[1] % rank, ins[2] % rank
                perm[a], perm[b] = perm[b], perm[a]
            else:
                perm = list(range(rank))[::-1]
            return self.set(n, [x[p] for p in perm])
        if op in SHAPE_OPS:
            out = self.fresh(n.meta)
            A.unify([a for axis in x for a in axis], [a for axis in out for a in axis])
            return self.set(n, out)
        if op == UNSQUEEZE:
            d = ins[1] % (len(x) + 1)
            return self.set(n, x[:d] + [[A.new(1)]] + x[d:])
        if op in SQUEEZE_OPS:
            dims = ins[1] if isinstance(ins[1], (list, tuple)) else [ins[1]]
            drop = {d % len(x) for d in dims if A.leaves(x[d % len(x)]) == []}
            return self.set(n, [a for i, a in enumerate(x) if i not in drop])
        if op == EXPAND:
            out = self.fresh(n.meta)
            off = len(out) - len(x)
            for i, axis in enumerate(x):
                if A.leaves(axis) or n.tensor_meta.shape[i + off] == 1:
                    out[i + off] = axis
            return self.set(n, out)
        if op in _LIKE:
            return self.set(n, x)
        if op in _SPLIT:
            return self.split(n, x)
        if op == SLICE and self.slice(n, x):
            return None
        if op == _SDPA:
            return self.attention(n, x)
        if op == _GROUP_NORM:
            return self.group_norm(n, x)
        if op == _EMBEDDING:                       # table rows indexed by ids; its columns go on
            ids = self.of(ins[1])
            if ids is None or len(x) != 2:
                return self.fix_all(n, "an embedding of unknown shape")
            A.fix(x[0], "indexed")
            return self.set(n, ids + [x[1]])
        if op == _SELECT or op == SLICE:
            d = ins[1] % len(x)
            A.fix(x[d], "indexed")
            if op == SLICE:
                out = list(x)
                out[d] = self.fresh(n.meta, "indexed")[d]
                return self.set(n, out)
            return self.set(n, x[:d] + x[d + 1:])
        if op in _REDUCE:
            dims = ins[1] if len(ins) > 1 else list(range(len(x)))
            dims = [dims] if isinstance(dims, int) else (dims or list(range(len(x))))
            red = {d % len(x) for d in dims}
            keep = len(ins) > 2 and bool(ins[2]) or bool(n.attrs.get("keepdim", False))
            A.fix([a for d in red for a in x[d]], "reduced over")
            fresh = self.fresh(n.meta if isinstance(n.meta, TensorMeta) else n.meta[0])
            out = [fresh[i] if i in red else x[i] for i in range(len(x))] if keep else \
                [x[i] for i in range(len(x)) if i not in red]
            return self.set(n, out)
        if op in _POOL:
            metas = n.meta if isinstance(n.meta, tuple) else (n.meta,)
            for i, m in enumerate(metas):
                out = self.fresh(m)
                out[:len(x) - 2] = x[:len(x) - 2]
                self.set(n, out, i if isinstance(n.meta, tuple) else None)
            return None
        if op in _SOFTMAX:
            A.fix(x[ins[1] % len(x)], "normalised by a softmax")
            return self.set(n, x)
        if category(op) in (Category.ELEMWISE, Category.BROADCAST) and isinstance(n.meta, TensorMeta):
            out = self.fresh(n.meta)
            rank = len(out)
            for v in ins:
                lv = self.of(v)
                if lv is None:
                    continue
                for i, axis in enumerate(lv):
                    j = i + rank - len(lv)
                    if A.leaves(axis):
                        A.unify(out[j], axis)
            return self.set(n, out)
        return self.fix_all(n, f"{op} is not understood by the channel walk")

    # -- concat, split, slice: offsets along an axis --------------------------------
    def piece(self, axis: list[int]) -> int:
        """One atom for a whole axis (a fresh atom unified with it when the axis has several factors)."""
        leaves = self.A.leaves(axis)
        if len(leaves) == 1:
            return leaves[0]
        one = self.A.new(math.prod(self.A.size[a] for a in leaves) if leaves else 1)
        self.A.unify([one], axis)
        return one

    def cat(self, n: Node) -> None:
        """Channel c of input i is channel offset_i + c of the output; other axes are shared."""
        ins = n.inputs
        parts = [self.of(v) for v in ins[0] if not (isinstance(v, Ref) and self._empty(v))]   # legacy cat([], x)
        if not parts or any(p is None for p in parts) or not isinstance(n.meta, TensorMeta):
            return self.fix_all(n, "a concat of unknown values")
        rank = len(parts[0])
        d = (ins[1] if len(ins) > 1 else n.attrs.get("dim", 0)) % rank
        out = list(parts[0])
        for p in parts[1:]:
            for i in range(rank):
                if i != d:
                    self.A.unify(out[i], p[i])
        out[d] = [self.A.cat([self.piece(p[d]) for p in parts])]
        return self.set(n, out)

    def _empty(self, v: Ref) -> bool:
        meta = self.g.node(v.name).meta
        return isinstance(meta, TensorMeta) and meta.concrete_shape(self.g.symbols) == (0,)

    def split(self, n: Node, x: Layout) -> None:
        """Output i is a piece of the input's axis: the input's axis is the concat of the outputs'."""
        d = (n.inputs[2] if len(n.inputs) > 2 else n.attrs.get("dim", 0)) % len(x)
        metas = n.meta if isinstance(n.meta, tuple) else ()
        sizes = [m.concrete_shape(self.g.symbols)[d] for m in metas]
        parts = [self.A.new(s) for s in sizes]
        self.A.unify([self.A.cat(parts)], x[d])
        for i, (m, part) in enumerate(zip(metas, parts)):
            out = list(x)
            out[d] = [part]
            self.set(n, out, i)

    def slice(self, n: Node, x: Layout) -> bool:
        """A step-1 slice is the middle part of a concat; False (not handled) for strided slices."""
        ins = n.inputs
        d = ins[1] % len(x)
        size = math.prod(self.A.size[a] for a in x[d])
        start, end = (ins[2] if len(ins) > 2 else 0), (ins[3] if len(ins) > 3 else size)
        step = ins[4] if len(ins) > 4 else 1
        if not all(isinstance(v, int) for v in (start, end, step)) or step != 1:
            return False
        start, end = (max(0, min(size, v + size if v < 0 else v)) for v in (start, end))
        end = max(start, end)
        if (start, end) == (0, size):
            self.set(n, x)
            return True
        mid = self.A.new(end - start)
        self.A.unify([self.A.cat([self.A.new(start), mid, self.A.new(size - end)])], x[d])
        out = list(x)
        out[d] = [mid]
        self.set(n, out)
        return True

    # -- attention and group norm ------------------------------------------------
    def attention(self, n: Node, q: Layout) -> None:
        """scaled_dot_product_attention(q, k, v, mask): [batch, heads, seq, dim]; heads are axis 1."""
        A, ins = self.A, n.inputs
        k, v = self.of(ins[1]), self.of(ins[2])
        if k is None or v is None or not len(q) == len(k) == len(v) == 4:
            return self.fix_all(n, "attention of unknown shape")
        for a, b in ((q[0], k[0]), (q[0], v[0]), (q[1], k[1]), (q[1], v[1]), (q[3], k[3]), (k[2], v[2])):
            A.unify(a, b)
        A.mark(q[1], Role.HEAD)
        for axes in (q[2], q[3], k[2], v[3]):
            A.mark(axes, Role.BMM_INNER)
        out = [q[0], q[1], q[2], v[3]]
        mask = self.of(ins[3]) if len(ins) > 3 else None
        if mask is not None:                      # broadcast onto the scores [batch, heads, q, k]
            scores = [q[0], q[1], q[2], k[2]]
            for i, axis in enumerate(mask):
                if A.leaves(axis):
                    A.unify(scores[i + 4 - len(mask)], axis)
        return self.set(n, out, 0 if isinstance(n.meta, tuple) else None)

    def group_norm(self, n: Node, x: Layout) -> None:
        """native_group_norm: channels are groups × per-group; only whole groups may go."""
        A, ins = self.A, n.inputs
        groups = ins[6]
        channels = math.prod(A.size[a] for a in x[1])
        g, inner = A.new(groups), A.new(channels // groups, "inside a group-norm group")
        A.unify([g, inner], x[1])
        for v in ins[1:3]:
            if isinstance(v, Ref):
                A.unify(self.of(v)[0], x[1])
        self.set(n, x, 0)
        for i in (1, 2):
            self.set(n, [x[0], [g]], i)
