"""What a manifest records of a compile's choices, and the manifest as a deterministic compile saves it.

:func:`runtime_decisions` collects the :class:`~mlcomp.hardware.decide.Decision` records a
runtime's build made (a split graph's parts included) for the manifest's ``decisions``;
:func:`stable_manifest` drops what differs between two identical compiles (wall-clock times,
durations, the cache's hit/miss record, absolute paths of dump and tuning folders).
"""
from __future__ import annotations

from typing import Any

__all__ = ["VOLATILE_KEYS", "runtime_decisions", "stable_manifest"]


# manifest keys whose values differ between two identical compiles: wall-clock times, the cache's
# hit/miss record, dump and tuning folders (absolute paths); any key ending in "seconds" goes too
VOLATILE_KEYS = frozenset({"created", "cache", "dumps", "work_dir"})


def stable_manifest(value: Any) -> Any:
    """``value`` (a manifest) without :data:`VOLATILE_KEYS` and ``*seconds`` keys, at any depth.

        >>> stable_manifest({"created": "2026", "compile_seconds": 1.2, "passes": [{"seconds": 0.1, "name": "dce"}]})
        {'passes': [{'name': 'dce'}]}
    """
    if isinstance(value, dict):
        return {k: stable_manifest(v) for k, v in value.items()
                if not (k in VOLATILE_KEYS or (isinstance(k, str) and k.endswith("seconds")))}
    if isinstance(value, (list, tuple)):
        return [stable_manifest(v) for v in value]
    return value


def runtime_decisions(runtime: Any) -> list[Any]:
    """The decisions a runtime's build recorded (``runtime.decisions``), parts of a split graph included."""
    out = list(getattr(runtime, "decisions", None) or [])
    for part in getattr(runtime, "parts", None) or ():
        out += runtime_decisions(part.get("runtime") if isinstance(part, dict) else part)
    return out
