"""What the pass manager did, pass by pass: :class:`PassRecord` and :class:`PipelineReport`.

A composite pass's record holds its children's records (``children``), so the
report nests like the pipeline; ``format()`` prints the top level, and every
level with ``nested=True``::

    pipeline cleanup,fuse,cleanup: 8 -> 4 nodes in 0.05 s
      #      pass                 time    nodes   stats
      1      cleanup              2.1 ms  8 -> 6  reshapes_removed=1, constants_created=1, rounds=2
      1.1    r1 simplify          0.3 ms  8 -> 7  reshapes_removed=1
      ...
      2.1    fold-batchnorm       -       6 -> 6  skipped (training graph)
"""
from __future__ import annotations

import collections
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlcomp.analysis.cost import node_bytes
from mlcomp.base.units import fmt_bytes
from mlcomp.ir import Graph
from mlcomp.pipeline.composite import Position

__all__ = ["PassDiff", "PassRecord", "PipelineReport", "Snapshot", "snapshot", "EXPLAIN"]

EXPLAIN = "explain"     # a stats key whose lines (a list of str) `--explain` prints under the pass's row


# ---------------------------------------------------------------------------
# What one pass changed (--explain)


@dataclass(frozen=True)
class Snapshot:
    modules: Mapping[str, str]          # node name -> module path of its origin
    kinds: Mapping[str, str]            # node name -> op qualname
    ops: Mapping[str, int]              # op qualname -> count (compute nodes)
    bytes_moved: int


def snapshot(graph: Graph) -> Snapshot:
    nodes = graph.call_nodes()
    moved = 0
    for n in nodes:
        r, w = node_bytes(graph, n)
        moved += r + w
    return Snapshot({n.name: n.origin.module_path or "<root>" for n in nodes}, {n.name: str(n.op) for n in nodes},
                    dict(collections.Counter(str(n.op) for n in nodes)), moved)


@dataclass(frozen=True)
class PassDiff:
    """What one pass changed."""

    added: tuple[str, ...]
    removed: tuple[str, ...]
    rewritten: tuple[str, ...]          # kept their name (and value) but are computed by another op
    op_delta: Mapping[str, int]
    bytes_before: int
    bytes_after: int
    modules: tuple[str, ...]            # module paths of the nodes added or removed
    groups: int = 0

    @classmethod
    def between(cls, before: Snapshot, after: Snapshot, stats: Mapping[str, Any]) -> PassDiff:
        added = tuple(n for n in after.modules if n not in before.modules)
        removed = tuple(n for n in before.modules if n not in after.modules)
        rewritten = tuple(n for n in after.kinds if n in before.kinds and before.kinds[n] != after.kinds[n])
        ops = set(before.ops) | set(after.ops)
        delta = {op: after.ops.get(op, 0) - before.ops.get(op, 0) for op in sorted(ops)}
        touched = [before.modules[n] for n in removed + rewritten] + [after.modules[n] for n in added]
        groups = stats.get("groups_formed", 0)
        return cls(added, removed, rewritten, {k: v for k, v in delta.items() if v}, before.bytes_moved,
                   after.bytes_moved, tuple(dict.fromkeys(touched)), groups if isinstance(groups, int) else 0)

    def format(self, *, limit: int = 8) -> list[str]:
        if not self.added and not self.removed and not self.rewritten:
            return ["no nodes added, removed or rewritten"]
        saved = self.bytes_before - self.bytes_after
        lines = [f"-{len(self.removed)} +{len(self.added)} ~{len(self.rewritten)} nodes; "
                 f"bytes moved {fmt_bytes(self.bytes_before)} -> {fmt_bytes(self.bytes_after)} "
                 f"({'saved ' + fmt_bytes(saved) if saved >= 0 else 'added ' + fmt_bytes(-saved)})"
                 + (f"; {self.groups} fusion group(s)" if self.groups else "")]
        ops = sorted(self.op_delta.items(), key=lambda kv: (-abs(kv[1]), kv[0]))
        shown = ", ".join(f"{op} {d:+d}" for op, d in ops[:limit])
        more = f" (+{len(ops) - limit} more)" if len(ops) > limit else ""
        lines.append(f"ops: {shown}{more}")
        mods = ", ".join(self.modules[:limit])
        more = f" (+{len(self.modules) - limit} more)" if len(self.modules) > limit else ""
        lines.append(f"modules: {mods}{more}")
        return lines

    def to_json(self) -> dict[str, Any]:
        return {"added": list(self.added), "removed": list(self.removed), "rewritten": list(self.rewritten),
                "op_delta": dict(self.op_delta),
                "bytes_before": self.bytes_before, "bytes_after": self.bytes_after,
                "modules": list(self.modules), "groups": self.groups}


# ---------------------------------------------------------------------------
# Records


