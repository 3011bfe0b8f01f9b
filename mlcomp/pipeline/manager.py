"""The pass manager: check the whole pipeline up front, then run every pass under its instruments.

Before anything runs, every pass (composite children included) is checked
against the graph's mode and the context; all problems are reported together::

    >>> from mlcomp.ir.builder import GraphBuilder
    >>> from mlcomp.ir.ops import aten
    >>> b = GraphBuilder("convbn", mode=Mode.TRAINING)
    >>> training_graph = b.output(b.call(aten("relu"), b.input("x", (2, 4))))
    >>> run_pipeline(training_graph, "fold-batchnorm,prune")
    Traceback (most recent call last):
    mlcomp.base.errors.PipelineMismatchError: pipeline fold-batchnorm,prune cannot run on graph convbn (a
    training graph); nothing was run: (1) pass 'fold-batchnorm' (pass 1 of 2) runs on inference graphs
    only, and graph convbn is a training graph (fuse skips it on training graphs by itself); (2) pass
    'prune' (pass 2 of 2) runs on inference graphs only, and graph convbn is a training graph. ...

Then the manager walks composites itself (:mod:`mlcomp.pipeline.composite`), so
instruments see the innermost pass: before (a composite was one opaque step)
``--verify`` said "pass 'fuse' changed the numbers"; after it says "pass
'fold-batchnorm' (inside fuse, pass 2 of 3, after cleanup; step 1 of 5 of fuse,
the first) changed the numbers", and the report nests the children's records
under the composite's.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from mlcomp.base.errors import PipelineMismatchError
from mlcomp.hardware.probe import host_precision_speeds
from mlcomp.ir import Graph, Mode
from mlcomp.pipeline.composite import (BEFORE_SHOWN, CompositePass, Observer, Position, children, execute,
                                       pass_text)
from mlcomp.pipeline.instruments import Instrument, Verify, random_inputs, standard_instruments
from mlcomp.pipeline.pass_base import REGISTRY, Pass, PassContext, PassRegistry, PassResult, Requirement
from mlcomp.pipeline.pass_records import PassRecord, PipelineReport
from mlcomp.pipeline.spec import Pipeline
from mlcomp.pipeline.target_facts import TargetFacts

__all__ = ["PassManager", "run_pipeline"]

_HOW = {
    Requirement.EXAMPLE_INPUTS: "pass example_inputs=",
    Requirement.CALIBRATION_DATA: "pass calibration_data=",
    Requirement.HARDWARE_SPEC: "pass hardware= (a HardwareSpec, e.g. from mlcomp.hardware.probe)",
    Requirement.TRAINING_GRAPH: "capture the model in training mode",
}


class PassManager:
    """Runs a :class:`Pipeline` with instruments; ``before_pass`` hooks in order, ``after_pass`` reversed."""

    def __init__(self, pipeline: "Pipeline | str | os.PathLike[str] | None", *,
                 instruments: Sequence[Instrument] = (), registry: PassRegistry | None = None) -> None:
        self.registry = registry or REGISTRY
        self.pipeline = Pipeline.coerce(pipeline, registry=self.registry)
        self.passes: list[Pass] = self.pipeline.build(self.registry)
        self.instruments = tuple(instruments)

    # -- checking ---------------------------------------------------------
    def problems(self, graph: Graph, ctx: PassContext) -> list[str]:
        """Every reason the pipeline cannot run on ``graph`` with ``ctx`` (empty: it can)."""
        out: list[str] = []
        total = len(self.passes)
        for i, p in enumerate(self.passes, 1):
            where = f"pass {i} of {total}"
            if graph.mode not in p.modes:
                out.append(f"pass {p.name!r} ({where}) runs on {_modes(p)} graphs only, and graph {graph.name} "
                           f"is a {graph.mode.value} graph{self._skipped_by(p.name, graph.mode)}")
                continue
            out += _unmet(p, graph, ctx, where)
        return out

    def check(self, graph: Graph, ctx: PassContext) -> None:
        """:class:`PipelineMismatchError` listing every problem, before any pass runs."""
        found = self.problems(graph, ctx)
        if not found:
            return
        listed = "; ".join(f"({i}) {text}" for i, text in enumerate(found, 1))
        raise PipelineMismatchError(
            f"pipeline {self.pipeline} cannot run on graph {graph.name} (a {graph.mode.value} graph); "
            f"nothing was run: {listed}",
            hint="drop those passes from the pipeline or give them what they need "
                 "(see `mlcomp passes` for what each pass runs on)")

    def _skipped_by(self, name: str, mode: Mode) -> str:
        owners = []
        for info in self.registry.infos():
            if isinstance(info.cls, type) and issubclass(info.cls, CompositePass):
                if any(s.pass_.name == name for s in children(info.make({}).body())):
                    owners.append(info.name)
        return f" ({' and '.join(owners)} skips it on {mode.value} graphs by itself)" if owners else ""

    # -- running ----------------------------------------------------------
    def run(self, graph: Graph, ctx: PassContext | None = None) -> tuple[Graph, PipelineReport]:
        """Run the pipeline on a copy of ``graph``; the new graph and a :class:`PipelineReport`."""
        ctx = ctx or PassContext()
        self.check(graph, ctx)
        report = PipelineReport(self.pipeline.spec, self.pipeline.target, nodes_before=len(graph))
        work = graph.copy()
        for inst in self.instruments:
            inst.start_pipeline(self.passes, work, ctx)
        recorder = _Recorder(self.instruments, report.records)
        names = [p.name for p in self.passes]
        start = time.perf_counter()
        for i, p in enumerate(self.passes, 1):
            at = Position(p.name, i, len(self.passes), tuple(names[max(0, i - 1 - BEFORE_SHOWN):i - 1]))
            work = execute(p, work, ctx, at, recorder).graph
        report.seconds = time.perf_counter() - start
        report.nodes_after = len(work)
        for inst in self.instruments:
            inst.end_pipeline(work, report)
        return work, report


def _modes(p: Pass) -> str:
    return " and ".join(sorted(m.value for m in p.modes)) or "no"


def _satisfied(req: Requirement, graph: Graph, ctx: PassContext) -> bool:
    if req is Requirement.EXAMPLE_INPUTS:
        return ctx.example_inputs is not None
    if req is Requirement.CALIBRATION_DATA:
        return ctx.calibration_data is not None
    if req is Requirement.HARDWARE_SPEC:
        return ctx.hardware is not None
    return graph.mode is Mode.TRAINING


def _unmet(p: Pass, graph: Graph, ctx: PassContext, where: str) -> list[str]:
    """Unmet requirements of ``p`` and of the children that will run (a child skipped for its mode needs nothing)."""
    out = []
    for req in sorted(p.requires, key=lambda r: r.value):
        if not _satisfied(req, graph, ctx):
            lacking = "the graph is not one" if req is Requirement.TRAINING_GRAPH else "none was given"
            out.append(f"pass {p.name!r} ({where}) needs {req.value}, and {lacking} ({_HOW[req]})")
    if isinstance(p, CompositePass):
        for step in children(p.body()):
            if graph.mode in step.pass_.modes:
                out += _unmet(step.pass_, graph, ctx, f"inside {p.name}, {where}")
    return out


@dataclass
class _Frame:
    nodes_before: int
    children: list[PassRecord] = field(default_factory=list)


class _Recorder(Observer):
    """Builds the nested records and calls the instruments around every pass."""

    def __init__(self, instruments: Sequence[Instrument], top: list[PassRecord]) -> None:
        self.instruments = instruments
        self.top = top
        self.frames: list[_Frame] = []

    def _siblings(self) -> list[PassRecord]:
        return self.frames[-1].children if self.frames else self.top

    def enter(self, p: Pass, graph: Graph, ctx: PassContext, at: Position) -> None:
        self.frames.append(_Frame(len(graph)))
        for inst in self.instruments:
            inst.before_pass(p, graph, ctx)

    def leave(self, p: Pass, result: PassResult, at: Position) -> None:
        frame = self.frames.pop()
        record = PassRecord(at.index, p.name, pass_text(p), 0.0, bool(result.changed), dict(result.stats),
                            frame.nodes_before, len(result.graph), children=frame.children, at=at,
                            declared_reference=result.reference)
        for inst in reversed(self.instruments):
            inst.after_pass(p, result, record)
        self._siblings().append(record)

    def skip(self, p: Pass, reason: str, graph: Graph, at: Position) -> None:
        self._siblings().append(PassRecord(at.index, p.name, pass_text(p), 0.0, False, {}, len(graph), len(graph),
                                           at=at, skipped=reason))


def run_pipeline(graph: Graph, pipeline: "Pipeline | str | os.PathLike[str] | None", *,
                 example_inputs: Sequence[torch.Tensor] | None = None,
                 instruments: Sequence[Instrument] | None = None, hardware: Any = None,
                 calibration_data: Sequence[Any] | None = None, registry: PassRegistry | None = None,
                 verify: bool = False, target: TargetFacts | None = None,
                 host_precision: Any = None, deterministic: bool = False,
                 optimizer: Any = None) -> tuple[Graph, PipelineReport]:
    """Run ``pipeline`` on a copy of ``graph``: the new graph and its :class:`PipelineReport`.

    ``instruments`` default to ``standard_instruments()`` (IR check and timing);
    ``verify=True`` is shorthand for adding :class:`Verify`.  When verifying without
    ``example_inputs``, deterministic random inputs are used and given to the passes too.
    ``target``: what the target builds in low precision (``PassContext.target``);
    ``host_precision``: the host's measured matrix-product speeds per dtype, measured
    here (once per process) when a pass uses them and none is given.
    ``deterministic``: passes that would decide by measuring take their fixed rules
    (``PassContext.deterministic``); the host's speeds are then not measured.
    ``optimizer``: the training step's optimizer spec (``PassContext.optimizer``: remat counts its update).
    """
    chosen = list(standard_instruments() if instruments is None else instruments)
    if verify and not any(isinstance(i, Verify) for i in chosen):
        chosen.insert(0, Verify())
    inputs = tuple(example_inputs) if example_inputs is not None else None
    if inputs is None and any(isinstance(i, Verify) for i in chosen):
        inputs = random_inputs(graph)
    manager = PassManager(pipeline, instruments=chosen, registry=registry)
    if host_precision is None and not deterministic and any(_uses_host_precision(p) for p in manager.passes):
        host_precision = host_precision_speeds()
    ctx = PassContext(hardware=hardware, example_inputs=inputs, deterministic=deterministic,
                      calibration_data=tuple(calibration_data) if calibration_data is not None else None,
                      target=target, host_precision=host_precision, optimizer=optimizer)
    return manager.run(graph, ctx)


def _uses_host_precision(p: Pass) -> bool:
    if p.uses_host_precision:
        return True
    return isinstance(p, CompositePass) and any(_uses_host_precision(s.pass_) for s in children(p.body()))
