"""Measured choices, made one way and recorded: paired rounds, a sign test, a :class:`Decision`.

A compile that picks between variants by timing them (TorchScript plain or optimised, a TVM
build tuned or not, a small GEMM as TVM code or a torch call) asks :func:`decide`:

* every candidate is warmed up, then sampled in rounds, one sample of each per round, the
  order rotated each round (each follows every other equally often);
* a contender's ratio in a round is its sample over the default's sample of the same round
  (load that hits both cancels);
* after ``min_rounds`` the rounds stop as soon as a two-sided sign test
  (:func:`~mlcomp.hardware.binomial.sign_test_p`) rejects "the median ratio is ``threshold``" at ``alpha`` for
  every contender, or when ``budget_s`` per candidate is spent;
* a contender wins only when decided below ``threshold`` (the smallest effect worth a
  change); with none, the default stays — also when the budget ran out undecided.

With ``deterministic=True`` nothing is sampled: the default is kept by a fixed rule.

    >>> samples = {"plain": iter([2.0] * 50).__next__, "tuned": iter([1.0] * 50).__next__}
    >>> d = decide("optimize_for_inference?", samples, policy=DecisionPolicy(warmup=0), clock=iter(range(999)).__next__)
    >>> d.choice, d.verdict.value, d.rounds, d.why
    ('tuned', 'decided', 6, 'decided by sign test p=0.031 after 6 rounds: tuned takes 0.5x the time of plain')
    >>> decide("optimize_for_inference?", samples, deterministic=True, rule="the plain trace").why
    'fixed rule (deterministic): the plain trace'
"""
from __future__ import annotations

import enum
import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from mlcomp.hardware.binomial import sign_test_p
from mlcomp.hardware.timing import Clock, Sync, no_sync

__all__ = ["ALPHA", "ELIMINATE_ABOVE", "MIN_ROUNDS", "Decision", "DecisionPolicy", "Sampler", "Verdict",
           "call_samplers", "clear_losers", "decide", "measure_times", "sign_test"]

ALPHA = 0.05        # a two-sided sign test below this decides
MIN_ROUNDS = 6      # the fewest paired rounds in which a sign test can decide at ALPHA (p = 2 / 2**6)
ELIMINATE_ABOVE = 1.5   # a contender decided slower than this many times the leader is a clear loser

Sampler = Callable[[], float]     # one sample of a candidate: seconds per call


def sign_test(ratios: Sequence[float], threshold: float = 1.0) -> float:
    """Two-sided sign-test p-value that the median of ``ratios`` is ``threshold`` (ties dropped).

        >>> round(sign_test([0.5] * 6), 4), sign_test([1.0] * 6), round(sign_test([0.5, 2.0] * 3), 4)
        (0.0312, 1.0, 1.0)
    """
    return sign_test_p(sum(r < threshold for r in ratios), sum(r > threshold for r in ratios))


def clear_losers(ratios: Mapping[str, Sequence[float]], *, factor: float = ELIMINATE_ABOVE, alpha: float = ALPHA,
                 min_rounds: int = MIN_ROUNDS) -> list[str]:
    """The contenders decided slower than ``factor`` x the leader: after ``min_rounds`` paired ratios (a
    contender's sample / the leader's, same round), their median is above ``factor`` and a sign test
    against ``factor`` gives p < ``alpha``.  A ranking stops sampling them (they cannot win).

        >>> clear_losers({"slow": [2.0] * 6, "close": [1.1] * 6, "young": [9.0] * 5})
        ['slow']
    """
    return [name for name, r in ratios.items()
            if len(r) >= min_rounds and median(r) > factor and sign_test(r, factor) < alpha]


class Verdict(enum.Enum):
    DECIDED = "decided"        # a sign test decided (for a contender, or for the default against all)
    UNDECIDED = "undecided"    # the budget ran out first: the default is kept
    FIXED = "fixed"            # nothing measured: a fixed rule (deterministic compile, nothing to compare)


@dataclass(frozen=True)
class DecisionPolicy:
    """How long and how sure: warm-up calls, seconds of samples per candidate, round bounds, test level,
    and the smallest effect that changes the choice (a contender must take < ``threshold`` x the default's time)."""

    warmup: int = 3
    budget_s: float = 0.25
    min_rounds: int = MIN_ROUNDS
    max_rounds: int = 2000
    alpha: float = ALPHA
    threshold: float = 0.9

    def to_json(self) -> dict[str, Any]:
        return {"warmup": self.warmup, "budget_s": self.budget_s, "min_rounds": self.min_rounds,
                "max_rounds": self.max_rounds, "alpha": self.alpha, "threshold": self.threshold}


