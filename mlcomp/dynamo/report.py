"""Which partition of which Dynamo graph ran where, and why: the backend's ``explain``.

    >>> report = BackendReport()
    >>> report.add(Partition("graph0", "fused_0", "mlcomp:cpu", nodes=3, seconds=0.5, cache="stored",
    ...                      sizes={"batch": [1, None], "seq": [8, 512]}))
    >>> report.add(Partition("graph0", "cond", "torch", nodes=1, reason="cond is not an op of mlcomp's IR"))
    >>> print(report.table())
    graph   partition  ran on      nodes  compile s  cache   sizes                  why
    graph0  fused_0    mlcomp:cpu  3      0.500      stored  batch 1.., seq 8..512
    graph0  cond       torch       1                                                cond is not an op of mlcomp's IR
    >>> report.counts()
    {'mlcomp:cpu': 1, 'torch': 1}
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlcomp.ir.symbols import ranges_from_json
from mlcomp.targets.fallback import EAGER_LABEL

__all__ = ["AOT", "BackendReport", "JointRecord", "Partition", "TORCH", "size_ranges"]

TORCH = "torch"
AOT = "aot-autograd"   # a graph whose forward and backward torch split before mlcomp compiled them



@dataclass
class Partition:
    """One region of one Dynamo graph: where it ran (``mlcomp:<target>`` or ``torch``) and why."""

    graph: str
    name: str
    ran_on: str
    nodes: int = 0
    seconds: float | None = None
    cache: str | None = None
    reason: str | None = None
    pipeline: str | None = None                                   # the pipeline as it ran (adapted to the target)
    regions: list[dict[str, Any]] = field(default_factory=list)   # the target's own eager regions, if any
    sizes: dict[str, list[int | None]] = field(default_factory=dict)   # symbolic sizes: name -> [min, max]
    picked: str | None = None                                     # how the auto target chose, if it did


@dataclass
class JointRecord:
    """A Dynamo graph trained through mlcomp's joint graph: what crossed from forward to backward, and why."""

    graph: str
    saved_before: int = 0          # tensors the forward saves for the backward, as captured
    saved_before_bytes: int = 0
    saved: int = 0                 # … after the pipeline (what the compiled forward saves)
    saved_bytes: int = 0
    pipeline: str | None = None
    target: str | None = None
    recomputed: int = 0            # forward values remat recomputes in the backward
    nodes_recomputed: int = 0
    tolerance: float | None = None  # declared by mixed precision (None: fp32)
    regions: list[dict[str, Any]] = field(default_factory=list)   # the target's own eager regions
    cache: list[str | None] = field(default_factory=list)        # the forward's and backward's cache outcomes

    def cache_status(self) -> str | None:
        """The halves' one cache outcome (``hit``, ``stored``…), ``forward/backward`` when they differ.

        >>> JointRecord("g", cache=["hit", "stored"]).cache_status()
        'hit/stored'
        """
        known = [c or "" for c in self.cache]
        return None if not any(known) else known[0] if len(set(known)) == 1 else "/".join(known)

    def note_passes(self, pipeline_report: Any) -> None:
        """Take remat's and mixed precision's figures from a pipeline report."""
        for rec in pipeline_report.walk():
            stats = rec.stats or {}
            self.recomputed += int(stats.get("activations_recomputed", 0) or 0)
            self.nodes_recomputed += int(stats.get("nodes_recomputed", 0) or 0)
            if stats.get("declared_tolerance") is not None:
                self.tolerance = max(self.tolerance or 0.0, float(stats["declared_tolerance"]))

    def line(self) -> str:
        text = (f"{self.graph} joint graph: forward saves {self.saved} tensors ({self.saved_bytes} bytes) for the "
                f"backward, {self.saved_before} ({self.saved_before_bytes} bytes) as captured")
        if self.recomputed:
            text += f"; remat recomputed {self.recomputed} values ({self.nodes_recomputed} nodes)"
        if self.tolerance is not None:
            text += f"; declared tolerance {self.tolerance:g}"
        return text


@dataclass
class BackendReport:
    """What the backend did, graph by graph; pass it as ``options={"report": r}`` to fill it."""

    partitions: list[Partition] = field(default_factory=list)
    graphs: int = 0          # Dynamo graphs the backend was given (a recompile counts again)
    joints: list[JointRecord] = field(default_factory=list)   # graphs trained through mlcomp's joint graph

    def add(self, part: Partition) -> None:
        self.partitions.append(part)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.partitions:
            out[p.ran_on] = out.get(p.ran_on, 0) + 1
        return out

    def of_graph(self, graph: str) -> list[Partition]:
        """The partitions of one Dynamo graph (its forward and backward graphs' included)."""
        return [p for p in self.partitions if p.graph == graph or p.graph.startswith(graph + ".")]

    def only(self, graph: str) -> "BackendReport":
        """This report restricted to one Dynamo graph."""
        return BackendReport(self.of_graph(graph), 1, [j for j in self.joints if j.graph == graph])

    def table(self) -> str:
        head = ("graph", "partition", "ran on", "nodes", "compile s", "cache", "sizes", "why")
        rows = [head] + [(p.graph, p.name, p.ran_on, str(p.nodes),
                          "" if p.seconds is None else f"{p.seconds:.3f}", p.cache or "", _sizes(p.sizes),
                          p.reason or _regions_note(p.regions) or p.picked or "") for p in self.partitions]
        widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
        lines = [("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1]).rstrip() for r in rows]
        return "\n".join(lines + [j.line() for j in self.joints])


def size_ranges(sizes: dict[str, list[int | None]]) -> list[str]:
    """Each symbolic size and its range (:class:`~mlcomp.ir.symbols.SizeRange`'s form), by name.

    >>> size_ranges({"seq": [8, 512], "batch": [1, None]})
    ['batch 1..', 'seq 8..512']
    """
    return [f"{name} {r}" for name, r in sorted(ranges_from_json(sizes).items())]


def _sizes(sizes: dict[str, list[int | None]]) -> str:
    """``batch 1.., seq 8..512``: each symbolic size and its range."""
    return ", ".join(size_ranges(sizes))


def _regions_note(regions: list[dict[str, Any]]) -> str:
    """The target's own eager regions inside a partition mlcomp compiled (``fallback="eager"``)."""
    in_torch = [r for r in regions if r.get("runs_on") == EAGER_LABEL]
    if not in_torch:
        return ""
    ops = sorted({op for r in in_torch for op in r.get("ops", ())})
    return f"{len(in_torch)} of {len(regions)} regions in torch ({', '.join(ops[:4])})"
