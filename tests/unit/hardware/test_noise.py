"""mlcomp.hardware.intervals and mlcomp.hardware.noise with fake counters: no real load is read."""
from __future__ import annotations

import itertools

import pytest
from scipy.stats import binom

from mlcomp.hardware.intervals import median_interval, speedup_of
from mlcomp.hardware.noise import CpuTimes, Load, LoadWatch, noise_reasons, settle


@pytest.mark.parametrize("n", [6, 9, 20, 57, 200])
def test_median_interval_reaches_its_level_with_the_narrowest_order_statistics(n: int) -> None:
    lo, hi, reached = median_interval([float(v) for v in range(n)])
    k = int(lo) + 1                                        # 1-based rank of the lower bound
    assert hi == n - k and reached >= 0.95
    assert reached == pytest.approx(1 - 2 * binom.cdf(k - 1, n, 0.5))
    assert 1 - 2 * binom.cdf(k, n, 0.5) < 0.95            # one rank narrower would not reach 95 %


def test_few_values_give_the_whole_range_and_say_so() -> None:
    s = speedup_of([1.0, 2.0, 3.0])
    assert (s.lo, s.hi) == (1.0, 3.0) and s.confidence == pytest.approx(0.75)


def _watch(*readings: CpuTimes) -> LoadWatch:
    it = iter(readings)
    return LoadWatch(read=lambda pids: next(it), cores=2, loadavg=lambda: None)


def test_load_watch_subtracts_this_runs_own_time() -> None:
    w = _watch(CpuTimes(1000, 400, 0, 10, 2), CpuTimes(1200, 580, 10, 110, 2))
    w.start()
    load = w.stop()                                         # 180 busy ticks, 100 ours: 80 of 200 on 2 CPUs
    assert load.others == pytest.approx(0.8) and load.steal == pytest.approx(0.05)
    assert _watch(None, None).stop() is None


def test_rules_name_busy_and_steal_and_nothing_when_quiet() -> None:
    assert noise_reasons(Load(0.4, 0.0, 2), threads=2) == []
    assert noise_reasons(Load(1.2, 0.0, 2), threads=1) == []            # one core left free, 0.2 over: slack
    assert noise_reasons(Load(1.6, 0.0, 2), threads=1)[0].startswith("busy:")
    assert noise_reasons(Load(0.0, 0.08, 2), threads=1) == ["steal: the hypervisor took 8% of the CPU time"]


def test_settle_waits_for_a_quiet_window_and_is_bounded() -> None:
    now = itertools.count()
    states = iter([75, 75, 5])                            # others' ticks per window: busy, busy, quiet

    def watch() -> LoadWatch:
        others = next(states)
        return _watch(CpuTimes(0, 0, 0, 0, 2), CpuTimes(100, others, 0, 0, 2))
    line = settle(60, 2, watch=watch, sleep=lambda s: None, clock=lambda: float(next(now)))
    assert line.startswith("quiet after")
    always = settle(3, 2, watch=lambda: _watch(CpuTimes(0, 0, 0, 0, 2), CpuTimes(100, 75, 0, 0, 2)),
                    sleep=lambda s: None, clock=lambda: float(next(now)))
    assert always.startswith("still not quiet after 3 s of waiting: busy: other processes used 1.5 of 2 cores")


def test_laps_give_each_rounds_load() -> None:
    w = _watch(CpuTimes(0, 0, 0, 0, 2), CpuTimes(100, 50, 0, 50, 2), CpuTimes(200, 190, 0, 100, 2),
               CpuTimes(300, 240, 0, 150, 2))
    w.start()
    assert [w.lap().others for _ in range(2)] == [0.0, pytest.approx(1.8)]
    assert w.stop().others == pytest.approx(0.6)            # 90 others' ticks of 300 on 2 CPUs
