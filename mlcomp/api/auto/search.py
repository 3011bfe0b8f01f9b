"""``target="auto"``: compile for every target that can run the model here, keep the fastest that verified.

::

    art = mlcomp.compile("mlp", target="auto", candidates=["cpu", "onnxruntime"])
    art.target, [(c["target"], c["median_ms"], c["verified"]) for c in art.manifest["auto"]["candidates"]]
    ('onnxruntime', [('cpu', <ms>, True), ('onnxruntime', <ms>, True)])   # the faster verified one

Each candidate
target is checked against the captured graph (available here, capabilities, ops),
compiled with the pipeline adapted to it, verified against eager, then all verified
artifacts are timed on the example inputs, **each in a fresh process of its own**
(:mod:`mlcomp.runtime.timing_worker`: the artifact saved, reloaded there and warmed up),
and ranked (:mod:`mlcomp.api.auto.rank`: rotated rounds of one sample each, a sign test on
paired ratios, tie-break rounds for the close ones)::

    one shared process: each runtime's threads slow the others', unevenly -> the pick is biased
    a process each:     each candidate runs as when deployed alone        -> the pick is fair

In one process the runtimes' thread pools (torch's OpenMP, ONNX Runtime's, TVM's, OpenVINO's)
compete for the cores, and not alike for all.  When a process cannot be used (an artifact
that cannot be saved, no interpreter to start) every candidate is timed in this process
instead and the manifest says why.  A sample is a block of calls lasting about ``BLOCK_S``
after an untimed block, so a switch between runtimes is not charged to the one switched to.

A candidate that is unavailable, cannot take the graph, fails to compile or fails
verification is recorded with the reason and never picked; when none verifies,
:class:`AutoTargetError` lists them all.  The pick is the artifact compiled for that target
itself (no wrapper: it runs exactly as a direct compile for that target does).

Candidates are compiled one after another: the backends already use every core, so
compiling two at once on a small machine only interleaves them.  Distributed (a
multi-process pipeline, not a single-process artifact) is never a default candidate.
"""
from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from mlcomp.api.auto.rank import (
    ALPHA,
    BLOCK_S,
    DEFAULT_AUTO_TIMING,
    Ranking,
    Sampler,
    block_samplers,
    rank,
    rank_samplers,
    sign_test,
)
from mlcomp.api.lowering import CompileResult, Note, compile_source
from mlcomp.base.errors import MlcompError
from mlcomp.base.table import Table
from mlcomp.hardware.decide import Decision
from mlcomp.hardware.timing import Clock, TimingPolicy, calls_per_block, fmt_seconds, synchronizer
from mlcomp.pipeline import Pipeline
from mlcomp.targets import CompileOptions, Target, TargetName, get_target
from mlcomp.runtime.timing_worker import ProcessSampler, WorkerError, save_inputs

__all__ = ["AUTO", "AutoTargetError", "Candidate", "AutoReport", "Ranking", "auto_candidates", "compile_auto",
           "rank", "sign_test", "DEFAULT_AUTO_TIMING", "IN_PROCESSES"]

AUTO = "auto"
IN_PROCESSES = "a fresh process per candidate"
NOT_TIMED = "not timed (deterministic compile)"
AUTO_QUESTION = "auto: which verified target is fastest?"
# a deterministic compile times nothing: the preference order is the candidate order
AUTO_RULE = "the first candidate, in the order tried, that compiled and verified (nothing timed)"
READY_TIMEOUT_S = 600.0     # a worker loads, checks and warms up its artifact within this


class AutoTargetError(MlcompError):
    """No candidate of ``target="auto"`` compiled and verified."""

    exit_code = 3


