"""The channel walk: which axes of which values are the same index space (atoms), op by op.

:func:`mlcomp.passes.prune.channel_groups.find_channel_groups` runs it once over the
graph and turns its atoms into groups.  Each op says which atoms of its inputs
and outputs are one index space::

    before (IR)                                              after (atoms of the channel axis)
    %cat = cat([%relu, %convolution_1], 1)                   cat: 24 = a.weight:0 (8) ++ b.weight:0 (16)
    %split_with_sizes = split_with_sizes(%view_2, [64]*3, 2) view_2: 192 = q (64) ++ k (64) ++ v (64)
    %native_group_norm = native_group_norm(%conv, …, 4, …)   conv: 16 = groups (4) x per group (4, fixed)
    %sdpa = scaled_dot_product_attention(%q, %k, %v, …)      q, k, v axis 1: one atom, the heads

What each op joins is a rule in :data:`mlcomp.passes.prune.channel_rules.RULES`
(op -> rule); the walk looks the node's op up and applies its rule.  Unknown
ops, inputs, outputs, indexed and reduced axes are fixed.  One visit per node
with near-constant union-find work (O(n α(n))).
"""
from __future__ import annotations

import math
from typing import Any

from mlcomp.passes.prune.channel_atoms import Atoms
from mlcomp.passes.prune.channel_rules import rule_for
from mlcomp.ir import Graph, Node, Ref, TensorMeta
from mlcomp.ir.ops import INPUT, OUTPUT, PARAM, Op
from mlcomp.ir.opsets import EXPAND, PERMUTE_OPS, SHAPE_OPS

__all__ = ["ChannelWalk", "Layout", "excluded"]


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

    def visit(self, n: Node) -> None:
        """Apply the op's rule (:func:`~mlcomp.passes.prune.channel_rules.rule_for`) to ``n``."""
        rule = rule_for(n.op)
        x = self.of(n.inputs[0]) if n.inputs else None
        if rule.needs_meta and not isinstance(n.meta, (TensorMeta, tuple)) or rule.needs_input and x is None:
            return self.fix_all(n, f"{n.op} is not understood")
        return rule.apply(self, n, x)

    # -- helpers the rules share ------------------------------------------------
    def piece(self, axis: list[int]) -> int:
        """One atom for a whole axis (a fresh atom unified with it when the axis has several factors)."""
        leaves = self.A.leaves(axis)
        if len(leaves) == 1:
            return leaves[0]
        one = self.A.new(math.prod(self.A.size[a] for a in leaves) if leaves else 1)
        self.A.unify([one], axis)
        return one

    def empty(self, v: Ref) -> bool:
        """True for a value of shape (0,) (the legacy ``cat([], x)`` operand)."""
        meta = self.g.node(v.name).meta
        return isinstance(meta, TensorMeta) and meta.concrete_shape(self.g.symbols) == (0,)
