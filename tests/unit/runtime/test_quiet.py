"""The settle before a timing sample: wait until the watched threads stop using CPU (fake clocks), and what is watched."""
from __future__ import annotations

import threading
import time

from mlcomp.runtime import quiet
from mlcomp.runtime.quiet import QUIET_WINDOW_S, cpu_of_others, wait_quiet


class Spinner:
    """CPU seconds of threads that spin (a whole core) until ``stop_at``, then only wake up now and then."""

    def __init__(self, stop_at: float, trickle: float = 0.0) -> None:
        self.now, self.stop_at, self.trickle = 0.0, stop_at, trickle

    def clock(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds

    def used(self) -> float:
        return min(self.now, self.stop_at) + self.trickle * max(0.0, self.now - self.stop_at)


def test_the_wait_ends_one_window_after_the_spinning_stops():
    spin = Spinner(stop_at=0.02)
    waited = wait_quiet(spin.used, 0.1, clock=spin.clock, sleep=spin.sleep)
    assert 0.02 + QUIET_WINDOW_S <= waited <= 0.02 + QUIET_WINDOW_S + 2 * quiet.POLL_S


def test_idle_wake_ups_below_the_share_count_as_quiet_and_a_pool_that_never_stops_costs_the_limit():
    trickle = Spinner(stop_at=0.0, trickle=quiet.QUIET_SHARE / 2)        # an idle pool's periodic wake-ups
    assert wait_quiet(trickle.used, 0.1, clock=trickle.clock, sleep=trickle.sleep) <= QUIET_WINDOW_S + 2 * quiet.POLL_S
    busy = Spinner(stop_at=10.0)
    waited = wait_quiet(busy.used, 0.1, clock=busy.clock, sleep=busy.sleep)
    assert 0.1 <= waited <= 0.1 + 2 * quiet.POLL_S


def test_the_reading_counts_this_process_s_other_threads_not_the_caller():
    used = cpu_of_others()
    stop = threading.Event()
    before = used()

    def spin() -> None:
        while not stop.is_set():
            pass
    worker = threading.Thread(target=spin)
    worker.start()
    try:
        for _ in range(10_000):            # the spinning thread's CPU shows up (however loaded the machine is)
            if used() > before:
                break
            stop.wait(0.001)
    finally:
        stop.set()
        worker.join()
    assert used() > before
    mine = cpu_of_others()
    first = mine()
    t0, x = time.thread_time(), 0
    while time.thread_time() - t0 < 0.2:    # the caller's own work (0.2 CPU-s) is not counted
        x += 1
    assert mine() - first < 0.05