@dataclass(frozen=True)
class Candidate:
    """One row of the auto target's table: what happened to one target."""

    target: str
    compile_seconds: float | None = None      # pipeline + lowering
    median_s: float | None = None             # per call on the example inputs
    verified: bool = False
    reason: str | None = None                 # why it was not picked (None for the pick and faster losers)
    picked: bool = False
    ratio: float | None = None                # median of its paired ratios to the pick's samples (the pick: 1)
    p_value: float | None = None              # sign test of those ratios against 1

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target,
                "compile_seconds": None if self.compile_seconds is None else round(self.compile_seconds, 4),
                "median_ms": None if self.median_s is None else round(self.median_s * 1e3, 6),
                "verified": self.verified, "reason": self.reason, "picked": self.picked,
                "ratio_to_picked": None if self.ratio is None else round(self.ratio, 4),
                "sign_p": None if self.p_value is None else round(self.p_value, 4)}

    @property
    def versus(self) -> str:
        if self.ratio is None or self.picked:
            return ""
        return f"{self.ratio:.3f}x" + ("" if self.p_value is None else f" p={self.p_value:.2g}")

    @property
    def state(self) -> str:
        return "yes" if self.verified else f"no: {self.reason}"


@dataclass(frozen=True)
class AutoReport:
    """Every candidate, in the order tried, and the timing policy used to rank them."""

    candidates: tuple[Candidate, ...]
    policy: TimingPolicy
    rounds: int = 0                 # rounds of every candidate
    tie_break_rounds: int = 0       # further rounds of the close ones only
    timed_in: str = IN_PROCESSES    # or "this process (why not a process each)"

    @property
    def picked(self) -> Candidate:
        return next(c for c in self.candidates if c.picked)

    def to_json(self) -> dict[str, Any]:
        return {"picked": self.picked.target, "candidates": [c.to_json() for c in self.candidates],
                "timing": {"protocol": "rotated rounds on the example inputs, one sample of each, median per "
                                       "candidate; close ones get tie-break rounds until a sign test decides "
                                       f"(p < {ALPHA})",
                           "warmup": self.policy.warmup, "budget_s": self.policy.budget_s,
                           "min_repeats": self.policy.min_repeats, "rounds": self.rounds,
                           "tie_break_rounds": self.tie_break_rounds, "timed_in": self.timed_in}}

    def table(self) -> Table:
        rows = tuple((c.target + (" *" if c.picked else ""),
                      "—" if c.compile_seconds is None else f"{c.compile_seconds:.2f} s",
                      fmt_seconds(c.median_s), c.versus, c.state) for c in self.candidates)
        return Table(f"auto: picked {self.picked.target} (fastest that verified; * marks it), timed in "
                     f"{self.timed_in}",
                     ("target", "compile", "median", "vs pick", "verified"), rows, right=frozenset({1, 2}))

    @staticmethod
    def format_json(data: dict[str, Any]) -> str:
        """The table from a manifest's ``auto`` record (a cache hit reports the original choice)."""
        cands = tuple(Candidate(c["target"], c["compile_seconds"],
                                None if c["median_ms"] is None else c["median_ms"] / 1e3,
                                c["verified"], c["reason"], c["picked"], c.get("ratio_to_picked"), c.get("sign_p"))
                      for c in data["candidates"])
        timing = data.get("timing", {})
        policy = TimingPolicy(warmup=timing.get("warmup", 3), budget_s=timing.get("budget_s", 0.3),
                              min_repeats=timing.get("min_repeats", 5))
        return AutoReport(cands, policy, timing.get("rounds", 0), timing.get("tie_break_rounds", 0),
                          timing.get("timed_in", "this process")).table().format()


def auto_candidates(names: Sequence[str | Target] | None = None) -> list[Target]:
    """The targets to try: the given ones (names or instances), else every registered target but distributed."""
    if names is None:
        return [get_target(t) for t in TargetName if t is not TargetName.DISTRIBUTED]
    out: list[Target] = []
    for item in names:
        target = item if isinstance(item, Target) else get_target(item)
        if target.name == AUTO:
            raise MlcompError("auto cannot be one of its own candidates",
                              hint="list real targets, e.g. cpu,onnxruntime")
        if all(t.name != target.name for t in out):
            out.append(target)
    return out


def _first_line(exc: BaseException) -> str:
    text = exc.message if isinstance(exc, MlcompError) else f"{type(exc).__name__}: {exc}"
    line = " ".join(text.split())
    return line if len(line) <= 300 else line[:300] + " …"


