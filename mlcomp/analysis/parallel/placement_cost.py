"""What placing nodes on stages or devices costs: per-node time, weights, activations, cut transfers.

The graph's compute nodes, in topological order, become *units* (a tuple
producer and the ``getitem`` s that pick from it form one unit, so a cut never
separates them).  For a cut at position ``k`` (units ``< k`` on one side,
``>= k`` on the other) every tensor produced before ``k`` and read at or after
``k`` (graph inputs included, graph outputs read "at the end") crosses it::

    units      0:conv  1:relu  2:conv  3:add(relu, conv)   output(add)
    cut k=2    crossing = relu (read by add at 3) → bytes(relu)
    cut k=3    crossing = relu, conv                 → bytes(relu) + bytes(conv)

    pc = PlacementCost.of(graph, hw)            # or times={node: seconds} measured by `mlcomp profile`
    pc.cut_bytes[2], pc.stage_time(0, 2), pc.transfer_seconds(2)

Prefix sums make the time, parameter bytes and activation bytes of any
contiguous range ``[i, j)`` O(1); the crossing bytes of every cut come from one
difference array, so building the table is O(n) after the cost model.

Links: ``bytes / bandwidth + latency`` per transfer.  ``gloo-loopback`` was
measured on this host by :class:`mlcomp.hardware.link.LinkProbe`; PCIe and
NVLink are spec-sheet figures (PCIe 4.0 x16 ≈ 32 GB/s per direction, NVLink 3
on A100 600 GB/s, NVLink 4 on H100 900 GB/s, both totals over all links).
"""
from __future__ import annotations

import itertools
import statistics
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import torch

from mlcomp.analysis.cost import node_cost
from mlcomp.analysis.liveness import is_view, value_bytes
from mlcomp.hardware.link import Link
from mlcomp.hardware.spec import DEFAULT_CPU, HardwareSpec
from mlcomp.ir import Graph, Node, TensorMeta, map_refs
from mlcomp.ir.interpreter import Interpreter
from mlcomp.ir.ops import GETITEM, INPUT, PARAM

__all__ = ["Link", "LINKS", "PlacementCost", "units_of", "measure_node_times"]


# gloo-loopback: a default for when no probe ran, from one run of the probe (mlcomp.hardware.link.LinkProbe:
# two processes, ping-pong 4 KiB … 16 MiB, relative-error fit; the run is in benchmarks/RESULTS.md).  Pass a
# fresh LinkProbe().result.link as PlacementCost.of(link=...).  The rest: spec sheets.
LINKS: dict[str, Link] = {
    "gloo-loopback": Link("gloo over TCP loopback (measured on this host, loaded)", 2.8e9, 180e-6),
    "pcie4-x16": Link("PCIe 4.0 x16 (spec sheet, one direction)", 32e9, 10e-6),
    "nvlink3": Link("NVLink 3, A100 (spec sheet, all links)", 600e9, 5e-6),
    "nvlink4": Link("NVLink 4, H100 (spec sheet, all links)", 900e9, 5e-6),
}


def units_of(graph: Graph) -> tuple[list[list[str]], dict[str, int]]:
    """Compute nodes grouped into units (a producer with its getitems), and node → unit index."""
    units: list[list[str]] = []
    unit_of: dict[str, int] = {}
    for node in graph.call_nodes():
        if node.op == GETITEM and node.inputs and node.input_names()[0] in unit_of:
            u = unit_of[node.input_names()[0]]
            units[u].append(node.name)
            unit_of[node.name] = u
            continue
        unit_of[node.name] = len(units)
        units.append([node.name])
    return units, unit_of


def _prefix(values: Sequence[float]) -> list[float]:
    return [0.0, *itertools.accumulate(values)]


def _sends_value(node: Node, graph: Graph) -> bool:
    """Whether a value would travel across a cut as a tensor (a tuple read only through getitems does not)."""
    if isinstance(node.meta, TensorMeta):
        return True
    return any(u.op != GETITEM for u in graph.users(node.name))


