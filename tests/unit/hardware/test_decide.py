"""mlcomp.hardware.decide on fake samplers and a fake clock: what is decided, when it stops, what is recorded."""
from __future__ import annotations

import json

import pytest

from mlcomp.hardware.decide import Decision, DecisionPolicy, Verdict, call_samplers, decide, sign_test


class Ticks:
    """A clock that advances by what the samplers 'took' (nothing else moves it)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sampler(self, times):
        it = iter(times)

        def sample() -> float:
            took = next(it)
            self.now += took
            return took
        return sample


def forever(*values: float):
    while True:
        yield from values


POLICY = DecisionPolicy(warmup=0, budget_s=0.1, min_rounds=6, max_rounds=1000, threshold=0.9)


def test_a_clear_winner_is_decided_in_the_fewest_rounds():
    clock = Ticks()
    d = decide("which?", {"plain": clock.sampler(forever(1e-3)), "fast": clock.sampler(forever(4e-4))},
               policy=POLICY, clock=clock)
    assert (d.choice, d.verdict, d.rounds, d.default) == ("fast", Verdict.DECIDED, 6, "plain")
    assert d.ratios["fast"] == pytest.approx(0.4) and d.p_values["fast"] == pytest.approx(2 / 2 ** 6)
    assert d.why == "decided by sign test p=0.031 after 6 rounds: fast takes 0.4x the time of plain"
    assert clock.now < 2 * POLICY.budget_s                  # stopped early, before the budget


def test_a_clear_loser_is_decided_too_and_the_default_stays():
    clock = Ticks()
    d = decide("which?", {"plain": clock.sampler(forever(1e-3)), "slow": clock.sampler(forever(3e-3))},
               policy=POLICY, clock=clock)
    assert (d.choice, d.verdict, d.rounds) == ("plain", Verdict.DECIDED, 6)
    assert "nothing takes under 0.9x the time of plain" in d.why


def test_a_tie_stays_undecided_and_keeps_the_default_after_the_budget():
    clock = Ticks()
    d = decide("which?", {"plain": clock.sampler(forever(1e-3)), "other": clock.sampler(forever(0.85e-3, 0.95e-3))},
               policy=POLICY, clock=clock)
    assert (d.choice, d.verdict) == ("plain", Verdict.UNDECIDED)
    assert d.why.startswith("undecided after ") and d.why.endswith("kept the default plain")
    assert clock.now >= 2 * POLICY.budget_s and d.rounds > POLICY.min_rounds


def test_an_effect_under_the_threshold_does_not_win():
    clock = Ticks()   # 5 % faster every round: decided, but not by the smallest effect worth a change
    d = decide("which?", {"plain": clock.sampler(forever(1e-3)), "other": clock.sampler(forever(0.95e-3))},
               policy=POLICY, clock=clock)
    assert (d.choice, d.verdict) == ("plain", Verdict.DECIDED)


def test_three_candidates_the_best_decided_one_wins_and_rounds_rotate():
    order: list[str] = []
    clock = Ticks()

    def tracked(name, times):
        inner = clock.sampler(times)
        return lambda: (order.append(name), inner())[1]
    d = decide("which?", {"a": tracked("a", forever(1.0)), "b": tracked("b", forever(0.5)),
                          "c": tracked("c", forever(0.3))}, policy=POLICY, clock=clock)
    assert d.choice == "c" and d.verdict is Verdict.DECIDED
    assert order[:9] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]


def test_deterministic_never_calls_a_sampler():
    def never() -> float:
        raise AssertionError("sampled in a deterministic decision")
    d = decide("which?", {"plain": never, "tuned": never}, deterministic=True, rule="the plain trace")
    assert (d.choice, d.verdict, d.rounds, d.why) == ("plain", Verdict.FIXED, 0,
                                                      "fixed rule (deterministic): the plain trace")
    named = decide("which?", {"a": never, "b": never}, default="b", deterministic=True)
    assert named.choice == "b"


def test_decision_json_round_trip():
    clock = Ticks()
    d = decide("which?", {"plain": clock.sampler(forever(1e-3)), "fast": clock.sampler(forever(4e-4))},
               policy=POLICY, clock=clock)
    data = json.loads(json.dumps(d.to_json()))
    assert data["verdict"] == "decided" and data["choice"] == "fast" and data["median_s"]["fast"] == 4e-4
    again = Decision.from_json(data)
    assert (again.choice, again.verdict, again.rounds, again.why) == (d.choice, d.verdict, d.rounds, d.why)


def test_unknown_default_is_refused():
    with pytest.raises(ValueError, match="not one of the candidates"):
        decide("which?", {"a": lambda: 1.0}, default="b")


def test_sign_test_values():
    assert sign_test([0.5] * 6, 0.9) == pytest.approx(2 / 2 ** 6)
    assert sign_test([0.5] * 5, 0.9) > 0.05                 # why MIN_ROUNDS is 6
    assert sign_test([0.5, 1.5] * 4, 0.9) == 1.0
    assert sign_test([0.9] * 4, 0.9) == 1.0                 # ties carry no evidence


def test_call_samplers_warm_up_then_time_one_call_with_lead_in():
    calls: list[str] = []
    clock = Ticks()

    def fn() -> None:
        calls.append("call")
        clock.now += 0.25
    samplers = call_samplers({"f": fn}, warmup=2, budget_s=10.0, clock=clock, lead_in=1, per_call={"f": 0.5})
    assert calls == ["call", "call"]                         # the warm-up
    assert samplers["f"]() == pytest.approx(0.125)            # one lead-in call untimed, one timed, scaled
    assert len(calls) == 4


def test_the_sign_test_is_twice_the_smaller_binomial_tail_exactly():
    from fractions import Fraction

    assert sign_test([0.5] + [2.0] * 9) == pytest.approx(float(2 * Fraction(1 + 10, 2 ** 10)), rel=1e-12)  # k=1, n=10
    assert sign_test([0.5] * 3 + [2.0] * 3) == 1.0                                         # balanced: capped at 1
