"""mlcomp.measure.rounds with a fake clock and injected load: intervals cover the true ratio, noise is named.

Samplers move a fake clock by their duration; the "machine" slows every variant alike during
a window of fake time (a load that comes and goes mid-run), or one variant only (what paired
rounds cannot cancel).  Nothing here reads a real clock or this machine's load.
"""
from __future__ import annotations

import random

import pytest

from mlcomp.hardware.noise import CpuTimes, LoadWatch
from mlcomp.measure.rounds import compare


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def loaded_sampler(clock: FakeClock, seconds: float, rng: random.Random, *, jitter: float = 0.05,
                   window: tuple[float, float] = (1.0, 2.0), factor: float = 4.0):
    """Seconds per call of ``seconds``, jittered, ``factor`` times slower while the clock is in ``window``."""
    def sample() -> float:
        slow = factor if window[0] <= clock.now < window[1] else 1.0
        took = seconds * slow * rng.lognormvariate(0.0, jitter)
        clock.now += took * 10                 # a sample is a block of ten calls
        return took
    return sample


def _watch(others_ticks, steal_ticks: int = 0) -> LoadWatch:
    """A watch whose counters say, per reading (one a round): 100 ticks passed on 2 CPUs, this run used 50
    and others ``others_ticks`` (a number, or a function of the reading's index)."""
    state = {"i": 0, "t": CpuTimes(0, 0, 0, 0, 2)}

    def read(pids):
        i, t = state["i"], state["t"]
        others = others_ticks(i) if callable(others_ticks) else others_ticks
        state["i"], state["t"] = i + 1, CpuTimes(t.total + 100, t.busy + 50 + others, t.steal + steal_ticks,
                                                 t.ours + 50, 2)
        return t
    return LoadWatch(read=read, cores=2, loadavg=lambda: 1.0)


def _run(seed: int, true_ratio: float = 2.0, **kw):
    clock, rng = FakeClock(), random.Random(seed)
    samplers = {"eager": loaded_sampler(clock, 2e-3, rng, **kw), "cpu": loaded_sampler(clock, 2e-3 / true_ratio, rng, **kw)}
    return compare(samplers, "eager", budget_s=1.5, clock=clock, precision=None, watch=None)


def test_load_that_comes_and_goes_mid_run_is_cancelled_by_paired_rounds() -> None:
    c = _run(0)
    eager, cpu = c.timings["eager"].samples, c.timings["cpu"].samples
    assert max(eager) > 3 * min(eager)                     # the load did hit: samples jump 4x mid-run
    s = c.speedups["cpu"]
    assert s.lo <= 2.0 <= s.hi and s.width < 1.1 and s.confidence >= 0.95
    assert c.rounds == len(cpu) >= 40 and c.reasons["cpu"] == ()


def test_intervals_cover_the_true_ratio_at_their_level() -> None:
    intervals = [_run(seed, true_ratio=1.7, jitter=0.15).speedups["cpu"] for seed in range(40)]
    covered = sum(s.lo <= 1.7 <= s.hi for s in intervals)
    assert covered >= 36                                   # 95 % intervals: about 38 of 40


def test_load_on_one_variant_only_is_named_noisy() -> None:
    clock, rng = FakeClock(), random.Random(1)
    eager = loaded_sampler(clock, 2e-3, rng, factor=1.0)
    hit = {"n": 0}

    def cpu() -> float:                                    # every other sample of cpu alone is 3x slower
        hit["n"] += 1
        took = 1e-3 * (3.0 if hit["n"] % 2 else 1.0)
        clock.now += took * 10
        return took
    c = compare({"eager": eager, "cpu": cpu}, "eager", budget_s=1.0, clock=clock, watch=None)
    assert any(r.startswith("noisy:") for r in c.reasons["cpu"])
    assert c.reasons["eager"] == ()


def test_equal_speeds_straddle_one_and_are_named() -> None:
    c = _run(3, true_ratio=1.0, jitter=0.1)
    s = c.speedups["cpu"]
    assert s.straddles_one
    assert c.reasons["cpu"] == (f"interval {s.lo:.2f}-{s.hi:.2f} includes 1: not told apart from the reference",)


