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

A ``cat`` (or a split/slice, read backwards) makes an atom that is a concat of
its parts; the concat's group follows its parts (``with_concats``: channel c of
part i is channel offset_i + c).  Atoms that touch a graph input or output, a
reduction, an index, an op the walk does not know, or an excluded node are
*fixed*.  The walk itself is :mod:`mlcomp.passes.prune.channel_walk`.  Cost: one visit per node with
near-constant union-find work each (O(n α(n))).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Iterable, Mapping

import torch

from mlcomp.passes.prune.channel_atoms import Atoms, Role
from mlcomp.passes.prune.channel_walk import ChannelWalk, Layout, excluded
from mlcomp.ir import Graph
from mlcomp.ir.ops import PARAM, Op

__all__ = ["GroupKind", "Role", "ChannelGroup", "ChannelGroups", "find_channel_groups", "flat_index"]

_CONCAT = "made of other groups (a concat or split): follows its parts"


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
        atoms.finalize()
        self._ids: dict[int, int] = {}
        members: dict[int, list[tuple[str, int]]] = {}
        for node in graph.nodes(PARAM):
            for axis, axis_atoms in enumerate(layouts.get((node.name, None), [])):
                for leaf in atoms.leaves(axis_atoms):
                    members.setdefault(leaf, []).append((node.name, axis))
        for root in atoms.concat:                 # concats no param holds still name an index space
            if atoms.find(root) == root:
                members.setdefault(root, [])
        groups = []
        for leaf in members:                      # first seen first: graph order of the params
            params = tuple(dict.fromkeys(members[leaf]))
            names = tuple(dict.fromkeys(p for p, _ in params))
            roles = atoms.roles.get(leaf, set())
            kind = (GroupKind.HEAD if Role.HEAD in roles else
                    GroupKind.OTHER if Role.BMM_INNER in roles else
                    GroupKind.CONV if Role.CONV_OUT in roles else
                    GroupKind.LINEAR if Role.LINEAR_OUT in roles else GroupKind.OTHER)
            fixed = atoms.fixed_reason(leaf) or (_CONCAT if leaf in atoms.concat else None)
            self._ids[leaf] = len(groups)
            groups.append(ChannelGroup(len(groups), atoms.size[leaf], kind, fixed, params,
                                       tuple(p for p in names if p in weights),
                                       tuple(p for p in names if p in bn_scales)))
        self.groups: list[ChannelGroup] = groups
        # where a group's channels sit inside a concat: (concat's group, offset, the part's factors, position)
        self._inside: dict[int, list[tuple[int, int, list[int], int]]] = {}
        for root, parts in atoms.concat.items():
            offset = 0
            for part in parts:
                leaves = atoms.leaves([part])
                for pos, leaf in enumerate(leaves):
                    if leaf in self._ids and root in self._ids:
                        self._inside.setdefault(self._ids[leaf], []).append(
                            (self._ids[root], offset, [atoms.size[x] for x in leaves], pos))
                offset += atoms.size[part]

    def is_excluded(self, name: str) -> bool:
        """Whether node ``name`` matches ``exclude`` (its name, or its module path or a parent of it)."""
        return excluded(self.graph.node(name), self.exclude)

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

    def inside(self, gid: int) -> list[tuple[int, int, list[int], int]]:
        """Concats group ``gid`` is a part of: (the concat's group id, offset, the part's factor sizes,
        the position of ``gid`` among them)."""
        return self._inside.get(gid, [])

    def with_concats(self, keep: Mapping[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """``keep`` (group id -> kept channels) plus every concat's kept channels, from its parts'.

        A concat of parts p_0..p_k keeps ``offset_i + c`` for every kept channel c of
        p_i (a part may itself be a product of groups, or a concat).
        """
        out = dict(keep)
        A, done = self._atoms, set()
        for top in A.concat:
            stack = [A.find(top)]
            while stack:                  # post-order without recursion: concats may nest deeply
                root = stack[-1]
                if root in done or root not in self._ids:
                    stack.pop()
                    continue
                leaves = [leaf for part in A.concat[root] for leaf in A.leaves([part])]
                todo = [leaf for leaf in leaves if leaf in A.concat and leaf not in done]
                if todo:
                    stack.extend(todo)
                    continue
                stack.pop()
                done.add(root)
                pieces, offset, changed = [], 0, False
                for part in A.concat[root]:
                    idx = flat_index([(self._ids.get(leaf), A.size[leaf]) for leaf in A.leaves([part])], out)
                    changed = changed or idx is not None
                    pieces.append((idx if idx is not None else torch.arange(A.size[part])) + offset)
                    offset += A.size[part]
                if changed:
                    out[self._ids[root]] = torch.cat(pieces)
        return out

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


def flat_index(layout: list[tuple[int | None, int]], keep: Mapping[int, torch.Tensor]) -> torch.Tensor | None:
    """Flat indices an axis keeps, given its (group, size) factors; None when no factor is pruned."""
    if not any(gid in keep for gid, _ in layout):
        return None
    idx = torch.zeros(1, dtype=torch.long)
    for gid, size in layout:
        part = keep[gid] if gid in keep else torch.arange(size)
        idx = (idx[:, None] * size + part[None, :]).reshape(-1)
    return idx


def find_channel_groups(graph: Graph, *, exclude: Iterable[str] = ()) -> ChannelGroups:
    """Walk ``graph`` once and return its channel groups (see the module docstring).

    ``exclude``: node names or module-path prefixes whose axes stay fixed.
    """
    walk = ChannelWalk(graph, tuple(exclude)).run()
    return ChannelGroups(graph, walk.A, walk.lay, walk.weights, walk.bn, walk.contractions, walk.exclude)


