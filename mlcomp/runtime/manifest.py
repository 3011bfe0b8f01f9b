"""The artifact folder's ``manifest.json``: its format, reading and validating it, the payload
checksums, what it records of a compile's choices, and the manifest as a deterministic compile saves it.

The manifest names the format (``mlcomp-artifact``) and its version; every other file
of the folder is listed under ``payload`` with its size and sha256, so a truncated or
modified file is reported as damage before anything loads it.
:func:`runtime_decisions` collects the :class:`~mlcomp.hardware.decide.Decision` records a
runtime's build made (a split graph's parts included) for the manifest's ``decisions``;
:func:`stable_manifest` drops what differs between two identical compiles (wall-clock times,
durations, the cache's hit/miss record, absolute paths of dump and tuning folders).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mlcomp.base.errors import ArtifactError
from mlcomp.base.files import sha256_file
from mlcomp.base.version import __version__
from mlcomp.runtime.folders import _COMPILE_ONE, MANIFEST, OTHER_FORMATS, damaged, not_artifact

__all__ = ["FORMAT", "FORMAT_VERSION", "VOLATILE_KEYS", "check_payload_file", "payload_entries", "read_manifest",
           "runtime_decisions", "stable_manifest"]

FORMAT = "mlcomp-artifact"
FORMAT_VERSION = 1


def read_manifest(directory: Path) -> dict[str, Any]:
    """The validated manifest of an artifact folder (format, version, required keys)."""
    if not directory.exists():
        raise ArtifactError(f"there is no artifact at {directory}",
                            hint="compile one with `mlcomp compile MODEL --target T -o DIR`")
    path = directory / MANIFEST
    if not path.is_file():
        raise not_artifact(directory)
    try:
        manifest = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise damaged(directory, f"its {MANIFEST} is not valid JSON ({exc})") from None
    form = manifest.get("format") if isinstance(manifest, dict) else None
    if form in OTHER_FORMATS:
        raise ArtifactError(f"{directory} is {OTHER_FORMATS[form][0]}, not an inference artifact",
                            hint=OTHER_FORMATS[form][1])
    if form != FORMAT:
        raise ArtifactError(f"{directory} is not an mlcomp artifact: its {MANIFEST} is another tool's "
                            f"(format {form!r}, not {FORMAT!r})", hint=_COMPILE_ONE)
    version = manifest.get("format_version")
    if version != FORMAT_VERSION:
        raise ArtifactError(
            f"the artifact at {directory} was written by mlcomp {manifest.get('mlcomp_version', '?')} in "
            f"artifact format {version}; this mlcomp ({__version__}) reads format {FORMAT_VERSION}",
            hint="compile the model again with this mlcomp (`mlcomp compile MODEL -o DIR`), or load it "
                 "with the mlcomp version that wrote it")
    missing = [k for k in ("target", "runtime", "inputs", "outputs", "payload") if k not in manifest]
    if missing:
        raise damaged(directory, f"its {MANIFEST} lacks {', '.join(missing)}")
    return manifest


def payload_entries(directory: Path) -> list[dict[str, Any]]:
    """Every file of ``directory`` but the manifest: its path, size and sha256 (the manifest's ``payload``)."""
    return [{"path": p.relative_to(directory).as_posix(), "bytes": p.stat().st_size, "sha256": sha256_file(p)}
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != MANIFEST]


def check_payload_file(directory: Path, entry: dict[str, Any]) -> None:
    """Damaged when the file of one ``payload`` entry is missing or does not match its size and sha256."""
    path = directory / entry["path"]
    if not path.is_file():
        raise damaged(directory, f"payload file {entry['path']} is missing")
    if path.stat().st_size != entry.get("bytes") or sha256_file(path) != entry.get("sha256"):
        raise damaged(directory, f"payload file {entry['path']} does not match its checksum (truncated or modified)")


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
