"""The ranking step of ``auto``: the verified candidates timed in the timing processes, or in this process.

:func:`time_candidates` runs every built artifact once more here (a candidate that fails now is
disqualified, not timed), waits for the timing processes to have loaded the rest
(:meth:`~mlcomp.api.auto.workers.WorkerPool.samplers`) and ranks them there
(:func:`~mlcomp.api.auto.rank.rank_samplers`, clear losers released in every process as they are
decided).  When the processes cannot be used, every candidate is timed in this process instead, in
blocks of about ``BLOCK_S`` after an untimed block (so a switch between runtimes is not charged to
the one switched to), and ``timed_in`` says why.
"""
from __future__ import annotations

import os
import statistics
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any

from mlcomp.api.auto.phases import Phases
from mlcomp.api.auto.rank import BLOCK_S, EARLY_ABOVE, Ranking, Sampler, block_samplers, rank_samplers
from mlcomp.api.auto.workers import WorkerPool
from mlcomp.base.errors import MlcompError
from mlcomp.hardware.timing import Clock, TimingPolicy, calls_per_block, synchronizer
from mlcomp.runtime.timing_worker import WorkerError

__all__ = ["IN_PROCESSES", "first_line", "time_candidates"]

IN_PROCESSES = "timing processes shared by the candidates"


def first_line(exc: BaseException) -> str:
    """``exc`` as one line of at most 300 characters (an :class:`MlcompError`'s message, else type: text)."""
    text = exc.message if isinstance(exc, MlcompError) else f"{type(exc).__name__}: {exc}"
    line = " ".join(text.split())
    return line if len(line) <= 300 else line[:300] + " …"


def time_candidates(built: dict[str, Any], inputs: Sequence[Any], policy: TimingPolicy, clock: Clock,
                    rows: dict[str, Any], pool: WorkerPool, phases: Phases) -> tuple[Ranking | None, str]:
    """Rank the built artifacts (``built``: name -> compile result; ``rows``: name -> its
    :class:`~mlcomp.api.auto.search.Candidate`, updated with what was measured); ``phases`` gets the
    seconds spent waiting for the saves (``saving``), for the processes (``workers_ready``), ranking (``rank``).

    ``(None, why)`` when every candidate failed when run again (each one's row says why).
    """
    with phases("saving"):
        pool.wait_saved()          # the saves for the timing processes left to finish
    for name, result in list(built.items()):
        try:
            result.artifact(*inputs)
        except Exception as exc:  # noqa: BLE001 - reported as the candidate's reason
            rows[name] = replace(rows[name], verified=False, reason=f"running it failed: {first_line(exc)}")
            del built[name]
    if not built:
        return None, "every verified candidate failed when run again for timing"
    timed_in = "this process (" + ("one candidate" if len(built) == 1 else "asked for") + ")"
    ranking = None
    if pool.enabled and len(built) > 1:
        try:
            with phases("workers_ready"):
                samplers = pool.samplers(list(built))
            with phases("rank"):
                ranking = rank_samplers(samplers, policy, on_eliminate=pool.stop, **_rules(pool.started))
            timed_in = f"{pool.started} {IN_PROCESSES}"
        except WorkerError as exc:
            timed_in = f"this process ({first_line(exc)})"
    if ranking is None:
        with phases("rank"):
            ranking = rank_samplers(_local_samplers(built, inputs, policy, clock), policy, clock=clock, **_rules(1))
    for name in built:
        group = pool.groups.get(name)
        gone = ranking.eliminated.get(name) or ranking.noise_ties.get(name)
        rows[name] = replace(rows[name], median_s=ranking.medians[name], ratio=ranking.ratios.get(name),
                             reason=gone.why if gone is not None else rows[name].reason,
                             p_value=ranking.p_values.get(name),
                             process_medians=tuple(statistics.median(s) for s in group.per_process if s) if group else ())
    return ranking, timed_in


def _rules(procs: int) -> dict[str, Any]:
    """The ranking's early rules: a loser above ``EARLY_ABOVE`` in every round leaves early, and a tie within the
    ``procs`` timing processes' noise ends the tie-break; ``MLCOMP_AUTO_RANK=full``: neither (for comparing)."""
    if os.environ.get("MLCOMP_AUTO_RANK") == "full":
        return {"procs": 1, "early": None}
    return {"procs": procs, "early": EARLY_ABOVE}


def _local_samplers(built: dict[str, Any], inputs: Sequence[Any], policy: TimingPolicy,
                    clock: Clock) -> dict[str, Sampler]:
    """Samplers in this process: a sample is a block of calls lasting about BLOCK_S after an untimed
    block, so the previous runtime's pool spinning down is not charged to the next one."""
    fns: dict[str, Callable[[], Any]] = {}
    calls: dict[str, int] = {}
    for name, result in built.items():
        art = result.artifact
        start = clock()
        art(*inputs)
        calls[name] = calls_per_block(BLOCK_S, clock() - start)
        fns[name] = (lambda a=art, k=calls[name]: [a(*inputs) for _ in range(k)])
    syncs = {name: synchronizer(built[name].artifact.manifest.get("device") or "cpu") for name in fns}
    return block_samplers(fns, policy, clock=clock, syncs=syncs, per_call={n: 1 / k for n, k in calls.items()})
