"""Operator fusion: groups of nodes become one fused kernel (after TVM's FuseOps).

Grouping walks the graph in topological order and tries to merge each node
with its immediate post-dominator (the first node every path from it reaches),
taking along everything on the paths between, when the operator classes allow
it (``mlcomp.ir.ops.Category``):

* elementwise/broadcast/injective nodes merge into a post-dominator of class at
  most injective, or into a reduction (a prologue);
* a compute op (matmul, conv, bmm) or a reduction takes an epilogue: paths of
  elementwise/broadcast ops only;
* a group holds at most one compute op or reduction.

A group is kept when it saves bytes (``mlcomp.analysis.cost.fused_bytes_saved``: values
produced and consumed inside never reach memory) and the estimated peak memory
of the graph does not grow past ``peak_slack``.  It then becomes one
composite node (``mlcomp.ir.composites``) named after the value it computes::

    before                                                after
    %convolution = aten.convolution(%x, %w, %b, ...)      %relu = mlcomp.fused_convolution_relu_1c9e0f4a2b71(%x, %w, %b)
    %relu = aten.relu.default(%convolution)

``fuse`` runs the whole family: fold-batchnorm (inference graphs), recompose,
fuse-attention, bias epilogues, then grouping.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Iterable

from mlcomp.passes import patterns as P
from mlcomp.passes.attention import FuseAttention
from mlcomp.passes.fusion.folds import FoldBatchNorm, FoldBias
from mlcomp.passes.fusion.recompose import Recompose

from mlcomp.analysis.cost import fused_bytes_saved
from mlcomp.analysis.liveness import peak_bytes, value_bytes
from mlcomp.ir import Graph, Node, Origin, Ref, TensorMeta, map_refs
from mlcomp.ir.builder import rename
from mlcomp.ir.composites import Tiling, fused_kernel, register_fused
from mlcomp.ir.graph_tools import post_dominators
from mlcomp.ir.ops import GETITEM, INPUT, OUTPUT, Category, category
from mlcomp.pipeline.composite import CompositePass, Sequential, Step
from mlcomp.pipeline.pass_base import Pass, PassContext, PassResult, option

_MASTER = (Category.COMPUTE, Category.REDUCTION)


@dataclass(frozen=True)
class GroupOptions:
    """How groups are chosen and run; shared by fuse-elementwise, fuse-epilogue and fuse."""

    min_bytes_saved: int = option(1, "keep a group only if it saves at least this many bytes of traffic", ge=0)
    max_group_size: int = option(32, "most nodes in one group", ge=1)
    peak_slack: float = option(0.0, "allowed relative growth of the estimated peak memory (0.1 = +10%)", ge=0)
    peak_slack_bytes: int = option(1 << 20, "allowed absolute growth of the estimated peak memory", ge=0)
    tile: bool = option(True, "run large elementwise groups tile by tile (cache blocking)")
    tile_elements: int = option(1 << 16, "elements per tile", ge=1)
    tile_min_elements: int = option(1 << 20, "only tile outputs with at least this many elements", ge=0)

    def group_options(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(GroupOptions)}


@dataclass(frozen=True)
class FuseElementwise(GroupOptions, Pass):
    """Group elementwise/broadcast/injective chains, reduction and compute epilogues into fused kernels."""

    name: ClassVar[str] = "fuse-elementwise"
    compute_only: bool = option(False, "only groups anchored on a compute op (matmul, convolution) and its epilogue")

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        candidates = form_groups(graph, max_size=self.max_group_size, compute_only=self.compute_only)
        scored = [(g, fused_bytes_saved(graph, g)) for g in candidates]
        kept = [(g, s) for g, s in scored if s >= max(self.min_bytes_saved, 1)]
        rejected_small = len(scored) - len(kept)
        limit = estimate_peak_bytes(graph, []) * (1.0 + self.peak_slack) + self.peak_slack_bytes
        kept = _within_peak(graph, kept, limit)
        rejected_peak = len(scored) - rejected_small - len(kept)
        tiling = Tiling(self.tile_elements, self.tile_min_elements) if self.tile else None
        tiled = 0
        for gid, (group, _) in enumerate(kept):
            tiled += materialize(graph, group, tiling, gid)
        stats = {"groups_formed": len(kept), "nodes_fused": sum(len(g) for g, _ in kept),
                 "bytes_saved": sum(s for _, s in kept), "groups_tiled": tiled,
                 "groups_rejected_small": rejected_small, "groups_rejected_peak": rejected_peak}
        return PassResult(graph, bool(kept), stats)


@dataclass(frozen=True)
class FuseEpilogue(GroupOptions, CompositePass):
    """Fold bias adds into addmm/conv, then fuse each compute op with its elementwise epilogue."""

    name: ClassVar[str] = "fuse-epilogue"

    def body(self) -> Sequential:
        return Sequential(FoldBias(), FuseElementwise(compute_only=True, **self.group_options()))


@dataclass(frozen=True)
class Fuse(GroupOptions, CompositePass):
    """All fusions: batch-norm folding, recomposition, attention, epilogues and elementwise groups."""

    name: ClassVar[str] = "fuse"
    batchnorm: bool = option(True, "fold batch norm into convolutions (skipped on training graphs)")
    recompose: bool = option(True, "recompose decomposed layer norm and GELU")
    attention: bool = option(True, "rewrite attention as scaled_dot_product_attention")
    groups: bool = option(True, "form fused groups (epilogues, elementwise chains, reductions)")

    def body(self) -> Sequential:
        # fold-batchnorm declares itself inference-only: on training graphs it is skipped (stat "batchnorm")
        return Sequential(*([Step(FoldBatchNorm(), label="batchnorm")] if self.batchnorm else []),
                          *([Recompose()] if self.recompose else []),
                          *([FuseAttention()] if self.attention else []),
                          FoldBias(),
                          *([FuseElementwise(**self.group_options())] if self.groups else []))


# ---------------------------------------------------------------------------
# Group formation


def _fusable(node: Node) -> bool:
    if P.is_structural(node) or node.op.is_composite or not P.is_fusable(node.op):
        return False
    metas = node.meta if isinstance(node.meta, tuple) else (node.meta,)
    return all(isinstance(m, TensorMeta) or m is None for m in metas) and node.meta is not None


def _cat(node: Node) -> Category:
    """Fusion class; projections (getitem) and reshapes cost nothing and fuse like elementwise ops."""
    return Category.ELEMWISE if node.op == GETITEM or node.op in P.SHAPE_OPS else category(node.op)


class _Groups:
    """Union-find over node names, tracking each group's members and compute/reduction master."""

    def __init__(self) -> None:
        self.parent: dict[str, str] = {}
        self.members: dict[str, list[str]] = {}
        self.masters: dict[str, int] = {}
        self.computes: dict[str, int] = {}

    def add(self, name: str, cat: Category) -> None:
        self.parent[name] = name
        self.members[name] = [name]
        self.masters[name] = int(cat in _MASTER)
        self.computes[name] = int(cat is Category.COMPUTE)

    def find(self, name: str) -> str:
        while self.parent[name] != name:
            self.parent[name] = self.parent[self.parent[name]]
            name = self.parent[name]
        return name

    def union(self, roots: Iterable[str]) -> str:
        roots = list(dict.fromkeys(self.find(r) for r in roots))
        head = roots[0]
        for r in roots[1:]:
            self.parent[r] = head
            self.members[head] += self.members.pop(r)
            self.masters[head] += self.masters.pop(r)
            self.computes[head] += self.computes.pop(r)
        return head


