"""Starting a pipeline artifact's ranks: the launch plan checked up front, torchrun supervised.

:func:`launch_plan` decides whether ``--nproc``, ``--schedule`` and ``--microbatches`` fit the
artifact before any process starts (``mlcomp launch`` calls it in the parent, each rank again in
:func:`mlcomp.targets.distributed.target.run_rank` for a torchrun started by hand)::

    >>> launch_plan({"runtime_info": {"stages": 2, "schedule": "1f1b", "microbatches": 2}}, nproc=2)
    (2, <Schedule.ONE_F_ONE_B: '1f1b'>, 2)
    >>> launch_plan({"runtime_info": {"stages": 2, "schedule": "1f1b", "microbatches": 2}}, nproc=3)
    Traceback (most recent call last):
    mlcomp.targets.distributed.supervise.LaunchError: the artifact has 2 pipeline stages but --nproc 3 processes \
were asked for: 1f1b runs one stage per process. Launch with --nproc 2, or --schedule interleaved with a divisor of 2.

:func:`supervise` runs torchrun in a session of its own and collects what the ranks print, so the
user sees one line: the ranks' own ``error: ...`` (each rank prints the same one; it is shown once)
or, when no rank explained itself, what torchrun reported, never its ``ChildFailedError``
traceback.  Ctrl-C is forwarded to torchrun, which stops its ranks (each exits 130 without a
traceback, :mod:`mlcomp.targets.distributed.launch`); the parent waits for them and raises ``KeyboardInterrupt``.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
from dataclasses import dataclass
from typing import Any, Sequence

from mlcomp.analysis.parallel.pipeline_schedule import Schedule
from mlcomp.base.errors import MlcompError

__all__ = ["LaunchError", "LaunchOutcome", "launch_plan", "supervise"]

STOP_SECONDS = 45.0      # torchrun waits 30 s for its ranks after forwarding a signal, then kills them


class LaunchError(MlcompError):
    """The launch arguments do not fit the artifact, or a rank failed."""


def launch_plan(manifest: dict[str, Any], nproc: int, *, schedule: str | None = None,
                 microbatches: int | None = None) -> tuple[int, Schedule, int]:
    """``(stages, schedule, microbatches)`` of a launch of ``nproc`` ranks; :class:`LaunchError` when they
    cannot run together (torch.distributed.pipelining would fail in every rank)."""
    info = manifest.get("runtime_info") or {}
    stages = int(info.get("stages", 1))
    kind = Schedule(schedule or info.get("schedule") or Schedule.ONE_F_ONE_B.value)
    micro = int(microbatches or info.get("microbatches") or stages)
    if kind is not Schedule.INTERLEAVED and stages != nproc:
        raise LaunchError(f"the artifact has {stages} pipeline stages but --nproc {nproc} processes were asked "
                          f"for: {kind.value} runs one stage per process",
                          hint=f"Launch with --nproc {stages}" + (f", or --schedule interleaved with a divisor "
                                                                  f"of {stages}" if stages > 1 else ""))
    if kind is Schedule.INTERLEAVED and stages % nproc:
        divisors = [d for d in range(1, stages + 1) if stages % d == 0]
        raise LaunchError(f"the artifact has {stages} pipeline stages, which --nproc {nproc} processes cannot share "
                          f"evenly under the interleaved schedule",
                          hint=f"Launch with --nproc one of {', '.join(map(str, divisors))}")
    if kind is Schedule.ONE_F_ONE_B and micro < stages:
        raise LaunchError(f"--microbatches {micro} is fewer than the artifact's {stages} stages, which the 1f1b "
                          "schedule needs at least", hint=f"Launch with --microbatches {stages} or more, or "
                                                          "--schedule gpipe")
    rounds = max(1, micro // nproc)
    if kind is Schedule.INTERLEAVED and micro % rounds:
        raise LaunchError(f"--microbatches {micro} is not a multiple of the interleaved schedule's {rounds} rounds "
                          f"({micro} // {nproc} processes)",
                          hint=f"Launch with --microbatches {rounds * nproc} (a multiple of --nproc {nproc})")
    return stages, kind, micro


@dataclass(frozen=True)
class LaunchOutcome:
    """What torchrun returned: its exit code, the ranks' stdout, and its and the ranks' stderr."""

    code: int
    stdout: str
    stderr: str

    def rank_exit_code(self) -> int:
        """The first failed rank's exit code as torchrun reports it (``exitcode : 4``), else torchrun's own."""
        codes = [int(c) for c in re.findall(r"exitcode\s*:\s*(-?\d+)", self.stderr)]
        return next((c for c in codes if c > 0), self.code)

    def message(self, what: str) -> str:
        """One line: the ranks' ``error:`` lines (each once), else the last line torchrun wrote."""
        errors = [ln.strip()[len("error: "):] for ln in self.stderr.splitlines() if ln.strip().startswith("error: ")]
        if errors:
            return "; ".join(dict.fromkeys(errors))
        lines = [ln.strip() for ln in self.stderr.splitlines() if ln.strip() and not ln.startswith(" ")]
        tail = next((ln for ln in reversed(lines) if "Error" in ln or "error" in ln), lines[-1] if lines else "")
        return f"{what} failed (torchrun exit {self.code}): {tail or 'no message'}"


def supervise(cmd: Sequence[str], *, env: dict[str, str] | None = None) -> LaunchOutcome:
    """Run ``cmd`` (torchrun) to the end, capturing its output; on Ctrl-C stop it and its ranks, then
    raise ``KeyboardInterrupt``."""
    proc = subprocess.Popen(list(cmd), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, env=env)
    try:
        out, err = proc.communicate()
    except KeyboardInterrupt:
        _stop(proc)
        raise
    except BaseException:
        _stop(proc)
        raise
    return LaunchOutcome(proc.returncode, out, err)


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT to torchrun's session (torchrun stops its ranks), wait, then SIGKILL what is left."""
    for sig, wait in ((signal.SIGINT, STOP_SECONDS), (signal.SIGKILL, 5.0)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            proc.communicate(timeout=wait)
            return
        except subprocess.TimeoutExpired:
            continue
        except KeyboardInterrupt:       # a second Ctrl-C: stop waiting politely
            continue
