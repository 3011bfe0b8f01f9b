"""The auto target's timing processes, started as soon as each candidate is built.

A worker (:class:`~mlcomp.runtime.timing_worker.ProcessSampler`) spends most of its start-up
importing torch and its backend and loading the artifact.  One spare worker is spawned ahead
(:meth:`WorkerPool.spare`: it imports torch and mlcomp while a candidate compiles) and loads the
next candidate that verifies, and a new spare is spawned while more are to come; so the start-up
overlaps the compiles instead of following them all (with ``procs=2`` a candidate's second
process starts fresh beside it, and the candidate's sampler is a
:class:`~mlcomp.runtime.timing_worker.ProcessGroup` of both)::

    compile cpu | compile onnxruntime | compile tvm ...........| rank
                  start worker cpu ---> ready                  |
                                        start worker ort -> ready

:meth:`WorkerPool.samplers` waits for the ones still loading.  When an artifact cannot be saved
(or a worker cannot start) the pool remembers why and every candidate is timed in the calling
process instead (the same message as before any was started).
"""
from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from mlcomp.runtime.timing_worker import ProcessGroup, ProcessSampler, WorkerError, save_for_worker, save_inputs

__all__ = ["READY_TIMEOUT_S", "WorkerPool"]

READY_TIMEOUT_S = 600.0     # a worker loads, checks and warms up its artifact within this


class WorkerPool:
    """Timing processes of the built candidates (``enabled=False``: none is started)."""

    def __init__(self, inputs: Sequence[Any], *, warmup: int, block_s: float, enabled: bool = True,
                 describe: Callable[[BaseException], str] = str, procs: int = 1) -> None:
        self.inputs, self.warmup, self.block_s, self.enabled = inputs, warmup, block_s, enabled
        self.procs = procs
        self.problem: str | None = None
        self._describe = describe
        self._stack = contextlib.ExitStack()
        self._root: Path | None = None
        self._feed: Path | None = None
        self._started: dict[str, list[ProcessSampler]] = {}
        self.groups: dict[str, ProcessGroup] = {}     # the names timed in several processes, after samplers()
        self._spare: ProcessSampler | None = None

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stack.close()

    def spare(self) -> None:
        """Start a worker that imports torch and mlcomp now, for the next candidate built (none if one waits)."""
        if not self.enabled or self.problem is not None or self._spare is not None:
            return
        try:
            self._spare = self._stack.enter_context(ProcessSampler.spawn(
                threads=torch.get_num_threads(), warmup=self.warmup, block_s=self.block_s))
        except WorkerError as exc:
            self.problem = self._describe(exc)

    def add(self, name: str, artifact: Any) -> None:
        """Save ``artifact`` and have a worker load it (the spare if one waits; not waiting for it); a
        failure disables the pool."""
        if not self.enabled or self.problem is not None:
            return
        try:
            if self._root is None:
                self._root = Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix="mlcomp-auto-")))
                self._feed = save_inputs(self.inputs, self._root / "inputs.pt")
            folder = save_for_worker(artifact, self._root / name)
        except Exception as exc:  # noqa: BLE001 - any save failure means: time them here instead
            self.problem = f"saving the candidates for their timing processes failed: {self._describe(exc)}"
            return
        try:
            workers = []
            if self._spare is not None:
                self._spare.load(folder, self._feed, name)
                workers, self._spare = [self._spare], None
            while len(workers) < self.procs:
                workers.append(self._stack.enter_context(ProcessSampler.start(
                    folder, self._feed, threads=torch.get_num_threads(), warmup=self.warmup,
                    block_s=self.block_s, label=name if self.procs == 1 else f"{name}#{len(workers)}")))
            self._started[name] = workers
        except WorkerError as exc:
            self.problem = self._describe(exc)

    def samplers(self, names: Sequence[str]) -> dict[str, Callable[[], float]]:
        """A sampler per name once every worker is ready; the workers of other names are stopped.

        Raises :class:`WorkerError` (why) when the pool cannot time them all.
        """
        if self.problem is not None:
            raise WorkerError(self.problem)
        missing = [n for n in names if n not in self._started]
        if missing:
            raise WorkerError(f"no timing process for {', '.join(missing)}")
        for name in [n for n in self._started if n not in names]:
            self.stop(name)
        if self._spare is not None:
            self._spare.close()
            self._spare = None
        for name in names:
            for worker in self._started[name]:
                worker.wait_ready(READY_TIMEOUT_S)
        if self.procs == 1:
            return {name: self._started[name][0].sample for name in names}
        self.groups = {name: ProcessGroup([w.sample for w in self._started[name]]) for name in names}
        return dict(self.groups)

    def stop(self, name: str) -> None:
        """Stop ``name``'s worker (a clear loser, or a candidate no longer timed); its cores are free again."""
        for sampler in self._started.pop(name, []):
            sampler.close()

