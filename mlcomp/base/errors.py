"""User-facing errors.

Every error a user can cause (bad file, unsupported op, bad pipeline spec,
wrong input shape) is an :class:`MlcompError`.  Its message is one paragraph:
what was wrong, where (file, node, module path, source line when known) and
what to do.  The CLI prints it without a traceback and exits with
``error.exit_code``.

Each error class names the party at fault (:class:`Party`); :data:`BLAME` maps the
party to the exit code and to the hint given when the raiser names none, so only
an internal failure ever says "bug in mlcomp" and only a wrong checksum or a
broken file mlcomp wrote says "damaged":

    party        class(es)                                   exit  default hint
    model        ModelFaultError                               2   change the model's code at the line named
    input        most (ModelLoadError, InputSpecError, …)      2   (the raiser's own)
    environment  TargetUnavailableError                        2   install the package / use another machine
    damaged      ArtifactDamagedError                          2   compile it again
    internal     InternalError, IRError, PassFailure           3   a bug in mlcomp: report it

>>> ModelFaultError("forward returns None").message
"the model's forward returns None. this is a problem in the model's code, not in mlcomp: change the line named."
>>> InternalError("a pass broke the graph").exit_code
3
"""
from __future__ import annotations

import enum
from dataclasses import dataclass


class Party(enum.Enum):
    """Whose fault an error is."""

    MODEL = "model"              # the user's model code (its forward, its modules, its factory)
    INPUT = "input"              # the user's command: options, files, shapes, example inputs
    ENVIRONMENT = "environment"  # this machine: a missing package or device
    DAMAGED = "damaged"          # a file mlcomp wrote no longer matches what mlcomp wrote
    INTERNAL = "internal"        # mlcomp itself


@dataclass(frozen=True)
class Blame:
    """What an error of one party looks like: its exit code, the prefix of its text, its default hint."""

    exit_code: int
    prefix: str
    hint: str | None


BUG_HINT = "this is a bug in mlcomp, not in your input; run again with `mlcomp --traceback ...` and report it"

BLAME: dict[Party, Blame] = {
    Party.MODEL: Blame(2, "the model's ", "this is a problem in the model's code, not in mlcomp: change the line named"),
    Party.INPUT: Blame(2, "", None),
    Party.ENVIRONMENT: Blame(2, "", "install the missing package, or run on a machine that has it"),
    Party.DAMAGED: Blame(2, "", "compile it again (`mlcomp compile MODEL --target T -o DIR`); "
                                "do not edit artifact folders by hand"),
    Party.INTERNAL: Blame(3, "", BUG_HINT),
}


class MlcompError(Exception):
    """Base class of all user errors; ``str(err)`` is the whole message."""

    party = Party.INPUT
    exit_code = 2

    def __init__(self, what: str, *, where: str | None = None, hint: str | None = None):
        self.what = BLAME[self.party].prefix + what if not what.startswith(BLAME[self.party].prefix) else what
        self.where = where
        self.hint = hint if hint is not None else BLAME[self.party].hint
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

    party = Party.INTERNAL
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

    party = Party.ENVIRONMENT


class VerificationError(MlcompError):
    """A compiled artifact's outputs differ from eager beyond tolerance."""

    exit_code = 4


class ArtifactError(MlcompError):
    """An artifact folder is missing, not an artifact, or from an incompatible version."""


class ArtifactDamagedError(ArtifactError):
    """A file mlcomp wrote into an artifact is missing, fails its checksum or cannot be parsed."""

    party = Party.DAMAGED


class ModelFaultError(MlcompError):
    """The user's model does something a compiled graph cannot hold (non-tensor outputs or arguments,
    in-place updates of buffers or inputs, dtypes eager PyTorch rejects too); names the module and line."""

    party = Party.MODEL


class InternalError(MlcompError):
    """A failure inside mlcomp itself (a pass, the IR, a target's lowering)."""

    party = Party.INTERNAL
    exit_code = 3


class OutputPathError(MlcompError):
    """An output destination (``-o``, ``--json``, ``--plot`` …) cannot or must not be written."""


class OptionError(MlcompError):
    """A command-line or API option has a value outside its range (a batch of 0, a NaN tolerance)."""


class LossScaleError(MlcompError):
    """A loss-scale setting is malformed, or the graph has no backward seed to scale."""


class PipelineMismatchError(PassFailure):
    """The pipeline's passes do not fit the graph's mode or the context; refused before any pass runs."""
