"""Rematerialisation: recompute saved activations in the backward to fit a memory budget.

On a joint training graph (:func:`mlcomp.frontend.joint.capture_joint`) the
backward reads forward values, which stay live from the forward to their
backward use.  ``remat{budget=0.5 solver=knapsack cost=flops}`` picks which of
them to keep (a solver of :mod:`mlcomp.passes.remat.solvers`) and duplicates the
rest into the backward, just before their first backward use, so the forward
values die at the end of the forward.  Before and after, on a 3-layer MLP::

    %relu: f32[8, 16] = aten.relu.default(%addmm)            # {phase=forward}
    ...
    %mm_1: f32[16, 32] = aten.mm.default(%permute_5, %relu)  # {phase=backward}

    %relu: f32[8, 16] = aten.relu.default(%addmm)            # {checkpoint=True, phase=forward}
    ...
    %relu.remat: f32[8, 16] = aten.relu.default(%addmm)      # {phase=backward}
    %mm_1: f32[16, 32] = aten.mm.default(%permute_5, %relu.remat)   # {phase=backward}

Which plan: the solver proposes plans at a fixed grid of allowances of saved
bytes (:mod:`mlcomp.passes.remat.pool`; values that cannot be recomputed -- graph
inputs and outputs, random and in-place ops, nodes matching ``keep`` -- are
always kept); every plan is applied to a copy and scored by the predicted peak
of the whole step (:func:`mlcomp.analysis.step_peak.step_memory`: forward,
backward, optimizer update, kernels' scratch; ``fused=true`` for a step with the
optimizer in the backward).  :func:`mlcomp.passes.remat.choose.choose` takes the
cheapest plan whose peak is at most ``lowest + budget × (peak without remat −
lowest)``: ``budget=0`` the lowest peak, ``budget=1`` no remat, and a tighter
budget never a higher peak.  ``peak=96MiB`` bounds the peak as a size (an error
naming the lowest reachable when no plan fits); ``saved=0.25`` or ``saved=256MB``
caps the saved activations the backward still reads
(:func:`mlcomp.analysis.training_graph.saved_activations`: a fraction of those
bytes without remat, or a size), leaving plans that keep more out of the pool
(an error naming the minimum feasible cap).  The stats report the peak before
and after, the lowest and the allowed, its moment and what is live there by
kind and module, and the recompute cost as FLOPs and as a share of the forward's.
Views and tuple projections follow the value they alias.  Recompute cost is
FLOPs or measured node times (:mod:`mlcomp.passes.remat.costs`).  ``sqrt`` is
Chen's fixed plan and ignores the limits.
"""
from __future__ import annotations

import fnmatch
from dataclasses import dataclass
from typing import Any, ClassVar

from mlcomp.analysis.liveness import buffers, is_view, storage_roots, value_bytes
from mlcomp.analysis.training_graph import saved_activations
from mlcomp.analysis.workspace import op_workspaces
from mlcomp.base.errors import MlcompError, PipelineSpecError
from mlcomp.hardware.decide import Decision
from mlcomp.ir import Graph, Mode, Node, Ref, map_refs
from mlcomp.ir.builder import remove_dead
from mlcomp.ir.node import Annotations, Phase
from mlcomp.ir.ops import GETITEM
from mlcomp.ir.opsets import is_pure
from mlcomp.passes.remat.aimed import aim
from mlcomp.passes.remat.choose import Choice, Scored, choose, lowest_peak, score
from mlcomp.passes.remat.costs import CostModel, cost_model, flops, profile
from mlcomp.passes.remat.options import (RematError, Saved, infeasible, parse_budget, parse_peak, parse_saved,
                                         peak_unmet)
from mlcomp.passes.remat.pool import pool
from mlcomp.passes.remat.problem import Candidate, RematPlan, RematProblem
from mlcomp.passes.remat.solvers import Solver, minimum
from mlcomp.runtime.optim import OptimizerSpec
from mlcomp.pipeline.pass_base import Pass, PassContext, PassResult, option

__all__ = ["CostModel", "Remat", "RematError", "Rewriter", "Saved", "build_problem", "forward_values",
           "parse_budget", "parse_saved", "rewrite", "saved_bytes"]

_FORWARD = (Phase.FORWARD, Phase.LOSS)


def _banned(node: Node, keep: tuple[str, ...]) -> bool:
    return not is_pure(node.op) or any(fnmatch.fnmatchcase(node.name, k) for k in keep)


def forward_values(graph: Graph) -> set[str]:
    """Forward and loss nodes, and projections of their tuples (a backward-phase ``getitem`` of a
    forward tuple runs in the forward: the element it picks is what the backward keeps)."""
    out: set[str] = set()
    for n in graph.call_nodes():
        if n.ann.phase in _FORWARD or (n.op == GETITEM and n.inputs and isinstance(n.inputs[0], Ref)
                                       and n.inputs[0].name in out):
            out.add(n.name)
    return out


