"""A comparison of variants against a reference: rotated rounds, paired speedups with intervals, noise named.

:func:`compare` takes one *sampler* per variant (a callable returning seconds per call of one
sample: :mod:`mlcomp.measure.samplers` makes them, in this process or in a worker process per
variant) and

1. takes rounds of one sample of each, the first variant of a round one later than in the
   round before (each follows every other equally often), so load that comes and goes falls
   on all of them alike;
2. reads the machine's load after every round (:meth:`mlcomp.hardware.noise.LoadWatch.lap`)
   and sets aside the rounds during which other processes kept busy the cores this run
   needs, as long as ``min_rounds`` quiet ones remain;
3. after ``min_rounds`` stops when ``budget_s`` per variant is spent, or earlier once every
   speedup's interval is within ``precision`` (relative half width), or at ``max_rounds``;
4. gives per variant its :class:`~mlcomp.hardware.timing.Timing` (its samples), its speedup
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
from mlcomp.hardware.noise import Load, LoadWatch, is_busy, mean_load, noise_reasons
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
    rounds: int                             # rounds the figures come from (busy ones set aside excluded)
    load: Load | None                       # the mean load of those rounds
    reasons: dict[str, tuple[str, ...]]     # per variant (the reference too: load reasons only)
    stopped: str                            # why the rounds ended
    kept: tuple[int, ...] = ()              # indexes of the rounds the figures come from

    def to_json(self) -> dict[str, Any]:
        return {"reference": self.reference, "rounds": self.rounds, "stopped": self.stopped,
                "load": self.load.to_json() if self.load else None,
                "speedups": {k: v.to_json() for k, v in self.speedups.items()},
                "reasons": {k: list(v) for k, v in self.reasons.items()}}


def _speedups(samples: Mapping[str, list[float]], reference: str, kept: list[int]) -> dict[str, Speedup]:
    ref = [samples[reference][i] for i in kept]
    return {n: speedup_of(paired_ratios(ref, [s[i] for i in kept])) for n, s in samples.items() if n != reference}


def _tight(samples: Mapping[str, list[float]], reference: str, kept: list[int], precision: float | None) -> bool:
    if precision is None or len(samples) < 2:
        return False
    return all(s.half_width() <= precision and s.confidence >= 0.95
               for s in _speedups(samples, reference, kept).values())


class _Rounds:
    """The rounds taken so far: samples per variant, the load of each round, which rounds were quiet."""

    def __init__(self, samplers: Mapping[str, Sampler], watch: LoadWatch | None, threads: int) -> None:
        self.samplers, self.watch, self.threads = samplers, watch, threads
        self.names = list(samplers)
        self.samples: dict[str, list[float]] = {n: [] for n in self.names}
        self.loads: list[Load | None] = []
        self.quiet: list[int] = []

    def take(self) -> None:
        k = len(self.loads) % len(self.names)
        for name in self.names[k:] + self.names[:k]:
            self.samples[name].append(self.samplers[name]())
        load = self.watch.lap() if self.watch is not None else None
        if not is_busy(load, self.threads):
            self.quiet.append(len(self.loads))
        self.loads.append(load)


def compare(samplers: Mapping[str, Sampler], reference: str, *, budget_s: float = 1.0,
            min_rounds: int = MIN_ROUNDS, max_rounds: int = 10_000, precision: float | None = None,
            threads: int = 1, clock: Clock = time.perf_counter, watch: LoadWatch | None = None,
            warmup_s: Mapping[str, tuple[float, int]] | None = None, patience_s: float = 0.0) -> Comparison:
    """Time ``samplers`` in rotated rounds against ``reference`` (module doc); ``watch`` reads the load
    (None: not read); ``threads``: the cores one variant uses, for the busy rule.

    Rounds during which other processes kept the cores busy are set aside when at least
    ``min_rounds`` quiet ones remain; to collect them the rounds may go on ``patience_s`` past the budget.
    """
    if reference not in samplers:
        raise ValueError(f"the reference {reference!r} is not one of {list(samplers)}")
    r = _Rounds(samplers, watch, threads)
    fewest = max(1, min(min_rounds, max_rounds))
    if watch is not None:
        watch.start()
    begin, stopped, check_at = clock(), f"{max_rounds} rounds, the most allowed", fewest
    spend = budget_s * len(r.names)
    while len(r.loads) < max_rounds:
        r.take()
        rounds, elapsed = len(r.loads), clock() - begin
        if rounds < fewest:
            continue
        if elapsed >= spend and (len(r.quiet) >= fewest or elapsed >= spend + patience_s):
            stopped = f"the budget ({budget_s:g} s per variant) spent"
            break
        if len(r.quiet) >= fewest and rounds >= check_at:    # geometric steps: O(rounds log rounds) in all
            check_at = rounds + max(1, rounds // 8)
            if _tight(r.samples, reference, r.quiet, precision):
                stopped = f"every interval within +-{precision:.0%}"
                break
    return _result(r, reference, budget_s, fewest, stopped, warmup_s or {})


def _result(r: _Rounds, reference: str, budget_s: float, fewest: int, stopped: str,
            warm: Mapping[str, tuple[float, int]]) -> Comparison:
    """The comparison from the quiet rounds when there are enough of them, else from all."""
    kept = r.quiet if len(r.quiet) >= fewest else list(range(len(r.loads)))
    aside = len(r.loads) - len(kept)
    if aside:
        stopped += f"; {aside} busy round(s) set aside"
    load = mean_load([r.loads[i] for i in kept])
    speedups = _speedups(r.samples, reference, kept)
    reasons = {n: tuple(noise_reasons(load, r.threads, speedups.get(n))) for n in r.names}
    timings = {n: Timing(tuple(r.samples[n][i] for i in kept), warm.get(n, (0.0, 0))[0], budget_s,
                         warm.get(n, (0.0, 0))[1]) for n in r.names}
    return Comparison(reference, timings, speedups, len(kept), load, reasons, stopped, tuple(kept))
