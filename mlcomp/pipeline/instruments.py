"""The pass manager's instruments and its report.

* :class:`Reference` — every value of the input graph on fixed inputs; after each
  pass the new graph is run and compared.  Nodes that survive a pass keep their
  names (a rewrite that computes an existing value reuses that value's name), so
  on a mismatch the first diverging value can be named by matching names;
* :func:`dump_graph` — IR text and Graphviz dot after a pass;
* :func:`snapshot` / :class:`PassDiff` — what a pass changed (``--explain``),
  pointing back at the module paths of the nodes it touched;
* :class:`PipelineReport` — per-pass timing, node counts, stats and diffs, as a
  table (``format()``) or JSON (``to_json()``).

A report prints like::

    pipeline cleanup,fuse,cleanup: 213 -> 63 nodes in 0.41 s
      #  pass      time      nodes       stats
      1  cleanup   31.2 ms   213 -> 193  nodes_removed=20
      2  fuse      302.5 ms  193 -> 83   groups_formed=17, nodes_fused=38, ...
"""
from __future__ import annotations

import collections
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from mlcomp.base.errors import VerificationError
from mlcomp.ir import Graph, TensorMeta

__all__ = ["Reference", "dump_graph", "snapshot", "Snapshot", "PassDiff", "PassRecord", "PipelineReport"]


# ---------------------------------------------------------------------------
# Verification


class Reference:
    """The input graph's values (by node name) on fixed inputs, for checking each pass."""

    def __init__(self, graph: Graph, inputs: tuple[torch.Tensor, ...] | None,
                 tolerance: float | None = None) -> None:
        from mlcomp.ir.interpreter import Interpreter

        self.inputs = inputs if inputs is not None else random_inputs(graph)
        self.tolerance = tolerance
        with torch.no_grad():
            self.values = Interpreter(graph).run_all(*self.inputs)
        self.outputs = self.values["__output__"]

    def check(self, graph: Graph, pass_name: str, position: str) -> float:
        """Max relative output error of ``graph``; :class:`VerificationError` past tolerance."""
        from mlcomp.analysis.verify import compare
        from mlcomp.ir.interpreter import Interpreter

        with torch.no_grad():
            values = Interpreter(graph).run_all(*self.inputs)
        tol = self.tolerance if self.tolerance is not None else graph_tolerance(graph)
        result = compare(self.outputs, values["__output__"], tol, [r.name for r in graph.output_refs])
        if result.passed:
            return result.max_rel
        worst = result.worst
        detail = worst.format() if worst is not None else result.note
        raise VerificationError(
            f"pass {pass_name!r} ({position}) changed the numbers: {detail}. "
            f"{self.first_divergence(graph, values, tol)}",
            where=f"graph {graph.name}",
            hint=f"the passes before it kept every output within tolerance; rerun with "
                 f"--dump-after {pass_name} to inspect the IR it wrote")

    def first_divergence(self, graph: Graph, values: Mapping[str, Any], tol: float | None) -> str:
        """A sentence naming the first node (topological order) whose value differs."""
        from mlcomp.analysis.verify import compare

        for node in graph.call_nodes():
            if node.name not in self.values:
                continue
            r = compare((self.values[node.name],), (values.get(node.name),), tol)
            if r.passed:
                continue
            fresh = [s for s in node.input_names() if s not in self.values]
            via = f"; it reads {', '.join('%' + s for s in fresh)}, created by this pass" if fresh else ""
            w = r.worst
            err = (w.note or f"max abs {w.max_abs:.3g}, max rel {w.max_rel:.3g}") if w else r.note
            return (f"The first value that diverges is %{node.name} ({node.op}) from module "
                    f"{node.origin}: {err}{via}")
        return "No value that kept its name diverges; the difference starts in nodes the pass created"


def graph_tolerance(graph: Graph) -> float | None:
    """The relative tolerance of the lowest float precision any node computes in (None: fp32)."""
    from mlcomp.analysis.verify import tolerance_for

    loosest = None
    for node in graph.call_nodes():
        for m in node.meta if isinstance(node.meta, tuple) else (node.meta,):
            if isinstance(m, TensorMeta) and m.dtype in (torch.float16, torch.bfloat16):
                t = tolerance_for(m.dtype)
                loosest = t if loosest is None else max(loosest, t)
    return loosest


