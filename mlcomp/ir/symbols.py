"""Symbolic sizes: names with the range of sizes each may take.

A dimension of a :class:`~mlcomp.ir.node.TensorMeta` is an ``int`` or a string: the name
of a symbol (``"batch"``) or an expression of symbols (``"batch*seq"``).  The graph keeps
each symbol's example value (``graph.symbols``, the sizes of the example inputs) and its
range (``graph.ranges``: name → :class:`SizeRange`), which the artifact's manifest records
and every call is checked against::

    graph m(%x: f32[batch, seq, 16])   ranges: batch in 1..64, seq in 2..
    %view: f32[batch*seq, 16] = aten.view.default(%x, [%mul, 16])

>>> r = SizeRange(1, 64)
>>> str(r), r.contains(64), r.contains(65), str(SizeRange(2, None))
('1..64', True, False, '2..')
>>> SizeRange.parse("8..512"), SizeRange.parse("4..")
(SizeRange(lo=8, hi=512), SizeRange(lo=4, hi=None))
>>> bind([("batch", 16), ("batch", "seq")], [(3, 16), (3, 7)])
{'batch': 3, 'seq': 7}
>>> sample_points({"batch": SizeRange(1, 64)}, {"batch": 4})
[{'batch': 1}, {'batch': 32}, {'batch': 64}]
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from mlcomp.base.errors import InputSpecError

__all__ = ["SizeRange", "bind", "check_sizes", "out_of_range", "sample_points", "rename_symbols", "ranges_json",
           "ranges_from_json", "UNBOUNDED_CHECK"]

UNBOUNDED_CHECK = 4          # an unbounded range is verified up to this many times its example value
_NAME = re.compile(r"[A-Za-z_]\w*")


@dataclass(frozen=True)
class SizeRange:
    """The sizes a symbol may take: ``lo`` to ``hi`` inclusive (``hi`` None: no upper bound)."""

    lo: int
    hi: int | None = None

    def __post_init__(self) -> None:
        if self.lo < 0 or (self.hi is not None and self.hi < self.lo):
            raise InputSpecError(f"size range {self} is empty or negative "
                          f"(its minimum must be at least 0 and at most its maximum)",
                          hint="give MIN..MAX with 0 <= MIN <= MAX, e.g. batch=1..64")

    @classmethod
    def parse(cls, text: str) -> "SizeRange":
        """``"MIN..MAX"``, ``"MIN.."`` or ``"..MAX"`` (a missing minimum is 1)."""
        lo, sep, hi = text.strip().partition("..")
        try:
            if not sep:
                raise ValueError(text)
            return cls(int(lo) if lo.strip() else 1, int(hi) if hi.strip() else None)
        except ValueError:
            raise InputSpecError(f"size range {text!r} is not MIN..MAX", hint="write it as 1..64, 8.. or ..512") from None

    def contains(self, size: int) -> bool:
        return self.lo <= size and (self.hi is None or size <= self.hi)

    def __str__(self) -> str:
        return f"{self.lo}..{'' if self.hi is None else self.hi}"


def ranges_json(ranges: Mapping[str, SizeRange]) -> dict[str, list[int | None]]:
    """The manifest's form: ``{"batch": [1, 64], "seq": [2, None]}``."""
    return {name: [r.lo, r.hi] for name, r in sorted(ranges.items())}


def ranges_from_json(data: Mapping[str, Any] | None) -> dict[str, SizeRange]:
    return {name: SizeRange(int(lo), None if hi is None else int(hi)) for name, (lo, hi) in (data or {}).items()}


def bind(shapes: Iterable[Sequence[Any]], sizes: Iterable[Sequence[int]]) -> dict[str, int]:
    """Each symbol named alone in a dimension of ``shapes`` → its size in ``sizes`` (first seen wins)."""
    out: dict[str, int] = {}
    for shape, actual in zip(shapes, sizes):
        for d, s in zip(shape, actual):
            if isinstance(d, str) and _NAME.fullmatch(d):
                out.setdefault(d, int(s))
    return out


def out_of_range(ranges: Mapping[str, SizeRange], shapes: Sequence[Sequence[Any]],
                 sizes: Sequence[Sequence[int]], names: Sequence[str]) -> str | None:
    """Why ``sizes`` do not fit: a symbol outside its range or given two sizes; ``None`` when they fit."""
    seen: dict[str, tuple[int, str]] = {}
    for shape, actual, name in zip(shapes, sizes, names):
        for axis, (d, s) in enumerate(zip(shape, actual)):
            if not (isinstance(d, str) and _NAME.fullmatch(d)):
                continue
            where = f"dim {axis} of input {name}"
            if d in seen and seen[d][0] != s:
                return f"{where} is {s} but {seen[d][1]} is {seen[d][0]}, and both are the size {d}"
            seen.setdefault(d, (int(s), where))
            r = ranges.get(d)
            if r is not None and not r.contains(int(s)):
                return f"{where} is {s}, outside the range {r} of the symbolic size {d} the artifact was compiled for"
    return None


def check_sizes(ranges: Mapping[str, SizeRange], shapes: Sequence[Sequence[Any]], sizes: Sequence[Sequence[int]],
                names: Sequence[str], where: str) -> None:
    """:func:`out_of_range` as an :class:`InputSpecError` naming the artifact."""
    problem = out_of_range(ranges, shapes, sizes, names)
    if problem:
        raise InputSpecError(problem, where=where,
                             hint="pass sizes inside the range, or compile again with a wider one "
                                  "(--dynamic batch=MIN..MAX,seq=MIN..MAX)")


def sample_points(ranges: Mapping[str, SizeRange], example: Mapping[str, int]) -> list[dict[str, int]]:
    """The sizes verification runs at: every symbol at its minimum, at a middle value, at its maximum.

    An unbounded maximum is taken as ``UNBOUNDED_CHECK`` times the example value; a minimum of
    0 as 1 (an empty tensor verifies nothing).  Repeated points are dropped.
    """
    lows, highs = {}, {}
    for name, r in ranges.items():
        lows[name] = max(r.lo, 1)
        highs[name] = r.hi if r.hi is not None else max(lows[name], UNBOUNDED_CHECK * example.get(name, 1))
    points = [lows, {n: (lows[n] + highs[n]) // 2 for n in ranges}, highs]
    out: list[dict[str, int]] = []
    for p in points:
        if p not in out:
            out.append(dict(p))
    return out


def rename_symbols(shape: Sequence[Any], mapping: Mapping[str, str]) -> tuple[Any, ...]:
    """``shape`` with each symbol of ``mapping`` renamed, inside expressions too (``s0*s1`` → ``batch*seq``)."""
    if not mapping:
        return tuple(shape)
    sub = lambda m: mapping.get(m.group(0), m.group(0))   # noqa: E731
    return tuple(_NAME.sub(sub, d) if isinstance(d, str) else d for d in shape)
