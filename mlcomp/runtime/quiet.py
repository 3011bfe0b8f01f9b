"""Wait until the other runtimes' threads stop spinning: the settle before a timing sample.

A runtime's thread pool keeps spinning for a while after its last call (ONNX Runtime's longest),
taking a core from whatever is timed next, in this process or another.  Rather than
waiting a fixed time longer than any such spin, :func:`wait_quiet` watches the CPU clocks of the
threads that could spin (every thread of this process but the caller's, every thread of the
other timing processes: :func:`cpu_of_others`) and returns once they used under ``QUIET_SHARE``
of a core over the last ``QUIET_WINDOW_S``::

    others' CPU:  ████████████████▏▏          spinning, then quiet
    wait:         |------ waited ------|window|  -> sample

A spinning thread uses a whole core (it never sleeps), so it is never taken for quiet; an idle
pool's periodic wake-ups (OpenVINO's) are far below the share.  The wait is bounded by ``limit_s``,
so a process that never goes quiet costs at most that.

    >>> ticks = iter(i * 0.001 for i in range(1000))          # the clock: 1 ms per reading
    >>> used = iter([0.0, 0.001, 0.002, 0.003, 0.0031] + [0.0031] * 50)   # spins 3 ms, then quiet
    >>> round(wait_quiet(lambda: next(used), 0.1, clock=lambda: next(ticks), sleep=lambda s: None), 3)
    0.005
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence

__all__ = ["POLL_S", "QUIET_SHARE", "QUIET_WINDOW_S", "cpu_of_others", "wait_quiet"]

POLL_S = 0.0005          # between two readings of the CPU clocks
QUIET_WINDOW_S = 0.002   # the other threads are quiet once they used, over the last this many seconds, ...
QUIET_SHARE = 0.1        # ... under this share of one core


def cpu_of_others(pids: Sequence[int] = ()) -> Callable[[], float]:
    """A reading of the CPU seconds used so far by every thread of this process but the calling one and by
    every thread of the processes ``pids`` (this one's own pid skipped; a process that is gone adds nothing)."""
    clocks = [((~pid) << 3) | 2 for pid in pids if pid != os.getpid()]    # Linux: the process's CPU clock id

    def used() -> float:
        total = time.process_time() - time.thread_time()
        for clock in clocks:
            try:
                total += time.clock_gettime(clock)
            except OSError:
                pass
        return total
    return used


def wait_quiet(used: Callable[[], float], limit_s: float, *, clock: Callable[[], float] = time.perf_counter,
               sleep: Callable[[float], None] = time.sleep) -> float:
    """Sleep until ``used()`` (CPU seconds) grew by under ``QUIET_SHARE`` of the wall time over the last
    ``QUIET_WINDOW_S``, or ``limit_s`` passed; the seconds waited."""
    start = clock()
    readings = [(start, used())]
    while True:
        sleep(POLL_S)
        now, cpu = clock(), used()
        readings.append((now, cpu))
        while len(readings) > 2 and readings[1][0] <= now - QUIET_WINDOW_S:
            readings.pop(0)                  # keep the oldest reading at least a window back
        then, before = readings[0]
        if now - then >= QUIET_WINDOW_S and cpu - before <= QUIET_SHARE * (now - then):
            return now - start
        if now - start >= limit_s:
            return now - start