def test_a_busy_machine_marks_every_variant_and_a_quiet_one_none() -> None:
    clock, rng = FakeClock(), random.Random(2)
    samplers = {"eager": loaded_sampler(clock, 2e-3, rng, factor=1.0), "cpu": loaded_sampler(clock, 1e-3, rng, factor=1.0)}
    busy = compare(samplers, "eager", budget_s=0.5, clock=clock, threads=2, watch=_watch(others_ticks=50))
    assert busy.load.others == pytest.approx(1.0)
    for name in ("eager", "cpu"):
        assert busy.reasons[name][0].startswith("busy: other processes used 1.0 of 2 cores")
    quiet = compare(samplers, "eager", budget_s=0.5, clock=clock, threads=2, watch=_watch(others_ticks=5))
    assert quiet.reasons == {"eager": (), "cpu": ()}
    stolen = compare(samplers, "eager", budget_s=0.5, clock=clock, threads=1, watch=_watch(5, steal_ticks=20))
    assert stolen.reasons["cpu"] == ("steal: the hypervisor took 20% of the CPU time",)


def test_tight_intervals_stop_early_and_noisy_ones_spend_the_budget() -> None:
    clock = FakeClock()

    def fixed(seconds: float):
        def sample() -> float:
            clock.now += seconds * 10
            return seconds
        return sample
    quick = compare({"eager": fixed(2e-3), "cpu": fixed(1e-3)}, "eager", budget_s=10.0, precision=0.03, clock=clock,
                    watch=None)
    assert quick.rounds == 8 and quick.stopped == "every interval within +-3%"
    noisy = _run(4, jitter=0.4)
    assert noisy.stopped.startswith("the budget") and noisy.rounds > 8


def test_the_reference_must_be_a_variant() -> None:
    with pytest.raises(ValueError, match="reference"):
        compare({"cpu": lambda: 1.0}, "eager")


def test_rounds_during_which_the_machine_was_busy_are_set_aside() -> None:
    """A load that slows one runtime more than another (thread pools) is not cancelled by pairing:
    the rounds it overlapped are dropped, read from the machine's counters round by round."""
    clock, rng = FakeClock(), random.Random(5)
    state = {"round": 0}
    eager = loaded_sampler(clock, 2e-3, rng, factor=1.0)

    def cpu() -> float:
        state["round"] += 1
        took = 1e-3 * (4.0 if 10 <= state["round"] < 40 else 1.0) * rng.lognormvariate(0.0, 0.05)
        clock.now += took * 10
        return took
    busy_rounds = _watch(lambda i: 80 if 10 <= i < 40 else 0)       # reading i ends round i
    c = compare({"eager": eager, "cpu": cpu}, "eager", budget_s=1.5, clock=clock, threads=2, watch=busy_rounds)
    s = c.speedups["cpu"]
    assert "30 busy round(s) set aside" in c.stopped and c.reasons["cpu"] == ()
    assert s.lo <= 2.0 <= s.hi and s.width < 1.1
    state["round"] = 0
    blind = compare({"eager": eager, "cpu": cpu}, "eager", budget_s=1.5, clock=clock, threads=2, watch=None)
    assert blind.speedups["cpu"].width > s.width               # without the counters the load stays in


def test_a_machine_busy_throughout_keeps_every_round_and_says_so() -> None:
    clock, rng = FakeClock(), random.Random(6)
    samplers = {"eager": loaded_sampler(clock, 2e-3, rng, factor=1.0), "cpu": loaded_sampler(clock, 1e-3, rng, factor=1.0)}
    c = compare(samplers, "eager", budget_s=0.5, clock=clock, threads=2, watch=_watch(90), patience_s=0.5)
    assert "set aside" not in c.stopped and c.rounds == len(c.timings["cpu"].samples)
    assert c.reasons["cpu"][0].startswith("busy: other processes used 1.8 of 2 cores")