@dataclass(frozen=True)
class Decision:
    """One choice and why: what was asked, among what, what was kept, and the evidence (JSON for the manifest)."""

    question: str
    candidates: tuple[str, ...]
    default: str
    choice: str
    verdict: Verdict
    why: str
    rounds: int = 0
    medians: Mapping[str, float] = field(default_factory=dict)     # seconds per sample
    ratios: Mapping[str, float] = field(default_factory=dict)      # median contender / default, same round
    p_values: Mapping[str, float] = field(default_factory=dict)    # sign test of those ratios at the threshold

    @classmethod
    def fixed(cls, question: str, candidates: Sequence[str], choice: str, rule: str, *,
              deterministic: bool = True) -> "Decision":
        """A choice made without measuring: ``rule`` says which (e.g. "the plain trace")."""
        why = f"fixed rule (deterministic): {rule}" if deterministic else f"fixed rule: {rule}"
        return cls(question, tuple(candidates), choice, choice, Verdict.FIXED, why)

    @property
    def decided_early(self) -> bool:
        return self.verdict is Verdict.DECIDED

    def to_json(self) -> dict[str, Any]:
        return {"question": self.question, "candidates": list(self.candidates), "default": self.default,
                "choice": self.choice, "verdict": self.verdict.value, "why": self.why, "rounds": self.rounds,
                "median_s": {k: _round(v) for k, v in self.medians.items()},
                "ratio": {k: round(v, 4) for k, v in self.ratios.items()},
                "p": {k: round(v, 5) for k, v in self.p_values.items()}}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Decision":
        return cls(data["question"], tuple(data["candidates"]), data["default"], data["choice"],
                   Verdict(data["verdict"]), data["why"], int(data.get("rounds", 0)),
                   dict(data.get("median_s", {})), dict(data.get("ratio", {})), dict(data.get("p", {})))


def _round(seconds: float) -> float:
    return float(f"{seconds:.4g}") if math.isfinite(seconds) else seconds


def call_samplers(fns: Mapping[str, Callable[[], Any]], *, warmup: int = 3, budget_s: float = 0.25,
                  clock: Clock = time.perf_counter, syncs: Mapping[str, Sync] | None = None,
                  lead_in: int = 0, per_call: Mapping[str, float] | None = None) -> dict[str, Sampler]:
    """Warm each of ``fns`` up (``warmup`` calls, at most ``budget_s`` seconds), then a sampler of each.

    A sample is ``lead_in`` untimed calls, then one timed call, each followed by the device's
    barrier; ``per_call`` scales it (a function that makes ``k`` calls has ``1 / k``).
    """
    sync = {n: (syncs or {}).get(n, no_sync) for n in fns}
    scale = {n: (per_call or {}).get(n, 1.0) for n in fns}
    for name, fn in fns.items():
        w0 = clock()
        for _ in range(warmup):
            fn()
            sync[name]()
            if clock() - w0 >= budget_s:     # a slow call: one budget of warm-up is enough
                break

    def sampler(name: str) -> Sampler:
        fn, barrier, k = fns[name], sync[name], scale[name]

        def sample() -> float:
            for _ in range(lead_in):
                fn()
            if lead_in:
                barrier()
            start = clock()
            fn()
            barrier()
            return (clock() - start) * k
        return sample
    return {name: sampler(name) for name in fns}


