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

``budget`` bounds the saved activations the backward still reads (bytes as
:func:`mlcomp.analysis.training_graph.saved_activations` counts them: forward values
and graph inputs read by the backward, views charged to their base): a fraction
in (0, 1] of those bytes without remat -- the meaning of torch's
``activation_memory_budget`` -- or a size (``256MB``; K/M/G are powers of 1024).
The solvers propose plans keeping at most that many bytes; values that cannot
be recomputed (graph inputs and outputs, random and in-place ops, nodes matching
``keep``) are always kept, and a budget below what they force is an error naming
the minimum.  The objective is the peak a user measures: every proposed plan is
applied to a copy and scored by the predicted peak of the whole step
(:func:`mlcomp.analysis.step_peak.step_memory`: forward, backward, optimizer
update, kernels' scratch; ``fused=true`` for a step with the optimizer in the
backward), and :func:`mlcomp.passes.remat.choose.choose` keeps the lowest (the
cheapest within a few percent of it).  ``peak=96MiB`` instead asks for the
cheapest plan whose predicted peak fits, an error naming the lowest reachable
when none does.  The stats report the peak before and after, its moment and
what is live there by kind and module.  Views and tuple projections follow the
value they alias.  Recompute cost is FLOPs or measured node times
(:mod:`mlcomp.passes.remat.costs`).  ``sqrt`` is Chen's fixed plan and ignores
the budget.
"""
from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Any, ClassVar

from mlcomp.analysis.liveness import is_view, liveness, storage_roots, value_bytes
from mlcomp.analysis.training_graph import saved_activations
from mlcomp.analysis.workspace import op_workspaces
from mlcomp.base.errors import MlcompError, PassFailure, PipelineSpecError
from mlcomp.base.units import SizeError, parse_size, size_unit
from mlcomp.hardware.decide import Decision
from mlcomp.ir import Graph, Mode, Node, Ref, map_refs
from mlcomp.ir.builder import remove_dead
from mlcomp.ir.node import Annotations, Phase
from mlcomp.ir.ops import GETITEM
from mlcomp.ir.opsets import is_pure
from mlcomp.passes.remat.choose import Scored, choose, score
from mlcomp.passes.remat.costs import CostModel, cost_model, flops, profile
from mlcomp.passes.remat.problem import Candidate, RematPlan, RematProblem
from mlcomp.runtime.optim import OptimizerSpec
from mlcomp.passes.remat.solvers import Solver, candidates, minimum, solve
from mlcomp.pipeline.pass_base import Pass, PassContext, PassResult, option

__all__ = ["Budget", "CostModel", "Remat", "RematError", "build_problem", "forward_values", "parse_budget",
           "rewrite", "saved_bytes"]

_FORWARD = (Phase.FORWARD, Phase.LOSS)


class RematError(PassFailure):
    """Rematerialisation cannot run on this graph or cannot meet the budget."""


@dataclass(frozen=True)
class Budget:
    fraction: float | None = None   # of the saved-activation bytes without remat
    nbytes: int | None = None       # absolute

    def resolve(self, saved: int) -> int:
        """The bytes of saved activations allowed, given ``saved`` bytes without remat."""
        return int(self.fraction * saved) if self.fraction is not None else int(self.nbytes or 0)


def parse_budget(text: str) -> Budget:
    """``0.5`` (a fraction in (0, 1]) or ``256MB`` / ``1.5GiB`` / ``4096`` B (a size, :mod:`mlcomp.base.units`)."""
    raw = str(text).strip()
    hint = ("give a fraction in (0, 1] of the saved activations without remat, e.g. remat{budget=0.5}, "
            "or a size such as 256MB (KB, MB, GB: powers of 1000; KiB, MiB, GiB: powers of 1024)")
    try:
        value, unit = size_unit(raw)
    except SizeError as exc:
        raise PipelineSpecError(f"option 'budget' of pass 'remat' got {raw!r}: {exc}", hint=hint) from None
    if value <= 0:
        raise PipelineSpecError(f"option 'budget' of pass 'remat' must be above 0, got {raw!r}", hint=hint)
    if unit == "" and value <= 1.0:
        return Budget(fraction=value)
    if unit == "" and value != int(value):
        raise PipelineSpecError(f"option 'budget' of pass 'remat' got {raw!r}: a fraction must be at most 1 "
                                "and a size a whole number of bytes", hint=hint)
    return Budget(nbytes=parse_size(raw))


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
    live = liveness(graph)           # buffers as the memory analysis counts them (views, tuple elements)
    storage = live.storage
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
                else 0 if n.ann.phase is Phase.BACKWARD else live.sizes.get(n.name, value_bytes(graph, n)))
        cands.append(Candidate(n.name, size, costs[n.name], reads, n.name in needed,
                               n.name not in outputs and not _banned(n, keep)))
    return RematProblem(tuple(cands))


def _is_alias(node: Node) -> bool:
    return node.op == GETITEM or is_view(node)


def rewrite(graph: Graph, problem: RematProblem, plan: RematPlan) -> int:
    """Duplicate the recomputed values into the backward (in place); returns the nodes added."""
    if not plan.recompute:
        return 0
    storage = storage_roots(graph)
    redo = {problem.candidates[i].name for i in plan.recompute}
    forward = forward_values(graph)
    pos = {n: graph.position_key(n) for n in graph.order()}
    first: dict[str, tuple[int, str]] = {}        # backward node -> (position, name) of its first real use

    def use_of(b: Node) -> tuple[int, str]:
        if b.name not in first:
            users = graph.users(b.name) if _is_alias(b) else []
            first[b.name] = min((use_of(u) for u in users), default=(pos[b.name], b.name))
        return first[b.name]

    readers: dict[str, list[Node]] = {}           # forward value to copy -> backward nodes reading it
    anchor: dict[str, tuple[int, str]] = {}
    outputs = {r.name for r in graph.output_refs}  # live to the end anyway: read, never copied
    for b in graph.call_nodes():
        if b.ann.phase is not Phase.BACKWARD or b.name in forward:
            continue
        for s in b.input_names():
            if s in forward and storage[s] in redo and s not in outputs:
                readers.setdefault(s, []).append(b)
                anchor[s] = min(anchor.get(s, (1 << 62, "")), use_of(b))
    order = [n for n in graph.order() if n in forward]
    need = set(readers)
    for s in reversed(order):                     # a copy needs copies of its recomputed inputs
        if s not in need:
            continue
        for t in graph.node(s).input_names():
            if t in forward and storage[t] in redo:
                need.add(t)
                anchor[t] = min(anchor.get(t, (1 << 62, "")), anchor[s])
    for s in order:                               # a tuple's projections right after it: the tuple then dies
        node = graph.node(s)                      # at once instead of holding every element to the last one
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
    for s, bs in readers.items():
        for b in bs:
            if b.name in done:
                continue
            done.add(b.name)
            cur = graph.node(b.name)
            graph.replace(cur.with_(inputs=map_refs(cur.inputs, swap), attrs=map_refs(dict(cur.attrs), swap)))
    remove_dead(graph, list(copies))          # originals only the backward read (a saved statistic)
    for s in redo:
        if s in graph:
            graph.replace(graph.node(s).with_ann(checkpoint=True))
    return len(copies)


@dataclass(frozen=True)
class Remat(Pass):
    """Recompute saved activations in the backward instead of keeping them, under a memory budget."""

    name: ClassVar[str] = "remat"
    modes: ClassVar[frozenset[Mode]] = frozenset({Mode.TRAINING})
    budget: str = option("", "saved activations kept: a fraction in (0, 1] of their bytes without remat "
                             "(like torch's activation_memory_budget) or a size (256MB); default 0.5, or no bound "
                             "with peak")
    peak: str = option("", "the whole step's predicted peak to stay under (96MiB): the cheapest plan that fits")
    solver: Solver = option(Solver.KNAPSACK, "how to choose what to keep: sqrt, mincut, knapsack or milp")
    cost: CostModel = option(CostModel.FLOPS, "recompute cost: flops (cost model) or profile (measured)")
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

    def limits(self) -> tuple[Budget, int | None]:
        """The saved-activation budget and the peak limit in bytes (``None``: minimise the peak)."""
        if not self.peak:
            return parse_budget(self.budget or "0.5"), None
        return parse_budget(self.budget or "1.0"), parse_peak(self.peak)

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        _check_joint(graph)
        cost, decision = cost_model(self.cost, ctx)
        decisions = [decision] if decision is not None else []
        problem = build_problem(graph, cost=cost, keep=self.keep, ctx=ctx, decisions=decisions)
        saved = saved_bytes(graph)
        budget, limit = self.limits()
        target = budget.resolve(saved)
        try:
            plans = _plans(problem, self.solver, target, saved, limit)
        except ValueError:          # milp: nothing fits
            plans = []
        if not plans:
            raise _infeasible(graph, self.budget or "1.0", target, saved, minimum(problem).memory)
        ws_cache = ctx.cache.setdefault("remat.workspace", {})
        workspace = None if ctx.deterministic else (lambda g: op_workspaces(g, cache=ws_cache))
        before, *scored = score(graph, problem, [problem.keep_all(), *plans], rewrite, workspace=workspace,
                                scratch=self.scratch(ctx), fused=self.fused)
        best = choose(scored, limit)
        if best is None:
            raise _peak_unmet(graph, self.peak, limit or 0, min(scored, key=lambda s: s.peak))
        stats = _stats(graph, best.graph, problem, best.plan, saved, target, self.solver)
        stats.update(_peak_stats(before, best, len(scored), limit))
        if decisions:
            stats["decisions"] = [d.to_json() for d in decisions]
        return PassResult(best.graph, best.graph is not graph, stats)


def parse_peak(text: str) -> int:
    """``96MiB`` / ``100MB`` / ``4096`` (bytes) → bytes (:mod:`mlcomp.base.units`)."""
    try:
        value = parse_size(str(text).strip())
    except SizeError as exc:
        raise PipelineSpecError(f"option 'peak' of pass 'remat' got {text!r}: {exc}",
                                hint="give the step's peak as a size, e.g. remat{peak=96MiB}") from None
    if value <= 0:
        raise PipelineSpecError(f"option 'peak' of pass 'remat' must be above 0, got {text!r}",
                                hint="give the step's peak as a size, e.g. remat{peak=96MiB}")
    return value


def _plans(problem: RematProblem, solver: Solver, target: int, saved: int, limit: int | None) -> list[RematPlan]:
    """The solver's candidates keeping at most ``target`` bytes (``sqrt``: its one plan); with a peak limit
    also those under tighter budgets, so that the cheapest plan meeting the limit is among them."""
    if solver is Solver.SQRT:
        return [solve(problem, solver, target)]
    plans: dict[frozenset[int], RematPlan] = {}
    shares = (1.0,) if limit is None or solver is Solver.MILP else (1.0, 0.5, 0.25, 0.1)
    for share in shares:
        for plan in candidates(problem, solver, min(target, int(saved * share))):
            plans.setdefault(plan.keep, plan)
    return [p for p in plans.values() if p.memory <= target]


def _peak_stats(before: Scored, best: Scored, compared: int, limit: int | None) -> dict[str, Any]:
    mem = best.memory
    return {"peak_before_bytes": before.peak, "peak_after_bytes": best.peak, "peak_limit_bytes": limit,
            "peak_at": mem.at, "peak_by_kind": mem.by_kind(), "peak_by_module": dict(list(mem.by_module().items())[:8]),
            "plans_compared": compared}


def _peak_unmet(graph: Graph, text: str, limit: int, lowest: Scored) -> RematError:
    return RematError(
        f"remat cannot bring the predicted peak of the training step of {graph.name} under {text} ({limit} "
        f"bytes): the lowest any plan reaches is {lowest.peak} bytes, at %{lowest.memory.at} "
        f"({', '.join(f'{k} {v}' for k, v in lowest.memory.by_kind().items())})",
        where=f"pass remat, graph {graph.name}",
        hint=f"raise the limit to at least peak={math.ceil(lowest.peak / 2**20)}MiB, lower the batch, or use "
             "fused=true with compile_training(update_in_backward=True) so gradients do not coexist")


def saved_bytes(graph: Graph) -> int:
    """Bytes of the saved activations of a joint graph (:func:`mlcomp.analysis.training_graph.saved_activations`)."""
    return sum(v.nbytes for v in saved_activations(graph))


def _infeasible(graph: Graph, budget: str, target: int, saved: int, least: int) -> RematError:
    frac = least / max(saved, 1)
    return RematError(
        f"remat cannot keep the saved activations of graph {graph.name} within the budget {budget} ({target} "
        f"bytes, {target / max(saved, 1):.3f} of the {saved} bytes saved without remat): the values that cannot be "
        f"recomputed (graph inputs and outputs, random or in-place ops, keep patterns) and what recomputing around "
        f"them needs hold at least {least} bytes, so the minimum feasible budget is {least} bytes "
        f"({frac:.3f} of the saved activations)", where=f"pass remat, graph {graph.name}",
        hint=f"raise the budget to at least budget={math.ceil(frac * 1000) / 1000} or {least}B, or drop keep "
             "patterns")


def _check_joint(graph: Graph) -> None:
    if graph.mode is not Mode.TRAINING:
        raise RematError(f"remat needs a joint training graph, and {graph.name} is an inference graph: there is "
                         "no backward pass whose saved activations could be recomputed", where=f"graph {graph.name}",
                         hint="compile with --train (capture_joint) or drop remat from the pipeline")
    if not any(n.ann.phase is Phase.BACKWARD for n in graph.call_nodes()):
        raise RematError(f"graph {graph.name} is a training graph without backward-phase nodes, so it saves "
                         "nothing for a backward", where=f"graph {graph.name}",
                         hint="capture forward, loss and backward together with capture_joint (--train)")


def _stats(graph: Graph, after: Graph, problem: RematProblem, plan: RematPlan, saved: int, target: int,
           solver: Solver) -> dict[str, Any]:
    cands = problem.candidates
    needed = [i for i in problem.needed if cands[i].nbytes > 0]
    recomputed = [i for i in needed if i not in plan.keep]
    added = [n for n in after.call_nodes() if n.name not in graph]
    kept = saved_bytes(after) if after is not graph else saved
    return {
        "solver": solver.value,
        "budget_bytes": target,
        "budget_met": kept <= target,
        "saved_before_bytes": saved,
        "saved_after_bytes": kept,
        "activations_saved": len(needed) - len(recomputed),
        "activations_saved_bytes": sum(cands[i].nbytes for i in needed if i in plan.keep),
        "activations_recomputed": len(recomputed),
        "activations_recomputed_bytes": sum(cands[i].nbytes for i in recomputed),
        "nodes_recomputed": len(added),
        "recompute_flops": int(sum(flops(after, n) for n in added)),
    }
