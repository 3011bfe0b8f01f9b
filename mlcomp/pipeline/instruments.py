"""The pass manager's instruments: objects with hooks around every pass, nested ones included.

An instrument sees each pass before and after it runs; the manager calls
``before_pass`` hooks in list order and ``after_pass`` hooks in reverse order
(so the first instrument wraps the others)::

    before                                         after
    run_pipeline(g, "-O2", verify=True,            run_pipeline(g, "-O2", instruments=[
                 dump_after="fuse",                    Verify(), IRCheck(), Dump("fuse", "dump"), Timing()])
                 dump_dir="dump")

* :class:`Timing` — seconds per pass (a composite: the sum of its children);
* :class:`IRCheck` — ``Graph.verify()`` after every pass that changed the graph;
* :class:`Verify` — every value of the input graph on fixed inputs (:class:`Reference`);
  after each pass that changed the graph the new one is run and compared, and the
  innermost pass that broke the numbers is named with the first diverging node;
* :class:`Dump` — IR text and Graphviz dot after the passes it names (any depth);
* :class:`Explain` — what each pass changed (:class:`~mlcomp.pipeline.pass_records.PassDiff`);
* :class:`Memory` — estimated peak memory before and after each pass (``mlcomp.analysis.liveness``).
"""
from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Iterable, Mapping, Sequence

import torch

from mlcomp.analysis.liveness import peak_bytes
from mlcomp.analysis.ranges import declared_tolerance, error_growth
from mlcomp.analysis.verify import compare
from mlcomp.base.errors import IRError, PassFailure, PipelineSpecError, VerificationError
from mlcomp.base.files import Kind, check_destination, mark_folder, write_text_atomic
from mlcomp.frontend.loading import graph_random_inputs
from mlcomp.ir import Graph
from mlcomp.ir.graph_tools import to_dot
from mlcomp.ir.interpreter import Interpreter
from mlcomp.pipeline.composite import CompositePass, Observer, Position, execute, walk
from mlcomp.pipeline.pass_base import Pass, PassContext, PassResult
from mlcomp.pipeline.pass_records import PassDiff, PassRecord, PipelineReport, snapshot
from mlcomp.pipeline.seeding import seeded

__all__ = ["Instrument", "Timing", "IRCheck", "Verify", "Dump", "Explain", "Memory", "standard_instruments",
           "Reference", "dump_graph", "random_inputs", "graph_tolerance"]


# ---------------------------------------------------------------------------
# The hooks


class Instrument:
    """Hooks the pass manager calls around the pipeline and around every pass (nested ones too).

    ``record`` is the pass's :class:`PassRecord` (position, stats, a composite's
    children already filled in); an instrument may add to it and may raise an
    :class:`MlcompError` to stop the pipeline.
    """

    def start_pipeline(self, passes: Sequence[Pass], graph: Graph, ctx: PassContext) -> None:
        """Before the first pass; ``passes`` are the top-level passes (walk them for nested ones)."""

    def before_pass(self, p: Pass, graph: Graph, ctx: PassContext) -> None:
        """Before ``p`` runs on ``graph``."""

    def after_pass(self, p: Pass, result: PassResult, record: PassRecord) -> None:
        """After ``p`` ran (a composite: after all of its children)."""

    def end_pipeline(self, graph: Graph, report: PipelineReport) -> None:
        """After the last pass; ``report`` is complete but for what instruments add here."""


class Timing(Instrument):
    """Seconds each pass took; a composite's time is the sum of its children's (instruments excluded)."""

    def __init__(self) -> None:
        self._started: list[float] = []

    def before_pass(self, p: Pass, graph: Graph, ctx: PassContext) -> None:
        self._started.append(time.perf_counter())

    def after_pass(self, p: Pass, result: PassResult, record: PassRecord) -> None:
        started = self._started.pop()
        ran = [c for c in record.children if c.skipped is None]
        record.seconds = sum(c.seconds for c in ran) if ran else time.perf_counter() - started


class IRCheck(Instrument):
    """``Graph.verify()`` after each pass that changed the graph: a broken graph becomes a
    :class:`PassFailure` naming the innermost pass.  A composite is checked too if one of its
    children reported no change since the last check (a pass that says "unchanged" but did
    change something is still caught, and blamed on the innermost composite around it)."""

    def __init__(self) -> None:
        self._pending = False

    def start_pipeline(self, passes: Sequence[Pass], graph: Graph, ctx: PassContext) -> None:
        self._pending = False

    def after_pass(self, p: Pass, result: PassResult, record: PassRecord) -> None:
        if record.children:
            due = self._pending
        else:
            due = bool(result.changed) or record.depth == 0
            self._pending = not due
        if not due:
            return
        self._pending = False
        try:
            result.graph.verify()
        except IRError as exc:
            raise PassFailure(
                f"pass {p.name!r} ({record.position}) produced an invalid graph: {exc.what}",
                where=exc.where, hint=f"this is a bug in the pass; rerun with --dump-after {p.name} to see "
                                      f"the IR it wrote") from exc


