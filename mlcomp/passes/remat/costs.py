"""Recompute costs for rematerialisation: FLOP counts, or each node's time measured through the context.

``cost=flops`` counts each forward node's FLOPs (FlopCounterMode; one per output
element for ops it does not count).  ``cost=profile`` runs the graph once on the
example inputs and times every forward node alone through
:meth:`~mlcomp.pipeline.pass_base.PassContext.measure` (the one route a pass
times anything: rotated rounds, medians, a :class:`~mlcomp.hardware.decide.Decision`
for the manifest); times are cached per op, arguments and shapes in ``ctx.cache``.
A deterministic run measures nothing and counts FLOPs, and says so in its decision.
"""
from __future__ import annotations

import enum
from functools import partial

import torch

from mlcomp.analysis.cost import node_flops
from mlcomp.base.errors import PassFailure
from mlcomp.hardware.decide import Decision
from mlcomp.ir import Graph, Node, map_refs, tensor_metas
from mlcomp.ir.interpreter import Interpreter
from mlcomp.pipeline.pass_base import PassContext

__all__ = ["COST_QUESTION", "CostModel", "cost_model", "flops", "profile"]

COST_QUESTION = "remat: recompute costs from measured node times (profile) or FLOP counts?"


class CostModel(enum.Enum):
    FLOPS = "flops"
    PROFILE = "profile"


def flops(graph: Graph, node: Node) -> float:
    counted = node_flops(graph, node)
    return float(counted or sum(m.numel(graph.symbols) for m in tensor_metas(node.meta)))


def cost_model(cost: CostModel, ctx: PassContext) -> tuple[CostModel, Decision | None]:
    """The cost model this run uses and, for ``cost=profile`` in a deterministic run, the record of the
    fixed rule taken (FLOP counts: node times vary from run to run, and so would the plan).  A profiled run
    records its measurement in :func:`profile`."""
    if cost is not CostModel.PROFILE:
        return cost, None
    if ctx.deterministic:
        return CostModel.FLOPS, Decision.fixed(COST_QUESTION, ("profile", "flops"), "flops",
                                               "FLOP counts; node times are not measured")
    return cost, None


def _call(fn, args, kwargs) -> None:
    with torch.no_grad():
        fn(*args, **kwargs)


def profile(graph: Graph, names: list[str], ctx: PassContext, error: type[PassFailure]) -> tuple[dict[str, float],
                                                                                                 Decision | None]:
    """Median seconds of each node on the example inputs and the measurement's decision (``None``: all cached)."""
    cache = ctx.cache.setdefault("remat.profile", {})
    key = lambda n: (n.op, repr(n.inputs), repr(dict(n.attrs)), repr(n.meta),   # noqa: E731
                     tuple(repr(graph.node(s).meta) for s in n.input_names()))
    todo = {key(graph.node(n)): graph.node(n) for n in names if key(graph.node(n)) not in cache}
    decision = None
    if todo:
        if ctx.example_inputs is None:
            raise error(f"remat{{cost=profile}} times every forward node of {graph.name} on the example "
                        "inputs, and none were given", where=f"pass remat, graph {graph.name}",
                        hint="pass example_inputs= (the CLI passes the batch) or use cost=flops")
        with torch.no_grad():
            env = Interpreter(graph, check_inputs=False).run_all(*ctx.example_inputs)
        fns = {}
        for i, node in enumerate(todo.values()):
            args = map_refs(node.inputs, lambda r: env[r.name])
            kwargs = map_refs(dict(node.attrs), lambda r: env[r.name])
            fns[f"{i}:{node.name}"] = partial(_call, node.op.resolve(), args, kwargs)
        times, decision = ctx.measure(COST_QUESTION, fns, rule="FLOP counts")
        assert times is not None      # cost_model turned profile into flops in a deterministic run
        decision = Decision(COST_QUESTION, ("profile", "flops"), "flops", "profile", decision.verdict,
                            f"cost=profile asked; {decision.why}; the plan can vary with the times",
                            rounds=decision.rounds)
        cache.update(zip(todo, (times[k] for k in fns)))
    return {n: cache[key(graph.node(n))] for n in names}, decision
