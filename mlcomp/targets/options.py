"""Compile options: one frozen, validated record every target reads (each uses what applies to it).

    >>> CompileOptions.make(threads="2")
    Traceback (most recent call last):
    mlcomp.targets.options.OptionsError: threads='2' must be an integer >= 1.
    >>> opts = CompileOptions.make(fallback="eager", tune_trials=64, tune_build_timeout=300,
    ...                            log_level="info")
    >>> opts.fallback, opts.log_level
    (<Fallback.EAGER: 'eager'>, <LogLevel.INFO: 'info'>)
    >>> opts.to_json()["log_level"]
    'info'

Backend knobs (TVM's MetaSchedule build/run timeouts, its console verbosity, whether its worker
processes may import torch) are fields here, validated like the others: no
module of mlcomp reads the environment.
"""
from __future__ import annotations

import dataclasses
import enum
import logging
from dataclasses import dataclass
from typing import Any

from mlcomp.base.errors import MlcompError

__all__ = ["Fallback", "LogLevel", "CompileOptions", "OptionsError"]


class Fallback(enum.Enum):
    NONE = "none"      # an unsupported node is an error
    EAGER = "eager"    # unsupported regions run in torch


class LogLevel(enum.Enum):
    """How much a backend may print to the console while compiling (files in ``work_dir`` get everything)."""

    DEBUG = "debug"
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"

    @property
    def logging_level(self) -> int:
        return {"debug": logging.DEBUG, "info": logging.INFO, "warning": logging.WARNING,
                "error": logging.ERROR}[self.value]

    @property
    def shows_native_log(self) -> bool:
        """Whether the C++ log lines a backend writes straight to fd 2 are left visible."""
        return self.logging_level <= logging.INFO


class OptionsError(MlcompError):
    """A compile option is unknown or has the wrong type."""


@dataclass(frozen=True)
class CompileOptions:
    """Options every target understands (each uses those that apply to it).

    ``device``: ``None`` = the target's default (``cpu``; ``cuda`` for the CUDA
    target).  ``threads``: intra-op threads (``None`` = the runtime's default).
    ``tune_trials``/``work_dir``: TVM MetaSchedule budget and its tuning database
    folder (reused across runs).  ``tolerance``: relative tolerance for
    verification (``None`` = by dtype).  ``optimize``: TorchScript
    ``optimize_for_inference`` (``None`` = measure both, keep the faster).
    ``cuda_graphs``: replay static-shape CUDA models as one CUDA graph.
    ``tf32``: the cuda target lets fp32 matrix products and convolutions use
    TF32 tensor cores (products rounded to a 10-bit mantissa; verified at the
    declared tolerance ``mlcomp.targets.torch.cuda.TF32_RTOL``); off: IEEE fp32.
    ``tune_build_timeout``/``tune_run_timeout``: seconds one MetaSchedule
    candidate may take to build/to measure before it counts as failed.
    ``log_level``: what a backend prints to the console (TVM: MetaSchedule's
    log records, and at ``info``/``debug`` its C++ log lines on stderr).
    ``tune_worker_torch``: let MetaSchedule's worker processes import torch
    (off by default: it costs each worker a minute, see ``tvm.build``).
    ``deterministic``: every choice a target would make by timing takes its fixed rule
    instead (each target documents its rule; the manifest's ``decisions`` say which), and
    the saved artifact holds nothing time- or path-dependent: two compiles write the same bytes.
    """

    device: str | None = None
    threads: int | None = None
    tune_trials: int = 0
    work_dir: str | None = None
    fallback: Fallback = Fallback.NONE
    tolerance: float | None = None
    optimize: bool | None = None
    cuda_graphs: bool = True
    tf32: bool = False
    opset: int | None = None
    tune_build_timeout: float = 180.0
    tune_run_timeout: float = 60.0
    log_level: LogLevel = LogLevel.WARNING
    tune_worker_torch: bool = False
    deterministic: bool = False

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                object.__setattr__(self, f.name, _check_option(f.name, value))

    @classmethod
    def make(cls, **values: Any) -> "CompileOptions":
        """Build from loose values (``fallback="eager"``), naming any unknown or ill-typed option.

        ``None`` means "the default" for every option.
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise OptionsError(f"unknown compile option(s) {', '.join(unknown)}",
                               hint=f"the options are: {', '.join(fields)}")
        return cls(**{key: value for key, value in values.items() if value is not None})

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["fallback"] = self.fallback.value
        out["log_level"] = self.log_level.value
        return out


def _check_option(key: str, value: Any) -> Any:
    """``value`` converted to the option's type; :class:`OptionsError` naming it otherwise."""
    if key in ("fallback", "log_level"):
        kind = Fallback if key == "fallback" else LogLevel
        try:
            return value if isinstance(value, kind) else kind(str(value).lower())
        except ValueError:
            raise OptionsError(f"{key}={value!r} is not valid",
                               hint=f"use one of: {', '.join(repr(k.value) for k in kind)}") from None
    if key in ("threads", "tune_trials", "opset"):
        low = 0 if key == "tune_trials" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise OptionsError(f"{key}={value!r} must be an integer >= {low}")
        return value
    if key in ("tolerance", "tune_build_timeout", "tune_run_timeout"):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < float("inf"):
            example = "1e-3" if key == "tolerance" else "120"
            raise OptionsError(f"{key}={value!r} must be a positive number such as {example}")
        return float(value)
    if key in ("optimize", "cuda_graphs", "tune_worker_torch", "tf32", "deterministic"):
        if not isinstance(value, bool):
            raise OptionsError(f"{key}={value!r} must be True or False")
        return value
    if key in ("device", "work_dir"):
        return str(value)
    return value
