"""The binomial distribution at one half, as the sign test and the median's interval use it.

``Binomial(n, 1/2)`` is read from ``scipy.special.bdtr`` (its cumulative distribution, the routine
``scipy.stats.binom.cdf`` calls): importing ``scipy.special`` costs a few tenths of a CPU-second,
``scipy.stats`` more than a second, paid by every process that makes a timed decision (an ``auto``
compile's own process among them).  The two-sided sign test of :func:`sign_test_p` is twice the smaller
tail (the distribution is symmetric): the value ``scipy.stats.binomtest(k, n, 0.5).pvalue`` gives
(``tests/unit/hardware/test_binomial.py`` checks both against ``scipy.stats``).

    >>> round(lower_tail(2, 10), 12)      # (1 + 10 + 45) / 1024
    0.0546875
    >>> sign_test_p(6, 0), round(sign_test_p(1, 5), 12), sign_test_p(3, 3)
    (0.03125, 0.21875, 1.0)
    >>> median_rank(20, 0.025)            # P(X <= 5) = 0.0207 <= 0.025 < P(X <= 6)
    6
"""
from __future__ import annotations

__all__ = ["lower_tail", "median_rank", "sign_test_p"]


def lower_tail(k: int, n: int) -> float:
    """``P(X <= k)`` for ``X ~ Binomial(n, 1/2)``."""
    from scipy.special import bdtr

    if k < 0:
        return 0.0
    return 1.0 if k >= n else float(bdtr(k, n, 0.5))


def sign_test_p(below: int, above: int) -> float:
    """Two-sided sign-test p-value of ``below`` signs one way and ``above`` the other (1 with no signs)."""
    n, k = below + above, min(below, above)
    if 2 * k == n:
        return 1.0
    return min(1.0, 2.0 * lower_tail(k, n))


def median_rank(n: int, tail: float) -> int:
    """The smallest ``k`` with ``P(X <= k) >= tail`` (``scipy.stats.binom.ppf(tail, n, 0.5)``), ``X ~ Binomial(n, 1/2)``."""
    k = 0
    while k < n and lower_tail(k, n) < tail:
        k += 1
    return k
