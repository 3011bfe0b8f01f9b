"""The compile cache's size: the cap, size strings, entries and which to evict (least recently used).

    >>> parse_size("500MB"), parse_size("2GiB"), parse_size("1.5G")
    (500000000, 2147483648, 1610612736)
    >>> parse_size("lots")
    Traceback (most recent call last):
    mlcomp.base.errors.OptionError: --cache-max-size 'lots' is not a size (a size is a number of bytes ...

Which entries go, before and after one store under a 1 MiB cap (``used``: the last
store or hit; ``new`` was just stored and is never a victim)::

    before:  a 400 KiB used 10:00 | b 400 KiB used 10:05 | new 400 KiB used 10:07   (1.2 MiB)
    after:   b, new (800 KiB)                                   evicted: a (least recently used)

:func:`lru_victims` decides (pure, O(n log n)); :meth:`mlcomp.api.cache.CompileCache.prune`
removes them and returns the :class:`PruneReport` the CLI prints.
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlcomp.base import units
from mlcomp.base.errors import OptionError
from mlcomp.base.units import fmt_bytes

__all__ = ["DEFAULT_MAX_BYTES", "CacheEntry", "PruneReport", "lru_victims", "parse_size"]

# the cap on the entries' total size when none is given (about 45 resnet18 artifacts on the cpu target)
DEFAULT_MAX_BYTES = 2 * 2**30

def parse_size(text: str | int, *, option: str = "--cache-max-size") -> int:
    """Bytes in ``text`` (:func:`mlcomp.base.units.parse_size`: ``"500MB"`` → 500000000, ``"2GiB"`` →
    2147483648); anything else is an :class:`OptionError` naming ``option``."""
    try:
        return units.parse_size(text)
    except units.SizeError as exc:
        raise OptionError(f"{option} {str(text)!r} is not a size ({exc})", hint=units.SIZE_HINT) from None


@dataclass(frozen=True)
class CacheEntry:
    """One stored entry as ``mlcomp cache list`` shows it."""

    key: str
    path: Path
    parts: dict[str, Any]
    created: str
    bytes: int
    used: float = 0.0       # last store or hit (the folder's mtime), seconds since the epoch

    def to_json(self) -> dict[str, Any]:
        return {"key": self.key, "path": str(self.path), "model": self.parts.get("model"),
                "target": self.parts.get("target"), "pipeline": self.parts.get("pipeline"),
                "created": self.created, "bytes": self.bytes,
                "used": time.strftime("%Y-%m-%dT%H:%M:%S%z", time.localtime(self.used))}

    def describe(self) -> str:
        return (f"{self.key[:12]} ({self.parts.get('model', '?')}, {self.parts.get('target', '?')}, "
                f"{fmt_bytes(self.bytes)})")


@dataclass
class PruneReport:
    """What one eviction round did: ``lines()`` is what the CLI prints (nothing when nothing was evicted)."""

    max_bytes: int | None                        # None: the cache has no cap
    evicted: list[CacheEntry] = field(default_factory=list)
    kept: list[CacheEntry] = field(default_factory=list)
    kept_over_cap: CacheEntry | None = None      # the entry just stored, alone larger than the cap

    @property
    def freed(self) -> int:
        return sum(e.bytes for e in self.evicted)

    @property
    def kept_bytes(self) -> int:
        return sum(e.bytes for e in self.kept)

    def summary(self) -> str:
        cap = "no" if self.max_bytes is None else fmt_bytes(self.max_bytes)
        n = len(self.evicted)
        parts = [f"evicted {n} least recently used entr{'y' if n == 1 else 'ies'} ({fmt_bytes(self.freed)}); "
                 f"{fmt_bytes(self.kept_bytes)} left in {_entries(len(self.kept))}"] if n else []
        if self.kept_over_cap is not None:
            parts.append(f"the entry just stored ({fmt_bytes(self.kept_over_cap.bytes)}) is larger than the cap "
                         "by itself and was kept")
        return f"cache over its {cap} cap: " + "; ".join(parts)

    def lines(self, *, each: bool = False) -> list[str]:
        """The summary when something was evicted or the cap is exceeded; ``each``: one line per eviction."""
        if not self.evicted and self.kept_over_cap is None:
            return []
        return [self.summary(), *(f"cache evicted {e.describe()}" for e in self.evicted if each)]

    def to_json(self) -> dict[str, Any]:
        return {"max_bytes": self.max_bytes, "evicted": [e.key for e in self.evicted], "freed_bytes": self.freed,
                "kept": len(self.kept), "kept_bytes": self.kept_bytes,
                "kept_over_cap": self.kept_over_cap.key if self.kept_over_cap else None}


def _entries(n: int) -> str:
    return f"{n} entr{'y' if n == 1 else 'ies'}"


def lru_victims(entries: Sequence[CacheEntry], max_bytes: int, *, keep: str | None = None) -> list[CacheEntry]:
    """The entries to evict, least recently used first, so that the rest fit ``max_bytes``.

    ``keep`` (a digest) is never a victim, even when it alone is over the cap.  Ties in use
    time go by key, so the order is stable.  One sort: O(n log n).
    """
    total = sum(e.bytes for e in entries)
    victims = []
    for entry in sorted(entries, key=lambda e: (e.used, e.key)):
        if total <= max_bytes:
            break
        if entry.key != keep:
            victims.append(entry)
            total -= entry.bytes
    return victims
