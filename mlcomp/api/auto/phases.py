"""Where an ``auto`` compile's time goes: wall and CPU seconds per phase, this process's and its timing processes'.

    >>> ticks = iter(range(100))
    >>> phases = Phases(wall=lambda: float(next(ticks)), cpu=lambda: 0.5 * next(ticks))
    >>> with phases("compile"):
    ...     pass
    >>> phases.wall, phases.cpu
    ({'compile': 2.0}, {'compile': 1.0})

On two cores a compile's wall time is bounded below by the CPU seconds of every process it runs
(the compiling one, the timing processes) over the cores: ``cpu`` (``time.process_time``, every
thread of this process) per phase and ``workers`` (each timing process's own account: imports,
loads, samples) say which of them to cut, whatever else loads the machine.
"""
from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from typing import Any

__all__ = ["Phases"]


class Phases:
    """Seconds per named phase, by the wall clock and by this process's CPU time (a phase entered twice adds up)."""

    def __init__(self, wall: Callable[[], float] = time.perf_counter,
                 cpu: Callable[[], float] = time.process_time) -> None:
        self._wall, self._cpu = wall, cpu
        self.wall: dict[str, float] = {}
        self.cpu: dict[str, float] = {}
        self.workers: list[dict[str, float]] = []     # each timing process's CPU seconds by what it did
        self._open: dict[str, tuple[float, float]] = {}

    @contextlib.contextmanager
    def __call__(self, name: str) -> Iterator[None]:
        self.begin(name)
        try:
            yield
        finally:
            self.end(name)

    def begin(self, name: str) -> None:
        """Start ``name`` (:meth:`end` adds its seconds): for a phase that ends outside the block it began in."""
        self._open[name] = (self._wall(), self._cpu())

    def end(self, name: str) -> None:
        w0, c0 = self._open.pop(name)
        self.wall[name] = self.wall.get(name, 0.0) + self._wall() - w0
        self.cpu[name] = self.cpu.get(name, 0.0) + self._cpu() - c0

    def to_json(self) -> dict[str, Any]:
        return {"phase_seconds": {k: round(v, 3) for k, v in self.wall.items()},
                "phase_cpu_seconds": {k: round(v, 3) for k, v in self.cpu.items()},
                "timing_process_cpu_seconds": [{k: round(v, 3) for k, v in w.items()} for w in self.workers]}
