"""A comparison of variants against a reference: rotated rounds, paired speedups with intervals, noise named.

:func:`compare` takes one *sampler* per variant (a callable returning seconds per call of one
sample: :mod:`mlcomp.measure.samplers` makes them, in this process or in a worker process per
variant) and

1. takes rounds of one sample of each, the first variant of a round one later than in the
   round before (each follows every other equally often), so load that comes and goes falls
   on all of them alike;
2. after ``min_rounds`` stops when ``budget_s`` per variant is spent, or earlier once every
   speedup's interval is within ``precision`` (relative half width), or at ``max_rounds``;
3. gives per variant its :class:`~mlcomp.hardware.timing.Timing` (its samples), its speedup
   over the reference from the paired per-round ratios with a 95 % interval
   (:func:`mlcomp.hardware.intervals.speedup_of`), and the reasons the figure cannot be
   trusted (:func:`mlcomp.hardware.noise.noise_reasons`: load while it ran, steal, spread,
   an interval that includes 1).

    >>> import itertools
    >>> ticks = itertools.count(step=0.01)                     # a fake clock: 10 ms per reading
    >>> c = compare({"eager": lambda: 2e-3, "cpu": lambda: 1e-3}, "eager", min_rounds=8, precision=0.03,
    ...             clock=lambda: next(ticks), watch=None)
    >>> c.speedups["cpu"].text(), c.rounds, c.stopped, c.reasons["cpu"]
    ('2.00x [2.00-2.00]', 8, 'every interval within +-3%', ())
"""
from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mlcomp.hardware.intervals import Speedup, paired_ratios, speedup_of
from mlcomp.hardware.noise import Load, LoadWatch, noise_reasons
from mlcomp.hardware.timing import Clock, Timing

__all__ = ["Comparison", "MIN_ROUNDS", "compare"]

MIN_ROUNDS = 8        # the fewest rounds of a comparison: a 95 % interval of the median needs 6
Sampler = Callable[[], float]


@dataclass(frozen=True)
class Comparison:
    """What :func:`compare` measured: samples per variant, speedups over the reference, load, reasons."""

    reference: str
    timings: dict[str, Timing]
    speedups: dict[str, Speedup]            # every variant but the reference
    rounds: int
    load: Load | None
    reasons: dict[str, tuple[str, ...]]     # per variant (the reference too: load reasons only)
    stopped: str                            # why the rounds ended

    def to_json(self) -> dict[str, Any]:
        return {"reference": self.reference, "rounds": self.rounds, "stopped": self.stopped,
                "load": self.load.to_json() if self.load else None,
                "speedups": {k: v.to_json() for k, v in self.speedups.items()},
                "reasons": {k: list(v) for k, v in self.reasons.items()}}


def _speedups(samples: Mapping[str, list[float]], reference: str) -> dict[str, Speedup]:
    ref = samples[reference]
    return {n: speedup_of(paired_ratios(ref, s)) for n, s in samples.items() if n != reference}


def _tight(samples: Mapping[str, list[float]], reference: str, precision: float | None) -> bool:
    if precision is None or len(samples) < 2:
        return False
    return all(s.half_width() <= precision and s.confidence >= 0.95 for s in _speedups(samples, reference).values())


def compare(samplers: Mapping[str, Sampler], reference: str, *, budget_s: float = 1.0,
            min_rounds: int = MIN_ROUNDS, max_rounds: int = 10_000, precision: float | None = None,
            threads: int = 1, clock: Clock = time.perf_counter, watch: LoadWatch | None = None,
            warmup_s: Mapping[str, tuple[float, int]] | None = None) -> Comparison:
    """Time ``samplers`` in rotated rounds against ``reference`` (module doc); ``watch`` reads the load
    (None: not read); ``threads``: the cores one variant uses, for the busy rule."""
    if reference not in samplers:
        raise ValueError(f"the reference {reference!r} is not one of {list(samplers)}")
    names = list(samplers)
    samples: dict[str, list[float]] = {n: [] for n in names}
    fewest = max(1, min(min_rounds, max_rounds))
    if watch is not None:
        watch.start()
    begin, rounds, stopped, check_at = clock(), 0, f"{max_rounds} rounds, the most allowed", fewest
    while rounds < max_rounds:
        k = rounds % len(names)
        for name in names[k:] + names[:k]:
            samples[name].append(samplers[name]())
        rounds += 1
        if rounds < fewest:
            continue
        if clock() - begin >= budget_s * len(names):
            stopped = f"the budget ({budget_s:g} s per variant) spent"
            break
        if rounds >= check_at:                   # checked at geometric steps: O(rounds log rounds) in all
            check_at = rounds + max(1, rounds // 8)
            if _tight(samples, reference, precision):
                stopped = f"every interval within +-{precision:.0%}"
                break
    load = watch.stop() if watch is not None else None
    speedups = _speedups(samples, reference)
    reasons = {n: tuple(noise_reasons(load, threads, speedups.get(n))) for n in names}
    warm = warmup_s or {}
    timings = {n: Timing(tuple(samples[n]), warm.get(n, (0.0, 0))[0], budget_s, warm.get(n, (0.0, 0))[1])
               for n in names}
    return Comparison(reference, timings, speedups, rounds, load, reasons, stopped)
