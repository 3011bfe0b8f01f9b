"""One comparison of ``mlcomp bench``: eager and the targets of one batch and device, timed together.

:func:`time_group` takes the runnables that compiled and passed their first call, waits for a
quiet machine when asked (``settle_s``, :func:`mlcomp.hardware.noise.settle`), times them in
rotated rounds (:func:`mlcomp.measure.rounds.compare`) — in a worker process each when every
one can be loaded there (:func:`mlcomp.measure.samplers.process_samplers`), else in this
process — and fills each row with its samples, its speedup over eager with a 95 % interval,
the rounds, and the reasons it cannot be trusted.  It returns one line saying how it went.
"""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from mlcomp.hardware.noise import LoadWatch, settle
from mlcomp.hardware.timing import Clock, Sync
from mlcomp.measure.bench_results import BenchRow
from mlcomp.measure.plots import EAGER
from mlcomp.measure.rounds import MIN_ROUNDS, Comparison, compare
from mlcomp.measure.samplers import ProcessGroup, Samplers, can_isolate, local_samplers, process_samplers

__all__ = ["Cell", "WatchFactory", "process_medians", "time_group"]

# pids of this run's workers -> the watch of the machine's load (the factory None: the load is not read)
WatchFactory = Callable[[Callable[[], Sequence[int]]], LoadWatch]


@dataclass(frozen=True)
class Cell:
    """What one comparison runs on: the loaded model, its label, batch, device, inputs and eager's outputs."""

    source: Any
    label: str
    batch: int
    device: str
    inputs: tuple
    expected: Any


def time_group(model: Any, cell: Cell, built: dict[str, Callable[..., Any]], rows: dict[str, BenchRow],
               config: Any, *, clock: Clock = time.perf_counter, sync: Sync, input_shapes: Sequence[str] = (),
               trust_pickle: bool = False, watch: WatchFactory | None = LoadWatch) -> tuple[dict[str, BenchRow], str]:
    """Time ``built`` (eager among them) against eager; the rows filled in and a line on how they were timed."""
    import torch

    threads = config.threads or torch.get_num_threads()
    waited = ""
    if config.settle_s > 0 and watch is not None:
        waited = f"; {settle(config.settle_s, threads, watch=lambda: watch(tuple))}"
    comparison, fallback, per_process = None, "", {}
    if config.isolate and cell.device == "cpu" and len(built) > 1 and can_isolate(built, model):
        eager = {"spec": model, "input_shapes": list(input_shapes), "trust_pickle": trust_pickle,
                 "batch": cell.batch}
        try:
            with process_samplers({n: f for n, f in built.items() if n != EAGER}, eager, cell.inputs,
                                  threads=threads, warmup=config.policy.warmup, procs=config.procs) as samplers:
                comparison, where = _compare(samplers, config, threads, clock, watch), samplers.where
                per_process = process_medians(samplers.groups, comparison.kept)
        except Exception as exc:  # noqa: BLE001 - a worker that cannot start: time them here instead
            fallback = f" (worker processes failed: {' '.join(str(exc).split())[:160]})"
    if comparison is None:
        calls = {n: (lambda f=f: f(*cell.inputs)) for n, f in built.items()}
        samplers = local_samplers(calls, warmup=config.policy.warmup, budget_s=config.policy.budget_s, clock=clock,
                                  syncs={n: sync for n in calls})
        comparison, where = _compare(samplers, config, threads, clock, watch), samplers.where + fallback
    rows = {n: replace(r, process_medians=per_process.get(n, ())) for n, r in _filled(rows, comparison).items()}
    if config.crosscheck:
        rows, checked = _crosscheck(model, cell, built, rows, threads, input_shapes, trust_pickle)
        waited += checked
    load = f"; {comparison.load.text()}" if comparison.load else ""
    on = "" if cell.device == "cpu" else f" on {cell.device}"
    plural = "s" if len(built) > 1 else ""
    note = (f"batch {cell.batch}{on}: {len(built)} variant{plural} timed in {where}, {comparison.rounds} rounds "
            f"({comparison.stopped}){load}{waited}")
    return rows, note


def _crosscheck(model: Any, cell: Cell, built: dict[str, Callable[..., Any]], rows: dict[str, BenchRow],
                threads: int, input_shapes: Sequence[str], trust_pickle: bool) -> tuple[dict[str, BenchRow], str]:
    """Rows with their whole-process speedup (:mod:`mlcomp.measure.crosscheck`), and a note."""
    from mlcomp.measure.crosscheck import crosscheck

    if cell.device != "cpu" or not can_isolate(built, model) or len(built) < 2:
        return rows, "; whole-process cross-check: needs a model spec and saved artifacts on cpu"
    eager = {"spec": model, "input_shapes": list(input_shapes), "trust_pickle": trust_pickle, "batch": cell.batch}
    per_call = {n: rows[n].timing.median for n in built}
    try:
        ratios = crosscheck({n: f for n, f in built.items() if n != EAGER}, eager, cell.inputs,
                            per_call_s=per_call, threads=threads)
    except Exception as exc:  # noqa: BLE001 - the column stays empty, the page says why
        return rows, f"; whole-process cross-check failed: {' '.join(str(exc).split())[:160]}"
    missing = [n for n, v in ratios.items() if v is None]
    note = ("; whole-process cross-check done" if not missing else
            f"; whole-process cross-check: no figure for {', '.join(missing)} (start-up varied more than the calls took)")
    return {n: replace(r, crosscheck=ratios.get(n)) for n, r in rows.items()}, note


def process_medians(groups: Mapping[str, ProcessGroup], kept: Sequence[int]) -> dict[str, tuple[float, ...]]:
    """Per variant timed in several processes: each process's median seconds per call over the kept rounds."""
    return {name: tuple(statistics.median([samples[i] for i in kept] or samples) for samples in group.per_process)
            for name, group in groups.items()}


def _compare(samplers: Samplers, config: Any, threads: int, clock: Clock, watch: WatchFactory | None) -> Comparison:
    policy = config.policy
    return compare(samplers.fns, EAGER, budget_s=policy.budget_s, min_rounds=max(policy.min_repeats, MIN_ROUNDS),
                   max_rounds=policy.max_repeats, precision=config.precision, threads=threads, clock=clock,
                   watch=watch(lambda: samplers.pids) if watch else None, warmup_s=samplers.warmup,
                   patience_s=config.settle_s)


def _filled(rows: dict[str, BenchRow], c: Comparison) -> dict[str, BenchRow]:
    out = {}
    for name, row in rows.items():
        timing = c.timings.get(name)
        if timing is None:
            out[name] = row
            continue
        s = c.speedups.get(name)
        out[name] = replace(row, timing=timing, speedup=1.0 if name == EAGER else s.median, interval=s,
                            rounds=c.rounds, unreliable=c.reasons.get(name, ()))
    return out