def form_groups(graph: Graph, *, max_size: int = 32, compute_only: bool = False) -> list[list[str]]:
    """Candidate groups (lists of node names in topological order, two or more nodes each)."""
    order = graph.order()
    pos = {n: i for i, n in enumerate(order)}
    pdom = post_dominators(graph)
    groups = _Groups()
    for node in graph.call_nodes():
        if _fusable(node):
            groups.add(node.name, _cat(node))
    for node in graph.call_nodes():
        if node.name not in groups.parent:
            continue
        sink = pdom.get(node.name)
        if sink is None or sink == node.name or sink not in groups.parent:
            continue
        cat = _cat(node)
        root = groups.find(node.name)
        if compute_only and groups.computes[root] == 0:
            continue
        # a group led by a compute op or reduction only takes elementwise/broadcast epilogues
        epilogue = cat in _MASTER or groups.masters[root] > 0
        limit = Category.BROADCAST if epilogue else Category.INJECTIVE
        path = _between(graph, node.name, sink, pos)
        if path is None or any(p not in groups.parent for p in path):
            continue
        if any(graph.node(p).ann.phase != node.ann.phase for p in path):
            continue                # a joint graph's forward and backward stay apart (the cut runs between them)
        sink_cat = _cat(graph.node(sink))
        inner_ok = all(_cat(graph.node(p)) <= limit for p in path if p != sink)
        sink_ok = sink_cat <= limit or (not epilogue and sink_cat is Category.REDUCTION)
        if not (inner_ok and sink_ok):
            continue
        roots = {groups.find(p) for p in path} | {root}
        if sum(groups.masters[r] for r in roots) > 1 or sum(len(groups.members[r]) for r in roots) > max_size:
            continue
        merged = [m for r in roots for m in groups.members[r]]
        if not _convex(graph, set(merged), pos):
            continue
        groups.union([root, *roots])
    out = []
    for members in groups.members.values():
        real = [m for m in members if graph.node(m).op != GETITEM and graph.node(m).op not in P.SHAPE_OPS]
        if len(real) > 1:
            out.append(sorted(members, key=pos.__getitem__))
    return sorted(out, key=lambda g: pos[g[0]])