def precheck(target: Target, graph: Any, options: CompileOptions, pipeline: Any = None) -> str | None:
    """Why ``target`` cannot take ``graph`` here (unavailable, the pipeline refuses it, capabilities, ops), or None."""
    reason = target.available()
    if reason:
        return f"unavailable: {reason}"
    try:
        if pipeline is not None and pipeline != "":
            Pipeline.coerce(pipeline).check_target(target.name, facts=target.facts(options))
    except MlcompError as exc:
        return f"the pipeline refuses it: {_first_line(exc)}"
    try:
        target.check_capabilities(graph, options, target.unsupported(graph))
    except MlcompError as exc:
        return f"cannot take the graph: {_first_line(exc)}"
    return None


def compile_auto(source: Any, graph: Any, *, candidates: Sequence[str | Target] | None = None,
                 pipeline: Any = None, capture_seconds: float = 0.0, instruments: Sequence[Any] | None = None,
                 policy: TimingPolicy = DEFAULT_AUTO_TIMING, clock: Clock = time.perf_counter,
                 note: Note | None = None, isolate: bool = True, **options: Any) -> CompileResult:
    """Compile ``graph`` for each candidate, verify, time the verified ones, return the fastest.

    ``instruments`` are built per candidate (a callable taking the target name) or shared;
    ``isolate=False`` times every candidate in this process, with ``clock`` (injectable for
    tests; a fresh process each uses its own clock).  The winner's manifest carries ``auto`` (every
    candidate: target, compile seconds, median ms, verified or why not).
    """
    say = note or (lambda text: None)
    opts = CompileOptions.make(**options)
    targets = auto_candidates(candidates)
    rows: dict[str, Candidate] = {}
    built: dict[str, CompileResult] = {}
    for target in targets:
        problem = precheck(target, graph, opts, pipeline)
        if problem:
            rows[target.name] = Candidate(target.name, reason=problem)
            continue
        say(f"auto: compile for {target.name}")
        t0 = time.perf_counter()
        try:
            result = compile_source(source, graph.copy(), target=target, pipeline=pipeline, verify=True,
                                    capture_seconds=capture_seconds, raise_on_failure=False,
                                    instruments=_instruments(instruments, target.name), **options)
        except MlcompError as exc:
            rows[target.name] = Candidate(target.name, time.perf_counter() - t0, reason=_first_line(exc))
            continue
        except Exception as exc:  # noqa: BLE001 - a backend's crash disqualifies that candidate only
            rows[target.name] = Candidate(target.name, time.perf_counter() - t0,
                                          reason=f"compile failed: {_first_line(exc)}")
            continue
        seconds = time.perf_counter() - t0
        if not result.check.passed:
            rows[target.name] = Candidate(target.name, seconds,
                                          reason=f"verification failed: {result.check.summary()}")
            continue
        rows[target.name] = Candidate(target.name, seconds, verified=True)
        built[target.name] = result
    if not built:
        raise AutoTargetError(
            f"no candidate target compiled and verified {graph.name}: "
            + "; ".join(f"{c.target}: {c.reason}" for c in rows.values()),
            hint="fix the first problem listed, name one target with --target, or try --fallback eager")
    if opts.deterministic:
        best = next(iter(built))
        decision = Decision.fixed(AUTO_QUESTION, [t.name for t in targets if t.name in built], best, AUTO_RULE)
        rounds, tie_break, timed_in = 0, 0, NOT_TIMED
    else:
        say(f"auto: time {', '.join(built)} on the example inputs")
        ranking, timed_in = _time(built, source.inputs(), policy, clock, rows, isolate)
        best, decision = ranking.picked, ranking.decision(AUTO_QUESTION)
        rounds, tie_break = ranking.rounds, ranking.tie_break_rounds
    rows[best] = replace(rows[best], picked=True)
    report = AutoReport(tuple(rows[t.name] for t in targets), policy, rounds, tie_break, timed_in)
    result = built[best]
    result.auto = report
    result.artifact.manifest["auto"] = report.to_json()
    result.artifact.manifest["decisions"] = [*result.artifact.decisions, dict(decision.to_json(), made_by="auto")]
    return result


