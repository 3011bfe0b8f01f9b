"""Byte sizes: one parser for every option that takes a size, one formatter for every table.

Before, three passes and commands parsed sizes each their own way (``remat{budget=1KB}`` was
1024 bytes, ``partition{memory_limit=1KB}`` and ``--cache-max-size 1KB`` 1000) and three
modules printed them.  After::

    parse_size("500MB")  -> 500000000        # KB, MB, GB, TB: powers of 1000
    parse_size("2GiB")   -> 2147483648       # KiB, MiB, GiB, TiB and K, M, G, T: powers of 1024
    parse_size("1e9")    -> 1000000000
    parse_size("12 parsecs")  raises SizeError("unknown unit 'parsecs'")
    fmt_bytes(3 * 2**20)            -> "3.0 MiB"
    fmt_bytes(-1536, sign=True)     -> "-1.5 KiB"

Callers turn :class:`SizeError` into their own user error (which option, what to write).
"""
from __future__ import annotations

import re

__all__ = ["SIZE_HINT", "SizeError", "fmt_bytes", "parse_size", "size_unit"]

_SI = {u.lower() + "b": 1000 ** (i + 1) for i, u in enumerate("KMGT")}
_BINARY = {**{u.lower(): 1024 ** (i + 1) for i, u in enumerate("KMGT")},
           **{u.lower() + "ib": 1024 ** (i + 1) for i, u in enumerate("KMGT")}}
_UNITS = {"": 1, "b": 1, **_SI, **_BINARY}
_NUMBER = re.compile(r"\s*([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*([A-Za-z]*)\s*")

SIZE_HINT = ("write it like 500MB, 2GiB or 1073741824 (bytes); KB, MB, GB, TB are powers of 1000, "
             "K/KiB, M/MiB, G/GiB, T/TiB powers of 1024")


class SizeError(ValueError):
    """``text`` is not a size; the message says why in a few words."""


def size_unit(text: str) -> tuple[float, str]:
    """``"1.5GiB"`` → ``(1.5, "gib")``: the number and the lower-cased unit, unit checked."""
    m = _NUMBER.fullmatch(str(text))
    if m is None:
        raise SizeError("a size is a number of bytes and an optional unit")
    unit = m.group(2).lower()
    if unit not in _UNITS:
        raise SizeError(f"unknown unit {m.group(2)!r}")
    return float(m.group(1)), unit


def parse_size(text: str | int) -> int:
    """Bytes in ``text`` (an int passes through); negative sizes are refused."""
    if isinstance(text, bool):
        raise SizeError("a size is a number of bytes, not a flag")
    if isinstance(text, int):
        value, unit = float(text), ""
    else:
        value, unit = size_unit(text)
    if value < 0:
        raise SizeError("a size is 0 or more")
    return int(value * _UNITS[unit])


def fmt_bytes(n: float | None, *, sign: bool = False, digits: int = 1) -> str:
    """``12.3 MiB`` (binary units, as every table prints them); ``+12.3 MiB`` with ``sign``; ``—`` for None."""
    if n is None:
        return "—"
    pre = "+" if sign and n >= 0 else ""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{pre}{n / scale:.{digits}f} {unit}"
    return f"{pre}{n:.0f} B"
