"""``target="auto"``: compile for every target that can run the model here, keep the fastest that verified.

::

    art = mlcomp.compile("mlp", target="auto", candidates=["cpu", "onnxruntime"])
    art.target, [(c["target"], c["median_ms"], c["verified"]) for c in art.manifest["auto"]["candidates"]]
    ('onnxruntime', [('cpu', <ms>, True), ('onnxruntime', <ms>, True)])   # the faster verified one

Each candidate
target is checked against the captured graph (available here, capabilities, ops),
compiled with the pipeline adapted to it, verified against eager, then all verified
artifacts are timed on the example inputs, **in timing processes of their own**
(:mod:`mlcomp.runtime.timing_host`: each artifact saved, reloaded there and warmed up), and ranked (:mod:`mlcomp.api.auto.rank`: rotated rounds of one sample each, a sign test on
paired ratios, tie-break rounds for the close ones)::

    the compiling process: every runtime's threads were started there -> the pick is biased
    timing processes:      each candidate loaded as when deployed       -> the pick is fair

In one process the runtimes' thread pools (torch's OpenMP, ONNX Runtime's, TVM's, OpenVINO's)
compete for the cores, and not alike for all.  When a process cannot be used (an artifact
that cannot be saved, no interpreter to start) every candidate is timed in this process
instead and the manifest says why.  A sample is a block of calls lasting about ``BLOCK_S``
after an untimed block, so a switch between runtimes is not charged to the one switched to.

A candidate that is unavailable, cannot take the graph, fails to compile or fails
verification is recorded with the reason and never picked; when none verifies,
:class:`AutoTargetError` lists them all.  The pick is the artifact compiled for that target
itself (no wrapper: it runs exactly as a direct compile for that target does).

Candidates are compiled one after another (the backends already use every core; the timing
processes' start-up takes the cores left).  ``procs`` timing processes start once, before the
capture or the first compile (:mod:`~mlcomp.api.auto.workers`), and every verified candidate is loaded
into each of them while the next compiles; a round of the ranking samples every candidate in one
of them, the next round in the next, so each candidate is timed in every process.  A clear loser
(:func:`mlcomp.hardware.decide.clear_losers`: after ``MIN_ROUNDS`` rounds its paired ratios to the
leader are decided above ``ELIMINATE_ABOVE`` by the sign test) stops being timed; the manifest says
after how many rounds and at what ratio.  ``phase_seconds`` and ``phase_cpu_seconds`` in the manifest:
the compiles, the wait for the timing processes, the ranking (:mod:`~mlcomp.api.auto.phases`), and
``timing_process_cpu_seconds``: each timing process's imports, loads and samples.  The measured medians are recorded per host kind, model and shape class
(:mod:`~mlcomp.api.auto.record`, in the compile cache's folder): the next auto compile with that
record builds the best-recorded candidate first and, when it verifies, picks it untimed.
Distributed (a multi-process pipeline, not a single-process artifact) is never a default candidate.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from mlcomp.api.auto.phases import Phases
from mlcomp.api.auto.rank import ALPHA, BLOCK_S, DEFAULT_AUTO_TIMING, Ranking, rank, sign_test
from mlcomp.api.auto.record import AutoRecord, RecordStore, record_key
from mlcomp.api.auto.timed import IN_PROCESSES, first_line, time_candidates
from mlcomp.api.auto.workers import WorkerPool
from mlcomp.api.lowering import CompileResult, EagerOnce, Note, compile_source
from mlcomp.base.errors import MlcompError
from mlcomp.base.table import Table
from mlcomp.frontend.source import collector_paused
from mlcomp.hardware.decide import Decision
from mlcomp.hardware.timing import Clock, TimingPolicy, fmt_seconds
from mlcomp.pipeline import Pipeline
from mlcomp.targets import CompileOptions, Target, TargetName, get_target

__all__ = ["AUTO", "AutoTargetError", "Candidate", "AutoReport", "Ranking", "auto_candidates", "compile_auto",
           "rank", "sign_test", "timing_pool", "DEFAULT_AUTO_TIMING", "IN_PROCESSES"]

AUTO = "auto"
AUTO_PROCS = 2        # timing processes: one runtime can differ between two by tens of per cent
NOT_TIMED = "not timed (deterministic compile)"
AUTO_QUESTION = "auto: which verified target is fastest?"
# a deterministic compile times nothing: the preference order is the candidate order
AUTO_RULE = "the first candidate, in the order tried, that compiled and verified (nothing timed)"
FROM_RECORD = "not timed: ranked from the record of an earlier auto compile on this host"
# what a candidate's load imports in a timing process, imported by each process at its first load (some start
# threads, so not before the fork; the first load comes after the capture): while the others compile, not after.
# A tvm artifact loads through tvm_ffi and TVM's runtime library (decision 49): not ``tvm``, the compiler's package
# (1-1.6 CPU-s per process, and the load is the same without it)
LOAD_IMPORTS: dict[str, tuple[str, ...]] = {"tvm": ("tvm_ffi",), "onnxruntime": ("onnxruntime",),
                                            "openvino": ("openvino",)}


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
    process_medians: tuple[float, ...] = ()   # each timing process's median per call, when timed in several

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target,
                "compile_seconds": None if self.compile_seconds is None else round(self.compile_seconds, 4),
                "median_ms": None if self.median_s is None else round(self.median_s * 1e3, 6),
                "verified": self.verified, "reason": self.reason, "picked": self.picked,
                "ratio_to_picked": None if self.ratio is None else round(self.ratio, 4),
                "sign_p": None if self.p_value is None else round(self.p_value, 4),
                "process_medians_ms": [round(m * 1e3, 6) for m in self.process_medians] or None}

    @property
    def versus(self) -> str:
        if self.ratio is None or self.picked:
            return ""
        return f"{self.ratio:.3f}x" + ("" if self.p_value is None else f" p={self.p_value:.2g}")

    @property
    def state(self) -> str:
        if self.verified:
            return "yes" if self.reason is None else f"yes; {self.reason}"
        return f"no: {self.reason}"


@dataclass(frozen=True)
class AutoReport:
    """Every candidate, in the order tried, and the timing policy used to rank them."""

    candidates: tuple[Candidate, ...]
    policy: TimingPolicy
    rounds: int = 0                 # rounds of every candidate
    tie_break_rounds: int = 0       # further rounds of the close ones only
    timed_in: str = IN_PROCESSES    # or "this process (why not a process each)", or FROM_RECORD
    eliminated: dict[str, Any] = field(default_factory=dict)    # clear loser -> its Elimination (JSON: a dict)
    phases: Phases = field(default_factory=Phases)              # seconds (wall, CPU) per phase, per process
    processes: int = 0                                          # timing processes started
    noise_ties: dict[str, Any] = field(default_factory=dict)    # equal to the pick within the processes' noise

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
                           "tie_break_rounds": self.tie_break_rounds, "timed_in": self.timed_in,
                           "eliminated": {n: e.to_json() if hasattr(e, "to_json") else e
                                          for n, e in self.eliminated.items()},
                           "noise_ties": {n: t.to_json() for n, t in self.noise_ties.items()},
                           "processes": self.processes, **self.phases.to_json()}}

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
                          timing.get("timed_in", "this process"), timing.get("eliminated", {})).table().format()


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
        if all(t.spec != target.spec for t in out):
            out.append(target)
    return out


def precheck(target: Target, graph: Any, options: CompileOptions, pipeline: Any = None) -> str | None:
    """Why ``target`` cannot take ``graph`` here (unavailable, the pipeline refuses it, capabilities, ops), or None."""
    reason = target.available()
    if reason:
        return f"unavailable: {reason}"
    try:
        if pipeline is not None and pipeline != "":
            Pipeline.coerce(pipeline).check_target(target.name, facts=target.facts(options))
    except MlcompError as exc:
        return f"the pipeline refuses it: {first_line(exc)}"
    try:
        target.check_capabilities(graph, options, target.unsupported(graph))
    except MlcompError as exc:
        return f"cannot take the graph: {first_line(exc)}"
    return None


def timing_pool(inputs: Sequence[Any], targets: Sequence[Target], policy: TimingPolicy = DEFAULT_AUTO_TIMING, *,
                procs: int = AUTO_PROCS, enabled: bool = True) -> WorkerPool:
    """The timing processes of an auto compile of ``targets`` on ``inputs`` (not started yet); they import the
    target registry and the targets' ``runtime_modules`` once, before the first forks the others, and each
    imports the runtimes of ``LOAD_IMPORTS`` at its first load."""
    preload = dict.fromkeys([get_target.__module__, *(m for t in targets for m in t.runtime_modules)])
    postload = dict.fromkeys(m for t in targets for m in LOAD_IMPORTS.get(t.name, ()))
    return WorkerPool(inputs, warmup=policy.warmup, block_s=BLOCK_S, describe=first_line, procs=procs,
                      enabled=enabled and len(targets) > 1, preload=list(preload), postload=list(postload))


def compile_auto(source: Any, graph: Any, *, candidates: Sequence[str | Target] | None = None,
                 pipeline: Any = None, capture_seconds: float = 0.0, instruments: Sequence[Any] | None = None,
                 policy: TimingPolicy = DEFAULT_AUTO_TIMING, clock: Clock = time.perf_counter,
                 note: Note | None = None, isolate: bool = True, records: RecordStore | None = None,
                 procs: int = AUTO_PROCS, pool: WorkerPool | None = None, **options: Any) -> CompileResult:
    """Compile ``graph`` for each candidate, verify, time the verified ones, return the fastest.

    ``instruments`` are built per candidate (a callable taking the target name) or shared;
    ``isolate=False`` times every candidate in this process, with ``clock`` (injectable for
    tests; the timing processes use their own clock); else every candidate is timed in each of ``procs``
    timing processes (one per round, in turn), so one process's luck decides nothing.  ``records``: where earlier measurements are
    kept (:mod:`~mlcomp.api.auto.record`); with a record for this host, model and shape class the
    candidates are built best-recorded first, the first that verifies is the pick and nothing is
    timed; without one, the measured ranking is recorded.  ``pool``: timing processes started earlier
    (:func:`timing_pool`, e.g. before the capture), discarded here when no ranking needs them.  The
    winner's manifest carries ``auto`` (every candidate: target, compile seconds, median ms, verified or why not).
    """
    say = note or (lambda text: None)
    opts = CompileOptions.make(**options)
    targets = auto_candidates(candidates)
    key = record = None
    if records is not None and not opts.deterministic:
        key = record_key(graph, source.inputs(), [t.spec for t in targets], pipeline, opts)
        record = records.load(key)
    ranked = [t.spec for t in targets] if record is None else record.order([t.spec for t in targets])
    order = sorted(targets, key=lambda t: ranked.index(t.spec))
    rows: dict[str, Candidate] = {}
    built: dict[str, CompileResult] = {}
    wanted = isolate and record is None and not opts.deterministic and len(targets) > 1
    if pool is None:
        pool = timing_pool(source.inputs(), targets, policy, procs=procs, enabled=wanted)
    elif not wanted:
        pool.discard()                 # started before the capture, not wanted after all (a record, one candidate)
    phases = Phases()
    eager = EagerOnce(source)          # every candidate is verified against one eager run
    with pool:
        pool.start()                   # the timing processes import torch and mlcomp while the candidates compile
        with phases("compile"), collector_paused():     # the builds' young collections free next to nothing
            _build_all(order, record, rows, built, pool, lambda target: _compile_one(
                source, graph, target, pipeline, capture_seconds, instruments, say, built, options, opts, eager))
        if not built:
            raise AutoTargetError(
                f"no candidate target compiled and verified {graph.name}: "
                + "; ".join(f"{c.target}: {c.reason}" for c in rows.values()),
                hint="fix the first problem listed, name one target with --target, or try --fallback eager")
        if opts.deterministic or record is not None:
            best = next(iter(built))
            rule = AUTO_RULE if record is None else f"the best-recorded candidate that verified ({records.path(key)})"
            decision = Decision.fixed(AUTO_QUESTION, [t.spec for t in order if t.spec in built], best, rule,
                                      deterministic=record is None)
            rounds, tie_break, timed_in, eliminated, ties = 0, 0, NOT_TIMED if record is None else FROM_RECORD, {}, {}
        else:
            say(f"auto: time {', '.join(built)} on the example inputs")
            ranking, timed_in = time_candidates(built, source.inputs(), policy, clock, rows, pool, phases)
            if ranking is None:
                raise AutoTargetError(f"{timed_in}: " + "; ".join(f"{c.target}: {c.reason}" for c in rows.values()),
                                      hint="name one target with --target and report the failure")
            best, decision = ranking.picked, ranking.decision(AUTO_QUESTION)
            rounds, tie_break, eliminated = ranking.rounds, ranking.tie_break_rounds, ranking.eliminated
            ties = ranking.noise_ties
            if key is not None and len(built) > 1:
                records.save(AutoRecord(key, {n: ranking.medians[n] for n in built}, best))
        phases.workers = pool.cpu_seconds()
        if closing := pool.started > 0:
            phases.begin("close")      # the timing processes told to quit and gone
    if closing:
        phases.end("close")
    rows[best] = replace(rows[best], picked=True)
    report = AutoReport(tuple(rows[t.spec] for t in targets), policy, rounds, tie_break, timed_in, eliminated,
                        phases, pool.started, ties)
    result = built[best]
    result.auto = report
    result.artifact.manifest["auto"] = report.to_json()
    result.artifact.manifest["decisions"] = [*result.artifact.decisions, dict(decision.to_json(), made_by="auto")]
    return result


def _build_all(order: Sequence[Target], record: AutoRecord | None, rows: dict[str, Candidate],
               built: dict[str, CompileResult], pool: WorkerPool, one: Callable[[Target], Candidate]) -> None:
    """Compile the candidates in ``order`` (``one``: a candidate's row; a verified build goes into ``built`` and to
    the timing processes); with a record, only up to the first that verifies (the others: :func:`_from_record`)."""
    for target in order:
        if record is not None and built:
            rows[target.spec] = _from_record(target.spec, record)
            continue
        rows[target.spec] = one(target)
        if target.spec in built:
            pool.add(target.spec, built[target.spec].artifact)


def _compile_one(source: Any, graph: Any, target: Target, pipeline: Any, capture_seconds: float,
                 instruments: Any, say: Note, built: dict[str, CompileResult], options: dict[str, Any],
                 opts: CompileOptions, eager: EagerOnce | None = None) -> Candidate:
    """Check, compile and verify ``graph`` for ``target``: its row (a verified build goes into ``built``)."""
    problem = precheck(target, graph, opts, pipeline)
    if problem:
        return Candidate(target.spec, reason=problem)
    say(f"auto: compile for {target.spec}")
    t0 = time.perf_counter()
    try:
        result = compile_source(source, graph.copy(), target=target, pipeline=pipeline, verify=True,
                                capture_seconds=capture_seconds, raise_on_failure=False,
                                instruments=_instruments(instruments, target.spec), eager=eager, **options)
    except MlcompError as exc:
        return Candidate(target.spec, time.perf_counter() - t0, reason=first_line(exc))
    except Exception as exc:  # noqa: BLE001 - a backend's crash disqualifies that candidate only
        return Candidate(target.spec, time.perf_counter() - t0, reason=f"compile failed: {first_line(exc)}")
    seconds = time.perf_counter() - t0
    if not result.check.passed:
        return Candidate(target.spec, seconds, reason=f"verification failed: {result.check.summary()}")
    built[target.spec] = result
    return Candidate(target.spec, seconds, verified=True)


def _from_record(name: str, record: AutoRecord) -> Candidate:
    """The row of a candidate not built because the record ranks a verified one above it."""
    ratio = record.ratio(name)
    median_s = record.medians.get(name)
    why = "not built: " + (f"recorded at {ratio:.2f}x the pick's time on this host" if ratio is not None
                           else "not in the record, and a recorded candidate verified")
    return Candidate(name, median_s=median_s, reason=why, ratio=ratio)


def _instruments(instruments: Any, name: str) -> Sequence[Any] | None:
    return instruments(name) if callable(instruments) else instruments
