"""The process state a TVM build has to change, changed inside one scope and restored on the way out.

TVM 0.27 running next to torch needs a few process-wide adjustments (the
reasons are in :mod:`mlcomp.targets.tvm.build`).  All of them live here, in
:class:`TvmScope`, and every one is undone when the scope exits, whether it
exits normally, by an exception, or by ``KeyboardInterrupt``::

    before                                   inside ``with TvmScope(...) as scope``
    inspect.stack            stock           a version that never calls inspect.getmodule
    logger tvm.s_tir.meta_schedule  NOTSET   the options' log level (WARNING by default)
    fd 2                     the terminal    /dev/null unless log_level is info/debug
    SIGINT (main thread)     default         recorded; raised at once, or at the end of a
                                             native region (``scope.native()``)
    temp files               —               scope.tmp, a private mkdtemp, removed at exit
    os.environ               untouched       untouched, except inside ``scope.for_workers()``

``scope.for_workers()`` is the one place the environment changes.  TVM's
MetaSchedule starts its build/run workers with ``subprocess.Popen`` and no
``env`` argument (``tvm.support.popen_pool.PopenWorker._start``), so the only
way to reach them is the inherited environment: for the duration of that
block ``PYTHONPATH`` starts with a shim folder inside ``scope.tmp`` whose
``torch`` package fails to import (see ``tvm.build``), and ``TMPDIR`` points
into ``scope.tmp`` so what workers leave behind (a killed build's folder) is
removed with it.  Both are restored when the block ends.

Ctrl-C: a ``KeyboardInterrupt`` raised inside a Python callback that TVM's
C++ task scheduler called ended the process in ``std::terminate`` (seen with
MetaSchedule, TVM 0.27), so inside ``scope.native()`` SIGINT is only recorded
and runs the actions registered with ``scope.on_interrupt`` (tuning kills its
worker processes, so the running batch fails at once); tuning code checks
``scope.interrupted`` at safe points and stops, and the region's exit raises
``KeyboardInterrupt``.  Outside native regions SIGINT raises at once.  Any
other error leaving a scope after Ctrl-C (TVM turns an interrupt raised in a
callback into a ``RuntimeError``) leaves it as ``KeyboardInterrupt``.  The
handler that was installed before (the CLI's) is called too, so it sees the
interrupt.

Thread safety: what is patched belongs to the whole process, so scopes are
serialised by one re-entrant lock (the module's only state): two TVM builds in
two threads of one process run one after the other, and a scope nested in
another on the same thread works.  Other threads that do not build with TVM
still see the patched ``inspect.stack`` (same frames, no module lookup), the
silenced fd 2, and inside ``for_workers()`` the changed environment, for as
long as the scope lasts.  Signal handling is only changed on the main thread.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import os
import shutil
import signal
import tempfile
import threading
from typing import Any, Callable, Iterator

from mlcomp.base.quiet import quiet_native
from mlcomp.targets.options import LogLevel

__all__ = ["TvmScope", "quiet_native", "fast_inspect_stack"]

# serialises TvmScopes: what they patch is process-wide (see the module docstring)
_LOCK = threading.RLock()
_LOGGERS = ("tvm.s_tir.meta_schedule",)


def fast_inspect_stack():
    """Install an ``inspect.stack`` that never calls ``inspect.getmodule``; return the one it replaced.

    Also shipped by value to MetaSchedule's worker processes as their initializer, so it
    imports what it needs itself and refers to nothing else in this module.
    """
    import inspect
    import linecache
    import sys

    def stack(context=1):
        frame, out = sys._getframe(1), []
        while frame is not None:
            fn, ln = frame.f_code.co_filename, frame.f_lineno
            line = linecache.getline(fn, ln) if context > 0 else ""
            out.append(inspect.FrameInfo(frame, fn, ln, frame.f_code.co_name,
                                         [line] if line else None, 0 if line else None))
            frame = frame.f_back
        return out

    previous, inspect.stack = inspect.stack, stack
    return previous


class TvmScope:
    """Context manager for one TVM build; see the module docstring for what it changes."""

    def __init__(self, *, log_level: LogLevel = LogLevel.WARNING, hide_torch_from_workers: bool = True) -> None:
        self.log_level = log_level
        self.hide_torch_from_workers = hide_torch_from_workers
        self.tmp = ""
        self.interrupted = False
        self._native = 0
        self._previous: Any = None
        self._actions: list[Callable[[], None]] = []
        self._stack: contextlib.ExitStack | None = None

    # -- entering and leaving -----------------------------------------------------
    def __enter__(self) -> "TvmScope":
        _LOCK.acquire()
        stack = contextlib.ExitStack()
        try:
            stack.callback(_LOCK.release)
            tempfile.gettempdir()   # cache the real one before any TMPDIR change (for_workers)
            self.tmp = tempfile.mkdtemp(prefix="mlcomp-tvm-")
            stack.callback(shutil.rmtree, self.tmp, True)
            previous = fast_inspect_stack()
            stack.callback(setattr, inspect, "stack", previous)
            for name in _LOGGERS:
                log = logging.getLogger(name)
                stack.callback(log.setLevel, log.level)
                log.setLevel(self.log_level.logging_level)
            if not self.log_level.shows_native_log:
                stack.enter_context(quiet_native())
            if threading.current_thread() is threading.main_thread():
                before = signal.getsignal(signal.SIGINT)
                if callable(before):   # not when Ctrl-C is ignored (SIG_IGN) or owned by C code
                    self._previous = before
                    signal.signal(signal.SIGINT, self._on_sigint)
                    stack.callback(signal.signal, signal.SIGINT, before)
        except BaseException:
            stack.close()
            raise
        self._stack = stack
        return self

    def __exit__(self, kind: Any, exc: Any, tb: Any) -> bool:
        stack, self._stack = self._stack, None
        assert stack is not None, "TvmScope exited without being entered"
        stack.close()
        if self.interrupted and kind is not None and not issubclass(kind, KeyboardInterrupt):
            raise KeyboardInterrupt from exc
        return False

    # -- Ctrl-C -------------------------------------------------------------------
    def _on_sigint(self, signum: int, frame: Any) -> None:
        self.interrupted = True
        for action in list(self._actions):
            action()
        if not self._native:
            self._deliver()

    @contextlib.contextmanager
    def on_interrupt(self, action: Callable[[], None]) -> Iterator[None]:
        """Within the block, Ctrl-C also runs ``action`` (quick, non-blocking: e.g. kill workers)."""
        self._actions.append(action)
        try:
            yield
        finally:
            self._actions.remove(action)

    def _deliver(self) -> None:
        """Raise the interrupt, letting the handler we replaced see it first (it may record it)."""
        if self._previous is not None and self._previous is not signal.default_int_handler:
            self._previous(signal.SIGINT, None)
        raise KeyboardInterrupt

    @contextlib.contextmanager
    def native(self) -> Iterator[None]:
        """A region where TVM's C++ calls back into Python: SIGINT is recorded, raised at the end."""
        self._native += 1
        try:
            yield
        finally:
            self._native -= 1
            if self.interrupted and not self._native:
                self._deliver()   # replaces what TVM raised when it stopped (kept as __context__)

    # -- worker processes ---------------------------------------------------------
    @contextlib.contextmanager
    def for_workers(self) -> Iterator[None]:
        """Environment that MetaSchedule's worker processes inherit: see the module docstring."""
        changes = {"TMPDIR": os.path.join(self.tmp, "workers")}
        os.makedirs(changes["TMPDIR"], exist_ok=True)
        if self.hide_torch_from_workers:
            shim = os.path.join(self.tmp, "shim")
            os.makedirs(os.path.join(shim, "torch"), exist_ok=True)
            with open(os.path.join(shim, "torch", "__init__.py"), "w") as f:
                f.write('raise ImportError("torch is hidden from MetaSchedule workers by mlcomp")\n')
            changes["PYTHONPATH"] = os.pathsep.join(filter(None, [shim, os.environ.get("PYTHONPATH")]))
        saved = {key: os.environ.get(key) for key in changes}
        try:
            os.environ.update(changes)
            yield
        finally:
            for key, value in saved.items():
                if value is None:
                    os.environ.pop(key, None)
                else:
                    os.environ[key] = value