class Verify(Instrument):
    """Compare the graph after each top-level pass with the input graph on fixed inputs
    (``ctx.example_inputs``, else random ones).

    When a composite changed the numbers, its children are replayed on a copy of
    the graph it started from, checking after each child that reports a change, so
    the error names the innermost pass (passes are deterministic); a successful
    pipeline pays one check per top-level pass.
    """

    def __init__(self, tolerance: float | None = None) -> None:
        self.tolerance = tolerance
        self.reference: Reference | None = None
        self._depth = 0
        self._start: tuple[Graph, PassContext] | None = None

    def start_pipeline(self, passes: Sequence[Pass], graph: Graph, ctx: PassContext) -> None:
        self.reference = Reference(graph, ctx.example_inputs, self.tolerance)
        self._depth, self._start = 0, None

    def before_pass(self, p: Pass, graph: Graph, ctx: PassContext) -> None:
        if self._depth == 0 and isinstance(p, CompositePass):
            self._start = (graph.copy(), ctx)
        self._depth += 1

    def after_pass(self, p: Pass, result: PassResult, record: PassRecord) -> None:
        self._depth -= 1
        if self._depth > 0:
            return                                  # checked with the top-level pass around it
        assert self.reference is not None and record.at is not None, "Verify.start_pipeline was not called"
        start, self._start = self._start, None
        if result.reference is not None:          # the pass changed the function on purpose
            declared = Reference(result.reference, self.reference.inputs, self.tolerance)
            record.max_error = declared.check(result.graph, p.name, record.position)
            self.reference = Reference(result.graph, self.reference.inputs, self.tolerance)
            return
        try:
            record.max_error = self.reference.check(result.graph, p.name, record.position)
        except VerificationError as outer:
            if start is not None and isinstance(p, CompositePass):
                try:
                    execute(p, start[0], start[1], record.at, _CheckEachPass(self.reference))
                except VerificationError as inner:
                    raise inner from None
                except Exception:  # noqa: BLE001 - the replay only refines the blame; keep the composite's
                    pass
            raise outer

    def end_pipeline(self, graph: Graph, report: PipelineReport) -> None:
        report.verified = True


class _CheckEachPass(Observer):
    """Replaying a composite: compare after every pass inside it that reports a change."""

    def __init__(self, reference: Reference) -> None:
        self.reference = reference

    def leave(self, p: Pass, result: PassResult, at: Position) -> None:
        if result.changed and not isinstance(p, CompositePass):
            self.reference.check(result.graph, p.name, at.describe())


class Dump(Instrument):
    """Write ``NN-pass[.child].ir.txt`` and ``.dot`` after the named passes (any depth) and of the input.

    ``after``: pass names (comma-separated text or a list); ``all`` is every top-level
    pass; ``fuse.fold-batchnorm`` names a child of a particular composite.
    """

    def __init__(self, after: str | Iterable[str], dump_dir: str | os.PathLike[str] | None) -> None:
        names = [s.strip() for s in (after.split(",") if isinstance(after, str) else after)]
        self.names = {n for n in names if n}
        if dump_dir is None:
            raise PipelineSpecError("dump_after needs a dump_dir to write the IR into",
                                    hint="pass --dump-dir DIR (or dump_dir=)")
        self.dump_dir = dump_dir
        self.files: list[str] = []

    def start_pipeline(self, passes: Sequence[Pass], graph: Graph, ctx: PassContext) -> None:
        known: dict[str, None] = {}
        for top in passes:
            for p, parents in walk(top):
                known[p.name] = None
                known[".".join((*parents, p.name))] = None
        unknown = sorted(n for n in self.names - set(known) - {"all"})
        if unknown:
            spec = ",".join(p.name for p in passes) or "(empty)"
            raise PipelineSpecError(f"--dump-after names {', '.join(unknown)}, which the pipeline "
                                    f"{spec} does not run",
                                    hint="use 'all' or one of: " + ", ".join(known))
        check_destination(self.dump_dir, Kind.DIR, force=True, option="dump_dir")   # never a user's folder
        Path(self.dump_dir).mkdir(parents=True, exist_ok=True)
        mark_folder(self.dump_dir, "IR dumps")
        self.files = dump_graph(self.dump_dir, 0, "input", graph)

    def after_pass(self, p: Pass, result: PassResult, record: PassRecord) -> None:
        if self._selected(record):
            self.files += _dump(self.dump_dir, record.path, result.graph)

    def _selected(self, record: PassRecord) -> bool:
        if "all" in self.names and record.depth == 0:
            return True
        return any(record.chain[-len(sel):] == sel for sel in (tuple(n.split(".")) for n in self.names))

    def end_pipeline(self, graph: Graph, report: PipelineReport) -> None:
        report.dumps.extend(self.files)


