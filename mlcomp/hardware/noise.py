"""Is this machine quiet enough to trust a timing?  What else ran, what the hypervisor took, and why not.

A :class:`LoadWatch` reads the kernel's CPU counters (``/proc/stat``) and this run's own CPU
time (``/proc/PID/stat`` of this process and its timing workers) when a comparison starts and
when it ends.  What the machine did minus what this run did is the *other* load, in cores;
``steal`` is the share of time a hypervisor gave to other guests.  :func:`noise_reasons` turns
that and a speedup's interval into one-line reasons a figure cannot be trusted, by the rules
of :data:`RULES` (a table, first to last):

=========  ===========================================================================
busy       other processes used more cores than this run left free (+ ``SLACK``)
steal      the hypervisor took more than ``STEAL_LIMIT`` of the CPU time
noisy      the per-round ratios vary more than ``SPREAD_LIMIT`` (relative IQR)
straddles  the interval includes 1: faster and slower are both consistent with the data
=========  ===========================================================================

    >>> quiet = Load(others=0.1, steal=0.0, cores=2, loadavg=0.4)
    >>> noise_reasons(quiet, threads=2)
    []
    >>> noise_reasons(Load(others=1.0, steal=0.0, cores=2, loadavg=3.1), threads=2)
    ['busy: other processes used 1.0 of 2 cores while this run needed 2 (load average 3.1)']

:func:`settle` waits (bounded) until the machine is quiet before a comparison starts.
The counters are read through an injectable ``read`` so tests drive all of it with fakes.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from mlcomp.hardware.intervals import Speedup

__all__ = ["Load", "LoadWatch", "RULES", "CpuTimes", "cores_available", "is_busy", "mean_load", "noise_reasons",
           "read_cpu_times", "settle"]

SLACK = 0.5            # cores of other load tolerated beyond what this run leaves free
STEAL_LIMIT = 0.05     # share of CPU time a hypervisor may take
SPREAD_LIMIT = 0.25    # relative IQR of the per-round ratios


@dataclass(frozen=True)
class CpuTimes:
    """One reading, in clock ticks: the machine's total and busy time, steal, and this run's own time."""

    total: int
    busy: int
    steal: int
    ours: int
    cpus: int            # CPUs the machine counters cover


def _own_ticks(pids: Sequence[int]) -> int:
    ticks = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])      # utime, stime
        except (OSError, IndexError, ValueError):
            continue                                        # a worker that has exited
    return ticks


def read_cpu_times(pids: Sequence[int] = ()) -> CpuTimes | None:
    """The machine's counters and the CPU time of this process plus ``pids``; None off Linux."""
    try:
        with open("/proc/stat") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    head = [int(v) for v in lines[0].split()[1:]]
    idle = head[3] + (head[4] if len(head) > 4 else 0)
    steal = head[7] if len(head) > 7 else 0
    total = sum(head[:8])
    cpus = sum(1 for s in lines[1:] if s.startswith("cpu"))
    return CpuTimes(total, total - idle, steal, _own_ticks([os.getpid(), *pids]), max(cpus, 1))


def cores_available() -> int:
    """Cores this process may run on (its affinity), else the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Load:
    """What the machine did while something was timed: other processes' cores, steal share, cores, load average."""

    others: float
    steal: float
    cores: int
    loadavg: float | None = None

    def text(self) -> str:
        avg = f", load average {self.loadavg:.1f}" if self.loadavg is not None else ""
        return f"other load {self.others:.1f} of {self.cores} cores, steal {self.steal:.0%}{avg}"

    def to_json(self) -> dict[str, Any]:
        return {"other_cores": round(self.others, 3), "steal": round(self.steal, 4), "cores": self.cores,
                "loadavg": self.loadavg}


def _loadavg() -> float | None:
    return os.getloadavg()[0] if hasattr(os, "getloadavg") else None


