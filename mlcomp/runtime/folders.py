"""What a folder given as an artifact is, when it is not a sound one: damaged, or something else entirely.

"Damaged" is said only of a folder mlcomp wrote as an artifact (its ``.mlcomp`` marker says so, or it
holds ``reference.pt``) whose files no longer match; a plain file, a report, a training artifact, a
user's folder or another tool's ``manifest.json`` is named for what it is, with what to give instead.
"""
from __future__ import annotations

import json
from pathlib import Path

from typing import Any

from mlcomp.base.errors import ArtifactDamagedError, ArtifactError, TargetUnavailableError
from mlcomp.base.files import MARKER

__all__ = ["damaged", "not_artifact", "unavailable", "first_line_of", "OTHER_FORMATS", "OTHER_OUTPUTS", "ARTIFACT_KINDS"]

MANIFEST = "manifest.json"
REFERENCE = "reference.pt"


def damaged(directory: Path, what: str) -> ArtifactDamagedError:
    """A file mlcomp wrote into the artifact is missing, fails its checksum or cannot be parsed."""
    return ArtifactDamagedError(f"the artifact at {directory} is damaged: {what}")


_COMPILE_ONE = "`mlcomp run` takes the folder that `mlcomp compile MODEL --target T -o DIR` writes; compile one"

# manifest format → (what the folder is, what to do with it instead of `mlcomp run`)
OTHER_FORMATS: dict[str, tuple[str, str]] = {
    "mlcomp-training": ("a training artifact (`mlcomp compile --train`)",
                        "load it in Python with mlcomp.load(DIR) and call its .step(x, y), or compile the model "
                        "without --train to get an artifact `mlcomp run` runs"),
}

# .mlcomp marker kind → what a folder without manifest.json is (any other kind: not an artifact)
OTHER_OUTPUTS: dict[str, str] = {"report": "an mlcomp report (`mlcomp report`)",
                                 "generator": "a generator (`mlcomp compile MODEL --generate N`; its prefill/ and "
                                              "decode/ subfolders are artifacts; mlcomp.load_generator loads the whole)"}
ARTIFACT_KINDS = ("artifact", "training artifact")     # markers atomic_dir writes into artifact folders

# files only an artifact holds: one of them without manifest.json means the manifest was lost
ARTIFACT_FILES = (REFERENCE,)


def not_artifact(directory: Path) -> ArtifactError:
    """No manifest.json: damaged when the folder is an artifact mlcomp wrote, else not an artifact at all."""
    if not directory.is_dir():
        return ArtifactError(f"{directory} is a file, not an artifact folder", hint=_COMPILE_ONE)
    try:
        kind = json.loads((directory / MARKER).read_text()).get("kind")
    except (OSError, ValueError, AttributeError):
        kind = None
    if kind in ARTIFACT_KINDS or any((directory / name).is_file() for name in ARTIFACT_FILES):
        return damaged(directory, f"its {MANIFEST} is missing")
    what = OTHER_OUTPUTS.get(kind, "an mlcomp output") if kind else "a folder mlcomp did not write"
    return ArtifactError(f"{directory} is {what}, not an artifact folder (it has no {MANIFEST})",
                         hint=_COMPILE_ONE)


def unavailable(manifest: dict[str, Any], reason: str) -> TargetUnavailableError:
    return TargetUnavailableError(
        f"the artifact needs target {manifest['target']}, which is not available here: {reason}",
        hint="load it on a machine with that backend, or compile the model for another target")


def first_line_of(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
