"""Ctrl-C as an exception that is remembered: an interrupt a native library swallowed still stops the
next commit of an output (:mod:`mlcomp.base.files`) and still exits as an interruption.

    >>> with InterruptScope() as scope:
    ...     scope.seen
    False
"""
from __future__ import annotations

import contextlib
import contextvars
import signal
import threading
from typing import Any, Iterator

__all__ = ["InterruptScope", "raise_if_interrupted", "shielded"]

# The interrupt scope active in this context (set and reset by InterruptScope only).
_SCOPE: contextvars.ContextVar["InterruptScope | None"] = contextvars.ContextVar("mlcomp_interrupts", default=None)


class InterruptScope:
    """Within the block, SIGINT raises ``KeyboardInterrupt`` and is remembered in ``seen``.

    The previous handler is restored on exit.  Inside :meth:`shielded` (the
    cleanup of a temporary) a Ctrl-C is only remembered, so cleanup finishes.
    Outside the main thread it installs nothing and only tracks the state.
    """

    def __init__(self) -> None:
        self.seen = False
        self._shield = 0
        self._previous: Any = None
        self._token: contextvars.Token | None = None

    def _handler(self, signum: int, frame: Any) -> None:
        self.seen = True
        if not self._shield:
            raise KeyboardInterrupt

    def __enter__(self) -> "InterruptScope":
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGINT, self._handler)
        self._token = _SCOPE.set(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._token is not None:
            _SCOPE.reset(self._token)
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)

    @contextlib.contextmanager
    def shielded(self) -> Iterator[None]:
        self._shield += 1
        try:
            yield
        finally:
            self._shield -= 1


def raise_if_interrupted() -> None:
    """Raise ``KeyboardInterrupt`` if Ctrl-C was pressed in this scope (even if something swallowed it)."""
    scope = _SCOPE.get()
    if scope is not None and scope.seen:
        raise KeyboardInterrupt


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    scope = _SCOPE.get()
    with scope.shielded() if scope is not None else contextlib.nullcontext():
        yield
