"""One cell of the support matrix: what it runs and how its outcome is classified.

A cell is a kind of run on one architecture (:mod:`mlcomp.models.architectures`):

============  ===========================================================================
``capture``   ``load_model(model, inputs).capture()`` and the IR verifier (:class:`Session`)
``O2``        what ``mlcomp.compile(model, inputs, target=T, pipeline="-O2")`` runs, verified against
              eager (on a copy of the session's captured graph); ``O2:auto`` names the target it picked
``bf16``      the same with ``-O2`` as it runs for T (:func:`pipeline_for`), then
              ``mixed-precision{dtype=bf16}`` (``fp16`` likewise)
``train``     ``mlcomp.compile(model, inputs, mode="train", loss="mse", optimizer="sgd",
              randomness="off")`` on cpu, gradients verified against eager autograd (LayerDrop and
              SpecAugment, drawn outside the graph, off for the step and named in the detail)
============  ===========================================================================

Outcomes (:class:`Status`): ``verified`` (ran and matched eager), ``refused`` (mlcomp
said up front that it cannot, with a reason: an unavailable target, a capability
mismatch, an unsupported op, an option or a model it cannot train) and ``failed``
(anything else: a capture or backend error, a verification mismatch, a crash or a
timeout), each with the first line of the message::

    >>> Cell.parse("bf16:tvm")
    Cell(kind='bf16', target='tvm')
    >>> classify(TargetUnavailableError("tvm is not installed"))
    (<Status.REFUSED: 'refused'>, 'TargetUnavailableError: tvm is not installed...')
"""
from __future__ import annotations

import enum
import time
import warnings
from dataclasses import dataclass
from typing import Any

from mlcomp.base.errors import OptionError, PipelineSpecError, TargetUnavailableError, UnsupportedOpError
from mlcomp.frontend.losses import TrainingError
from mlcomp.targets.options import OptionsError

__all__ = ["Cell", "CellResult", "Status", "classify", "first_line", "pipeline_for", "run_cell", "PIPELINES", "Session"]

# mlcomp's own "cannot, because": raised before a backend runs, with a reason and a hint
REFUSALS: tuple[type[BaseException], ...] = (TargetUnavailableError, UnsupportedOpError, OptionError,
                                             OptionsError, PipelineSpecError, TrainingError)
PIPELINES = {"O2": "-O2", "bf16": "mixed-precision{dtype=bf16}", "fp16": "mixed-precision{dtype=fp16}"}
DETAIL_CHARS = 300
# first lines that only announce the error (TorchScript's interpreter): its last line says what failed
HEADERS_ONLY = ("The following operation failed in the TorchScript interpreter.",)


class Status(enum.Enum):
    VERIFIED = "verified"
    REFUSED = "refused"
    FAILED = "failed"


@dataclass(frozen=True)
class Cell:
    """A column of the matrix: ``capture``, ``train`` (cpu) or ``<O2|bf16|fp16>:<target>``."""

    kind: str
    target: str = "cpu"

    @classmethod
    def parse(cls, text: str) -> "Cell":
        kind, _, target = text.partition(":")
        if kind not in ("capture", "train", *PIPELINES):
            raise ValueError(f"unknown cell kind {kind!r} in {text!r}")
        return cls(kind, target or "cpu")

    @property
    def key(self) -> str:
        return self.kind if self.kind in ("capture", "train") else f"{self.kind}:{self.target}"


@dataclass
class CellResult:
    status: Status
    detail: str = ""
    seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status.value, "detail": self.detail, "seconds": round(self.seconds, 2)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "CellResult":
        return cls(Status(data["status"]), data.get("detail", ""), float(data.get("seconds", 0.0)))


def pipeline_for(cell: Cell) -> str:
    """The pipeline of an inference cell: ``-O2``, or for a precision ``-O2`` adapted to the target (the
    passes the preset keeps there, :func:`~mlcomp.pipeline.presets.adapt_preset`) and ``mixed-precision``.

    A written-out list is never adapted, so ``-O2,mixed-precision{…}`` would run mlcomp's fusion on
    targets the preset leaves it out for.
    """
    if cell.kind == "O2":
        return PIPELINES["O2"]
    from mlcomp.api.lowering import resolve_target
    from mlcomp.pipeline.presets import adapt_preset

    target = resolve_target(cell.target, None)
    adapted = adapt_preset(PIPELINES["O2"], target.name, target.rewrites)
    return ",".join(p for p in (adapted.text if adapted else PIPELINES["O2"], PIPELINES[cell.kind]) if p)


