"""Pipeline partition: cut the topological order into stages by an exact dynamic program.

``partition{stages=N objective=throughput|latency|memory microbatches=M
schedule=gpipe|1f1b|interleaved memory_limit=2GiB training=false}`` writes
``Node.ann.stage`` on every compute node (the generic splitter,
:mod:`mlcomp.ir.split`, turns that into one graph per stage)::

    before                                    after (stages=2)
    %addmm = aten.addmm.default(...)          %addmm = aten.addmm.default(...)     {stage=0}
    %relu = aten.relu.default(%addmm)         %relu = aten.relu.default(%addmm)    {stage=0}
    %addmm_1 = aten.addmm.default(...)        %addmm_1 = aten.addmm.default(...)   {stage=1}

The cost of a stage covering units ``[i, j)`` (:mod:`mlcomp.analysis.parallel.placement_cost`)
is its compute time (× 3 with ``training``: backward ≈ twice forward) plus
receiving what crosses cut ``i`` and sending what crosses cut ``j`` (× 2 in
training: gradients come back), so residual branches and attention's extra
inputs count every value crossing a cut.  Its memory is its parameters plus
its activations times the microbatches the schedule keeps in flight (GPipe:
``M``; 1F1B: ``S - s``; inference: 1).

* ``throughput``: minimise the slowest stage.  The cost is ``A(j) - B(i)``, so
  "can every stage stay under ``T``" is one sweep per stage with a sliding
  window maximum of ``B`` (O(n)); bisection on ``T`` finds the optimum to
  float precision and the plan is rebuilt at it: O(S·n·log(1/ε)).
* ``latency``: minimise the sum of stage times, i.e. the transfer time of the
  cuts (one sliding-window minimum per stage, exact, O(S·n)).
* ``memory``: minimise the largest stage memory (same bisection on memory).

``memory_limit`` bounds every stage; if no cut fits, the error gives the
smallest limit that does.
"""
from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import ClassVar

from mlcomp.analysis.parallel.pipeline_schedule import Schedule, in_flight
from mlcomp.analysis.parallel.placement_cost import PlacementCost
from mlcomp.base.errors import MlcompError, PipelineSpecError
from mlcomp.base.units import SIZE_HINT, SizeError, parse_size
from mlcomp.ir import Graph
from mlcomp.ir.graph_tools import annotate
from mlcomp.pipeline.pass_base import Pass, PassContext, PassResult, option

__all__ = ["Objective", "Partition", "PartitionError", "Plan", "even_cuts", "parse_bytes", "solve"]


class PartitionError(MlcompError):
    """No partition satisfies what was asked (too many stages, a memory limit too small)."""


class Objective(enum.Enum):
    THROUGHPUT = "throughput"
    LATENCY = "latency"
    MEMORY = "memory"


def parse_bytes(text: str | int | None) -> int | None:
    """``"2GiB"`` → 2147483648; ``"512MB"``, ``"1e9"`` and plain integers too (:mod:`mlcomp.base.units`)."""
    if text is None:
        return None
    try:
        return parse_size(text)
    except SizeError as exc:
        raise PartitionError(f"memory_limit={text!r} is not a size ({exc})", hint=SIZE_HINT) from None


@dataclass(frozen=True)
class Plan:
    """Cut positions ``0 < c1 < … < n`` and what each stage costs."""

    cuts: tuple[int, ...]
    stage_times: tuple[float, ...]
    stage_memory: tuple[int, ...]

    @property
    def bottleneck(self) -> float:
        return max(self.stage_times)

    @property
    def balance(self) -> float:
        """Slowest stage over the mean stage (1.0 = perfectly balanced)."""
        mean = sum(self.stage_times) / len(self.stage_times)
        return self.bottleneck / mean if mean > 0 else 1.0


def plan_of(pc: PlacementCost, cuts: Sequence[int], *, backward: float,
            flight: Callable[[int], int]) -> Plan:
    bounds = [0, *cuts, pc.n]
    times = tuple(pc.stage_time(bounds[s], bounds[s + 1], backward=backward) for s in range(len(bounds) - 1))
    mem = tuple(pc.stage_memory(bounds[s], bounds[s + 1], flight(s)) for s in range(len(bounds) - 1))
    return Plan(tuple(cuts), times, mem)


