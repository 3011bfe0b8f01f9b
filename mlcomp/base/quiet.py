"""A scoped silence for torch's exporters: warnings, prints and log records, all restored on exit.

    >>> with quiet_torch():
    ...     torch.export.export(model, args)     # nothing printed; levels restored afterwards
"""
from __future__ import annotations

import contextlib
import io
import logging
import warnings
from typing import Any

__all__ = ["quiet_torch"]


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
