"""Scoped silences, all restored on exit: torch's exporters (warnings, prints, log records) and
native code writing straight to file descriptor 2 (TVM's log lines, the profiler's start/stop lines).

    >>> import logging, warnings
    >>> with quiet_torch():                      # around torch.export.export(model, args)
    ...     warnings.warn("an exporter's warning")
    ...     logging.getLogger("torch.export").warning("an exporter's log record")
    >>> import os
    >>> with quiet_native():                     # around profiler.__enter__()
    ...     _ = os.write(2, b"USDT: profiler_start\\n")   # goes to /dev/null
"""
from __future__ import annotations

import contextlib
import io
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from typing import Any

__all__ = ["quiet_converter", "quiet_native", "quiet_torch"]


class quiet_torch:
    """Silence torch's warnings and log records during export; failures become MlcompErrors."""

    _LOGGERS = ("torch", "torch._subclasses.fake_tensor", "torch._dynamo", "torch.export",
                "torch.fx.experimental.symbolic_shapes", "torch._export")

    def __enter__(self) -> None:
        self._ctx = warnings.catch_warnings()
        self._ctx.__enter__()
        warnings.simplefilter("ignore")
        # torch prints the partial graph of a failed export; the error we raise says enough
        self._out = contextlib.ExitStack()
        self._out.enter_context(contextlib.redirect_stdout(io.StringIO()))
        self._out.enter_context(contextlib.redirect_stderr(io.StringIO()))
        self._levels = {}
        for name in self._LOGGERS:
            log = logging.getLogger(name)
            self._levels[name] = log.level
            log.setLevel(logging.CRITICAL)

    def __exit__(self, *exc: Any) -> None:
        for name, level in self._levels.items():
            logging.getLogger(name).setLevel(level)
        self._out.__exit__(*exc)
        self._ctx.__exit__(*exc)


@contextlib.contextmanager
def quiet_native() -> Iterator[None]:
    """Send what C++ code writes straight to fd 2 to ``/dev/null`` for the duration.

    Python-level errors still arrive as exceptions; fd 2 is restored on any exit.
    """
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        sink = os.open(os.devnull, os.O_WRONLY)
        try:
            os.dup2(sink, 2)
        finally:
            os.close(sink)
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


@contextlib.contextmanager
def quiet_converter() -> Iterator[io.StringIO]:
    """:func:`quiet_torch`, plus what model converters (the ONNX exporter, OpenVINO's frontend) print:
    their stdout goes to the yielded buffer and logging below ERROR is off; both restored on exit."""
    buffer = io.StringIO()
    previous = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with quiet_torch(), contextlib.redirect_stdout(buffer):
            yield buffer
    finally:
        logging.disable(previous)
