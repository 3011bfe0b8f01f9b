"""Samplers for :func:`mlcomp.measure.rounds.compare`: blocks of calls, here or in a worker process each.

A *sampler* takes one sample of a variant and returns seconds per call.  A sample is a block
of calls lasting about ``BLOCK_S`` (one call for a slow model), after an untimed lead-in block:
the runtime that ran just before keeps its thread pool spinning for a while, and that cost is
not charged to this one.

* :func:`local_samplers`: every variant in this process (any callable; fakes in tests).
* :func:`process_samplers`: every variant in a fresh worker process of its own
  (:class:`~mlcomp.runtime.timing_worker.ProcessSampler`): compiled artifacts saved to a
  temporary folder and loaded there, eager torch by loading the model spec there.  No two
  runtimes' thread pools share a process, as when each is deployed.  With ``procs=2`` each
  variant runs in two processes (:class:`~mlcomp.runtime.timing_worker.ProcessGroup`): one runtime in two processes can
  differ by tens of per cent on a VM (where its memory landed), and one process per variant
  would report that as a difference between variants.
"""
from __future__ import annotations

import contextlib
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlcomp.hardware.decide import call_samplers
from mlcomp.hardware.timing import Clock, Sync, calls_per_block, no_sync
from mlcomp.runtime.timing_worker import ProcessGroup

__all__ = ["BLOCK_S", "ProcessGroup", "Samplers", "can_isolate", "local_samplers", "process_samplers", "saved"]

BLOCK_S = 0.02            # seconds of calls per sample
READY_TIMEOUT_S = 600.0   # a worker loads, checks and warms up its variant within this


@dataclass
class Samplers:
    """Samplers by variant, where they run, their worker pids, and warm-up (seconds, calls) per variant;
    ``groups``: the variants timed in several processes each."""

    fns: dict[str, Callable[[], float]]
    where: str
    pids: list[int] = field(default_factory=list)
    warmup: dict[str, tuple[float, int]] = field(default_factory=dict)
    groups: dict[str, ProcessGroup] = field(default_factory=dict)


def local_samplers(fns: Mapping[str, Callable[[], Any]], *, warmup: int, budget_s: float,
                   clock: Clock = time.perf_counter, syncs: Mapping[str, Sync] | None = None) -> Samplers:
    """Warm each of ``fns`` up (``warmup`` calls, at most ``budget_s`` s), size its block from one more
    call, and return block samplers of them (with an untimed lead-in block)."""
    blocks: dict[str, Callable[[], Any]] = {}
    scale: dict[str, float] = {}
    warm: dict[str, tuple[float, int]] = {}
    for name, fn in fns.items():
        barrier = (syncs or {}).get(name, no_sync)
        w0, calls = clock(), 0
        while calls < warmup and clock() - w0 < budget_s:
            fn()
            barrier()
            calls += 1
        start = clock()
        fn()
        barrier()
        k = calls_per_block(BLOCK_S, clock() - start)
        warm[name] = (clock() - w0, calls + 1)
        blocks[name] = (lambda f=fn, n=k: [f() for _ in range(n)])
        scale[name] = 1.0 / k
    samplers = call_samplers(blocks, warmup=0, clock=clock, syncs=syncs, lead_in=1, per_call=scale)
    return Samplers(samplers, "this process", [], warm)


def saved(artifact: Any, folder: Path) -> Path:
    """Save ``artifact`` for a worker process (:func:`~mlcomp.runtime.timing_worker.save_for_worker`)."""
    from mlcomp.runtime.timing_worker import save_for_worker

    return save_for_worker(artifact, folder)


def can_isolate(fns: Mapping[str, Any], model: Any) -> bool:
    """Workers can run these: the model is a spec (a string) and every other variant a savable artifact."""
    return isinstance(model, str) and all(hasattr(fn, "save") and hasattr(fn, "manifest")
                                          for name, fn in fns.items() if name != "eager")


@contextlib.contextmanager
def process_samplers(artifacts: Mapping[str, Any], eager: Mapping[str, Any] | None, inputs: Sequence[Any], *,
                     threads: int, warmup: int, procs: int = 1) -> Iterator[Samplers]:
    """``procs`` warm worker processes per variant: ``artifacts`` (name -> Artifact) and, when ``eager``
    is given (``load_model`` arguments: ``spec``, ``input_shapes``, ``trust_pickle``, ``batch``), ``"eager"``.
    With ``procs`` > 1 each variant's sampler is a :class:`ProcessGroup` of its processes."""
    from mlcomp.runtime.timing_worker import ProcessSampler, save_inputs

    with tempfile.TemporaryDirectory(prefix="mlcomp-bench-") as tmp, contextlib.ExitStack() as stack:
        root = Path(tmp)
        feed = save_inputs(inputs, root / "inputs.pt")
        folders: dict[str, Path | None] = {"eager": None} if eager is not None else {}
        folders.update({name: saved(art, root / name) for name, art in artifacts.items()})
        start = time.perf_counter()
        workers = {(name, i): stack.enter_context(ProcessSampler.start(
                       folder, feed, threads=threads, warmup=warmup, block_s=BLOCK_S,
                       label=name if procs == 1 else f"{name}#{i}", model=dict(eager) if folder is None else None))
                   for name, folder in folders.items() for i in range(procs)}
        for worker in workers.values():
            worker.wait_ready(READY_TIMEOUT_S)
        spent = time.perf_counter() - start
        if procs == 1:
            fns: dict[str, Callable[[], float]] = {name: w.sample for (name, _), w in workers.items()}
            groups: dict[str, ProcessGroup] = {}
        else:
            groups = {name: ProcessGroup([workers[name, i].sample for i in range(procs)]) for name in folders}
            fns = dict(groups)
        where = f"{len(workers)} worker processes" + (f" ({procs} per variant)" if procs > 1 else "")
        yield Samplers(fns, where, [w.pid for w in workers.values()], {n: (spent, warmup) for n in folders}, groups)
