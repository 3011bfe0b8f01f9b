"""Timing, measured the way the textbook intends but correctly.

The chapter times a loop with a wall clock and, on asynchronous backends, a
barrier before the clock stops.  This module makes each of those steps explicit
and injectable so that tests can drive it with fakes:

* warm-up calls run before any sample is taken (first-call costs: allocator
  pools, kernel selection, lazy imports, JIT) — ``warmup`` of them, or fewer
  once they have used up one time budget;
* every sample is ``clock(); fn(); sync(); clock()`` — the synchroniser runs
  *before* the clock stops, so work still queued on a device is counted;
* samples are taken until the time budget is spent, but never fewer than
  ``min_repeats`` nor more than ``max_repeats``;
* the summary is the median and the 90th percentile, not the mean (one
  preempted sample does not move a median).

    >>> t = measure(lambda: sum(range(100)), TimingPolicy(warmup=1, budget_s=0.01, min_repeats=5))
    >>> t.repeats >= 5, 0 < t.median <= t.p90        # seconds per call; values depend on the machine
    (True, True)

Peak memory lives in :mod:`mlcomp.hardware.peak_memory`.
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from mlcomp.base.errors import MlcompError

Clock = Callable[[], float]
Sync = Callable[[], None]


class BenchConfigError(MlcompError):
    """A benchmark or study option is out of range (budget, repeats, batch sizes, targets)."""


def no_sync() -> None:
    """The synchroniser of a synchronous device (CPU torch returns only when the work is done)."""


def synchronizer(device: Any) -> Sync:
    """The barrier for ``device``: ``torch.cuda.synchronize`` on CUDA, :func:`no_sync` on CPU."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return lambda: torch.cuda.synchronize(dev)
    return no_sync


def calls_per_block(block_s: float, per_call_s: float, most: int = 1000) -> int:
    """How many calls of ``per_call_s`` seconds last about ``block_s`` (at least 1, at most ``most``).

        >>> calls_per_block(0.02, 40e-6), calls_per_block(0.02, 0.5)
        (500, 1)
    """
    return max(1, min(most, math.ceil(block_s / max(per_call_s, 1e-9))))


# ---------------------------------------------------------------------------
# statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between order statistics."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0..100")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50.0)


@dataclass(frozen=True)
class TimingPolicy:
    """How to measure one thing: warm-up calls, time budget, bounds on the number of samples."""

    warmup: int = 3
    budget_s: float = 1.0
    min_repeats: int = 5
    max_repeats: int = 10_000

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise BenchConfigError(f"warm-up count {self.warmup} is negative", hint="use 0 or more")
        if not self.budget_s > 0:
            raise BenchConfigError(f"time budget {self.budget_s} s is not positive",
                                   hint="give --budget in seconds per measurement, e.g. --budget 1")
        if self.min_repeats < 1 or self.max_repeats < self.min_repeats:
            raise BenchConfigError(
                f"repeat bounds min={self.min_repeats} max={self.max_repeats} are inconsistent",
                hint="need 1 <= --min-repeats <= --max-repeats")


@dataclass(frozen=True)
class Timing:
    """Samples of one measurement, in seconds per call of the timed function."""

    samples: tuple[float, ...]
    warmup_s: float = 0.0
    budget_s: float = 0.0
    warmup_calls: int = 0

    @property
    def repeats(self) -> int:
        return len(self.samples)

    @property
    def median(self) -> float:
        return median(self.samples)

    @property
    def p90(self) -> float:
        return percentile(self.samples, 90.0)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def mean(self) -> float:
        return sum(self.samples) / len(self.samples)

    def to_json(self) -> dict[str, Any]:
        return {"median_s": self.median, "p90_s": self.p90, "min_s": self.min, "mean_s": self.mean,
                "repeats": self.repeats, "warmup_s": self.warmup_s, "warmup_calls": self.warmup_calls}


def measure(fn: Callable[[], Any], policy: TimingPolicy = TimingPolicy(), *, clock: Clock = time.perf_counter,
            sync: Sync = no_sync) -> Timing:
    """Time ``fn`` per :class:`TimingPolicy`; see the module docstring for the protocol."""
    w0 = clock()
    warm, calls = 0.0, 0
    while calls < policy.warmup:
        fn()
        sync()
        calls += 1
        warm = clock() - w0
        if warm >= policy.budget_s:      # a slow model: one budget of warm-up is enough
            break
    samples: list[float] = []
    begin = clock()
    while len(samples) < policy.max_repeats:
        start = clock()
        fn()
        sync()                      # drain queued device work before the clock stops
        stop = clock()
        samples.append(stop - start)
        if len(samples) >= policy.min_repeats and stop - begin >= policy.budget_s:
            break
    return Timing(tuple(samples), warm, policy.budget_s, calls)


def measure_interleaved(fns: Mapping[str, Callable[[], Any]], policy: TimingPolicy = TimingPolicy(), *,
                        clock: Clock = time.perf_counter,
                        sync: Sync | Mapping[str, Sync] = no_sync, lead_in: int = 0) -> dict[str, Timing]:
    """Time several variants round-robin, one sample of each per round.

    On a shared machine the load drifts; timing variant A for a second and then
    B for a second compares A's moment with B's.  Interleaving spreads the drift
    over every variant.  Each variant is warmed up first; rounds continue until
    ``len(fns) * budget_s`` is spent (at least ``min_repeats`` rounds, at most
    ``max_repeats``).  ``sync`` is one synchroniser or one per variant.  ``lead_in`` calls of
    a variant run untimed right before each of its samples: variants that are different
    runtimes in one process (torch, ONNX Runtime, OpenVINO) each keep a thread pool that
    spins for a while after its last call, and the first call of the next runtime competes
    with it for the cores, a cost none of them pays when it runs alone.
    """
    syncs = {k: (sync[k] if isinstance(sync, Mapping) else sync) for k in fns}
    warm: dict[str, tuple[float, int]] = {}
    for name, fn in fns.items():
        w0, calls = clock(), 0
        while calls < policy.warmup:
            fn()
            syncs[name]()
            calls += 1
            if clock() - w0 >= policy.budget_s:
                break
        warm[name] = (clock() - w0, calls)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    begin, rounds = clock(), 0
    while rounds < policy.max_repeats:
        for name, fn in fns.items():
            if lead_in:
                for _ in range(lead_in):
                    fn()
                syncs[name]()
            start = clock()
            fn()
            syncs[name]()
            samples[name].append(clock() - start)
        rounds += 1
        if rounds >= policy.min_repeats and clock() - begin >= policy.budget_s * len(fns):
            break
    return {k: Timing(tuple(samples[k]), warm[k][0], policy.budget_s, warm[k][1]) for k in fns}


def fmt_seconds(s: float | None) -> str:
    """``1.23 ms`` style, three significant digits."""
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return "—"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if abs(s) >= scale or unit == "ns":
            v = s / scale
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{s:g} s"  # pragma: no cover


def fmt_rate(v: float | None, unit: str) -> str:
    """``45.1 GFLOP/s`` style with SI prefixes."""
    if v is None:
        return "—"
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.3g} {prefix}{unit}"
    return f"{v:.3g} {unit}"