def _instruments(instruments: Any, name: str) -> Sequence[Any] | None:
    return instruments(name) if callable(instruments) else instruments


def _time(built: dict[str, CompileResult], inputs: Sequence[Any], policy: TimingPolicy, clock: Clock,
          rows: dict[str, Candidate], isolate: bool) -> tuple[Ranking, str]:
    """Rank the built artifacts, each in a process of its own if it can be, else all in this one.

    Every artifact first runs once here: a candidate that fails now is disqualified, not timed.
    """
    for name, result in list(built.items()):
        try:
            result.artifact(*inputs)
        except Exception as exc:  # noqa: BLE001 - reported as the candidate's reason
            rows[name] = replace(rows[name], verified=False, reason=f"running it failed: {_first_line(exc)}")
            del built[name]
    if not built:
        raise AutoTargetError("every verified candidate failed when run again for timing: "
                              + "; ".join(f"{c.target}: {c.reason}" for c in rows.values()),
                              hint="name one target with --target and report the failure")
    timed_in = "this process (" + ("one candidate" if len(built) == 1 else "asked for") + ")"
    ranking = None
    if isolate and len(built) > 1:
        try:
            with _process_samplers(built, inputs, policy) as samplers:
                ranking, timed_in = rank_samplers(samplers, policy), IN_PROCESSES
        except WorkerError as exc:
            timed_in = f"this process ({_first_line(exc)})"
    if ranking is None:
        ranking = rank_samplers(_local_samplers(built, inputs, policy, clock), policy, clock=clock)
    for name in built:
        rows[name] = replace(rows[name], median_s=ranking.medians[name], ratio=ranking.ratios.get(name),
                             p_value=ranking.p_values.get(name))
    return ranking, timed_in


@contextlib.contextmanager
def _process_samplers(built: dict[str, CompileResult], inputs: Sequence[Any],
                      policy: TimingPolicy) -> Iterator[dict[str, Sampler]]:
    """A warm worker process per artifact (saved to a temporary folder and reloaded there)."""
    with tempfile.TemporaryDirectory(prefix="mlcomp-auto-") as tmp, contextlib.ExitStack() as workers:
        root = Path(tmp)
        try:
            feed = save_inputs(inputs, root / "inputs.pt")
            folders = {name: _saved(result.artifact, root / name) for name, result in built.items()}
        except Exception as exc:  # noqa: BLE001 - any save failure means: time them here instead
            raise WorkerError(f"saving the candidates for their timing processes failed: {_first_line(exc)}") from None
        started = {name: workers.enter_context(ProcessSampler.start(
                       folder, feed, threads=torch.get_num_threads(), warmup=policy.warmup, block_s=BLOCK_S,
                       label=name)) for name, folder in folders.items()}
        for sampler in started.values():
            sampler.wait_ready(READY_TIMEOUT_S)
        yield {name: sampler.sample for name, sampler in started.items()}


def _saved(artifact: Any, folder: Path) -> Path:
    """Save ``artifact`` for a worker without touching its manifest (saving records the payload there)."""
    manifest = artifact.manifest
    artifact.manifest = dict(manifest)
    try:
        return artifact.save(folder)
    finally:
        artifact.manifest = manifest


def _local_samplers(built: dict[str, CompileResult], inputs: Sequence[Any], policy: TimingPolicy,
                    clock: Clock) -> dict[str, Sampler]:
    """Samplers in this process: a sample is a block of calls lasting about BLOCK_S after an untimed
    block, so the previous runtime's pool spinning down is not charged to the next one."""
    fns: dict[str, Callable[[], Any]] = {}
    calls: dict[str, int] = {}
    for name, result in built.items():
        art = result.artifact
        start = clock()
        art(*inputs)
        calls[name] = calls_per_block(BLOCK_S, clock() - start)
        fns[name] = (lambda a=art, k=calls[name]: [a(*inputs) for _ in range(k)])
    syncs = {name: synchronizer(built[name].artifact.manifest.get("device") or "cpu") for name in fns}
    return block_samplers(fns, policy, clock=clock, syncs=syncs, per_call={n: 1 / k for n, k in calls.items()})