def random_inputs(graph: Graph, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Deterministic random inputs matching the graph's input metas."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for node in graph.input_nodes:
        meta = node.tensor_meta
        shape = meta.concrete_shape(graph.symbols)
        if meta.dtype.is_floating_point:
            out.append(torch.randn(shape, generator=gen).to(meta.dtype))
        elif meta.dtype == torch.bool:
            out.append(torch.randint(0, 2, shape, generator=gen).bool())
        else:
            out.append(torch.randint(0, 10, shape, generator=gen).to(meta.dtype))
    return tuple(out)


# ---------------------------------------------------------------------------
# Dumps


def dump_graph(dump_dir: str | os.PathLike[str], index: int, name: str, graph: Graph) -> list[str]:
    """Write ``NN-name.ir.txt`` and ``NN-name.dot`` into ``dump_dir``; returns their paths."""
    from mlcomp.base.files import write_text_atomic

    base = Path(dump_dir) / f"{index:02d}-{name}"
    text, dot = base.with_suffix(".ir.txt"), base.with_suffix(".dot")
    write_text_atomic(text, graph.format() + "\n")
    write_text_atomic(dot, graph.to_dot() + "\n")
    return [str(text), str(dot)]


# ---------------------------------------------------------------------------
# Explain


@dataclass(frozen=True)
class Snapshot:
    modules: Mapping[str, str]          # node name -> module path of its origin
    kinds: Mapping[str, str]            # node name -> op qualname
    ops: Mapping[str, int]              # op qualname -> count (compute nodes)
    bytes_moved: int


def snapshot(graph: Graph) -> Snapshot:
    from mlcomp.analysis.cost import node_bytes

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
    def between(cls, before: Snapshot, after: Snapshot, stats: Mapping[str, Any]) -> "PassDiff":
        added = tuple(n for n in after.modules if n not in before.modules)
        removed = tuple(n for n in before.modules if n not in after.modules)
        rewritten = tuple(n for n in after.kinds if n in before.kinds and before.kinds[n] != after.kinds[n])
        ops = set(before.ops) | set(after.ops)
        delta = {op: after.ops.get(op, 0) - before.ops.get(op, 0) for op in sorted(ops)}
        touched = [before.modules[n] for n in removed + rewritten] + [after.modules[n] for n in added]
        return cls(added, removed, rewritten, {k: v for k, v in delta.items() if v}, before.bytes_moved,
                   after.bytes_moved, tuple(dict.fromkeys(touched)), int(stats.get("groups_formed", 0)))

    def format(self, *, limit: int = 8) -> list[str]:
        if not self.added and not self.removed and not self.rewritten:
            return ["no nodes added, removed or rewritten"]
        saved = self.bytes_before - self.bytes_after
        lines = [f"-{len(self.removed)} +{len(self.added)} ~{len(self.rewritten)} nodes; "
                 f"bytes moved {_human(self.bytes_before)} -> "
                 f"{_human(self.bytes_after)} ({'saved ' + _human(saved) if saved >= 0 else 'added ' + _human(-saved)})"
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
# Report


@dataclass
class PassRecord:
    index: int
    name: str
    spec: str
    seconds: float
    changed: bool
    stats: dict[str, Any]
    nodes_before: int
    nodes_after: int
    max_error: float | None = None      # max relative output error after this pass (verify)
    diff: PassDiff | None = None        # explain

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "spec": self.spec, "seconds": self.seconds,
                "changed": self.changed, "stats": _jsonable(self.stats), "nodes_before": self.nodes_before,
                "nodes_after": self.nodes_after, "max_error": self.max_error,
                "diff": self.diff.to_json() if self.diff else None}


@dataclass
class PipelineReport:
    """What ``run_pipeline`` did, pass by pass."""

    pipeline: str
    target: str | None = None
    nodes_before: int = 0
    nodes_after: int = 0
    seconds: float = 0.0
    verified: bool = False
    records: list[PassRecord] = field(default_factory=list)
    dumps: list[str] = field(default_factory=list)

    def stats(self, name: str) -> dict[str, Any]:
        """Stats of the first run of pass ``name`` (KeyError if it did not run)."""
        for r in self.records:
            if r.name == name:
                return r.stats
        raise KeyError(name)

    def format(self) -> str:
        head = (f"pipeline {self.pipeline or '(empty)'}: {self.nodes_before} -> {self.nodes_after} nodes "
                f"in {self.seconds:.2f} s" + (" (every pass verified against the input graph)"
                                                if self.verified else ""))
        rows = [("#", "pass", "time", "nodes", "stats")]
        for r in self.records:
            stats = ", ".join(f"{k}={_fmt(v, k)}" for k, v in r.stats.items()) or ("changed" if r.changed else "-")
            if r.max_error is not None:
                stats += f"; max rel err {r.max_error:.1e}"
            rows.append((str(r.index), r.spec, f"{r.seconds * 1e3:.1f} ms",
                         f"{r.nodes_before} -> {r.nodes_after}", stats))
        widths = [max(len(row[i]) for row in rows) for i in range(4)]
        lines = [head]
        for i, row in enumerate(rows):
            lines.append("  " + "  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4])
            rec = self.records[i - 1] if i else None
            if rec is not None and rec.diff is not None:
                lines.extend("       " + text for text in rec.diff.format())
        if self.dumps:
            lines.append(f"  dumped {len(self.dumps)} file(s) into {Path(self.dumps[0]).parent}")
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"pipeline": self.pipeline, "target": self.target, "nodes_before": self.nodes_before,
                "nodes_after": self.nodes_after, "seconds": self.seconds, "verified": self.verified,
                "passes": [r.to_json() for r in self.records], "dumps": list(self.dumps)}


def _fmt(v: Any, key: str = "") -> str:
    if isinstance(v, (int, float)) and not isinstance(v, bool) and "bytes" in key:
        return _human(v)
    if isinstance(v, float):
        return f"{v:.3g}"
    if isinstance(v, Mapping):
        return "{" + ", ".join(f"{k}: {_fmt(x, k)}" for k, x in v.items()) + "}"
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


def _human(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1024 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GB"  # pragma: no cover