def _between(graph: Graph, src: str, sink: str, pos: dict[str, int], limit: int = 64) -> list[str] | None:
    """Nodes on paths from ``src`` to ``sink`` (sink included, src excluded); None if too many."""
    reach: set[str] = set()
    stack = [src]
    while stack:                                   # forward from src, not past the sink
        for user in graph.users(stack.pop()):
            if user.name in reach or pos[user.name] > pos[sink]:
                continue
            reach.add(user.name)
            if len(reach) > 4 * limit:
                return None
            if user.name != sink:
                stack.append(user.name)
    back: set[str] = {sink}
    stack = [sink]
    while stack:                                   # backward from the sink within reach
        for name in graph.node(stack.pop()).input_names():
            if name in reach and name not in back:
                back.add(name)
                stack.append(name)
    return sorted(back, key=pos.__getitem__) if len(back) <= limit else None


def _convex(graph: Graph, group: set[str], pos: dict[str, int]) -> bool:
    """No path leaves the group and comes back (else the fused node would depend on itself)."""
    last = max(pos[n] for n in group)
    outside = [u.name for n in group for u in graph.users(n) if u.name not in group and pos[u.name] < last]
    seen: set[str] = set()
    while outside:
        name = outside.pop()
        if name in seen:
            continue
        seen.add(name)
        for user in graph.users(name):
            if user.name in group:
                return False
            if pos[user.name] < last:
                outside.append(user.name)
    return True


# ---------------------------------------------------------------------------
# Peak memory


def _footprint(graph: Graph, group: list[str]) -> int:
    return sum(value_bytes(graph, graph.node(n)) for n in group)


def estimate_peak_bytes(graph: Graph, groups: list[list[str]]) -> int:
    """Peak bytes of live intermediates with each group run as one kernel (:mod:`mlcomp.analysis.liveness`)."""
    return peak_bytes(graph, groups=groups)