def decide(question: str, samplers: Mapping[str, Sampler], *, default: str | None = None,
           policy: DecisionPolicy = DecisionPolicy(), clock: Clock = time.perf_counter,
           deterministic: bool = False, rule: str | None = None) -> Decision:
    """Keep ``default`` (the first candidate unless named) unless a contender is decided faster (module doc).

    ``samplers`` take one sample each (see :func:`call_samplers`); ``clock`` bounds the rounds
    by ``policy.budget_s`` per candidate.  ``deterministic``: no sample is taken; the default is
    kept by the fixed rule ``rule``.
    """
    names = list(samplers)
    default = names[0] if default is None else default
    if default not in samplers:
        raise ValueError(f"default {default!r} is not one of the candidates {names}")
    if deterministic or len(names) == 1:
        return Decision.fixed(question, names, default, rule or f"kept {default}", deterministic=deterministic)
    contenders = [n for n in names if n != default]
    samples: dict[str, list[float]] = {n: [] for n in names}
    ratios: dict[str, list[float]] = {n: [] for n in contenders}
    p = {n: 1.0 for n in contenders}
    sides = {n: [0, 0] for n in contenders}      # rounds below / above the threshold
    begin, rounds = clock(), 0
    while rounds < policy.max_rounds:
        k = rounds % len(names)
        taken = {n: samplers[n]() for n in names[k:] + names[:k]}
        for n, s in taken.items():
            samples[n].append(s)
        base = taken[default]
        for n in contenders:
            r = taken[n] / base if base > 0 else (1.0 if taken[n] == 0 else math.inf)
            ratios[n].append(r)
            if r != policy.threshold:
                sides[n][r > policy.threshold] += 1
        rounds += 1
        if rounds >= policy.min_rounds:
            p = {n: sign_test_p(*sides[n]) for n in contenders}
            if all(v < policy.alpha for v in p.values()):
                break
            if clock() - begin >= policy.budget_s * len(names):
                break
    medians = {n: median(samples[n]) for n in names}
    ratio = {n: median(ratios[n]) for n in contenders}
    return _verdict(question, names, default, rounds, medians, ratio, p, policy)


def measure_times(question: str, fns: Mapping[str, Callable[[], Any]], *, rounds: int = 3,
                  policy: DecisionPolicy = DecisionPolicy(warmup=1), clock: Clock = time.perf_counter,
                  deterministic: bool = False, rule: str = "nothing timed") -> tuple[dict[str, float] | None, Decision]:
    """Median seconds per call of each of ``fns`` (``rounds`` rotated rounds after :func:`call_samplers`' warm-up)
    and the record of the measurement, for a choice that weighs measured times (remat's recompute costs).

    ``deterministic``: nothing runs; ``(None, fixed decision)``, and the caller takes its fixed ``rule``.

        >>> times, d = measure_times("cost?", {"a": lambda: None}, clock=iter(range(99)).__next__)
        >>> times, d.choice, d.why
        ({'a': 1.0}, 'measured', 'measured: 1 call(s), 3 rotated rounds each after 1 warm-up call(s)')
    """
    names = list(fns)
    if deterministic:
        return None, Decision.fixed(question, ("measured", "fixed"), "fixed", rule)
    samplers = call_samplers(fns, warmup=policy.warmup, budget_s=policy.budget_s, clock=clock)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for k in range(rounds):
        turn = k % max(len(names), 1)
        for n in names[turn:] + names[:turn]:
            samples[n].append(samplers[n]())
    times = {n: median(v) for n, v in samples.items()}
    why = f"measured: {len(names)} call(s), {rounds} rotated rounds each after {policy.warmup} warm-up call(s)"
    return times, Decision(question, ("measured", "fixed"), "fixed", "measured", Verdict.DECIDED, why, rounds=rounds)


def _verdict(question: str, names: list[str], default: str, rounds: int, medians: dict[str, float],
             ratio: dict[str, float], p: dict[str, float], policy: DecisionPolicy) -> Decision:
    winners = [n for n in ratio if p[n] < policy.alpha and ratio[n] < policy.threshold]
    evidence = dict(rounds=rounds, medians=medians, ratios=ratio, p_values=p)
    if winners:
        best = min(winners, key=lambda n: ratio[n])
        why = (f"decided by sign test p={p[best]:.2g} after {rounds} rounds: {best} takes "
               f"{ratio[best]:.3g}x the time of {default}")
        return Decision(question, tuple(names), default, best, Verdict.DECIDED, why, **evidence)
    if all(v < policy.alpha for v in p.values()):
        worst = max(p.values())
        why = (f"decided by sign test p<={worst:.2g} after {rounds} rounds: nothing takes under "
               f"{policy.threshold}x the time of {default}; kept {default}")
        return Decision(question, tuple(names), default, default, Verdict.DECIDED, why, **evidence)
    why = (f"undecided after {rounds} rounds (p={min(p.values()):.2g}, the budget spent): kept the default "
           f"{default}")
    return Decision(question, tuple(names), default, default, Verdict.UNDECIDED, why, **evidence)