def build_problem(graph: Graph, *, cost: CostModel = CostModel.FLOPS, keep: tuple[str, ...] = (),
                  ctx: PassContext | None = None, decisions: list[Decision] | None = None) -> RematProblem:
    """The graph inputs and forward values of a joint graph as a :class:`RematProblem` (storage roots,
    graph order).  A plan's kept bytes are the saved-activation bytes of the rewritten graph: inputs and
    graph outputs are candidates that cannot be recomputed, and a tuple is charged every element it holds."""
    bufs = buffers(graph)            # buffers as the memory analysis counts them (views, tuple elements)
    storage = bufs.storage
    outputs = {storage[r.name] for r in graph.output_refs}
    forward = forward_values(graph)
    inputs = graph.input_nodes
    nodes = [n for n in graph.call_nodes() if n.name in forward and storage[n.name] == n.name]
    index = {n.name: i for i, n in enumerate([*inputs, *nodes])}
    needed = {storage[s] for b in graph.call_nodes() if b.name not in forward and b.ann.phase is Phase.BACKWARD
              for s in b.input_names() if storage[s] in index}
    if cost is CostModel.PROFILE:    # measured through ctx.measure; its record appended to ``decisions``
        costs, measured = profile(graph, [n.name for n in nodes], ctx or PassContext(), RematError)
        if measured is not None and decisions is not None:
            decisions.append(measured)
    else:
        costs = {n.name: flops(graph, n) for n in nodes}
    cands = [Candidate(n.name, value_bytes(graph, n), 0.0, (), n.name in needed, False) for n in inputs]
    for n in nodes:
        reads = tuple(dict.fromkeys(index[storage[s]] for s in n.input_names() if storage[s] in index))
        # a tuple read in the backward (by a copy of one of its elements) holds all its elements; an element
        # first picked in the backward phase is not a saved activation (saved_activations leaves it out)
        size = (value_bytes(graph, n) if isinstance(n.meta, tuple)
                else 0 if n.ann.phase is Phase.BACKWARD else bufs.size.get(n.name, value_bytes(graph, n)))
        cands.append(Candidate(n.name, size, costs[n.name], reads, n.name in needed,
                               n.name not in outputs and not _banned(n, keep)))
    return RematProblem(tuple(cands))


def _is_alias(node: Node) -> bool:
    return node.op == GETITEM or is_view(node)


class Rewriter:
    """Applies plans to copies of one joint graph: what a rewrite reads of the graph (storage roots, forward
    values, each backward reader's first real use) is found once here, not once per plan scored."""

    def __init__(self, graph: Graph) -> None:
        self.storage = storage_roots(graph)
        self.forward = forward = forward_values(graph)
        pos = {n: graph.position_key(n) for n in graph.order()}
        first: dict[str, tuple[int, str]] = {}     # backward node -> (position, name) of its first real use

        def use_of(b: Node) -> tuple[int, str]:
            if b.name not in first:
                users = graph.users(b.name) if _is_alias(b) else []
                first[b.name] = min((use_of(u) for u in users), default=(pos[b.name], b.name))
            return first[b.name]

        outputs = {r.name for r in graph.output_refs}   # live to the end anyway: read, never copied
        # (forward value, backward node reading it, that node's first real use), in graph order
        self.reads = [(s, b.name, use_of(b)) for b in graph.call_nodes()
                      if b.ann.phase is Phase.BACKWARD and b.name not in forward
                      for s in b.input_names() if s in forward and s not in outputs]
        self.order = [n for n in graph.order() if n in forward]

    def __call__(self, graph: Graph, problem: RematProblem, plan: RematPlan) -> int:
        """Duplicate the recomputed values of ``plan`` into the backward of ``graph`` (the graph given to the
        constructor or a copy of it; in place); returns the nodes added."""
        if not plan.recompute:
            return 0
        storage, forward, order = self.storage, self.forward, self.order
        redo = {problem.candidates[i].name for i in plan.recompute}
        readers: dict[str, list[str]] = {}        # forward value to copy -> backward nodes reading it
        anchor: dict[str, tuple[int, str]] = {}
        for s, b, use in self.reads:
            if storage[s] in redo:
                readers.setdefault(s, []).append(b)
                anchor[s] = min(anchor.get(s, (1 << 62, "")), use)
        need = set(readers)
        for s in reversed(order):                 # a copy needs copies of its recomputed inputs
            if s not in need:
                continue
            for t in graph.node(s).input_names():
                if t in forward and storage[t] in redo:
                    need.add(t)
                    anchor[t] = min(anchor.get(t, (1 << 62, "")), anchor[s])
        for s in order:                           # a tuple's projections right after it: the tuple then dies
            node = graph.node(s)                  # at once instead of holding every element to the last one
            if s in need and node.op == GETITEM and isinstance(node.inputs[0], Ref) and node.inputs[0].name in need:
                anchor[s] = anchor[node.inputs[0].name]
        copies: dict[str, str] = {}
        swap = lambda r: Ref(copies[r.name]) if r.name in copies else r
        for s in order:
            if s not in need:
                continue
            node = graph.node(s)
            name = graph.fresh_name(f"{s}.remat")
            graph.add(Node(name, node.op, map_refs(node.inputs, swap), map_refs(dict(node.attrs), swap),
                           meta=node.meta, ann=Annotations(phase=Phase.BACKWARD), origin=node.origin),
                      before=anchor[s][1])
            copies[s] = name
        done: set[str] = set()
        for bs in readers.values():
            for b in bs:
                if b in done:
                    continue
                done.add(b)
                cur = graph.node(b)
                graph.replace(cur.with_(inputs=map_refs(cur.inputs, swap), attrs=map_refs(dict(cur.attrs), swap)))
        remove_dead(graph, list(copies))          # originals only the backward read (a saved statistic)
        for s in redo:
            if s in graph:
                graph.replace(graph.node(s).with_ann(checkpoint=True))
        return len(copies)


