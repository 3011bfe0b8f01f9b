"""How sure a measured speedup is: paired per-round ratios, their median, and a confidence interval.

A comparison times its variants in rounds, one sample of each per round (see
:mod:`mlcomp.measure.rounds`).  A variant's speedup in round ``i`` is the reference's
sample over the variant's sample *of that round*: load that slows the whole round cancels.
The speedup reported is the median of those ratios; its interval is the distribution-free
order-statistic interval of a median (the inversion of the sign test of
:func:`mlcomp.hardware.decide.sign_test`): with ``n`` ratios sorted, ``[r_(k), r_(n-k+1)]``
where ``k`` is the largest rank with ``P(Binomial(n, 1/2) < k) <= (1 - confidence) / 2``.
No assumption is made about the shape of the noise.

    >>> s = speedup_of([2.0, 2.1, 1.9, 2.0, 2.05, 1.95, 2.0, 2.02])
    >>> s.median, s.lo, s.hi, s.rounds
    (2.0, 1.9, 2.1, 8)
    >>> s.text()
    '2.00x [1.90-2.10]'

Fewer than six ratios cannot give a 95 % interval; the interval is then the whole range and
:attr:`Speedup.confidence` says what it reaches (below the level asked for).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlcomp.hardware.binomial import lower_tail, median_rank

__all__ = ["CONFIDENCE", "Speedup", "median_interval", "paired_ratios", "relative_iqr", "speedup_of"]

CONFIDENCE = 0.95     # the level of every interval mlcomp prints


def median_interval(values: Sequence[float], confidence: float = CONFIDENCE) -> tuple[float, float, float]:
    """(lo, hi, confidence reached): the order-statistic interval for the median of ``values``.

        >>> median_interval([float(v) for v in range(1, 21)])
        (6.0, 15.0, 0.9586105346679688)
        >>> median_interval([1.0, 2.0, 3.0])[:2]          # too few for 95 %: the whole range
        (1.0, 3.0)
    """
    if not values:
        raise ValueError("the median interval of no values")
    s, n = sorted(values), len(values)
    tail = (1.0 - confidence) / 2
    k = max(median_rank(n, tail), 1)          # the smallest k with P(X <= k) >= tail
    reached = 1.0 - 2.0 * lower_tail(k - 1, n)
    return s[k - 1], s[n - k], reached


def relative_iqr(values: Sequence[float]) -> float:
    """Interquartile range over the median: how much values vary, robust to a few outliers.

        >>> relative_iqr([1.0, 1.0, 1.0, 1.0]), round(relative_iqr([0.8, 1.0, 1.0, 1.2]), 3)
        (0.0, 0.1)
    """
    from mlcomp.hardware.timing import percentile

    mid = percentile(values, 50.0)
    return (percentile(values, 75.0) - percentile(values, 25.0)) / mid if mid > 0 else math.inf


def paired_ratios(reference: Sequence[float], variant: Sequence[float]) -> list[float]:
    """Per round: the reference's sample over the variant's (above 1: the variant is faster)."""
    return [a / b if b > 0 else (1.0 if a == 0 else math.inf) for a, b in zip(reference, variant)]


@dataclass(frozen=True)
class Speedup:
    """The median paired ratio (reference time / variant time), its interval, rounds and spread."""

    median: float
    lo: float
    hi: float
    rounds: int
    confidence: float              # what the interval reaches (CONFIDENCE, or less with few rounds)
    spread: float                  # relative IQR of the per-round ratios

    @property
    def width(self) -> float:
        """hi / lo: 1.0 is a point; 1.2 means the interval spans 20 %."""
        return self.hi / self.lo if self.lo > 0 else math.inf

    @property
    def straddles_one(self) -> bool:
        return self.lo < 1.0 < self.hi

    def half_width(self) -> float:
        """Half the interval relative to the median (0.03: about +-3 %)."""
        return (self.hi - self.lo) / (2 * self.median) if self.median > 0 else math.inf

    def text(self) -> str:
        return f"{self.median:.2f}x [{_num(self.lo)}-{_num(self.hi)}]"

    def to_json(self) -> dict[str, Any]:
        return {"median": self.median, "lo": self.lo, "hi": self.hi, "rounds": self.rounds,
                "confidence": round(self.confidence, 4), "spread": round(self.spread, 4)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> "Speedup":
        return cls(d["median"], d["lo"], d["hi"], d["rounds"], d["confidence"], d["spread"])


def _num(v: float) -> str:
    return f"{v:.2f}" if v < 100 else f"{v:.0f}"


def speedup_of(ratios: Sequence[float], confidence: float = CONFIDENCE) -> Speedup:
    """The :class:`Speedup` of per-round ratios (reference / variant)."""
    from mlcomp.hardware.timing import median

    lo, hi, reached = median_interval(ratios, confidence)
    return Speedup(median(ratios), lo, hi, len(ratios), reached, relative_iqr(ratios))
