"""``schedule``: reorder a training graph so that the step's predicted peak does not rise, and falls where
another order helps (:mod:`mlcomp.analysis.memory_schedule`).

The generated step runs the graph's nodes in their order, so the order is the
schedule.  The pass computes two greedy memory-aware orders -- forward (run
memory-freeing nodes first, :func:`~mlcomp.analysis.memory_schedule.memory_order`)
and reverse (built from the end: run allocating nodes last,
:func:`~mlcomp.analysis.memory_schedule.reverse_memory_order`) -- predicts the
whole step's peak in each (:func:`mlcomp.analysis.step_peak.step_memory`, with
``fused=true`` for the optimizer in the backward) and keeps the lowest, only when
it is lower than the graph's own order: the scheduled step's predicted peak never
exceeds the unscheduled one's.  Values, ops and names are unchanged; only
positions move::

    %a0 = relu(%x); %a1 = neg(%x); %a2 = exp(%x); %s0 = sum(%a0); ...       peak 3076 B
    %a0 = relu(%x); %s0 = sum(%a0); %a1 = neg(%x); %s1 = sum(%a1); ...       peak 1036 B
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from mlcomp.analysis.liveness import peak_bytes
from mlcomp.analysis.memory_schedule import memory_order, reverse_memory_order
from mlcomp.analysis.step_peak import grad_params, step_memory
from mlcomp.ir import Graph, Mode
from mlcomp.pipeline.pass_base import Pass, PassContext, PassResult, option

__all__ = ["ORDERS", "Schedule", "reordered"]

ORDERS = (("forward", memory_order), ("reverse", reverse_memory_order))   # the orders compared


def reordered(graph: Graph, order: list[str]) -> Graph:
    """A copy of ``graph`` whose nodes run in ``order`` (every node once, dependencies first)."""
    out = Graph(graph.name, mode=graph.mode)
    out.constants = graph.constants.copy()
    out.symbols, out.ranges = dict(graph.symbols), dict(graph.ranges)
    out.kept_ops = dict(graph.kept_ops)
    out.meta_cache = graph.meta_cache
    for name in order:
        out.add(graph.node(name))
    return out


@dataclass(frozen=True)
class Schedule(Pass):
    """Reorder the graph's nodes to lower the step's predicted peak (never raising it)."""

    name: ClassVar[str] = "schedule"
    modes: ClassVar[frozenset[Mode]] = frozenset(Mode)
    fused: bool = option(False, "predict the step with the optimizer in the backward (update_in_backward)")

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        grads = grad_params(graph) if graph.mode is Mode.TRAINING else {}
        fused = self.fused and bool(grads)
        peak = (lambda o: step_memory(graph, o, fused=fused).peak_bytes) if grads else \
            (lambda o: peak_bytes(graph, o))
        before = peak(None)
        orders = {k: fn(graph, fused=fused, grads=grads.items()) for k, fn in ORDERS}
        peaks = {k: peak(o) for k, o in orders.items()}
        best = min(peaks, key=lambda k: (peaks[k], k != "forward"))
        order, after = orders[best], peaks[best]
        moved = sum(a != b for a, b in zip(order, graph.order()))
        keep = after < before
        stats = {"peak_before_bytes": before, "peak_after_bytes": after if keep else before,
                 "nodes_moved": moved if keep else 0, "kept_order": not keep, "order": best if keep else "graph",
                 "peaks_bytes": peaks}
        return PassResult(reordered(graph, order) if keep else graph, keep, stats)
