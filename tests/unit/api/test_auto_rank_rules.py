"""The ranking's early rules, on fake samples: a loser above EARLY_ABOVE in every round leaves after
EARLY_ROUNDS (two rounds in each timing process), and a contender as fast as the leader within the noise
the timing processes show (one process's median ratio says faster, the other's slower) ends the tie-break
and is reported as such.  Round ``i`` is timed in process ``i % procs``, as the pool's alternating groups do.
"""
from __future__ import annotations

import itertools
from pathlib import Path
from typing import Any

import pytest

from mlcomp.api.auto import rank as auto_rank
from mlcomp.api.auto import timed
from mlcomp.api.auto.phases import Phases
from mlcomp.api.auto.search import Candidate
from mlcomp.api.auto.workers import WorkerPool
from mlcomp.hardware.binomial import sign_test_p as _sign_p
from mlcomp.hardware.intervals import median_interval
from mlcomp.hardware.timing import TimingPolicy
from tests.unit.api.test_auto_quick import FakeProcess, Saveable

POLICY = TimingPolicy(warmup=0, budget_s=1.0, min_repeats=3, max_repeats=60)


def _ticks():
    ticks = itertools.count(step=0.001)
    return lambda: next(ticks)


def _per_process(times: dict[str, list[float]]):
    """Samplers whose ``k``-th call returns ``times[name][k % len]``: with one entry per process, the value
    of the process that round is timed in."""
    calls = {n: itertools.count() for n in times}
    return {n: (lambda n=n: times[n][next(calls[n]) % len(times[n])]) for n in times}


def test_a_loser_above_the_early_bound_in_every_round_leaves_after_two_rounds_in_each_process():
    samplers = _per_process({"a": [1e-3], "slow": [1.3e-3, 1.25e-3], "close": [1.1e-3]})
    ranking = auto_rank.rank_samplers(samplers, POLICY, clock=_ticks(), procs=2)
    gone = ranking.eliminated["slow"]
    assert (gone.after_rounds, gone.leader, gone.early) == (auto_rank.EARLY_ROUNDS, "a", auto_rank.EARLY_ABOVE)
    assert gone.why == "eliminated after 4 rounds: 1.27x the time of a, above 1.2x in every round"
    assert "close" not in ranking.eliminated and ranking.picked == "a"
    # three processes: not before two rounds in each
    three = auto_rank.rank_samplers(_per_process({"a": [1e-3], "slow": [1.3e-3]}), POLICY, clock=_ticks(), procs=3)
    assert three.eliminated["slow"].after_rounds == 6
    # one round at 1.15x: never above the bound in every round, so it stays until the sign test decides
    dips = _per_process({"a": [1e-3], "slow": [1.3e-3, 1.3e-3, 1.15e-3, 1.3e-3]})
    kept = auto_rank.rank_samplers(dips, POLICY, clock=_ticks(), procs=2)
    assert "slow" not in kept.eliminated and kept.p_values["slow"] < auto_rank.ALPHA
    assert kept.decision().verdict.value == "decided"


def test_an_early_loser_counts_as_decided():
    ranking = auto_rank.rank_samplers(_per_process({"a": [1e-3], "b": [2e-3]}), POLICY, clock=_ticks(), procs=2)
    assert ranking.rounds == auto_rank.EARLY_ROUNDS and ranking.p_values["b"] > auto_rank.ALPHA
    decision = ranking.decision()
    assert decision.verdict.value == "decided" and "(b eliminated)" in decision.why


def test_a_tie_within_the_processes_noise_ends_the_tie_break_and_says_so():
    """b is 0.97x a in process 0 and 1.08x in process 1: the processes disagree about which is faster; one
    process (the same samples) has no such evidence and samples on."""
    times = {"a": [1e-3], "b": [0.97e-3, 1.08e-3]}
    ranking = auto_rank.rank_samplers(_per_process(times), POLICY, clock=_ticks(), procs=2)
    other = "b" if ranking.picked == "a" else "a"
    tie = ranking.noise_ties[other]
    assert ranking.tie_break_rounds == 0 and ranking.rounds == auto_rank.MIN_ROUNDS
    assert sorted(round(r, 4) for r in tie.per_process) in ([0.97, 1.08], [0.9259, 1.0309])
    assert "within the timing processes' noise" in ranking.decision().why
    alone = auto_rank.rank_samplers(_per_process(times), POLICY, clock=_ticks(), procs=1)
    assert alone.noise_ties == {} and alone.rounds + alone.tie_break_rounds > ranking.rounds