def even_cuts(n: int, stages: int) -> tuple[int, ...]:
    """What a user does by hand: the same number of units in every stage."""
    return tuple(round(n * s / stages) for s in range(1, stages))


def _monotone_memory(pc: PlacementCost, i: int, j: int, k: int) -> int:
    return pc.stage_memory(i, j, k)


def _sweep(pc: PlacementCost, stages: int, key_b: Callable[[int], float], key_a: Callable[[int], float],
           limit_t: float, flight: Callable[[int], int], limit_m: float,
           ) -> list[list[int]] | None:
    """Exactly ``stages`` stages with ``A(j) - B(i) <= limit_t`` and memory <= ``limit_m``: the parent
    pointers per stage, or ``None``.  One pass per stage: a two-pointer memory window and a
    monotone deque holding the window's maximum ``B`` among reachable starts."""
    n = pc.n
    reach = [False] * (n + 1)
    reach[0] = True
    parents: list[list[int]] = []
    for s in range(stages):
        k = flight(s)
        parent = [-1] * (n + 1)
        nxt = [False] * (n + 1)
        window: deque[int] = deque()
        lo = 0
        added = 0
        for j in range(1, n + 1):
            while added < j:            # start positions i < j enter the window
                if reach[added]:
                    b = key_b(added)
                    while window and key_b(window[-1]) <= b:
                        window.pop()
                    window.append(added)
                added += 1
            while lo < j and _monotone_memory(pc, lo, j, k) > limit_m:
                lo += 1
            while window and window[0] < lo:
                window.popleft()
            if window and key_a(j) - key_b(window[0]) <= limit_t:
                nxt[j] = True
                parent[j] = window[0]
        parents.append(parent)
        reach = nxt
    return parents if reach[n] else None


def _cuts_from(parents: list[list[int]], n: int) -> tuple[int, ...]:
    cuts, j = [], n
    for parent in reversed(parents):
        j = parent[j]
        cuts.append(j)
    return tuple(reversed(cuts[:-1]))


def solve(pc: PlacementCost, stages: int, objective: Objective = Objective.THROUGHPUT, *,
          training: bool = False, microbatches: int = 1, schedule: Schedule = Schedule.ONE_F_ONE_B,
          memory_limit: int | None = None) -> Plan:
    """The optimal contiguous cut of ``pc`` into ``stages`` stages (see the module docstring)."""
    n = pc.n
    if stages < 1:
        raise PartitionError(f"stages={stages}: a pipeline needs at least one stage")
    if stages > n:
        raise PartitionError(f"cannot cut {pc.graph_name} into {stages} stages: it has only {n} compute "
                             "node(s) to place", hint=f"ask for at most {n} stages")
    backward = 2.0 if training else 0.0
    flight = (lambda s: in_flight(schedule, s, stages, microbatches, training))
    kappa = 2.0 if training else 1.0
    key_a = lambda j: pc._pt[j] * (1 + backward) + kappa * pc.transfer_seconds(j)
    key_b = lambda i: pc._pt[i] * (1 + backward) - kappa * pc.transfer_seconds(i)
    limit = math.inf if memory_limit is None else float(memory_limit)
    if _sweep(pc, stages, key_b, key_a, math.inf, flight, limit) is None:
        least = solve(pc, stages, Objective.MEMORY, training=training, microbatches=microbatches,
                      schedule=schedule).stage_memory
        raise PartitionError(
            f"no cut of {pc.graph_name} into {stages} stages fits memory_limit={memory_limit} bytes "
            f"({memory_limit / 2**20:.1f} MiB) per stage; the smallest limit any cut meets is "
            f"{max(least)} bytes ({max(least) / 2**20:.1f} MiB)",
            hint="raise memory_limit to at least that, use more stages, or a schedule with fewer "
                 "microbatches in flight (1f1b)")
    if objective is Objective.LATENCY:
        cuts = _min_transfer(pc, stages, flight, limit)
    elif objective is Objective.THROUGHPUT:
        cuts = _bisect(lambda t: _sweep(pc, stages, key_b, key_a, t, flight, limit),
                       0.0, key_a(n) - key_b(0) + 2 * kappa * max(map(pc.transfer_seconds, range(n + 1))) + 1.0, n)
    else:
        mem_hi = float(_monotone_memory(pc, 0, n, max(flight(s) for s in range(stages))))
        cuts = _bisect(lambda m: _sweep(pc, stages, key_b, key_a, math.inf, flight, min(m, limit)),
                       0.0, mem_hi + 1.0, n)
    return plan_of(pc, cuts, backward=backward, flight=flight)


