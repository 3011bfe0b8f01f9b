"""Channel dependency groups: which channels of which tensors must be pruned together.

Found by walking the IR once, not by module types.  Every axis of every value is
a sequence of *atoms* (major to minor); an op says which atoms of its inputs and
outputs are the same index space, and a union-find joins them.  A reshape that
splits or merges axes refines atoms (768 → 3 × 256 → 3 × 4 × 64), so a channel
flattened into a Linear stays one channel with a spatial block, and attention's
head axis is one atom shared by q, k, v and the output projection::

    before (IR)                                          after (groups)
    %convolution = convolution(%x, %stem.0.weight, …)    group [conv, 64]: stem.0.weight:0,
    %getitem = getitem(batch_norm(%convolution, …), 0)     stem.1.weight:0, layer1.0.conv1.weight:1,
    %add = add(%getitem_5, %relu)  …                       layer1.0.conv2.weight:0, …
    %view = view(%avg_pool2d_1, [1, 400])                group [linear, 16]: features.3.weight:0,
    %addmm = addmm(%b, %view, permute(%fc1.weight))        classifier.1.weight:1 (blocks of 25)

Atoms that touch a graph input or output, a reduction, an index, an op the walk
does not know, or an excluded node are *fixed*.  Cost: one visit per node with
near-constant union-find work each (O(n α(n))).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Iterable

from mlcomp.analysis.channel_atoms import Atoms, Role
from mlcomp.ir import Graph, Node, Ref, TensorMeta
from mlcomp.ir.ops import GETITEM, INPUT, OUTPUT, PARAM, Category, Op, aten, category
from mlcomp.ir.opsets import (ADDMM, BATCH_NORM_EVAL, BMM, CONVOLUTION, EXPAND, LAYER_NORM, MM, PERMUTE,
                              PERMUTE_OPS, SHAPE_OPS, SLICE, SQUEEZE_OPS, TRANSPOSE, UNSQUEEZE)

__all__ = ["GroupKind", "Role", "ChannelGroup", "ChannelGroups", "find_channel_groups"]

_LIKE = frozenset({aten("full_like"), aten("zeros_like"), aten("ones_like"), aten("empty_like")})
_REDUCE = frozenset({aten("mean.dim"), aten("sum.dim_IntList"), aten("amax"), aten("amin"), aten("any.dim"),
                     aten("var.correction"), aten("prod.dim_int")})
_POOL = frozenset({aten("avg_pool2d"), aten("_adaptive_avg_pool2d"), aten("adaptive_avg_pool2d"),
                   aten("max_pool2d_with_indices"), aten("max_pool2d")})
_SOFTMAX = frozenset({aten("_softmax"), aten("_log_softmax"), aten("_safe_softmax")})
_SELECT = aten("select.int")


class GroupKind(enum.Enum):
    CONV = "conv"
    LINEAR = "linear"
    HEAD = "head"
    OTHER = "other"            # touches no weight output (spatial, sequence, head_dim…): never pruned


@dataclass(frozen=True)
class ChannelGroup:
    """One prunable index space: ``size`` channels shared by every member axis."""

    id: int
    size: int
    kind: GroupKind
    fixed: str | None                      # why it cannot be pruned (None: prunable)
    params: tuple[tuple[str, int], ...]    # (PARAM node, axis) holding this atom (maybe as a factor)
    weights: tuple[str, ...]               # params whose per-channel norm is the importance
    bn_scales: tuple[str, ...]             # batch-norm gammas of the group (importance=bn-scale)

    @property
    def modules(self) -> tuple[str, ...]:
        """Module paths of the member parameters (``layer1.0.conv1``), sorted, without repeats."""
        return tuple(sorted({p.rpartition(".")[0] for p, _ in self.params}))


Layout = list[list[int]]     # per axis: its atoms


class ChannelGroups:
    """The result of :func:`find_channel_groups`: groups, and the atom layout of any value's axes."""

    def __init__(self, graph: Graph, atoms: Atoms, layouts: dict[tuple[str, int | None], Layout],
                 weights: dict[str, Op], bn_scales: dict[str, None],
                 contractions: list[tuple[str, int, int]], exclude: tuple[str, ...] = ()) -> None:
        self.graph = graph
        self.weight_ops = dict(weights)       # weight PARAM -> the op that consumes it (conv, addmm, mm)
        self.exclude = exclude
        self._atoms = atoms
        self._layouts = layouts
        self.contractions = contractions      # (node, input position, axis) where channels are summed away
        self.contracted: dict[str, list[tuple[int, int]]] = {}
        for name, pos, axis in contractions:
            self.contracted.setdefault(name, []).append((pos, axis))
        self._ids: dict[int, int] = {}
        members: dict[int, list[tuple[str, int]]] = {}
        for node in graph.nodes(PARAM):
            for axis, axis_atoms in enumerate(layouts.get((node.name, None), [])):
                for leaf in atoms.leaves(axis_atoms):
                    members.setdefault(leaf, []).append((node.name, axis))
        groups = []
        for leaf in members:                      # first seen first: graph order of the params
            params = tuple(dict.fromkeys(members[leaf]))
            names = tuple(dict.fromkeys(p for p, _ in params))
            roles = atoms.roles.get(leaf, set())
            kind = (GroupKind.HEAD if Role.HEAD in roles else
                    GroupKind.OTHER if Role.BMM_INNER in roles else
                    GroupKind.CONV if Role.CONV_OUT in roles else
                    GroupKind.LINEAR if Role.LINEAR_OUT in roles else GroupKind.OTHER)
            self._ids[leaf] = len(groups)
            groups.append(ChannelGroup(len(groups), atoms.size[leaf], kind, atoms.fixed_reason(leaf), params,
                                       tuple(p for p in names if p in weights),
                                       tuple(p for p in names if p in bn_scales)))
        self.groups: list[ChannelGroup] = groups

    def is_excluded(self, name: str) -> bool:
        """Whether node ``name`` matches ``exclude`` (its name, or its module path or a parent of it)."""
        return _excluded(self.graph.node(name), self.exclude)

    def prunable(self, kinds: Iterable[GroupKind] | None = None) -> list[ChannelGroup]:
        wanted = set(kinds) if kinds is not None else {GroupKind.CONV, GroupKind.LINEAR, GroupKind.HEAD}
        return [g for g in self.groups if g.fixed is None and g.kind in wanted]

    def group_of(self, param: str, axis: int) -> ChannelGroup | None:
        """The group whose atom is the major factor of ``param``'s ``axis`` (None if it has none)."""
        layout = self.layout(param, axis)
        return self.groups[layout[0][0]] if layout and layout[0][0] is not None else None

    def layout(self, name: str, axis: int, index: int | None = None) -> list[tuple[int | None, int]]:
        """The axis as (group id or None, size) factors, major first (size-1 factors dropped)."""
        atoms = self._layouts.get((name, index))
        if atoms is None or axis >= len(atoms):
            return []
        return [(self._ids.get(a), self._atoms.size[a]) for a in self._atoms.leaves(atoms[axis])]

    def rank(self, name: str, index: int | None = None) -> int:
        return len(self._layouts.get((name, index), []))

    def describe(self) -> str:
        lines = []
        for g in self.groups:
            state = (f"fixed: {g.fixed}" if g.fixed else "prunable" if g.kind is not GroupKind.OTHER
                     else "not a channel axis")
            lines.append(f"group {g.id} [{g.kind.value}, {g.size}] {state}: "
                         + ", ".join(f"{p}:{a}" for p, a in g.params))
        return "\n".join(lines)


