"""User-facing errors.

Every error a user can cause (bad file, unsupported op, bad pipeline spec,
wrong input shape) is an :class:`MlcompError`.  Its message is one paragraph:
what was wrong, where (file, node, module path, source line when known) and
what to do.  The CLI prints it without a traceback and exits with
``error.exit_code``.
"""
from __future__ import annotations


class MlcompError(Exception):
    """Base class of all user errors; ``str(err)`` is the whole message."""

    exit_code = 2

    def __init__(self, what: str, *, where: str | None = None, hint: str | None = None):
        self.what = what
        self.where = where
        self.hint = hint
        super().__init__(self.message)

    @property
    def message(self) -> str:
        parts = [self.what.rstrip(".") + "."]
        if self.where:
            parts.append(f"Where: {self.where}.")
        if self.hint:
            parts.append(self.hint.rstrip(".") + ".")
        return " ".join(parts)


class ModelLoadError(MlcompError):
    """A model file or factory could not be read."""


class UnsafePickleError(ModelLoadError):
    """The file is a pickled Python object; loading it would run its code."""


class CaptureError(MlcompError):
    """The model could not be captured into the IR (e.g. data-dependent control flow)."""


class InputSpecError(MlcompError):
    """Example inputs or ``--input-shape`` are missing or do not fit the model."""


class IRError(MlcompError):
    """``Graph.verify`` found a broken graph; the message names the node."""

    exit_code = 3


class PipelineSpecError(MlcompError):
    """A pipeline (inline or TOML) is malformed or names unknown passes/options."""


class PassFailure(MlcompError):
    """A pass raised or broke the graph mid-pipeline."""

    exit_code = 3


class UnsupportedOpError(MlcompError):
    """A target cannot run some nodes of the graph."""


class TargetUnavailableError(MlcompError):
    """A target's backend (package or device) is missing."""


class VerificationError(MlcompError):
    """A compiled artifact's outputs differ from eager beyond tolerance."""

    exit_code = 4


class ArtifactError(MlcompError):
    """An artifact folder is missing, corrupt or from an incompatible version."""


class OutputPathError(MlcompError):
    """An output destination (``-o``, ``--json``, ``--plot`` …) cannot or must not be written."""


class OptionError(MlcompError):
    """A command-line or API option has a value outside its range (a batch of 0, a NaN tolerance)."""


class PipelineMismatchError(PassFailure):
    """The pipeline's passes do not fit the graph's mode or the context; refused before any pass runs."""