def _within_peak(graph: Graph, kept: list[tuple[list[str], int]], limit: float) -> list[tuple[list[str], int]]:
    """Drop the groups with the largest footprint until the estimated peak is within ``limit``.

    How many to drop is found by bisection over the footprint order (each probe
    is one O(n log n) liveness pass), so the whole is O(n log² n) rather than one
    liveness pass per dropped group.  With no group kept the peak is the
    unfused graph's, which is within the limit by construction.
    """
    order = sorted(range(len(kept)), key=lambda i: -_footprint(graph, kept[i][0]))

    def survivors(dropped: int) -> list[tuple[list[str], int]]:
        gone = set(order[:dropped])
        return [k for i, k in enumerate(kept) if i not in gone]

    if not kept or estimate_peak_bytes(graph, [g for g, _ in kept]) <= limit:
        return kept
    lo, hi = 0, len(kept)            # dropping lo groups exceeds the limit; dropping hi is within it
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if estimate_peak_bytes(graph, [g for g, _ in survivors(mid)]) <= limit:
            hi = mid
        else:
            lo = mid
    return survivors(hi)


# ---------------------------------------------------------------------------
# Materialisation


def materialize(graph: Graph, members: list[str], tiling: Tiling | None, gid: int) -> int:
    """Replace ``members`` (topological order) by one fused node; returns 1 if it runs tiled."""
    group = set(members)
    outer_outputs = {r.name for r in graph.output_refs}
    inputs: list[str] = []
    for name in members:
        for src in graph.node(name).input_names():
            if src not in group and src not in inputs:
                inputs.append(src)
    outputs = [n for n in members if n in outer_outputs or any(u.name not in group for u in graph.users(n))]
    body = Graph("body", mode=graph.mode)
    local: dict[str, str] = {}
    for i, src in enumerate(inputs):
        local[src] = f"a{i}"
        body.add(Node(f"a{i}", INPUT, meta=graph.node(src).meta))
    for j, name in enumerate(members):
        node = graph.node(name)
        local[name] = f"v{j}"
        inner = lambda r: Ref(local[r.name])  # noqa: E731
        body.add(node.with_(name=f"v{j}", inputs=map_refs(node.inputs, inner),
                            attrs=map_refs(dict(node.attrs), inner), origin=Origin(), ann=type(node.ann)()))
    body.add(Node("output", OUTPUT, inputs=(tuple(Ref(local[o]) for o in outputs),)))
    op = register_fused(body, tiling)
    master = next((graph.node(n) for n in members if _cat(graph.node(n)) in _MASTER), graph.node(members[-1]))
    metas = [graph.node(o).meta for o in outputs]
    args = tuple(Ref(s) for s in inputs)
    single = len(outputs) == 1
    phase = graph.node(members[-1]).ann.phase        # a joint graph's phase: groups never span two (form_groups)
    fused = graph.add(Node(graph.fresh_name(f"{outputs[0]}__fused" if single else f"fused_{outputs[0]}"), op, args,
                           meta=metas[0] if single else tuple(metas), origin=master.origin)
                      .with_ann(fusion_group=gid, phase=phase), before=members[-1])
    if single:
        temps = [(fused.name, outputs[0])]
    else:
        temps = [(graph.add(Node(graph.fresh_name(f"{o}__fused"), GETITEM, (Ref(fused.name), j), meta=metas[j],
                                 origin=graph.node(o).origin), before=members[-1]).name, o)
                 for j, o in enumerate(outputs)]
    for tmp, final in temps:
        graph.replace_all_uses(final, tmp)
    for name in reversed(members):
        graph.erase(name)
    for tmp, final in temps:
        rename(graph, tmp, final)
    kernel = fused_kernel(op)
    return int(kernel is not None and kernel.tiled)


__all__ = ["FuseElementwise", "FuseEpilogue", "Fuse", "form_groups", "estimate_peak_bytes", "materialize"]
