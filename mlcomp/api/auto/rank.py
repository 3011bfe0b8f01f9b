"""Rank candidates by speed: rotated rounds of samples, a sign test on paired ratios, tie-break rounds.

    >>> import itertools
    >>> ticks = itertools.count(step=0.001)           # a fake clock: 1 ms per reading
    >>> samplers = {"onnxruntime": lambda: 0.000386, "tvm": lambda: 0.000271}   # seconds per call
    >>> ranking = rank_samplers(samplers, DEFAULT_AUTO_TIMING, clock=lambda: next(ticks))
    >>> ranking.picked, ranking.medians
    ('tvm', {'onnxruntime': 0.000386, 'tvm': 0.000271})
    >>> ranking.eliminated["onnxruntime"].why
    'eliminated after 4 rounds: 1.42x the time of tvm, above 1.2x in every round'

A *sampler* is a callable that takes one timing sample of its candidate and returns seconds
per call.  :func:`block_samplers` makes samplers of plain functions in this process (an
untimed lead-in call, then a timed one, with the device's barrier); the auto target uses
:class:`~mlcomp.runtime.timing_worker.ProcessSampler` instead, a fresh process per candidate.

After the rounds of every candidate, tie-break rounds of the undecided ones go on until a sign
test (:func:`mlcomp.hardware.decide.sign_test`) decides (p < ``ALPHA``), the interval of the
paired ratios (:func:`mlcomp.hardware.intervals.median_interval`) shows two equal within
``NEAR_TIE``, the timing processes disagree about which of the two is faster or the two differ by less
than one of them differs between the processes (:func:`noise_tie`: equal within the noise the processes
show; the decision says so), or ``TIE_BREAK`` × the budget is spent.  A
clear loser leaves earlier (:class:`Elimination`): above ``EARLY_ABOVE`` × the leader in every one of at
least ``EARLY_ROUNDS`` rounds (two in each timing process), or decided above ``ELIMINATE_ABOVE`` × by the
sign test.  :meth:`Ranking.decision` is the choice as a
:class:`~mlcomp.hardware.decide.Decision` for the manifest.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from mlcomp.hardware.decide import ALPHA, ELIMINATE_ABOVE, MIN_ROUNDS, Decision, Verdict, call_samplers, clear_losers, \
    sign_test
from mlcomp.hardware.intervals import CONFIDENCE, median_interval
from mlcomp.hardware.timing import Clock, Sync, TimingPolicy

__all__ = ["ALPHA", "BLOCK_S", "DEFAULT_AUTO_TIMING", "EARLY_ABOVE", "EARLY_ROUNDS", "MIN_ROUNDS", "NEAR_TIE",
           "TIE_BREAK", "Elimination", "NoiseTie", "Ranking", "Sampler", "block_samplers", "noise_tie", "rank",
           "rank_samplers", "sign_test"]

# a short budget per candidate: ranking targets needs a stable median, not bench's precision
DEFAULT_AUTO_TIMING = TimingPolicy(warmup=3, budget_s=0.3, min_repeats=5)
BLOCK_S = 0.02          # seconds of calls per timing sample
TIE_BREAK = 10.0        # tie-break rounds stop after TIE_BREAK x policy.budget_s seconds
NEAR_TIE = 0.02         # a contender whose ratio interval to the leader lies within 1 +- this is its equal
EARLY_ABOVE = 1.2       # slower than this x the leader in every one of the first rounds: a clear loser ...
EARLY_ROUNDS = 4        # ... after this many rounds (and at least two in each timing process)
NOISE_MIN = 3           # paired ratios each timing process needs before its median is compared with the others'

Sampler = Callable[[], float]     # one sample of a candidate: seconds per call


@dataclass(frozen=True)
class Elimination:
    """Why a clear loser stopped being sampled: after how many rounds, against which leader, the evidence.

        >>> Elimination(6, "onnxruntime", 2.5, 0.03125).why
        'eliminated after 6 rounds: 2.50x the time of onnxruntime, above 1.5x by sign test p=0.031'
        >>> Elimination(4, "onnxruntime", 1.4, 0.125, EARLY_ABOVE).why
        'eliminated after 4 rounds: 1.40x the time of onnxruntime, above 1.2x in every round'
    """

    after_rounds: int
    leader: str
    ratio: float          # median of its paired ratios to the leader then
    p_value: float        # sign test of those ratios against the bound
    early: float | None = None     # the bound of the early rule (every round above it), None: the sign test's

    @property
    def why(self) -> str:
        head = f"eliminated after {self.after_rounds} rounds: {self.ratio:.2f}x the time of {self.leader}, "
        if self.early is not None:
            return head + f"above {self.early}x in every round"
        return head + f"above {ELIMINATE_ABOVE}x by sign test p={self.p_value:.2g}"

    def to_json(self) -> dict[str, Any]:
        return {"after_rounds": self.after_rounds, "leader": self.leader, "ratio": round(self.ratio, 4),
                "p": round(self.p_value, 5), "why": self.why}


@dataclass(frozen=True)
class NoiseTie:
    """A contender as fast as the leader within the noise of the timing processes: one process's median paired
    ratio says it is faster, another's that it is slower, or its ratio differs from 1 by less than the median of
    one of the two differs between the processes (``spread``: the larger of the two, max / min - 1).

        >>> NoiseTie(1.04, (0.98, 1.09), 0.13).why
        "1.040x, within the timing processes' noise (per process 0.980x, 1.090x; a median 13% apart between them)"
    """

    ratio: float                        # median of every paired ratio to the leader
    per_process: tuple[float, ...]      # median of the ratios measured in each timing process
    spread: float = 0.0                 # the larger relative spread of the two candidates' per-process medians

    @property
    def why(self) -> str:
        each = ", ".join(f"{r:.3f}x" for r in self.per_process)
        return (f"{self.ratio:.3f}x, within the timing processes' noise (per process {each}; a median "
                f"{self.spread:.0%} apart between them)")

    def to_json(self) -> dict[str, Any]:
        return {"ratio": round(self.ratio, 4), "per_process": [round(r, 4) for r in self.per_process],
                "spread": round(self.spread, 4)}


def noise_tie(paired: Sequence[float], procs: int, samples: Sequence[Sequence[float]] = ()) -> NoiseTie | None:
    """The :class:`NoiseTie` of a contender whose ``paired`` ratios (the ``i``-th measured in timing process
    ``i % procs``) have medians on either side of 1 in different processes (they disagree about which of the two
    is faster), or whose median ratio differs from 1 by at most the spread of the per-process medians of one of
    ``samples`` (the two candidates' samples, the ``i``-th in process ``i % procs``): once every process has
    ``NOISE_MIN`` of each; else None.  Processes that agree on the direction and differ in the size (1.05x and
    1.9x), each candidate alike in both, make no tie: the tie-break goes on.

        >>> noise_tie([0.99, 1.10] * 3, 2).per_process, noise_tie([1.05, 1.9] * 3, 2), noise_tie([1.0] * 6, 1)
        ((0.99, 1.1), None, None)
        >>> round(noise_tie([1.05] * 6, 2, [[1.0, 1.1] * 3, [1.05, 1.155] * 3]).spread, 3)   # 10% apart
        0.1
    """
    if procs < 2:
        return None
    each = [list(paired[p::procs]) for p in range(procs)]
    if min(len(e) for e in each) < NOISE_MIN:
        return None
    per = tuple(median(e) for e in each)
    spread = max((_spread(s, procs) for s in samples), default=0.0)
    ratio = median(paired)
    if min(per) <= 1 <= max(per) or abs(ratio - 1) <= spread:
        return NoiseTie(ratio, per, spread)
    return None


def _spread(samples: Sequence[float], procs: int) -> float:
    """max / min - 1 of the medians of ``samples`` taken in each process (the ``i``-th in process ``i % procs``)."""
    per = [median(s) for p in range(procs) if (s := samples[p::procs])]
    return max(per) / min(per) - 1 if len(per) == procs and min(per) > 0 else 0.0


@dataclass(frozen=True)
class Ranking:
    """What :func:`rank_samplers` measured: per candidate its median, its paired ratio to the pick and the sign test."""

    picked: str
    medians: dict[str, float]                 # seconds per call
    ratios: dict[str, float] = field(default_factory=dict)     # median of (its sample / the pick's), same round
    p_values: dict[str, float] = field(default_factory=dict)   # two-sided sign test of those ratios against 1
    rounds: int = 0                           # rounds of every candidate still sampled
    tie_break_rounds: int = 0                 # rounds of the close ones only
    eliminated: dict[str, Elimination] = field(default_factory=dict)   # clear loser -> when and why it stopped
    near_ties: dict[str, tuple[float, float]] = field(default_factory=dict)  # equal within noise -> ratio interval
    noise_ties: dict[str, NoiseTie] = field(default_factory=dict)   # equal within the timing processes' noise

    def decision(self, question: str = "auto: which verified target is fastest?") -> Decision:
        """The pick as a :class:`~mlcomp.hardware.decide.Decision` (default: the first candidate tried)."""
        names = tuple(self.medians)
        others = {n: p for n, p in self.p_values.items() if n != self.picked}
        rounds = self.rounds + self.tie_break_rounds
        evidence = dict(rounds=rounds, medians=dict(self.medians), p_values=others,
                        ratios={n: r for n, r in self.ratios.items() if n != self.picked})
        tested = {n: p for n, p in others.items() if n not in self.eliminated}    # the eliminated are decided
        if all(p < ALPHA for p in tested.values()):
            why = (f"decided by sign test p<={max(tested.values(), default=0.0):.2g} after {rounds} rounds"
                   + (f" ({', '.join(self.eliminated)} eliminated)" if self.eliminated else "")
                   + f": {self.picked} is the fastest")
            return Decision(question, names, names[0], self.picked, Verdict.DECIDED, why, **evidence)
        close = ", ".join(f"{n} p={p:.2g}" + (f" [{self.near_ties[n][0]:.3f}-{self.near_ties[n][1]:.3f}] within "
                                             f"1+-{NEAR_TIE}" if n in self.near_ties else "")
                          + (f" {self.noise_ties[n].why}" if n in self.noise_ties else "")
                          for n, p in tested.items() if p >= ALPHA)
        why = f"undecided after {rounds} rounds ({close}): picked the lowest paired median, {self.picked}"
        return Decision(question, names, names[0], self.picked, Verdict.UNDECIDED, why, **evidence)


def block_samplers(fns: Mapping[str, Callable[[], Any]], policy: TimingPolicy = DEFAULT_AUTO_TIMING, *,
                   clock: Clock = time.perf_counter, syncs: Mapping[str, Sync] | None = None,
                   per_call: Mapping[str, float] | None = None) -> dict[str, Sampler]:
    """Warm each of ``fns`` up (``policy.warmup`` calls, at most ``policy.budget_s``), then samplers of them.

    A sample is an untimed lead-in call, then a timed one, each followed by the device's
    barrier; ``per_call`` scales it (a function that makes ``k`` calls has ``1 / k``).
    """
    return call_samplers(fns, warmup=policy.warmup, budget_s=policy.budget_s, clock=clock, syncs=syncs,
                         lead_in=1, per_call=per_call)


def rank(fns: Mapping[str, Callable[[], Any]], policy: TimingPolicy = DEFAULT_AUTO_TIMING, *,
         clock: Clock = time.perf_counter, syncs: Mapping[str, Sync] | None = None,
         per_call: Mapping[str, float] | None = None) -> Ranking:
    """:func:`rank_samplers` of :func:`block_samplers` of ``fns``: every candidate in this process."""
    return rank_samplers(block_samplers(fns, policy, clock=clock, syncs=syncs, per_call=per_call), policy,
                         clock=clock)


def rank_samplers(samplers: Mapping[str, Sampler], policy: TimingPolicy = DEFAULT_AUTO_TIMING, *,
                  clock: Clock = time.perf_counter, on_eliminate: Callable[[str], Any] | None = None,
                  procs: int = 1, early: float | None = EARLY_ABOVE) -> Ranking:
    """Take samples in rounds and pick the fastest; close contenders get tie-break rounds.

    A round takes one sample of each, starting one candidate later than the round before
    (every candidate follows every other equally often); ``procs``: the samplers take round ``i`` in
    timing process ``i % procs``.  Rounds go on until
    ``policy.budget_s`` per candidate is spent and at least ``MIN_ROUNDS`` (bounded by
    ``policy.max_repeats``) are done, or, once those are done, as soon as every contender is decided
    slower than the leader or its equal (more rounds could not change the pick).  Then the leader is the lowest median (or a contender
    whose paired ratios to it, its sample / the leader's in the same round, have a median
    below 1); a contender is decided slower when the sign test of those ratios gives
    p < ``ALPHA``, and the leader's equal when the 95 % interval of those ratios lies within
    ``1 ± NEAR_TIE`` (``near_ties``: more rounds would only pick between equals) or, with several
    processes, when the processes' median ratios lie on either side of 1 or its ratio is within the spread of
    either candidate's per-process medians (``noise_ties``,
    :func:`noise_tie`).  Undecided ones
    and the leader go on in tie-break rounds of their own until every contender is decided or
    ``TIE_BREAK`` × ``policy.budget_s`` more seconds are spent; the pick is the leader then.  A clear loser
    (:func:`_losers`: above ``early`` x the leader in every round, or decided slower than ``ELIMINATE_ABOVE`` x
    by the sign test) is sampled no more from the round that decides it
    (``on_eliminate(name)`` is told, e.g. to stop its process).  O(rounds × candidates) per check.
    """
    names = list(samplers)
    samples: dict[str, list[float]] = {n: [] for n in names}
    rounds: list[dict[str, float]] = []

    def one_round(active: list[str]) -> None:
        k = len(rounds) % len(active)
        taken: dict[str, float] = {}
        for name in active[k:] + active[:k]:
            taken[name] = samplers[name]()
            samples[name].append(taken[name])
        rounds.append(taken)

    fewest = min(max(policy.min_repeats, MIN_ROUNDS), policy.max_repeats)
    begin = clock()
    sampled, eliminated = list(names), {}
    while len(rounds) < policy.max_repeats:
        one_round(sampled)
        leader = _leader(sampled, samples, rounds)
        paired = {n: _ratios(rounds, n, leader) for n in sampled if n != leader}
        medians = {n: median(samples[n]) for n in sampled}
        for name, gone in _losers(paired, len(rounds), leader, procs, early, medians).items():
            sampled.remove(name)
            eliminated[name] = gone
            if on_eliminate is not None:
                on_eliminate(name)
        if len(sampled) == 1 or len(rounds) >= fewest and (clock() - begin >= policy.budget_s * len(sampled)
                                                            or len(_undecided(sampled, samples, rounds, procs)) == 1):
            break                      # the budget is spent, or the leader is decided against every contender
    everyone = len(rounds)
    active = _undecided(sampled, samples, rounds, procs)
    begin = clock()
    while len(active) > 1 and len(rounds) < policy.max_repeats and clock() - begin < TIE_BREAK * policy.budget_s:
        one_round(active)
        active = _undecided(active, samples, rounds, procs)
    picked = _leader(active, samples, rounds)
    ratios, p_values, near, tied = {}, {}, {}, {}
    for name in names:
        paired = _ratios(rounds, name, picked)
        ratios[name], p_values[name] = (median(paired), sign_test(paired)) if paired else (math.nan, 1.0)
        if name == picked or p_values[name] < ALPHA or name in eliminated:
            continue
        if (band := _within_noise(paired)) is not None:
            near[name] = band
        elif (tie := noise_tie(paired, procs, (samples[name], samples[picked]))) is not None:
            tied[name] = tie
    return Ranking(picked, {n: median(samples[n]) for n in names}, ratios, p_values, everyone,
                   len(rounds) - everyone, eliminated, near, tied)


def _losers(paired: Mapping[str, Sequence[float]], done: int, leader: str, procs: int,
            early: float | None, medians: Mapping[str, float] | None = None) -> dict[str, Elimination]:
    """The clear losers after ``done`` rounds (``paired``: each contender's ratios to ``leader``): above ``early``
    in every round once there are ``EARLY_ROUNDS`` and two in each of ``procs`` processes (and, given
    ``medians`` of every sample, its median above ``early`` x the leader's too), or decided above
    ``ELIMINATE_ABOVE`` by the sign test (:func:`mlcomp.hardware.decide.clear_losers`).

        >>> sorted(_losers({"far": [1.3, 1.25, 1.4, 1.3], "near": [1.3, 1.1, 1.4, 1.3]}, 4, "x", 2, 1.2))
        ['far']
        >>> _losers({"far": [1.3] * 4}, 4, "x", 2, 1.2, medians={"far": 1.1, "x": 1.0})   # its median is not
        {}
    """
    out: dict[str, Elimination] = {}
    if early is not None and done >= max(EARLY_ROUNDS, 2 * procs):
        for name, r in paired.items():
            if r and min(r) > early and (medians is None or medians[name] > early * medians[leader]):
                out[name] = Elimination(done, leader, median(r), sign_test(r, early), early)
    for name in clear_losers({n: r for n, r in paired.items() if n not in out}):
        out[name] = Elimination(done, leader, median(paired[name]), sign_test(paired[name], ELIMINATE_ABOVE))
    return out


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
               rounds: Sequence[Mapping[str, float]], procs: int = 1) -> list[str]:
    """The leader and every contender not yet decided slower than it (median ratio above 1 and a
    sign test at p < ALPHA) nor decided its equal (:func:`_within_noise`, :func:`noise_tie`)."""
    leader = _leader(active, samples, rounds)
    keep = [leader]
    for name in active:
        if name == leader:
            continue
        paired = _ratios(rounds, name, leader)
        ratio = median(paired)
        if not (ratio > 1 and sign_test(paired) < ALPHA) and _within_noise(paired) is None \
                and noise_tie(paired, procs, (samples[name], samples[leader])) is None:
            keep.append(name)
    return keep


def _within_noise(paired: Sequence[float]) -> tuple[float, float] | None:
    """The 95 % interval of the median of ``paired`` when it lies within ``1 +- NEAR_TIE`` (either of the
    two is as fast as the other, within noise: more rounds would only pick between equals), else None.

        >>> _within_noise([0.99, 1.01, 1.0, 1.005, 0.995, 1.0]), _within_noise([1.0, 1.03] * 3)
        ((0.99, 1.01), None)
    """
    if len(paired) < MIN_ROUNDS:
        return None
    lo, hi, reached = median_interval(paired, CONFIDENCE)
    return (lo, hi) if reached >= CONFIDENCE and 1 / (1 + NEAR_TIE) <= lo and hi <= 1 + NEAR_TIE else None
