"""The auto target's timing processes: started once, at the start of a compile, shared by every candidate.

``procs`` hosting processes (:class:`~mlcomp.runtime.timing_host.HostWorker`) come from one start-up
(:meth:`~mlcomp.runtime.timing_host.HostWorker.spawn_group`: a zygote imports torch and mlcomp, then
forks the others) when :meth:`WorkerPool.start` is called: by ``mlcomp.compile`` before the capture,
else before the first candidate compiles.  A pool that hosted nothing (no candidate verified, a
record or a cache hit made it unneeded) is killed, not waited for (:meth:`WorkerPool.discard`).
Each candidate that verifies is saved once and loaded into every one of them (:meth:`WorkerPool.add`,
not waiting), so its start-up is only its own load, and the number of processes does not grow with
the number of candidates::

    start | capture | compile cpu | compile onnxruntime | compile tvm ...... | warm      | rank
    zygote: import torch, mlcomp | fork -> process 1
    process 0:                     load cpu .. load onnxruntime .. load tvm | all |
    process 1:                     load cpu .. load onnxruntime .. load tvm |     | all |

A load makes no call: while the compiles load both cores, a runtime's parallel calls would spin waiting for
a core (a TorchScript ResNet-18's six warm-up calls took 1.8 CPU-s per process so).  :meth:`WorkerPool.samplers`
waits for the loads still running, has each process warm its artifacts up in turn, and gives each candidate a
:class:`~mlcomp.runtime.timing_worker.ProcessGroup` over the processes, alternating: a ranking's
round samples every candidate in one process (the paired ratios of a round compare candidates
within one process), the next round in the next process.  :meth:`WorkerPool.stop` releases a
clear loser in every process.  When an artifact cannot be saved (or a process cannot start or
load it) the pool remembers why and every candidate is timed in the calling process instead.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from mlcomp.runtime.timing_host import HostWorker
from mlcomp.runtime.timing_worker import ProcessGroup, WorkerError, save_for_worker, save_inputs

__all__ = ["READY_TIMEOUT_S", "WorkerPool"]

READY_TIMEOUT_S = 600.0     # a process loads, checks and warms up its artifacts within this


def _variant() -> dict[str, Any]:
    """The spawn options the environment asks for: forked processes unless ``MLCOMP_AUTO_PROCESSES=spawn``,
    a quiet wait unless ``MLCOMP_AUTO_SETTLE=fixed``, the pool's preload unless ``MLCOMP_AUTO_PRELOAD=off`` (its
    runtimes' imports at the first load unless ``MLCOMP_AUTO_POSTLOAD=off``: at each one's own), a
    lead-in that ends on steady calls unless ``MLCOMP_AUTO_LEAD=fixed``, warm-ups once every candidate is built
    unless ``MLCOMP_AUTO_WARM=load`` (for comparing the schemes: benchmarks/auto_compile.py --variants)."""
    out: dict[str, Any] = {"fork": os.environ.get("MLCOMP_AUTO_PROCESSES") != "spawn",
                           "quiet": os.environ.get("MLCOMP_AUTO_SETTLE") != "fixed"}
    if os.environ.get("MLCOMP_AUTO_PRELOAD") == "off":
        out["preload"] = ()
    if os.environ.get("MLCOMP_AUTO_POSTLOAD") == "off":
        out["postload"] = ()
    if os.environ.get("MLCOMP_AUTO_LEAD") == "fixed":
        out["steady"] = False
    out["warm_later"] = os.environ.get("MLCOMP_AUTO_WARM") != "load"
    return out


class WorkerPool:
    """``procs`` timing processes shared by the built candidates (``enabled=False``: none is started).

    ``spawn`` makes the processes (default :meth:`HostWorker.spawn_group`; tests pass a fake);
    ``preload``: the modules their loads will need, imported once before the first forks the others;
    ``postload``: the runtimes their loads import, imported by each process at its first load;
    ``started`` counts the processes spawned.
    """

    def __init__(self, inputs: Sequence[Any], *, warmup: int, block_s: float, enabled: bool = True,
                 describe: Callable[[BaseException], str] = str, procs: int = 1, preload: Sequence[str] = (),
                 postload: Sequence[str] = (),
                 spawn: Callable[..., Sequence[Any]] = HostWorker.spawn_group) -> None:
        self.inputs, self.warmup, self.block_s, self.enabled = inputs, warmup, block_s, enabled
        self.procs, self.preload, self.postload = procs, tuple(preload), tuple(postload)
        self.problem: str | None = None
        self.started = 0
        self.groups: dict[str, ProcessGroup] = {}     # the names timed, after samplers()
        self._describe, self._spawn = describe, spawn
        self._stack = contextlib.ExitStack()
        self._root: Path | None = None
        self._workers: list[Any] = []
        self._added: list[str] = []
        self._saver: concurrent.futures.ThreadPoolExecutor | None = None
        self._saving: list[concurrent.futures.Future[None]] = []

    def __enter__(self) -> "WorkerPool":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.wait_saved()           # the saves write into the folder the stack removes
        if self._saver is not None:
            self._saver.shutdown()
        if not self._added:
            self.discard()          # never used: not waited for (they may still be importing)
        self._stack.close()

    def discard(self) -> None:
        """Kill the processes now, whatever they are doing (nothing of them is wanted)."""
        for worker in self._workers:
            worker.kill()
        self._workers.clear()
        self.enabled, self.started = False, 0

    def start(self) -> None:
        """Spawn the ``procs`` processes now (once; they import torch and mlcomp while the caller compiles)."""
        if not self.enabled or self.problem is not None or self._workers:
            return
        try:
            self._root = Path(self._stack.enter_context(tempfile.TemporaryDirectory(prefix="mlcomp-auto-")))
            feed = save_inputs(self.inputs, self._root / "inputs.pt")
            for worker in self._spawn(feed, self.procs, threads=torch.get_num_threads(), warmup=self.warmup,
                                      block_s=self.block_s,
                                      **{"preload": self.preload, "postload": self.postload, **_variant()}):
                self._workers.append(self._stack.enter_context(worker))
                self.started += 1
        except WorkerError as exc:
            self.problem = self._describe(exc)

    def add(self, name: str, artifact: Any) -> None:
        """Save ``artifact`` and have every process load it, in a thread of the pool's (the caller goes on
        compiling the next candidate: a TVM module's export is LLVM and the linker, off the GIL); a failure
        disables the pool.  Adds are done in order; :meth:`wait_saved` waits for them."""
        self.start()
        if not self.enabled or self.problem is not None:
            return
        if self._saver is None:
            self._saver = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="mlcomp-auto-save")
        self._saving.append(self._saver.submit(self._save_and_host, name, artifact))

    def wait_saved(self) -> None:
        """Block until every artifact given to :meth:`add` is saved and sent to the processes."""
        for future in self._saving:
            future.result()
        self._saving.clear()

    def _save_and_host(self, name: str, artifact: Any) -> None:
        if self.problem is not None:
            return
        try:
            folder = save_for_worker(artifact, self._root / name)
        except Exception as exc:  # noqa: BLE001 - any save failure means: time them here instead
            self.problem = f"saving the candidates for their timing processes failed: {self._describe(exc)}"
            return
        try:
            for worker in self._workers:
                worker.host(name, folder)
            self._added.append(name)
        except WorkerError as exc:
            self.problem = self._describe(exc)

    def samplers(self, names: Sequence[str]) -> dict[str, Callable[[], float]]:
        """A sampler per name once every process has loaded it; the other names are released.

        Raises :class:`WorkerError` (why) when the pool cannot time them all.
        """
        self.wait_saved()
        if self.problem is not None:
            raise WorkerError(self.problem)
        missing = [n for n in names if n not in self._added]
        if missing:
            raise WorkerError(f"no timing process has {', '.join(missing)}")
        for worker in self._workers:
            worker.wait_hosted(READY_TIMEOUT_S)
        for worker in self._workers:        # one process at a time: the warm-ups compete for no core
            worker.warm(READY_TIMEOUT_S)
        for worker in self._workers:        # each waits for the others' threads to be quiet before a sample
            worker.watch([w.pid for w in self._workers if w.pid is not None])
        for name in [n for n in self._added if n not in names]:
            self.stop(name)
        self.groups = {name: ProcessGroup([w.sampler(name) for w in self._workers], alternate=True)
                       for name in names}
        return dict(self.groups)

    def cpu_seconds(self) -> list[dict[str, float]]:
        """Each process's CPU seconds by what it did (:meth:`HostWorker.stats`); none for a pool that hosted
        nothing or whose processes cannot answer."""
        if not self._added or self.problem is not None:
            return []
        try:
            return [worker.stats() for worker in self._workers]
        except WorkerError:
            return []

    def stop(self, name: str) -> None:
        """Release ``name`` in every process (a clear loser, or a candidate no longer timed)."""
        for worker in self._workers:
            worker.drop(name)