def rewrite(graph: Graph, problem: RematProblem, plan: RematPlan) -> int:
    """Duplicate the recomputed values into the backward (in place); returns the nodes added
    (:class:`Rewriter` for several plans on copies of one graph)."""
    return Rewriter(graph)(graph, problem, plan) if plan.recompute else 0


@dataclass(frozen=True)
class Remat(Pass):
    """Recompute saved activations in the backward instead of keeping them, under a memory budget."""

    name: ClassVar[str] = "remat"
    modes: ClassVar[frozenset[Mode]] = frozenset({Mode.TRAINING})
    budget: str = option("", "the predicted peak allowed, in [0, 1] from the lowest any plan reaches (0) to the "
                             "peak without remat (1); a tighter budget never gives a higher peak; default 0.1, "
                             "or 1 with peak")
    peak: str = option("", "the whole step's predicted peak to stay under (96MiB): the cheapest plan that fits")
    solver: Solver = option(Solver.KNAPSACK, "how to choose what to keep: sqrt, mincut, knapsack or milp")
    cost: CostModel = option(CostModel.FLOPS, "recompute cost: flops (cost model) or profile (measured)")
    saved: str = option("", "a cap on the saved activations kept: a fraction in (0, 1] of their bytes without "
                            "remat or a size (256MB); plans keeping more are not compared")
    keep: tuple[str, ...] = option((), "node names (fnmatch patterns) never recomputed")
    fused: bool = option(False, "predict the step with the optimizer in the backward (update_in_backward)")
    optimizer: str = option("", 'the step\'s optimizer (sgd, "adam{lr=1e-3}"): its update\'s temporaries join the '
                                "predicted peak; default: the step's own when the CLI or the API runs the pipeline")

    def __post_init__(self) -> None:
        super().__post_init__()
        self.limits()
        self.scratch()

    def scratch(self, ctx: PassContext | None = None) -> float:
        """Temporary bytes the optimizer's update allocates per parameter byte: the ``optimizer`` option's,
        else the step's (``ctx.optimizer``, which the CLI and the API set), else 0."""
        if not self.optimizer:
            known = ctx.optimizer if ctx is not None else None
            return known.scratch() if known is not None else 0.0
        try:
            return OptimizerSpec.parse(self.optimizer).scratch()
        except MlcompError as exc:
            raise PipelineSpecError(f"option 'optimizer' of pass 'remat' got {self.optimizer!r}: {exc.what}",
                                    hint='give the step\'s optimizer, e.g. remat{optimizer="adam{lr=1e-3}"}') from None

    def limits(self) -> tuple[float, int | None, Saved | None]:
        """The budget, the peak limit in bytes and the cap on the saved activations (``None``: none)."""
        budget = parse_budget(self.budget or ("1.0" if self.peak else "0.1"))
        return budget, parse_peak(self.peak) if self.peak else None, parse_saved(self.saved) if self.saved else None

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        _check_joint(graph)
        cost, decision = cost_model(self.cost, ctx)
        decisions = [decision] if decision is not None else []
        problem = build_problem(graph, cost=cost, keep=self.keep, ctx=ctx, decisions=decisions)
        saved = saved_bytes(graph)
        budget, limit, cap = self.limits()
        target = cap.resolve(saved) if cap is not None else None
        plans = pool(problem, self.solver, target)
        if not plans:
            raise infeasible(graph.name, self.saved, target or 0, saved, minimum(problem).memory)
        ws_cache = ctx.cache.setdefault("remat.workspace", {})
        workspace = None if ctx.deterministic else (lambda g: op_workspaces(g, cache=ws_cache))
        full = problem.keep_all()
        rewriter = Rewriter(graph)
        rate = lambda ps: score(graph, problem, ps, rewriter, workspace=workspace,   # noqa: E731
                                scratch=self.scratch(ctx), fused=self.fused)
        before, *scored = rate([full, *(p for p in plans if p.keep != full.keep)])
        if len(scored) < len(plans):        # the keep-all plan is one of the pool's
            scored.insert(0, before)
        aimed: list[Scored] = []
        if self.solver is not Solver.SQRT:  # plans aimed at the peaks of no remat and of the pool's lowest
            starts = [before, lowest_peak(scored)]
            aimed = _aimed(problem, starts, rate, target, {s.plan.keep for s in scored})
            scored += aimed
        choice = choose(scored, before.peak, 1.0 if self.solver is Solver.SQRT else budget, limit)
        best = choice.best
        if best is None:
            low = choice.lowest
            raise peak_unmet(graph.name, self.peak, limit or 0, low.peak, low.memory.at, low.memory.by_kind())
        stats = _stats(graph, best.graph, problem, best.plan, saved, self.solver)
        stats.update(budget=budget, saved_limit_bytes=target, **_peak_stats(before, choice, len(scored), limit),
                     plans_aimed=len(aimed), plan_aimed=any(best is s for s in aimed))
        if decisions:
            stats["decisions"] = [d.to_json() for d in decisions]
        return PassResult(best.graph, best.graph is not graph, stats)