class Explain(Instrument):
    """Record what each pass changed (nodes added/removed/rewritten, ops, bytes moved, module paths)."""

    def __init__(self) -> None:
        self._before: list[Any] = []

    def before_pass(self, p: Pass, graph: Graph, ctx: PassContext) -> None:
        self._before.append(snapshot(graph))

    def after_pass(self, p: Pass, result: PassResult, record: PassRecord) -> None:
        record.diff = PassDiff.between(self._before.pop(), snapshot(result.graph), result.stats)


class Memory(Instrument):
    """Estimated peak memory of intermediate values (``mlcomp.analysis.liveness.peak_bytes``) around each pass."""

    def __init__(self) -> None:
        self._before: list[int] = []

    def before_pass(self, p: Pass, graph: Graph, ctx: PassContext) -> None:
        self._before.append(peak_bytes(graph))

    def after_pass(self, p: Pass, result: PassResult, record: PassRecord) -> None:
        record.peak_bytes_before = self._before.pop()
        record.peak_bytes_after = peak_bytes(result.graph)


def standard_instruments(*, verify: bool = False, tolerance: float | None = None, check_ir: bool = True,
                         dump_after: str | Iterable[str] | None = None,
                         dump_dir: str | os.PathLike[str] | None = None, explain: bool = False,
                         memory: bool = False, timing: bool = True) -> list[Instrument]:
    """The usual instruments in the order that makes sense: after a pass, time it, dump its IR,
    check the IR, then memory, explain and the numbers (the ``after_pass`` hooks run last to first)."""
    out: list[Instrument] = []
    if verify:
        out.append(Verify(tolerance))
    if explain:
        out.append(Explain())
    if memory:
        out.append(Memory())
    if check_ir:
        out.append(IRCheck())
    if dump_after is not None:
        out.append(Dump(dump_after, dump_dir))
    if timing:
        out.append(Timing())
    return out


# ---------------------------------------------------------------------------
# Verification


class Reference:
    """The input graph's values (by node name) on fixed inputs, for checking each pass."""

    def __init__(self, graph: Graph, inputs: tuple[torch.Tensor, ...] | None,
                 tolerance: float | None = None) -> None:
        self.inputs = inputs if inputs is not None else random_inputs(graph)
        self.tolerance = tolerance
        with torch.no_grad(), seeded():
            self.values = Interpreter(graph).run_all(*self.inputs)
        self.outputs = self.values["__output__"]

    def check(self, graph: Graph, pass_name: str, position: str) -> float:
        """Max relative output error of ``graph``; :class:`VerificationError` past tolerance."""
        with torch.no_grad(), seeded():
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
        """A sentence naming the first node (topological order) whose value differs; in a graph
        computing in bf16/fp16, where every node differs a little, the node where the error grows most."""
        if declared_tolerance(graph) is not None:
            growth = error_growth(graph, self.values, values)
            if growth is not None:
                return growth.sentence(graph)
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
            phase = f" in the {node.ann.phase.value} phase" if node.ann.phase is not None else ""
            return (f"The first value that diverges is %{node.name} ({node.op}){phase} from module "
                    f"{node.origin}: {err}{via}")
        return "No value that kept its name diverges; the difference starts in nodes the pass created"


def graph_tolerance(graph: Graph) -> float | None:
    """The tolerance the graph's bf16/fp16 nodes declare (None: fp32), see ``analysis.ranges``."""
    declared = declared_tolerance(graph)
    return declared.rtol if declared is not None else None


def random_inputs(graph: Graph, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Deterministic random inputs matching the graph's input metas."""
    return graph_random_inputs(graph, seed)


# ---------------------------------------------------------------------------
# Dumps


def dump_graph(dump_dir: str | os.PathLike[str], index: int, name: str, graph: Graph) -> list[str]:
    """Write ``NN-name.ir.txt`` and ``NN-name.dot`` into ``dump_dir``; returns their paths."""
    return _dump(dump_dir, f"{index:02d}-{name}", graph)


def _dump(dump_dir: str | os.PathLike[str], stem: str, graph: Graph) -> list[str]:
    text, dot = Path(dump_dir) / f"{stem}.ir.txt", Path(dump_dir) / f"{stem}.dot"
    write_text_atomic(text, graph.format() + "\n", fmt="ir")
    write_text_atomic(dot, to_dot(graph) + "\n", fmt="dot")
    return [str(text), str(dot)]


