"""``target="auto"``: compile for every target that can run the model here, keep the fastest that verified.

    >>> art = mlcomp.compile("mlp", target="auto", candidates=["cpu", "onnxruntime"])
    >>> art.target, [(c["target"], c["median_ms"], c["verified"]) for c in art.manifest["auto"]["candidates"]]
    ('onnxruntime', [('cpu', 0.071073, True), ('onnxruntime', 0.06425, True)])   # mlp, batch 1

Before: the user compiled and benchmarked each target by hand.  After: each candidate
target is checked against the captured graph (available here, capabilities, ops),
compiled with the pipeline adapted to it, verified against eager, then all verified
artifacts are timed together on the example inputs with the interleaved-median
protocol (:func:`mlcomp.hardware.timing.measure_interleaved`: one sample of each per
round, so load drift hits every candidate alike; a sample is a block of calls lasting
about ``BLOCK_S`` after an untimed block, so the switch between runtimes' thread pools is
not charged to the runtime switched to).  A candidate that is unavailable,
cannot take the graph, fails to compile or fails verification is recorded with the
reason and never picked; when none verifies, :class:`AutoTargetError` lists them all.

Candidates are compiled one after another: the backends already use every core, so
compiling two at once on a small machine only interleaves them.  Distributed (a
multi-process pipeline, not a single-process artifact) is never a default candidate.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Sequence

from mlcomp.api.lowering import CompileResult, Note, compile_source
from mlcomp.base.errors import MlcompError
from mlcomp.base.table import Table
from mlcomp.hardware.timing import Clock, TimingPolicy, fmt_seconds, measure_interleaved, synchronizer
from mlcomp.pipeline import Pipeline
from mlcomp.targets import CompileOptions, Target, TargetName, get_target

__all__ = ["AUTO", "AutoTargetError", "Candidate", "AutoReport", "auto_candidates", "compile_auto",
           "DEFAULT_AUTO_TIMING"]

AUTO = "auto"
# a short budget per candidate: ranking targets needs a stable median, not bench's precision
DEFAULT_AUTO_TIMING = TimingPolicy(warmup=3, budget_s=0.3, min_repeats=5)
BLOCK_S = 0.02          # seconds of calls per timing sample (see _time)


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

    def to_json(self) -> dict[str, Any]:
        return {"target": self.target,
                "compile_seconds": None if self.compile_seconds is None else round(self.compile_seconds, 4),
                "median_ms": None if self.median_s is None else round(self.median_s * 1e3, 6),
                "verified": self.verified, "reason": self.reason, "picked": self.picked}

    @property
    def state(self) -> str:
        return "yes" if self.verified else f"no: {self.reason}"


@dataclass(frozen=True)
class AutoReport:
    """Every candidate, in the order tried, and the timing policy used to rank them."""

    candidates: tuple[Candidate, ...]
    policy: TimingPolicy

    @property
    def picked(self) -> Candidate:
        return next(c for c in self.candidates if c.picked)

    def to_json(self) -> dict[str, Any]:
        return {"picked": self.picked.target, "candidates": [c.to_json() for c in self.candidates],
                "timing": {"protocol": "interleaved median on the example inputs", "warmup": self.policy.warmup,
                           "budget_s": self.policy.budget_s, "min_repeats": self.policy.min_repeats}}

    def table(self) -> Table:
        rows = tuple((c.target + (" *" if c.picked else ""),
                      "—" if c.compile_seconds is None else f"{c.compile_seconds:.2f} s",
                      fmt_seconds(c.median_s), c.state) for c in self.candidates)
        return Table(f"auto: picked {self.picked.target} (fastest that verified; * marks it)",
                     ("target", "compile", "median", "verified"), rows, right=frozenset({1, 2}))

    @staticmethod
    def format_json(data: dict[str, Any]) -> str:
        """The table from a manifest's ``auto`` record (a cache hit reports the original choice)."""
        cands = tuple(Candidate(c["target"], c["compile_seconds"],
                                None if c["median_ms"] is None else c["median_ms"] / 1e3,
                                c["verified"], c["reason"], c["picked"]) for c in data["candidates"])
        timing = data.get("timing", {})
        policy = TimingPolicy(warmup=timing.get("warmup", 3), budget_s=timing.get("budget_s", 0.3),
                              min_repeats=timing.get("min_repeats", 5))
        return AutoReport(cands, policy).table().format()


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
            Pipeline.coerce(pipeline).check_target(target.name)
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
                 note: Note | None = None, **options: Any) -> CompileResult:
    """Compile ``graph`` for each candidate, verify, time the verified ones, return the fastest.

    ``instruments`` are built per candidate (a callable taking the target name) or shared;
    ``clock`` is injectable for tests.  The winner's manifest carries ``auto`` (every
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
    say(f"auto: time {', '.join(built)} on the example inputs")
    timings = _time(built, source.inputs(), policy, clock, rows)
    best = min(timings, key=lambda name: timings[name])
    rows[best] = replace(rows[best], picked=True)
    report = AutoReport(tuple(rows[t.name] for t in targets), policy)
    result = built[best]
    result.auto = report
    result.artifact.manifest["auto"] = report.to_json()
    return result


def _instruments(instruments: Any, name: str) -> Sequence[Any] | None:
    return instruments(name) if callable(instruments) else instruments


def _time(built: dict[str, CompileResult], inputs: Sequence[Any], policy: TimingPolicy, clock: Clock,
          rows: dict[str, Candidate]) -> dict[str, float]:
    """Median seconds per call of each built artifact, timed round-robin; a failing call disqualifies."""
    fns: dict[str, Callable[[], Any]] = {}
    calls: dict[str, int] = {}
    for name, result in list(built.items()):
        art = result.artifact
        try:
            start = clock()
            art(*inputs)                       # one call outside the clock: a crash here is not a timing
            once = clock() - start
        except Exception as exc:  # noqa: BLE001 - reported as the candidate's reason
            rows[name] = replace(rows[name], verified=False, reason=f"running it failed: {_first_line(exc)}")
            del built[name]
            continue
        # a sample is a block of calls lasting about BLOCK_S, after one untimed block (lead_in): the
        # first calls after switching runtimes compete with the previous runtime's thread pool
        # spinning down, which would be charged to every runtime but torch's own (anchors: auto
        # picked cpu over faster openvino and onnxruntime on resnet18 and the transformer)
        calls[name] = max(1, min(1000, math.ceil(BLOCK_S / max(once, 1e-9))))
        fns[name] = (lambda a=art, k=calls[name]: [a(*inputs) for _ in range(k)])
    if not fns:
        raise AutoTargetError("every verified candidate failed when run again for timing: "
                              + "; ".join(f"{c.target}: {c.reason}" for c in rows.values()),
                              hint="name one target with --target and report the failure")
    syncs = {name: synchronizer(built[name].artifact.manifest.get("device") or "cpu") for name in fns}
    timings = measure_interleaved(fns, policy, clock=clock, sync=syncs, lead_in=1)
    medians = {name: timing.median / calls[name] for name, timing in timings.items()}
    for name, median in medians.items():
        rows[name] = replace(rows[name], median_s=median)
    return medians