def find_channel_groups(graph: Graph, *, exclude: Iterable[str] = ()) -> ChannelGroups:
    """Walk ``graph`` once and return its channel groups (see the module docstring).

    ``exclude``: node names or module-path prefixes whose axes stay fixed.
    """
    return _Walk(graph, tuple(exclude)).run()


def _excluded(node: Node, exclude: tuple[str, ...]) -> bool:
    path = node.origin.module_path
    return any(node.name == e or path == e or path.startswith(e + ".") for e in exclude)


class _Walk:
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
    def run(self) -> ChannelGroups:
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
            if node.op not in (INPUT, OUTPUT) and _excluded(node, self.exclude):
                for key in [(node.name, None)] + [(node.name, i) for i in range(8)]:
                    if key in self.lay:
                        self.A.fix([a for axis in self.lay[key] for a in axis], "excluded")
        return ChannelGroups(self.g, self.A, self.lay, self.weights, self.bn, self.contractions, self.exclude)

    def visit(self, n: Node) -> None:  # noqa: C901 - one dispatch over op families
        op, ins, A = n.op, n.inputs, self.A
        x = self.of(ins[0]) if ins else None
        if op == GETITEM:
            src = ins[0].name if isinstance(ins[0], Ref) else None
            found = self.lay.get((src, ins[1])) if src is not None else None
            self.set(n, found) if found is not None else self.fix_all(n, "an unknown value")
            return
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
