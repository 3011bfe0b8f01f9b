"""The binomial distribution at one half: what the sign test and the median's interval need, without scipy.

``Binomial(n, 1/2)`` puts ``C(n, i) / 2**n`` on ``i``.  Its lower tail ``P(X <= k)`` starts from the
term at ``k`` (``C(n, k)`` in integers over ``2**n``: Python's ``int / int`` rounds once, and gives 0
where the float underflows) and walks down the coefficients in floats (``C(n, i - 1) = C(n, i) * i /
(n - i + 1)``) until a term is below ``2**-60`` of the sum; a tail past the middle is one minus the
mirrored tail (``P(X <= k) = 1 - P(X <= n - k - 1)``).  The two-sided sign test of
:func:`sign_test_p` is twice the smaller tail (the distribution is symmetric): the value
``scipy.stats.binomtest(k, n, 0.5).pvalue`` gives, without importing ``scipy.stats``.

    >>> lower_tail(2, 10)                 # (1 + 10 + 45) / 1024
    0.0546875
    >>> sign_test_p(6, 0), sign_test_p(1, 5), sign_test_p(3, 3)
    (0.03125, 0.21875, 1.0)
    >>> median_rank(20, 0.025)            # P(X <= 5) = 0.0207 <= 0.025 < P(X <= 6)
    6
"""
from __future__ import annotations

from math import comb

__all__ = ["lower_tail", "median_rank", "sign_test_p"]

_NEGLIGIBLE = 2.0 ** -60     # a term below this share of the sum so far ends the sum


def _tail(k: int, n: int) -> float:
    """``P(X <= k)`` for ``0 <= k < n / 2``: from the term at ``k`` down, while the terms still count."""
    term = comb(n, k) / (1 << n)
    total = term
    i = k
    while i > 0 and term > total * _NEGLIGIBLE:
        term = term * i / (n - i + 1)
        total += term
        i -= 1
    return total


def lower_tail(k: int, n: int) -> float:
    """``P(X <= k)`` for ``X ~ Binomial(n, 1/2)``."""
    if k < 0:
        return 0.0
    if k >= n:
        return 1.0
    if 2 * k < n:
        return _tail(k, n)
    return 1.0 - _tail(n - k - 1, n)


def sign_test_p(below: int, above: int) -> float:
    """Two-sided sign-test p-value of ``below`` signs one way and ``above`` the other (1 with no signs)."""
    n, k = below + above, min(below, above)
    if 2 * k == n:
        return 1.0
    return min(1.0, 2.0 * lower_tail(k, n))


def median_rank(n: int, tail: float) -> int:
    """The smallest ``k`` with ``P(X <= k) >= tail`` (``scipy.stats.binom.ppf(tail, n, 0.5)``), ``X ~ Binomial(n, 1/2)``."""
    whole = 1 << n
    term = total = 1                      # C(n, 0)
    k = 0
    while k < n and total / whole < tail:
        term = term * (n - k) // (k + 1)
        total += term
        k += 1
    return k
