"""Timing processes that share one start-up: the first imports torch, mlcomp and the loaders, then forks the others.

A timing process spends most of its start-up importing (torch, mlcomp, then each
runtime at its first load); two of them importing side by side cost twice that, on the
cores the candidates compile on.  :meth:`~mlcomp.runtime.timing_host.HostWorker.spawn_group`
starts one fresh interpreter (the *zygote*, in the caller's session) that imports torch, mlcomp and the
modules the loads will need (``preload``: the targets' ``runtime_modules``, only imports that start no thread
and leave the runtime as a fresh process has it), then forks the other timing processes from itself
(:func:`fork_siblings`), before it has run anything: no model, no kernel, so no runtime's thread pool
exists in it when it forks (the only threads are the idle helpers some imports leave).  They stay in
the caller's session and process group, with its priority.  Each process then serves its own pipes::

    parent ── stdin/stdout ───────────── zygote: imports, forks ── serves timing process 0
           ── pipe pair 1 (pass_fds) ──────────────────────────── forked: serves timing process 1

A forked process first says its pid on its pipe (the parent's :class:`Forked` handle learns it
there: it is not the parent's child).  When ``fork`` fails, that process is started afresh
instead, on the same pipes (it imports again; nothing else changes).  Each is killed by its pid;
one whose pid is not known yet, like any whose command pipe closes (the parent gone), exits at its
next read of the commands, so nothing outlives its pool.
"""
from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from typing import IO, Any

__all__ = ["Forked", "fork_siblings", "spawn_sibling"]

Serve = Callable[[dict[str, Any], IO[str], IO[str]], None]


class Forked:
    """The parent's handle on a timing process the zygote forked: its pipes (as a ``Popen``'s ``stdin`` and
    ``stdout``), its pid once it said it, ``poll``/``wait`` by its reply pipe, ``kill`` by its pid."""

    def __init__(self, commands_fd: int, replies_fd: int) -> None:
        self.stdin = os.fdopen(commands_fd, "wb", buffering=0)
        self.stdout = os.fdopen(replies_fd, "rb", buffering=0)
        self.pid: int | None = None
        self.returncode: int | None = None       # -1 once it is gone (its status is its parent's to read)

    def poll(self) -> int | None:
        return self.returncode

    def kill(self) -> None:
        """Kill it now (a pid it said but nobody read yet is read first).  One not forked yet, or forked and
        not yet past saying its pid, ends at its first read of the commands, once the parent closes them."""
        if self.pid is None and select.select([self.stdout], [], [], 0)[0]:
            line = self.stdout.readline()
            with contextlib.suppress(ValueError, KeyError, TypeError):
                self.pid = int(json.loads(line)["pid"])
        if self.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
        self.returncode = -1

    def wait(self, timeout: float | None = None) -> int:
        """Until its reply pipe closes (it exited); ``subprocess.TimeoutExpired`` after ``timeout`` seconds."""
        end = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if end is None else max(0.0, end - time.monotonic())
            ready, _, _ = select.select([self.stdout], [], [], left)
            if not ready:
                raise subprocess.TimeoutExpired("a forked timing process", timeout or 0.0)
            if not self.stdout.read(65536):
                self.returncode = -1
        return self.returncode


def spawn_sibling(config: dict[str, Any], fds: tuple[int, int], module: str) -> int:
    """Start a fresh timing process serving ``fds`` (commands, replies) with ``config``: its pid."""
    proc = subprocess.Popen([sys.executable, "-m", module, json.dumps(dict(config, fds=list(fds)))],
                            pass_fds=fds, stdin=subprocess.DEVNULL, stdout=sys.stderr)
    return proc.pid


def fork_siblings(config: dict[str, Any], serve: Serve, module: str, *, fork: Callable[[], int] = os.fork,
                  spawn: Callable[..., int] = spawn_sibling, closing: Sequence[int] = ()) -> list[int]:
    """In the zygote, after its imports: a process per (commands fd, replies fd) of ``config["siblings"]``,
    forked, or started afresh (``spawn``) when ``fork`` fails; their pids.  A forked one closes
    ``closing`` (the zygote's own pipes) and the other siblings' fds, serves its pair and exits."""
    siblings = [tuple(pair) for pair in config.get("siblings", ())]
    own = {**{k: v for k, v in config.items() if k != "siblings"}, "sibling": True}
    pids = []
    for i, (commands, replies) in enumerate(siblings):
        try:
            pid = fork()
        except OSError:
            pid = spawn(own, (commands, replies), module)
        else:
            if pid == 0:
                _serve_forked(own, serve, (commands, replies), [*closing, *(fd for pair in siblings[i + 1:]
                                                                              for fd in pair)])
        pids.append(pid)
        os.close(commands)
        os.close(replies)
    return pids


def _serve_forked(config: dict[str, Any], serve: Serve, fds: tuple[int, int], closing: Sequence[int]) -> None:
    """The forked child: drop the zygote's pipes, serve its own, exit (never returns)."""
    for fd in closing:
        os.close(fd)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    commands, channel = os.fdopen(fds[0], "r"), os.fdopen(fds[1], "w", buffering=1)
    status = 0
    try:
        serve(config, channel, commands)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then this process ends
        channel.write(json.dumps({"error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:500]}"}) + "\n")
        status = 1
    channel.flush()
    sys.stderr.flush()
    os._exit(status)