def _bisect(feasible: Callable[[float], list[list[int]] | None], lo: float, hi: float, n: int) -> tuple[int, ...]:
    best = feasible(hi)
    assert best is not None
    for _ in range(200):
        if hi - lo <= 1e-12 * max(hi, 1e-30):
            break
        mid = (lo + hi) / 2
        got = feasible(mid)
        if got is None:
            lo = mid
        else:
            hi, best = mid, got
    return _cuts_from(best, n)


def _min_transfer(pc: PlacementCost, stages: int, flight: Callable[[int], int], limit: float) -> tuple[int, ...]:
    """Fewest transfer seconds over the cuts: dp[s][j] = tr(j) + min dp[s-1][i] over the memory window."""
    n = pc.n
    inf = math.inf
    best = [0.0] + [inf] * n
    parents: list[list[int]] = []
    for s in range(stages):
        k = flight(s)
        nxt = [inf] * (n + 1)
        parent = [-1] * (n + 1)
        window: deque[int] = deque()
        lo = added = 0
        for j in range(1, n + 1):
            while added < j:
                if best[added] < inf:
                    while window and best[window[-1]] >= best[added]:
                        window.pop()
                    window.append(added)
                added += 1
            while lo < j and _monotone_memory(pc, lo, j, k) > limit:
                lo += 1
            while window and window[0] < lo:
                window.popleft()
            if window:
                nxt[j] = best[window[0]] + (pc.transfer_seconds(j) if j < n else 0.0)
                parent[j] = window[0]
        parents.append(parent)
        best = nxt
    return _cuts_from(parents, n)


@dataclass(frozen=True)
class Partition(Pass):
    """Cut the graph into pipeline stages (exact DP over contiguous cuts); writes ann.stage."""

    name: ClassVar[str] = "partition"
    stages: int = option(2, "number of pipeline stages", ge=1)
    objective: Objective = option(Objective.THROUGHPUT, "what to minimise: the slowest stage, the sum of "
                                  "stage times, or the largest stage memory")
    microbatches: int = option(4, "microbatches per batch (memory in flight, schedule)", ge=1)
    schedule: Schedule = option(Schedule.ONE_F_ONE_B, "pipeline schedule the stages will run")
    memory_limit: str = option("", "bytes per stage (512MiB, 2GiB); empty = no limit")
    training: bool = option(False, "cost forward+backward (training) instead of forward only")

    def __post_init__(self) -> None:
        super().__post_init__()
        try:
            parse_bytes(self.memory_limit or None)
        except PartitionError as err:
            raise PipelineSpecError(err.what, hint=err.hint) from None

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        pc = PlacementCost.of(graph, ctx.hw)
        plan = solve(pc, self.stages, self.objective, training=self.training, microbatches=self.microbatches,
                     schedule=self.schedule, memory_limit=parse_bytes(self.memory_limit or None))
        stage = pc.node_stage(plan.cuts)
        changed = annotate(graph, "stage", stage)
        stats = {"stages": self.stages, "cuts": list(plan.cuts),
                 "stage_ms": [round(t * 1e3, 4) for t in plan.stage_times],
                 "balance": round(plan.balance, 4),
                 "stage_memory_bytes": list(plan.stage_memory),
                 "cut_bytes": [pc.cut_bytes[c] for c in plan.cuts]}
        return PassResult(graph, changed, stats)
