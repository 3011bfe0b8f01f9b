"""Compare a compiled artifact (or any callable) with the eager model it came from.

    >>> eager_out = torch.tensor([[1.0, -2.0]])
    >>> result = compare(eager_out, eager_out + 2 ** -10, names=["addmm_2"])    # eager's, the artifact's
    >>> print(result.format())
    output 0 (addmm_2: f32[1, 2]): max abs 0.000977, max rel 0.000488 (tol 1e-04) FAILED
    >>> result.passed
    False

Errors per output:

* ``max_abs`` = ``max |actual - expected|``;
* ``max_rel`` = ``max_abs / max |expected|`` (norm-wise, so values near zero do
  not blow it up; an all-zero expected output uses the absolute error).

An output passes when ``max_rel <= rtol``; ``rtol`` depends on the output dtype
(fp32 ``1e-4``, fp64 ``1e-7``, fp16 ``5e-3``, bf16 ``2e-2``; integers and bools
must match exactly) unless a tolerance is given (``--tolerance``, a finite
number from 0 to :data:`MAX_TOLERANCE`; :func:`check_tolerance`).  Shapes and dtypes
must match too.

Why a ceiling: an all-zero output has ``max_rel`` exactly 1, and an output with
every element off by a tenth of the largest one has 0.1.  A tolerance of 1 or
more passes the zero output, so nothing was verified; ``MAX_TOLERANCE = 0.1``
(5x bf16's default, 25x bf16's unit roundoff 2^-8) is the loosest bound that
still tells a right output from one that is wrong by a tenth of its scale::

    >>> check_tolerance(1e9)
    Traceback (most recent call last):
    mlcomp.base.errors.OptionError: --tolerance 1e+09 is too loose to mean "verified": the error is relative \
to the output's largest value, so at 1 an all-zero output passes; the loosest accepted is 0.1. Give a relative \
tolerance such as 1e-4 (fp32) or 2e-2 (bf16), or leave it out for the default of each output's dtype.

A NaN or an infinity in an output never passes, in the eager output or the
compiled one, even where both have it in the same place: the result says which
output and how many elements, e.g.

    output 0 (addmm_2: f32[1, 2]): eager PyTorch's output has 2 NaN element(s) of 2
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from mlcomp.base.errors import OptionError, VerificationError

__all__ = ["DEFAULT_RTOL", "MAX_TOLERANCE", "check_tolerance", "tolerance_for", "OutputError", "VerifyResult", "compare", "flatten_outputs",
           "check_against"]

DEFAULT_RTOL: dict[torch.dtype, float] = {
    torch.float64: 1e-7, torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 2e-2,
}
MAX_TOLERANCE = 0.1      # the loosest --tolerance (module doc: at 1 an all-zero output passes)


def check_tolerance(value: float | None, *, option: str = "--tolerance",
                    ceiling: float = MAX_TOLERANCE) -> float | None:
    """``value`` if it is a usable relative tolerance (finite, 0 to ``ceiling``) or ``None``; else an OptionError.
    A user's tolerance is held to :data:`MAX_TOLERANCE`; mlcomp's own checks (``tolerance_for``) to finiteness."""
    if value is None:
        return None
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    hint = ("Give a relative tolerance such as 1e-4 (fp32) or 2e-2 (bf16), or leave it out for the default of "
            "each output's dtype")
    if not math.isfinite(number) or number < 0:
        raise OptionError(f"{option} {value} is not a usable tolerance: it must be a finite number >= 0", hint=hint)
    if number > ceiling:
        raise OptionError(f"{option} {number:g} is too loose to mean \"verified\": the error is relative to the "
                          f"output's largest value, so at 1 an all-zero output passes; the loosest accepted is "
                          f"{MAX_TOLERANCE:g}", hint=hint)
    return number


def tolerance_for(dtype: torch.dtype, override: float | None = None) -> float:
    """Relative tolerance for an output of ``dtype`` (``override`` wins when given)."""
    if override is not None:
        return float(check_tolerance(override, ceiling=math.inf))
    if dtype.is_floating_point or dtype.is_complex:
        return DEFAULT_RTOL.get(dtype, 1e-4)
    return 0.0


def flatten_outputs(value: Any) -> list[Any]:
    """Nested tuples/lists/dicts of tensors → flat list (the order ``torch.export`` uses)."""
    from torch.utils._pytree import tree_flatten

    leaves, _ = tree_flatten(value)
    return list(leaves)


@dataclass(frozen=True)
class OutputError:
    index: int
    name: str
    expected: str          # "f32[1, 10]"
    max_abs: float
    max_rel: float
    rtol: float
    passed: bool
    note: str = ""         # why it failed beyond the numbers (shape, dtype, NaN)

    def format(self) -> str:
        head = f"output {self.index} ({self.name}: {self.expected})" if self.name else \
            f"output {self.index} ({self.expected})"
        if self.note:
            return f"{head}: {self.note}"
        return (f"{head}: max abs {self.max_abs:.3g}, max rel {self.max_rel:.3g} "
                f"(tol {self.rtol:.0e}) {'ok' if self.passed else 'FAILED'}")

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "expected": self.expected,
                "max_abs": _finite(self.max_abs), "max_rel": _finite(self.max_rel),
                "rtol": self.rtol, "passed": self.passed, "note": self.note}


@dataclass(frozen=True)
class VerifyResult:
    outputs: tuple[OutputError, ...]
    note: str = ""          # a structural mismatch (number of outputs)

    @property
    def passed(self) -> bool:
        return not self.note and all(o.passed for o in self.outputs)

    @property
    def worst(self) -> OutputError | None:
        """The failing output with the largest relative error (or the largest overall)."""
        if not self.outputs:
            return None
        failing = [o for o in self.outputs if not o.passed]
        pool = failing or list(self.outputs)
        return max(pool, key=lambda o: (math.inf if o.note else o.max_rel))

    @property
    def max_abs(self) -> float:
        return max((o.max_abs for o in self.outputs), default=0.0)

    @property
    def max_rel(self) -> float:
        return max((o.max_rel for o in self.outputs), default=0.0)

    def format(self) -> str:
        lines = [o.format() for o in self.outputs]
        if self.note:
            lines.insert(0, self.note)
        return "\n".join(lines)

    def summary(self) -> str:
        if self.note:
            return f"FAILED: {self.note}"
        w = self.worst
        state = "passed" if self.passed else "FAILED"
        if w is None:
            return f"{state} (no outputs)"
        if w.note and not self.passed:
            return f"FAILED: output {w.index} ({w.name or 'unnamed'}): {w.note}"
        return (f"{state}: {len(self.outputs)} output(s), max abs {self.max_abs:.3g}, "
                f"max rel {self.max_rel:.3g} (worst {w.name or w.index}, tol {w.rtol:.0e})")

    def to_json(self) -> dict[str, Any]:
        return {"passed": self.passed, "note": self.note, "max_abs": _finite(self.max_abs),
                "max_rel": _finite(self.max_rel), "outputs": [o.to_json() for o in self.outputs]}

    def raise_if_failed(self, *, where: str) -> "VerifyResult":
        if self.passed:
            return self
        if self.note:
            raise VerificationError(f"the outputs do not match eager PyTorch: {self.note}", where=where,
                                    hint="this is a bug in the target or a pass; run with --fallback eager "
                                         "or another target to narrow it down")
        w = self.worst
        assert w is not None
        if w.note.startswith("NaN/inf"):
            eager_bad = "eager PyTorch's output" in w.note
            raise VerificationError(
                f"output {w.index} ({w.name or 'unnamed'}: {w.expected}) is not finite, so it cannot be "
                f"verified: {w.note.removeprefix('NaN/inf: ')}", where=where,
                hint="the model itself computes NaN/inf on these inputs: check its weights, inputs and "
                     "numerically unsafe ops (log, division, overflow in low precision)" if eager_bad else
                     "the target or a pass produced them: bisect the pipeline with --verify, or try "
                     "--fallback eager or another target")
        detail = w.note or (f"max rel error {w.max_rel:.3g} (max abs {w.max_abs:.3g}) exceeds "
                            f"the tolerance {w.rtol:.0e}")
        raise VerificationError(
            f"output {w.index} ({w.name or 'unnamed'}: {w.expected}) differs from eager PyTorch: {detail}",
            where=where,
            hint="if the difference is expected (reduced precision, reordered sums), loosen it with "
                 "--tolerance; otherwise bisect the pipeline with --verify or try another target")


def _finite(x: float) -> float | str:
    return x if math.isfinite(x) else str(x)


def _describe(t: torch.Tensor) -> str:
    from mlcomp.ir import TensorMeta

    return str(TensorMeta.of(t))


def _nonfinite(t: torch.Tensor) -> str:
    """"3 NaN and 1 inf element(s) of 64", or "" when every element is finite."""
    nan = int(t.isnan().sum())
    inf = int(t.isinf().sum())
    if not nan and not inf:
        return ""
    parts = ([f"{nan} NaN"] if nan else []) + ([f"{inf} inf"] if inf else [])
    return f"{' and '.join(parts)} element(s) of {t.numel()}"


def _one(index: int, name: str, exp: Any, act: Any, override: float | None) -> OutputError:
    if not isinstance(exp, torch.Tensor):
        same = exp == act
        return OutputError(index, name, type(exp).__name__, 0.0 if same else math.inf,
                           0.0 if same else math.inf, 0.0, bool(same),
                           "" if same else f"expected {exp!r}, got {act!r}")
    desc = _describe(exp)
    rtol = tolerance_for(exp.dtype, override)
    if not isinstance(act, torch.Tensor):
        return OutputError(index, name, desc, math.inf, math.inf, rtol, False,
                           f"expected a tensor, got {type(act).__name__}")
    if tuple(act.shape) != tuple(exp.shape):
        return OutputError(index, name, desc, math.inf, math.inf, rtol, False,
                           f"shape {list(act.shape)} instead of {list(exp.shape)}")
    if act.dtype != exp.dtype:
        return OutputError(index, name, desc, math.inf, math.inf, rtol, False,
                           f"dtype {act.dtype} instead of {exp.dtype}")
    e = exp.detach().cpu()
    a = act.detach().cpu()
    if e.numel() == 0:
        return OutputError(index, name, desc, 0.0, 0.0, rtol, True)
    if not (e.is_floating_point() or e.is_complex()):
        bad = int((a != e).sum())
        return OutputError(index, name, desc, float(bad), float(bad), rtol, bad == 0,
                           "" if bad == 0 else f"{bad} element(s) differ (exact match required)")
    e64, a64 = e.to(torch.complex128 if e.is_complex() else torch.float64), \
        a.to(torch.complex128 if a.is_complex() else torch.float64)
    bad_e, bad_a = _nonfinite(e64), _nonfinite(a64)
    if bad_e or bad_a:
        note = "; ".join(([f"eager PyTorch's output has {bad_e}"] if bad_e else [])
                         + ([f"the compiled output has {bad_a}"] if bad_a else []))
        return OutputError(index, name, desc, math.inf, math.inf, rtol, False, f"NaN/inf: {note}")
    diff = (a64 - e64).abs()
    max_abs = float(diff.max())
    scale = float(e64.abs().max())
    max_rel = max_abs / scale if scale > 0 else max_abs
    return OutputError(index, name, desc, max_abs, max_rel, rtol, max_rel <= rtol)


def compare(expected: Any, actual: Any, tolerance: float | None = None,
            names: Sequence[str] | None = None) -> VerifyResult:
    """Per-output errors of ``actual`` against ``expected`` (nested structures are flattened)."""
    exp, act = flatten_outputs(expected), flatten_outputs(actual)
    names = list(names or [])
    if len(exp) != len(act):
        return VerifyResult((), note=f"{len(act)} output(s) where eager returns {len(exp)}")
    return VerifyResult(tuple(_one(i, names[i] if i < len(names) else "", e, a, tolerance)
                              for i, (e, a) in enumerate(zip(exp, act))))


def check_against(fn: Callable[..., Any], expected: Any, inputs: Sequence[torch.Tensor], *,
                  tolerance: float | None = None, names: Sequence[str] | None = None,
                  where: str = "", raise_on_failure: bool = True) -> VerifyResult:
    """Run ``fn(*inputs)`` under ``no_grad`` and compare it with ``expected``."""
    with torch.no_grad():
        actual = fn(*inputs)
    result = compare(expected, actual, tolerance, names)
    if raise_on_failure:
        result.raise_if_failed(where=where or "verification")
    return result
