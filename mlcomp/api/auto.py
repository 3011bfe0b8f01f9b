"""``target="auto"``: compile for every target that can run the model here, keep the fastest that verified.

    >>> art = mlcomp.compile("mlp", target="auto", candidates=["cpu", "onnxruntime"])
    >>> art.target, [(c["target"], c["median_ms"], c["verified"]) for c in art.manifest["auto"]["candidates"]]
    ('onnxruntime', [('cpu', 0.071073, True), ('onnxruntime', 0.06425, True)])   # mlp, batch 1

Before: the user compiled and benchmarked each target by hand.  After: each candidate
target is checked against the captured graph (available here, capabilities, ops),
compiled with the pipeline adapted to it, verified against eager, then all verified
artifacts are timed together on the example inputs (:func:`rank`): rounds of one sample
of each, the order rotated every round, so load drift and the previous runtime's thread pool
hit every candidate alike; a sample is a block of calls lasting about ``BLOCK_S`` after an
untimed block, so the switch between runtimes' thread pools is not charged to the runtime
switched to.  Each round pairs the candidates; a contender whose paired ratios to the
leader (fastest median) a sign test cannot yet tell from 1 (p ≥ ``ALPHA``) gets tie-break
rounds with it, without the decided ones, until the test decides or ``TIE_BREAK`` × the
budget is spent::

    before: ResNet-18@1, ORT vs OpenVINO 3 % apart: ~8 rounds, fixed order, pick flipped between runs
    after:  the same 8 rounds, then tie-break rounds of the two until p < 0.05 (≤ 3 s more)

A candidate that is unavailable, cannot take the graph, fails to compile or fails
verification is recorded with the reason and never picked; when none verifies,
:class:`AutoTargetError` lists them all.  The pick is the artifact compiled for that target
itself (no wrapper: it runs exactly as a direct compile for that target does).

Candidates are compiled one after another: the backends already use every core, so
compiling two at once on a small machine only interleaves them.  Distributed (a
multi-process pipeline, not a single-process artifact) is never a default candidate.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from statistics import median
from typing import Any

from mlcomp.api.lowering import CompileResult, Note, compile_source
from mlcomp.base.errors import MlcompError
from mlcomp.base.table import Table
from mlcomp.hardware.timing import (
    Clock,
    Sync,
    TimingPolicy,
    fmt_seconds,
    no_sync,
    synchronizer,
)
from mlcomp.pipeline import Pipeline
from mlcomp.targets import CompileOptions, Target, TargetName, get_target

__all__ = ["AUTO", "AutoTargetError", "Candidate", "AutoReport", "Ranking", "auto_candidates", "compile_auto",
           "rank", "sign_test", "DEFAULT_AUTO_TIMING"]

AUTO = "auto"
# a short budget per candidate: ranking targets needs a stable median, not bench's precision
DEFAULT_AUTO_TIMING = TimingPolicy(warmup=3, budget_s=0.3, min_repeats=5)
BLOCK_S = 0.02          # seconds of calls per timing sample (see _time)
ALPHA = 0.05            # a two-sided sign test below this decides "faster" / "slower"
MIN_ROUNDS = 6          # the fewest rounds in which the sign test can decide at ALPHA (p = 2 / 2**6)
TIE_BREAK = 10.0        # tie-break rounds stop after TIE_BREAK x policy.budget_s seconds


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

    @property
    def picked(self) -> Candidate:
        return next(c for c in self.candidates if c.picked)

    def to_json(self) -> dict[str, Any]:
        return {"picked": self.picked.target, "candidates": [c.to_json() for c in self.candidates],
                "timing": {"protocol": "rotated rounds on the example inputs, median per candidate; close ones "
                                       f"get tie-break rounds until a sign test decides (p < {ALPHA})",
                           "warmup": self.policy.warmup, "budget_s": self.policy.budget_s,
                           "min_repeats": self.policy.min_repeats, "rounds": self.rounds,
                           "tie_break_rounds": self.tie_break_rounds}}

    def table(self) -> Table:
        rows = tuple((c.target + (" *" if c.picked else ""),
                      "—" if c.compile_seconds is None else f"{c.compile_seconds:.2f} s",
                      fmt_seconds(c.median_s), c.versus, c.state) for c in self.candidates)
        return Table(f"auto: picked {self.picked.target} (fastest that verified; * marks it)",
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
        return AutoReport(cands, policy, timing.get("rounds", 0), timing.get("tie_break_rounds", 0)).table().format()


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
    ranking = _time(built, source.inputs(), policy, clock, rows)
    best = ranking.picked
    rows[best] = replace(rows[best], picked=True)
    report = AutoReport(tuple(rows[t.name] for t in targets), policy, ranking.rounds, ranking.tie_break_rounds)
    result = built[best]
    result.auto = report
    result.artifact.manifest["auto"] = report.to_json()
    return result


def _instruments(instruments: Any, name: str) -> Sequence[Any] | None:
    return instruments(name) if callable(instruments) else instruments


def _time(built: dict[str, CompileResult], inputs: Sequence[Any], policy: TimingPolicy, clock: Clock,
          rows: dict[str, Candidate]) -> Ranking:
    """Rank the built artifacts (:func:`rank`) in blocks of calls; a failing call disqualifies."""
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
        # a sample is a block of calls lasting about BLOCK_S, after one untimed block (rank's lead-in): the
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
    ranking = rank(fns, policy, clock=clock, syncs=syncs, per_call={n: 1 / k for n, k in calls.items()})
    for name in fns:
        rows[name] = replace(rows[name], median_s=ranking.medians[name], ratio=ranking.ratios.get(name),
                             p_value=ranking.p_values.get(name))
    return ranking


@dataclass(frozen=True)
class Ranking:
    """What :func:`rank` measured: per candidate its median, its paired ratio to the pick and the sign test."""

    picked: str
    medians: dict[str, float]                 # seconds per call (× ``per_call``)
    ratios: dict[str, float] = field(default_factory=dict)     # median of (its sample / the pick's), same round
    p_values: dict[str, float] = field(default_factory=dict)   # two-sided sign test of those ratios against 1
    rounds: int = 0                           # rounds of every candidate
    tie_break_rounds: int = 0                 # rounds of the close ones only


def sign_test(ratios: Sequence[float]) -> float:
    """Two-sided sign-test p-value that the median of ``ratios`` is 1 (ties dropped)."""
    below, above = sum(r < 1 for r in ratios), sum(r > 1 for r in ratios)
    n, k = below + above, min(below, above)
    return 1.0 if n == 0 else min(1.0, 2 * sum(math.comb(n, i) for i in range(k + 1)) / 2 ** n)


def rank(fns: Mapping[str, Callable[[], Any]], policy: TimingPolicy = DEFAULT_AUTO_TIMING, *,
         clock: Clock = time.perf_counter, syncs: Mapping[str, Sync] | None = None,
         per_call: Mapping[str, float] | None = None) -> Ranking:
    """Time ``fns`` in rounds and pick the fastest; close contenders get tie-break rounds.

    Each is warmed up (``policy.warmup`` calls, at most ``policy.budget_s``).  A round times one
    sample of each after an untimed lead-in call of the same one, starting one candidate later
    than the round before (every candidate follows every other equally often).  Rounds go on
    until ``policy.budget_s`` per candidate is spent and at least ``MIN_ROUNDS`` (bounded by
    ``policy.max_repeats``) are done.  Then the leader is the lowest median (or a contender whose
    paired ratios to it, its sample / the leader's in the same round, have a median below 1);
    a contender is decided slower when the sign test of those ratios gives p < ``ALPHA``.
    Undecided ones and the leader go on in tie-break rounds of their own until every
    contender is decided or ``TIE_BREAK`` × ``policy.budget_s`` more seconds are spent; the pick
    is the leader then.  O(rounds × candidates) per check.
    """
    names = list(fns)
    sync = {n: (syncs or {}).get(n, no_sync) for n in names}
    scale = {n: (per_call or {}).get(n, 1.0) for n in names}
    for name in names:
        w0 = clock()
        for _ in range(policy.warmup):
            fns[name]()
            sync[name]()
            if clock() - w0 >= policy.budget_s:
                break
    samples: dict[str, list[float]] = {n: [] for n in names}
    rounds: list[dict[str, float]] = []

    def one_round(active: list[str]) -> None:
        k = len(rounds) % len(active)
        taken: dict[str, float] = {}
        for name in active[k:] + active[:k]:
            fns[name]()                    # lead-in: the previous runtime's pool spins down here
            sync[name]()
            start = clock()
            fns[name]()
            sync[name]()
            taken[name] = (clock() - start) * scale[name]     # per call: blocks differ in length
            samples[name].append(taken[name])
        rounds.append(taken)

    fewest = min(max(policy.min_repeats, MIN_ROUNDS), policy.max_repeats)
    begin = clock()
    while len(rounds) < policy.max_repeats:
        one_round(names)
        if len(rounds) >= fewest and clock() - begin >= policy.budget_s * len(names):
            break
    everyone = len(rounds)
    active = _undecided(names, samples, rounds)
    begin = clock()
    while len(active) > 1 and len(rounds) < policy.max_repeats and clock() - begin < TIE_BREAK * policy.budget_s:
        one_round(active)
        active = _undecided(active, samples, rounds)
    picked = _leader(active, samples, rounds)
    ratios, p_values = {}, {}
    for name in names:
        paired = _ratios(rounds, name, picked)
        ratios[name], p_values[name] = (median(paired), sign_test(paired)) if paired else (math.nan, 1.0)
    return Ranking(picked, {n: median(samples[n]) for n in names}, ratios, p_values, everyone,
                   len(rounds) - everyone)


def _ratios(rounds: Sequence[Mapping[str, float]], name: str, leader: str) -> list[float]:
    """``name``'s sample / ``leader``'s in every round that timed both."""
    out = []
    for r in rounds:
        if name in r and leader in r:
            a, b = r[name], r[leader]
            out.append(a / b if b > 0 else (1.0 if a == 0 else math.inf))
    return out


def _leader(active: list[str], samples: Mapping[str, list[float]], rounds: Sequence[Mapping[str, float]]) -> str:
    """The lowest median, unless a contender's paired ratios to it have a median below 1 (they
    cancel load drift that the medians of each keep): then the contender with the lowest one."""
    leader = min(active, key=lambda n: median(samples[n]))
    paired = {n: median(r) for n in active if n != leader and (r := _ratios(rounds, n, leader))}
    best = min(paired, key=lambda n: paired[n], default=None)
    return best if best is not None and paired[best] < 1 else leader


def _undecided(active: list[str], samples: Mapping[str, list[float]],
               rounds: Sequence[Mapping[str, float]]) -> list[str]:
    """The leader and every contender not yet decided slower than it (median ratio above 1 and a
    sign test at p < ALPHA)."""
    leader = _leader(active, samples, rounds)
    keep = [leader]
    for name in active:
        if name == leader:
            continue
        paired = _ratios(rounds, name, leader)
        ratio = median(paired)
        if not (ratio > 1 and sign_test(paired) < ALPHA):
            keep.append(name)
    return keep
