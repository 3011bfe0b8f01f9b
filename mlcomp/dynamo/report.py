"""Which partition of which Dynamo graph ran where, and why: the backend's ``explain``.

    >>> report = BackendReport()
    >>> report.add(Partition("graph0", "fused_0", "mlcomp:cpu", nodes=3, seconds=0.5, cache="stored"))
    >>> report.add(Partition("graph0", "cond", "torch", nodes=1, reason="cond is not an op of mlcomp's IR"))
    >>> print(report.table())
    graph   partition  ran on      nodes  compile s  cache   why
    graph0  fused_0    mlcomp:cpu  3      0.500      stored
    graph0  cond       torch       1                         cond is not an op of mlcomp's IR
    >>> report.counts()
    {'mlcomp:cpu': 1, 'torch': 1}
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from mlcomp.targets.fallback import EAGER_LABEL

__all__ = ["BackendReport", "Partition", "TORCH"]

TORCH = "torch"



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


@dataclass
class BackendReport:
    """What the backend did, graph by graph; pass it as ``options={"report": r}`` to fill it."""

    partitions: list[Partition] = field(default_factory=list)
    graphs: int = 0          # Dynamo graphs the backend was given (a recompile counts again)

    def add(self, part: Partition) -> None:
        self.partitions.append(part)

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.partitions:
            out[p.ran_on] = out.get(p.ran_on, 0) + 1
        return out

    def of_graph(self, graph: str) -> list[Partition]:
        return [p for p in self.partitions if p.graph == graph]

    def table(self) -> str:
        head = ("graph", "partition", "ran on", "nodes", "compile s", "cache", "why")
        rows = [head] + [(p.graph, p.name, p.ran_on, str(p.nodes),
                          "" if p.seconds is None else f"{p.seconds:.3f}", p.cache or "",
                          p.reason or _regions_note(p.regions)) for p in self.partitions]
        widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
        return "\n".join(("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1]).rstrip()
                         for r in rows)


def _regions_note(regions: list[dict[str, Any]]) -> str:
    """The target's own eager regions inside a partition mlcomp compiled (``fallback="eager"``)."""
    in_torch = [r for r in regions if r.get("runs_on") == EAGER_LABEL]
    if not in_torch:
        return ""
    ops = sorted({op for r in in_torch for op in r.get("ops", ())})
    return f"{len(in_torch)} of {len(regions)} regions in torch ({', '.join(ops[:4])})"