@dataclass
class PassRecord:
    """One run of one pass; a composite's record holds its children's."""

    index: int
    name: str
    spec: str
    seconds: float
    changed: bool
    stats: dict[str, Any]
    nodes_before: int
    nodes_after: int
    max_error: float | None = None      # max relative output error after this pass (Verify)
    diff: PassDiff | None = None        # Explain
    children: list[PassRecord] = field(default_factory=list)
    at: Position | None = None          # where it ran (None: built by hand)
    skipped: str | None = None          # why a composite's child did not run
    peak_bytes_before: int | None = None    # Memory
    peak_bytes_after: int | None = None
    declared_reference: Graph | None = field(default=None, repr=False, compare=False)  # set by function-changing passes

    @property
    def path(self) -> str:
        """Unique stem, as in dump file names: ``02-fuse.fold-batchnorm``."""
        return self.at.slug if self.at else ""

    @property
    def position(self) -> str:
        """``pass 2 of 3, after cleanup`` or ``inside fuse, pass 2 of 3, ...; step 1 of 5 of fuse, the first``."""
        return self.at.describe() if self.at else ""

    @property
    def depth(self) -> int:
        return self.at.depth if self.at else 0

    @property
    def chain(self) -> tuple[str, ...]:
        """Pass names from the top level down: ``("fuse", "fold-batchnorm")``."""
        return self.at.names if self.at else (self.name,)

    @property
    def round(self) -> int | None:
        """Fixed-point round inside its composite."""
        return self.at.round if self.at else None

    def walk(self) -> Iterator[PassRecord]:
        """This record and every record nested in it, in run order."""
        yield self
        for c in self.children:
            yield from c.walk()

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "spec": self.spec, "seconds": self.seconds,
                "changed": self.changed, "stats": _jsonable(self.stats), "nodes_before": self.nodes_before,
                "nodes_after": self.nodes_after, "max_error": self.max_error,
                "diff": self.diff.to_json() if self.diff else None, "path": self.path,
                "position": self.position, "round": self.round, "skipped": self.skipped,
                "peak_bytes_before": self.peak_bytes_before, "peak_bytes_after": self.peak_bytes_after,
                "children": [c.to_json() for c in self.children]}


@dataclass
class PipelineReport:
    """What the pass manager did, pass by pass (``records`` are the top-level passes)."""

    pipeline: str
    target: str | None = None
    nodes_before: int = 0
    nodes_after: int = 0
    seconds: float = 0.0
    verified: bool = False
    records: list[PassRecord] = field(default_factory=list)
    dumps: list[str] = field(default_factory=list)
    dropped: list[str] = field(default_factory=list)   # preset passes this target does not want, and why

    def walk(self) -> Iterator[PassRecord]:
        """Every record, nested ones included, in run order."""
        for r in self.records:
            yield from r.walk()

    @property
    def changes_function(self) -> bool:
        """True when a pass changed the model's function on purpose (pruning): the compiled
        model is then checked against the pipeline's output graph, not the eager model."""
        return bool(self.function_changes())

    def function_changes(self) -> list[PassRecord]:
        """The records of passes that changed the function, in run order."""
        return [r for r in self.walk() if r.declared_reference is not None]

    def stats(self, name: str) -> dict[str, Any]:
        """Stats of the first top-level run of pass ``name``, else of its first nested run (KeyError if none)."""
        for r in [*self.records, *self.walk()]:
            if r.name == name and r.skipped is None:
                return r.stats
        raise KeyError(name)

    def format(self, *, nested: bool = False) -> str:
        head = (f"pipeline {self.pipeline or '(empty)'}: {self.nodes_before} -> {self.nodes_after} nodes "
                f"in {self.seconds:.2f} s" + (" (every pass verified against the input graph)"
                                                if self.verified else ""))
        rows: list[tuple[str, str, str, str, str]] = [("#", "pass", "time", "nodes", "stats")]
        shown: list[PassRecord | None] = [None]

        def add(rec: PassRecord, number: str) -> None:
            rows.append((number, "  " * rec.depth + (f"r{rec.round} " if rec.round else "") + rec.spec,
                         "-" if rec.skipped else f"{rec.seconds * 1e3:.1f} ms",
                         f"{rec.nodes_before} -> {rec.nodes_after}", _stats_text(rec)))
            shown.append(rec)
            if nested:
                for i, c in enumerate(rec.children, 1):
                    add(c, f"{number}.{i}")

        for r in self.records:
            add(r, str(r.index))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [head]
        for row, rec in zip(rows, shown):
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4])
            if rec is not None and rec.diff is not None:
                lines.extend("       " + "  " * rec.depth + text for text in rec.diff.format())
            if rec is not None and nested:          # a pass's own explanation (quantize: per-layer accuracy)
                lines.extend("       " + "  " * rec.depth + text for text in rec.stats.get(EXPLAIN, ()))
        lines.extend(f"  dropped for target {self.target or '?'}: {d}" for d in self.dropped)
        if self.dumps:
            lines.append(f"  dumped {len(self.dumps)} file(s) into {Path(self.dumps[0]).parent}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"pipeline": self.pipeline, "target": self.target, "nodes_before": self.nodes_before,
                "nodes_after": self.nodes_after, "seconds": self.seconds, "verified": self.verified,
                "passes": [r.to_json() for r in self.records], "dumps": list(self.dumps),
                "dropped": list(self.dropped)}


def _stats_text(r: PassRecord) -> str:
    if r.skipped:
        return f"skipped ({r.skipped})"
    text = ", ".join(f"{k}={_fmt(v, k)}" for k, v in r.stats.items() if k != EXPLAIN) or ("changed" if r.changed else "-")
    if r.max_error is not None:
        text += f"; max rel err {r.max_error:.1e}"
    if r.peak_bytes_before is not None and r.peak_bytes_after is not None:
        text += f"; peak {fmt_bytes(r.peak_bytes_before)} -> {fmt_bytes(r.peak_bytes_after)}"
    return text


def _fmt(v: Any, key: str = "") -> str:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and "bytes" in key:
        return fmt_bytes(v)
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{k}: {_fmt(x, k)}" for k, x in v.items()) + "}"
    if isinstance(v, (list, tuple)) and len(v) > 3 and all(isinstance(x, Mapping) for x in v):
        return f"[{len(v)} records, in the artifact's manifest.json]"     # per-layer tables (quantize)
    return str(v)


def _jsonable(v: Any) -> Any:
    if isinstance(v, Mapping):
        return {str(k): _jsonable(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    if isinstance(v, (str, int, float, bool)) or v is None:
        return v
    return str(v)


