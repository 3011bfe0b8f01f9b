"""What a long command is doing right now: one live line on a terminal, one log line per stage otherwise.

Every long command (compile, tune, bench, report) reports its stages through
one :class:`Progress`.  On a terminal the current stage is a single status line
on stderr, rewritten in place with the elapsed time and erased when the
command prints its results.  Anywhere else (a pipe, a CI log, a file) each stage
is one plain line, written where the command's own text goes (stdout), or to
stderr when stdout carries machine-readable output (``--json`` without a file).

For ``mlcomp report resnet18 -o report/ > log.txt``::

            [  0.0s] capture resnet18
            [0/6     8s] resnet18 eager batch 1
            [1/6    13s] resnet18 cpu batch 1
            ...

Each update also checks for a Ctrl-C that a native library swallowed
(:func:`mlcomp.base.files.raise_if_interrupted`), so a command that moves on
to its next stage after such an interrupt stops there instead.

    >>> progress = Progress.for_command(live=False)   # off a terminal: one line per update
    >>> with progress.stage("capture mlp"):
    ...     pass
    [  0.0s] capture mlp
    >>> progress(3, 8, "bench mlp cpu batch 32")      # the bench's (done, total, message) protocol
    [3/8     0s] bench mlp cpu batch 32
"""
from __future__ import annotations

import contextlib
import sys
import time
from typing import Callable, Iterator, TextIO

from mlcomp.base.files import raise_if_interrupted

__all__ = ["Progress", "ProgressLine"]


class ProgressLine:
    """One status line: rewritten in place on a terminal (``tty``), one line per update otherwise.

    Called as ``line(done, total, message)``; ``done >= total`` ends the line on a terminal.
    """

    def __init__(self, stream: TextIO, *, tty: bool, clock: Callable[[], float] = time.monotonic) -> None:
        self.stream, self.tty, self.clock = stream, tty, clock
        self.start = clock()
        self._width = 0

    def __call__(self, done: int, total: int, message: str) -> None:
        self.write(f"[{done}/{total} {self.clock() - self.start:5.0f}s] {message}", final=done >= total)

    def write(self, text: str, *, final: bool = False) -> None:
        if self.tty:
            pad = max(0, self._width - len(text))
            self.stream.write("\r" + text + " " * pad + ("\n" if final else ""))
            self._width = 0 if final else len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def clear(self) -> None:
        """Erase a live line so the next output starts on a clean line (no-op off a terminal)."""
        if self.tty and self._width:
            self.stream.write("\r" + " " * self._width + "\r")
            self.stream.flush()
            self._width = 0


class Progress:
    """Stages of one command; see the module docstring for where the lines go."""

    def __init__(self, line: ProgressLine | None) -> None:
        self.line = line

    @classmethod
    def for_command(cls, *, machine_output: bool = False, live: bool | None = None,
                    quiet: bool = False) -> "Progress":
        """The progress display for the running command.

        ``live`` forces (True) or forbids (False) the in-place line; None decides
        from whether stderr is a terminal.  ``machine_output``: stdout holds JSON or
        CSV, so log lines go to stderr.  ``quiet``: report nothing.
        """
        if quiet:
            return cls(None)
        tty = sys.stderr.isatty() if live is None else live
        if tty:
            return cls(ProgressLine(sys.stderr, tty=True))
        return cls(ProgressLine(sys.stderr if machine_output else sys.stdout, tty=False))

    @property
    def live(self) -> bool:
        return self.line is not None and self.line.tty

    def note(self, message: str) -> None:
        """Report that a stage starts (the bench's stage names come through ``__call__``)."""
        raise_if_interrupted()
        if self.line is not None:
            self.line.write(f"[{self.line.clock() - self.line.start:5.1f}s] {message}")

    @contextlib.contextmanager
    def stage(self, message: str) -> Iterator[None]:
        """``with progress.stage("compile for tvm"): ...``: shown while the block runs, erased after on a terminal."""
        self.note(message)
        try:
            yield
        finally:
            self.clear()
        raise_if_interrupted()

    def __call__(self, done: int, total: int, message: str) -> None:
        raise_if_interrupted()
        if self.line is not None:
            self.line(done, total, message)

    def clear(self) -> None:
        if self.line is not None:
            self.line.clear()