def _aimed(problem: RematProblem, starts: list[Scored], rate, cap: int | None,
           seen: set[frozenset[int]]) -> list[Scored]:
    """:func:`mlcomp.passes.remat.aimed.aim` from each start: new plans, none keeping more than ``cap``."""
    out = []
    for start in starts:
        for s in aim(problem, start, rate):
            if s.plan.keep not in seen and (cap is None or s.plan.memory <= cap):
                seen.add(s.plan.keep)
                out.append(s)
    return out


def _peak_stats(before: Scored, choice: Choice, compared: int, limit: int | None) -> dict[str, Any]:
    best = choice.best
    assert best is not None
    mem = best.memory
    return {"peak_before_bytes": before.peak, "peak_after_bytes": best.peak, "peak_lowest_bytes": choice.lowest.peak,
            "peak_allowed_bytes": choice.allowed, "peak_limit_bytes": limit, "peak_at": mem.at,
            "peak_by_kind": mem.by_kind(), "peak_by_module": dict(list(mem.by_module().items())[:8]),
            "plans_compared": compared}


def saved_bytes(graph: Graph) -> int:
    """Bytes of the saved activations of a joint graph (:func:`mlcomp.analysis.training_graph.saved_activations`)."""
    return sum(v.nbytes for v in saved_activations(graph))


def _check_joint(graph: Graph) -> None:
    if graph.mode is not Mode.TRAINING:
        raise RematError(f"remat needs a joint training graph, and {graph.name} is an inference graph: there is "
                         "no backward pass whose saved activations could be recomputed", where=f"graph {graph.name}",
                         hint="compile with --train (capture_joint) or drop remat from the pipeline")
    if not any(n.ann.phase is Phase.BACKWARD for n in graph.call_nodes()):
        raise RematError(f"graph {graph.name} is a training graph without backward-phase nodes, so it saves "
                         "nothing for a backward", where=f"graph {graph.name}",
                         hint="capture forward, loss and backward together with capture_joint (--train)")


def _stats(graph: Graph, after: Graph, problem: RematProblem, plan: RematPlan, saved: int,
           solver: Solver) -> dict[str, Any]:
    cands = problem.candidates
    needed = [i for i in problem.needed if cands[i].nbytes > 0]
    recomputed = [i for i in needed if i not in plan.keep]
    added = [n for n in after.call_nodes() if n.name not in graph]
    redo = sum(flops(after, n) for n in added)
    forward = sum(flops(graph, graph.node(n)) for n in forward_values(graph)) if added else 1.0
    return {
        "solver": solver.value,
        "saved_before_bytes": saved,
        "saved_after_bytes": saved_bytes(after) if after is not graph else saved,
        "activations_saved": len(needed) - len(recomputed),
        "activations_saved_bytes": sum(cands[i].nbytes for i in needed if i in plan.keep),
        "activations_recomputed": len(recomputed),
        "activations_recomputed_bytes": sum(cands[i].nbytes for i in recomputed),
        "nodes_recomputed": len(added),
        "recompute_cost": plan.cost,
        "recompute_flops": int(redo),
        "recompute_overhead": redo / max(forward, 1.0),     # of the forward's FLOPs
    }