def first_line(text: str) -> str:
    """The first non-empty line of ``text``, at most :data:`DETAIL_CHARS` characters."""
    lines = [ln.strip() for ln in str(text).splitlines() if ln.strip()]
    line = lines[0] if lines else ""
    if line in HEADERS_ONLY and len(lines) > 1:
        line = f"{line} … {lines[-1]}"
    return line if len(line) <= DETAIL_CHARS else line[:DETAIL_CHARS - 1] + "…"


def classify(exc: BaseException) -> tuple[Status, str]:
    """``(refused | failed, "ErrorClass: first line")`` for an exception a cell raised."""
    status = Status.REFUSED if isinstance(exc, REFUSALS) else Status.FAILED
    return status, f"{type(exc).__name__}: {first_line(str(exc)) or repr(exc)}"


class Session:
    """One architecture in one process: the model, its inputs and (once) its captured graph.

    Inference cells compile a copy of the one captured graph through
    :func:`mlcomp.api.compiler.compile_model`, after the same up-front target check
    ``mlcomp.compile`` makes, so capture runs once per process, not once per cell; a
    capture failure is raised again by every cell that needs the graph.
    """

    def __init__(self, model: Any, inputs: tuple) -> None:
        self.model, self.inputs = model, inputs
        self._captured: tuple[Any, Any, float] | None = None
        self._error: BaseException | None = None

    def captured(self) -> tuple[Any, Any, float]:
        """``(model source, graph, capture seconds)``; raises what capture raised."""
        if self._captured is None and self._error is None:
            from mlcomp.api.inputs import load_source

            t0 = time.perf_counter()
            try:
                source = load_source(self.model, self.inputs, {})
                graph = source.capture()
                graph.verify()
                self._captured = (source, graph, time.perf_counter() - t0)
            except Exception as exc:   # noqa: BLE001 - kept and raised again by each cell
                self._error = exc
        if self._error is not None:
            raise self._error
        return self._captured


def _capture(session: Session, cell: Cell) -> str:
    _, graph, _ = session.captured()
    return f"{len(graph.call_nodes())} nodes"


def _infer(session: Session, cell: Cell) -> str:
    from mlcomp.api.compiler import check_pipeline_target, compile_model, is_auto

    pipeline = pipeline_for(cell)
    check_pipeline_target(cell.target, pipeline)                  # before capture
    source, graph, seconds = session.captured()
    result = compile_model(source, graph.copy(), target=cell.target, pipeline=pipeline, capture_seconds=seconds,
                           threads=1)
    result.check.raise_if_failed(where=f"target {cell.target}, model {graph.name}")
    record = result.artifact.verification or {}
    worst, ties = record.get("max_abs"), record.get("near_tie_selections")
    note = f"; against the reference taking the artifact's order at {ties} near-tie selection row(s)" if ties else ""
    picked = f" (auto picked {result.artifact.target})" if is_auto(cell.target) else ""
    return (f"max |diff| {worst:.3g}" if isinstance(worst, float) else "") + picked + note


def _train(session: Session, cell: Cell) -> str:
    import mlcomp

    art = mlcomp.compile(session.model, session.inputs, mode="train", target="cpu", loss="mse", optimizer="sgd",
                         threads=1, randomness="off")
    check = art.verification or {}
    if not check.get("passed"):
        raise AssertionError(f"gradients differ from eager: worst {check.get('worst')} "
                             f"rel {check.get('worst_rel')}")
    off = check.get("randomness_off") or []
    return f"worst gradient rel {check.get('worst_rel', 0.0):.3g}" + (f"; without {'; '.join(off)}" if off else "")


_RUNNERS = {"capture": _capture, "O2": _infer, "bf16": _infer, "fp16": _infer, "train": _train}


def run_cell(session: Session, cell: Cell) -> CellResult:
    """Run one cell in this process; every exception becomes a refused or failed result."""
    t0 = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            detail = _RUNNERS[cell.kind](session, cell)
        return CellResult(Status.VERIFIED, detail, time.perf_counter() - t0)
    except Exception as exc:   # noqa: BLE001 - the matrix records every failure, whatever raised it
        status, detail = classify(exc)
        return CellResult(status, detail, time.perf_counter() - t0)
