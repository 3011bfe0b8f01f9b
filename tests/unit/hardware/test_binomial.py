"""hardware/binomial.py: the binomial tail at one half (scipy.special) equals the exact sum and scipy.stats' figures."""
from __future__ import annotations

import subprocess
import sys
from fractions import Fraction
from math import comb

import pytest

from mlcomp.hardware.binomial import lower_tail, median_rank, sign_test_p

stats = pytest.importorskip("scipy.stats")


def test_the_tail_is_the_exact_sum_of_coefficients_over_a_power_of_two():
    for n in (1, 2, 7, 40, 301):
        assert lower_tail(-1, n) == 0.0
        count = 0
        for k in range(n + 1):
            count += comb(n, k)
            assert lower_tail(k, n) == pytest.approx(float(Fraction(count, 2 ** n)), rel=1e-12, abs=1e-16), (k, n)


def test_the_sign_test_gives_scipys_binomtest_p_value():
    for n in (*range(0, 25), 97, 250, 2000):
        for below in sorted({0, 1, n // 3, n // 2 - 1, n // 2, n // 2 + 1, n - 1, n} & set(range(n + 1))):
            want = 1.0 if n == 0 else stats.binomtest(below, n, 0.5).pvalue
            assert sign_test_p(below, n - below) == pytest.approx(want, rel=1e-9), (below, n)


def test_the_median_rank_is_scipys_percent_point():
    for n in range(1, 400, 7):
        for tail in (0.005, 0.025, 0.05, 0.25):
            assert median_rank(n, tail) == int(stats.binom.ppf(tail, n, 0.5)), (n, tail)


def test_deciding_imports_scipys_special_functions_not_its_statistics():
    code = ("import sys, mlcomp.hardware.decide as d, mlcomp.hardware.intervals as i;"
            "d.sign_test([0.5] * 9); i.median_interval([1.0] * 30); print('scipy.stats' in sys.modules)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert run.stdout.strip() == "False", run.stderr[-2000:]