def test_processes_that_agree_on_a_small_difference_make_no_tie():
    """1.04x in one process, 1.05x in the other: the spread (1 %) is below the difference, the sign test decides."""
    ranking = auto_rank.rank_samplers(_per_process({"a": [1e-3], "b": [1.04e-3, 1.05e-3]}), POLICY,
                                      clock=_ticks(), procs=2)
    assert ranking.picked == "a" and ranking.noise_ties == {} and ranking.p_values["b"] < auto_rank.ALPHA
    assert auto_rank.noise_tie([1.04, 1.05] * 3, 2) is None
    assert auto_rank.noise_tie([1.05, 1.9] * 3, 2) is None           # same direction, another size: no tie
    steady = [[1.0] * 6, [1.04, 1.05] * 3]                            # each candidate alike in both processes
    assert auto_rank.noise_tie([1.04, 1.05] * 3, 2, steady) is None


def test_a_pair_closer_than_one_candidate_differs_between_the_processes_is_a_tie():
    """b is 1.03x a in most rounds (0.995x in one of three in process 0: the sign test cannot decide), and a itself
    runs 10 % slower in process 1 than in process 0: the pair is within the noise the processes show, so the
    ranking stops after MIN_ROUNDS and says so."""
    times = {"a": [1e-3, 1.1e-3], "b": [1.03e-3, 1.133e-3, 0.995e-3, 1.133e-3]}
    ranking = auto_rank.rank_samplers(_per_process(times), POLICY, clock=_ticks(), procs=2)
    tie = ranking.noise_ties["b"]
    assert ranking.picked == "a" and ranking.tie_break_rounds == 0 and ranking.rounds == auto_rank.MIN_ROUNDS
    assert round(tie.spread, 3) == 0.1 and round(tie.ratio, 3) == 1.03
    assert "a median 10% apart between them" in ranking.decision().why
    assert auto_rank.noise_tie([0.99, 1.1] * 2, 2) is None          # two ratios per process: too few to tell


class SkewedProcess(FakeProcess):
    """A fake timing process whose samples of ``b`` are ``skew[index]`` x its speed (the others: as the speed)."""

    skew = (0.97, 1.08)

    def sampler(self, name: str):
        def sample() -> float:
            self.log.append((self.index, "sample", name))
            return self.speed[name] * (self.skew[self.index] if name == "b" else 1.0)
        return sample


def test_the_row_and_the_manifest_say_a_pick_was_tied_within_the_processes_noise():
    log: list[tuple[int, str, str]] = []

    def spawn(feed: Path, n: int, **_: Any) -> list[FakeProcess]:
        return [SkewedProcess(i, {"a": 1e-3, "b": 1e-3}, log) for i in range(n)]
    pool = WorkerPool([], warmup=1, block_s=0.01, procs=2, spawn=spawn)

    class Built:
        def __init__(self) -> None:
            self.artifact = lambda *xs: None
    built = {"a": Built(), "b": Built()}
    rows = {n: Candidate(n, 0.1, verified=True) for n in built}
    with pool:
        for name in built:
            pool.add(name, Saveable())
        ranking, timed_in = timed.time_candidates(built, [], POLICY, _ticks(), rows, pool, Phases())
    other = "b" if ranking.picked == "a" else "a"
    assert timed_in.startswith("2 ") and list(ranking.noise_ties) == [other]
    assert "within the timing processes' noise (per process" in rows[other].reason
    assert rows[ranking.picked].reason is None


def test_the_environment_turns_the_early_rules_off(monkeypatch):
    monkeypatch.delenv("MLCOMP_AUTO_RANK", raising=False)
    assert timed._rules(2) == {"procs": 2, "early": auto_rank.EARLY_ABOVE}
    monkeypatch.setenv("MLCOMP_AUTO_RANK", "full")
    assert timed._rules(2) == {"procs": 1, "early": None}


def test_the_exact_sign_test_and_median_interval_match_the_binomial_tables():
    """Values of the binomial distribution at 1/2: two-sided p of k of n, the interval's ranks."""
    got = (_sign_p(0, 6), _sign_p(1, 9), _sign_p(5, 5), _sign_p(0, 0), _sign_p(2, 10))
    assert got == pytest.approx((1 / 32, 22 / 1024, 1.0, 1.0, 2 * (1 + 12 + 66) / 4096), rel=1e-12)
    assert _sign_p(8, 2) == _sign_p(2, 8)
    lo, hi, reached = median_interval([float(v) for v in range(1, 11)])         # n=10: ranks 2 and 9
    assert (lo, hi) == (2.0, 9.0) and reached == pytest.approx(1 - 2 * 11 / 1024, rel=1e-12)


def test_a_loser_in_every_round_whose_median_is_not_above_the_bound_stays():
    """Above 1.2x the leader in each of its rounds, but the leader's samples of other rounds were slower (the load
    changed): its median is not above 1.2x the leader's, so the early rule leaves it to the sign test."""
    from mlcomp.api.auto.rank import _losers

    gone = _losers({"b": [1.3] * 4}, 4, "a", 2, 1.2, {"a": 1e-3, "b": 1.3e-3})
    assert list(gone) == ["b"] and gone["b"].early == 1.2
    assert _losers({"b": [1.3] * 4}, 4, "a", 2, 1.2, {"a": 2e-3, "b": 1.3e-3}) == {}