@dataclass(frozen=True)
class PlacementCost:
    """Per-unit costs of a graph along its topological order (see the module docstring)."""

    graph_name: str
    units: tuple[tuple[str, ...], ...]
    time: tuple[float, ...]             # seconds per unit (forward)
    params: tuple[int, ...]             # parameter bytes first read by the unit
    activations: tuple[int, ...]        # bytes the unit allocates (views none; what training keeps)
    cut_bytes: tuple[int, ...]          # bytes crossing cut k, k = 0..n (0 and n: nothing)
    cut_values: tuple[int, ...]         # how many tensors cross cut k
    link: Link
    measured: bool = False              # times come from a profiling run
    _pt: tuple[float, ...] = ()
    _pp: tuple[float, ...] = ()
    _pa: tuple[float, ...] = ()

    @classmethod
    def of(cls, graph: Graph, hw: HardwareSpec | None = None, *, link: Link | None = None,
           times: Mapping[str, float] | None = None) -> "PlacementCost":
        """Build the table; ``times`` (node → seconds, from ``mlcomp profile``) replace the roofline."""
        hw = hw or DEFAULT_CPU
        units, unit_of = units_of(graph)
        n = len(units)
        time = [0.0] * n
        acts = [0] * n
        for u, names in enumerate(units):
            for name in names:
                node = graph.node(name)
                if times is not None and name in times:
                    time[u] += float(times[name])
                elif times is None:
                    time[u] += hw.time(node_cost(graph, node))
                if node.op != GETITEM and not is_view(node):     # views allocate nothing
                    acts[u] += value_bytes(graph, node)
        params = [0] * n
        for p in graph.nodes(PARAM):
            readers = [unit_of[r.name] for r in graph.users(p.name) if r.name in unit_of]
            if readers:
                params[min(readers)] += value_bytes(graph, p)
        # crossing bytes of every cut: a value made at unit p and last read at unit l crosses cuts p+1..l
        diff = [0] * (n + 2)
        count = [0] * (n + 2)
        outputs = {r.name for r in graph.output_refs}
        for node in graph.nodes():
            if node.op == PARAM or node.op.is_structural and node.op != INPUT:
                continue
            if node.op != INPUT and not _sends_value(node, graph):
                continue
            p = -1 if node.op == INPUT else unit_of[node.name]
            last = max((unit_of[u.name] for u in graph.users(node.name) if u.name in unit_of), default=p)
            if node.name in outputs:
                last = n - 1
            if last <= p:
                continue
            size = value_bytes(graph, node)
            lo, hi = max(p + 1, 1), min(last, n - 1)
            if lo > hi:
                continue
            diff[lo] += size
            diff[hi + 1] -= size
            count[lo] += 1
            count[hi + 1] -= 1
        cut = [0] * (n + 1)
        values = [0] * (n + 1)
        run = runc = 0
        for k in range(1, n):
            run += diff[k]
            runc += count[k]
            cut[k], values[k] = run, runc
        return cls(graph.name, tuple(tuple(u) for u in units), tuple(time), tuple(params), tuple(acts),
                   tuple(cut), tuple(values), link or LINKS["gloo-loopback"], times is not None,
                   tuple(_prefix(time)), tuple(_prefix(params)), tuple(_prefix(acts)))

    # -- O(1) range queries ------------------------------------------------
    @property
    def n(self) -> int:
        return len(self.units)

    def compute_seconds(self, i: int, j: int) -> float:
        """Forward compute time of units ``[i, j)``."""
        return self._pt[j] - self._pt[i]

    def param_bytes(self, i: int, j: int) -> int:
        return int(self._pp[j] - self._pp[i])

    def activation_bytes(self, i: int, j: int) -> int:
        return int(self._pa[j] - self._pa[i])

    def transfer_seconds(self, k: int) -> float:
        """Time to move what crosses cut ``k`` once (0 at the ends)."""
        if k <= 0 or k >= self.n or not self.cut_values[k]:
            return 0.0
        return self.link.seconds(self.cut_bytes[k], self.cut_values[k])

    def stage_time(self, i: int, j: int, *, backward: float = 0.0) -> float:
        """Slowest-stage objective of units ``[i, j)``: compute (× (1 + backward)) plus receiving
        at ``i`` and sending at ``j`` (× 2 when activations go forward and gradients come back)."""
        comm = self.transfer_seconds(i) + self.transfer_seconds(j)
        return self.compute_seconds(i, j) * (1.0 + backward) + comm * (2.0 if backward else 1.0)

    def stage_memory(self, i: int, j: int, in_flight: int = 1) -> int:
        """Parameters plus ``in_flight`` microbatches of the activations the stage produces."""
        return self.param_bytes(i, j) + in_flight * self.activation_bytes(i, j)

    def node_stage(self, cuts: Sequence[int]) -> dict[str, int]:
        """Node → stage for cut positions ``0 < c1 < … < n`` (stage s covers ``[c_s, c_{s+1})``)."""
        bounds = [0, *cuts, self.n]
        out: dict[str, int] = {}
        for s in range(len(bounds) - 1):
            for u in range(bounds[s], bounds[s + 1]):
                for name in self.units[u]:
                    out[name] = s
        return out


def measure_node_times(graph: Graph, inputs: Sequence[Any], *, repeats: int = 5,
                       clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median seconds of every compute node over ``repeats`` sweeps of the graph (``mlcomp profile``).

    The graph runs once to record every value; then each sweep calls every node
    in topological order on its recorded inputs, timing each call alone.  Nodes
    run in their real order, so a layer's weights are as cold in the cache as
    in a real forward (re-running one node back to back would keep them warm
    and under-count memory-bound layers 2x on a 75 MB MLP).  ``clock``:
    ``time.perf_counter`` (wall) or ``time.thread_time`` (CPU seconds of this
    thread: what a one-thread rank needs on a core of its own, whatever the
    load of the host; :meth:`mlcomp.hardware.link.LinkProfile.speed` turns it
    back into wall time on a shared host).
    """
    with torch.no_grad():
        env = Interpreter(graph).run_all(*inputs)
        calls = []
        for node in graph.call_nodes():
            calls.append((node.name, node.op.resolve(), map_refs(node.inputs, lambda r: env[r.name]),
                          map_refs(dict(node.attrs), lambda r: env[r.name])))
        samples: dict[str, list[float]] = {name: [] for name, *_ in calls}
        for sweep in range(repeats + 1):            # sweep 0 warms up: first-call allocations, dispatch caches
            for name, fn, args, kwargs in calls:
                if not sweep:
                    fn(*args, **kwargs)
                    continue
                start = clock()
                fn(*args, **kwargs)
                samples[name].append(clock() - start)
    return {name: statistics.median(s) for name, s in samples.items()}