class LoadWatch:
    """Counters at :meth:`start` and at :meth:`stop`; ``pids`` (this run's workers) are asked for at each reading."""

    def __init__(self, pids: Callable[[], Sequence[int]] = tuple,
                 read: Callable[[Sequence[int]], CpuTimes | None] = read_cpu_times,
                 cores: int | None = None, loadavg: Callable[[], float | None] = _loadavg) -> None:
        self._pids, self._read, self._loadavg = pids, read, loadavg
        self.cores = cores if cores is not None else cores_available()
        self._first: CpuTimes | None = None
        self._lap: CpuTimes | None = None

    def start(self) -> None:
        self._first = self._lap = self._read(self._pids())

    def stop(self) -> Load | None:
        """The load since :meth:`start`; None where the counters cannot be read or no tick passed."""
        return self._between(self._first, self._read(self._pids()))

    def lap(self) -> Load | None:
        """The load since the last :meth:`lap` (or :meth:`start`): one round's worth."""
        now = self._read(self._pids())
        load, self._lap = self._between(self._lap, now), now
        return load

    def _between(self, first: CpuTimes | None, last: CpuTimes | None) -> Load | None:
        if first is None or last is None or last.total <= first.total:
            return None
        total = last.total - first.total
        others = max(0.0, (last.busy - first.busy) - (last.ours - first.ours)) / total * last.cpus
        return Load(min(others, float(last.cpus)), (last.steal - first.steal) / total, self.cores, self._loadavg())


# (name, does it apply?, the one line that says why) - first to last
Rule = tuple[str, Callable[[Load | None, int, Speedup | None], bool], Callable[[Load | None, int, Speedup | None], str]]
RULES: tuple[Rule, ...] = (
    ("busy", lambda ld, th, s: ld is not None and ld.others > max(0, ld.cores - th) + SLACK,
     lambda ld, th, s: f"busy: other processes used {ld.others:.1f} of {ld.cores} cores while this run needed "
                       f"{th}" + (f" (load average {ld.loadavg:.1f})" if ld.loadavg is not None else "")),
    ("steal", lambda ld, th, s: ld is not None and ld.steal > STEAL_LIMIT,
     lambda ld, th, s: f"steal: the hypervisor took {ld.steal:.0%} of the CPU time"),
    ("noisy", lambda ld, th, s: s is not None and s.spread > SPREAD_LIMIT,
     lambda ld, th, s: f"noisy: the per-round ratios vary {s.spread:.0%} (IQR over median)"),
    ("straddles", lambda ld, th, s: s is not None and s.straddles_one,
     lambda ld, th, s: f"interval {s.lo:.2f}-{s.hi:.2f} includes 1: not told apart from the reference"),
)


def is_busy(load: Load | None, threads: int) -> bool:
    """The first rule of :data:`RULES`: other processes used cores this run needed."""
    return RULES[0][1](load, threads, None)


def mean_load(loads: Sequence[Load | None]) -> Load | None:
    """The average of per-round loads (None where none could be read)."""
    known = [ld for ld in loads if ld is not None]
    if not known:
        return None
    n = len(known)
    return Load(sum(ld.others for ld in known) / n, sum(ld.steal for ld in known) / n, known[-1].cores,
                known[-1].loadavg)


def noise_reasons(load: Load | None, threads: int, speedup: Speedup | None = None) -> list[str]:
    """One line per rule of :data:`RULES` that applies (none: the figure can be trusted)."""
    return [why(load, threads, speedup) for _, applies, why in RULES if applies(load, threads, speedup)]


def settle(max_s: float, threads: int, *, watch: Callable[[], LoadWatch] = LoadWatch, window_s: float = 1.0,
           sleep: Callable[[float], None] = time.sleep, clock: Callable[[], float] = time.monotonic) -> str:
    """Wait until one ``window_s`` passes with the machine quiet (no busy or steal reason), at most ``max_s``.

    Returns one line saying how it went (quiet after how long, or what was still running).
    """
    begin, why = clock(), ["the load could not be read"]
    while True:
        w = watch()
        w.start()
        sleep(window_s)
        load = w.stop()
        why = noise_reasons(load, threads) if load is not None else why
        if load is not None and not why:
            return f"quiet after {clock() - begin:.0f} s of waiting ({load.text()})"
        if clock() - begin >= max_s:
            return f"still not quiet after {max_s:g} s of waiting: {'; '.join(why)}"
