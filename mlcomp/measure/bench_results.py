"""What ``mlcomp bench`` measured: one row per (target, batch), one result per model.

A :class:`BenchRow` is a cell (ok, skipped or failed, with timing, its speedup over eager
with a 95 % interval, the rounds, compile time, peak memory, error against eager, and why
the figure cannot be trusted when it cannot); a :class:`BenchResult` holds a model's rows
and how each comparison was timed, and renders them as a text table, JSON or CSV
(:func:`to_csv`)::

    print(result.format())
    mlp  input f32[B, 784]  pipeline (none)  budget 1 s/variant
    target  batch  median  p90  speedup [95% CI]          rounds  spread  ...  note
    eager   1      <t>     <t>  1 (reference)             40      3%
    cpu     1      <t>     <t>  1.52x [1.47-1.58]         40      4%
    ort     1      <t>     <t>  0.98x [0.91-1.04] UNRELIABLE  40  21%    ...  interval 0.91-1.04 includes 1 ...

A speedup is never printed bare: it always carries its interval, and an unreliable one the
word UNRELIABLE and its reasons.
"""
from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlcomp.base.table import Table
from mlcomp.base.units import fmt_bytes
from mlcomp.hardware.intervals import CONFIDENCE, Speedup, relative_iqr
from mlcomp.hardware.peak_memory import MemoryReading
from mlcomp.hardware.timing import Timing, TimingPolicy, fmt_seconds
from mlcomp.measure.plots import EAGER

__all__ = ["CSV_FIELDS", "BenchResult", "BenchRow", "to_csv"]


@dataclass(frozen=True)
class BenchRow:
    """One (target, batch) cell; ``status`` is ok, skipped or failed (``reason`` says why)."""

    model: str
    target: str
    batch: int
    device: str = "cpu"
    status: str = "ok"
    reason: str = ""
    timing: Timing | None = None
    compile_s: float | None = None
    first_call_s: float | None = None     # the first call after compiling (cold: caches, lazy init)
    memory: MemoryReading | None = None
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    verified: bool | None = None          # within mlcomp.analysis.verify's tolerance for the output dtype
    speedup: float | None = None          # median of eager's sample / this one's, same round, device and batch
    interval: Speedup | None = None       # that ratio with its 95 % interval and spread
    rounds: int | None = None             # rounds of the comparison this cell was timed in
    unreliable: tuple[str, ...] = ()      # why the figure cannot be trusted (empty: it can)
    crosscheck: float | None = None       # whole-process speedup (mlcomp.measure.crosscheck), when asked for
    dtype: str = "fp32"                   # the precision the target computed in (mlcomp.measure.variants)
    process_medians: tuple[float, ...] = ()   # with --procs N: each worker process's median s per call

    def process_gap(self) -> float | None:
        """How far apart this variant's processes were: (slowest - fastest) / fastest median."""
        if len(self.process_medians) < 2 or min(self.process_medians) <= 0:
            return None
        return max(self.process_medians) / min(self.process_medians) - 1.0

    def speedup_text(self) -> str:
        """``1.52x [1.47-1.58]``, ``reference``, or ``—``; ``UNRELIABLE`` appended when the cell is."""
        if self.status != "ok" or self.speedup is None:
            return "—"
        text = self.interval.text() if self.interval else ("reference" if self.target == EAGER else "—")
        return text + (" UNRELIABLE" if self.unreliable and self.interval else "")

    def spread(self) -> float | None:
        """IQR over median: of the per-round ratios to eager, or of eager's own samples."""
        if self.interval is not None:
            return self.interval.spread
        return relative_iqr(self.timing.samples) if self.timing else None

    @property
    def label(self) -> str:
        if self.target == EAGER:
            return EAGER if self.device == "cpu" else f"{EAGER} ({self.device})"
        return self.target if self.dtype == "fp32" else f"{self.target} {self.dtype}"

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "target": self.target, "dtype": self.dtype, "batch": self.batch,
                "device": self.device, "status": self.status, "reason": self.reason or None,
                "timing": self.timing.to_json() if self.timing else None, "compile_s": self.compile_s,
                "first_call_s": self.first_call_s,
                "memory": self.memory.to_json() if self.memory else None, "max_abs_err": self.max_abs_err,
                "max_rel_err": self.max_rel_err, "verified": self.verified, "speedup": self.speedup,
                "speedup_interval": self.interval.to_json() if self.interval else None, "rounds": self.rounds,
                "unreliable": list(self.unreliable), "crosscheck_speedup": self.crosscheck,
                "process_medians_s": list(self.process_medians) or None}


CSV_FIELDS = ("model", "target", "device", "batch", "status", "median_s", "p90_s", "repeats", "speedup",
              "speedup_lo", "speedup_hi", "unreliable", "crosscheck_speedup", "compile_s", "first_call_s", "peak_mem_bytes", "max_abs_err", "max_rel_err", "reason", "dtype")


@dataclass(frozen=True)
class BenchResult:
    """All cells of one model."""

    model: str
    inputs: str
    pipeline: str | None
    machine: str
    policy: TimingPolicy
    rows: tuple[BenchRow, ...]
    notes: tuple[str, ...] = ()       # per comparison: where and how long it was timed, the load meanwhile
    crosscheck: bool = False          # a whole-process column was asked for: shown even where it gave no figure

    def table(self) -> Table:
        cross = self.crosscheck or any(r.crosscheck is not None for r in self.rows)
        procs = any(r.process_medians for r in self.rows)
        cols = ("target", "batch", "median", "p90", f"speedup [{CONFIDENCE:.0%} CI]", "rounds", "spread",
                "compile", "1st call", "peak mem", "max abs err") + (("whole-process",) if cross else ()) \
            + (("per process (gap)",) if procs else ()) + ("note",)
        rows = []
        for r in self.rows:
            extra = ((f"{r.crosscheck:.2f}x" if r.crosscheck else "—"),) if cross else ()
            extra += (_per_process_cell(r),) if procs else ()
            if r.status != "ok" or r.timing is None:
                why = f"{r.status}: {_short(r.reason)}" if r.status != "ok" else _short(r.reason)
                rows.append((r.label, str(r.batch), "—", "—", "—", "—", "—", fmt_seconds(r.compile_s), "—", "—",
                             "—") + extra + (why,))
                continue
            t, spread = r.timing, r.spread()
            note = "; ".join(filter(None, (r.reason if r.dtype != "fp32" else "", *r.unreliable))) \
                if r.unreliable else r.reason         # a low-precision row keeps what ran in it
            rows.append((r.label, str(r.batch), fmt_seconds(t.median), fmt_seconds(t.p90), r.speedup_text(),
                         str(r.rounds or t.repeats), "—" if spread is None else f"{spread:.0%}",
                         fmt_seconds(r.compile_s), fmt_seconds(r.first_call_s),
                         fmt_bytes(r.memory.growth, sign=True) if r.memory else "—", _err_cell(r)) + extra + (note,))
        title = (f"{self.model}  input {self.inputs}  pipeline {self.pipeline or '(none)'}  "
                 f"budget {self.policy.budget_s:g} s/variant")
        return Table(title, cols, tuple(rows), frozenset(range(1, len(cols) - 1)))

    def format(self) -> str:
        timed = "".join(f"\n  {n}" for n in self.notes)
        bad = sum(1 for r in self.rows if r.unreliable and r.interval)
        flagged = f"\n{bad} speedup(s) UNRELIABLE: the note says why." if bad else ""
        return (self.table().format() + f"\n({self.machine})\ntimed:{timed}{flagged}\n"
                "speedup: median over rounds of eager's sample / this one's in the same round (variants "
                f"timed in rotated rounds), with its {CONFIDENCE:.0%} interval (order statistics of those "
                "ratios). spread: IQR/median of those ratios (eager: of its own samples). compile: wall time "
                "of mlcomp.compile (a target's first compile includes importing its backend). 1st call: the "
                "first call after compiling. peak mem: RSS growth over the baseline around compile + first "
                "call (GPU: allocated bytes).")

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "inputs": self.inputs, "pipeline": self.pipeline, "machine": self.machine,
                "policy": {"warmup": self.policy.warmup, "budget_s": self.policy.budget_s,
                           "min_repeats": self.policy.min_repeats, "max_repeats": self.policy.max_repeats},
                "timed": list(self.notes), "rows": [r.to_json() for r in self.rows]}

    def csv_rows(self) -> list[dict[str, Any]]:
        out = []
        for r in self.rows:
            t = r.timing
            out.append({"model": r.model, "target": r.target, "dtype": r.dtype, "device": r.device, "batch": r.batch,
                        "status": r.status, "median_s": t.median if t else "", "p90_s": t.p90 if t else "",
                        "repeats": t.repeats if t else "", "speedup": r.speedup or "",
                        "speedup_lo": r.interval.lo if r.interval else "",
                        "speedup_hi": r.interval.hi if r.interval else "", "unreliable": "; ".join(r.unreliable),
                        "crosscheck_speedup": "" if r.crosscheck is None else r.crosscheck,
                        "compile_s": "" if r.compile_s is None else r.compile_s,
                        "first_call_s": "" if r.first_call_s is None else r.first_call_s,
                        "peak_mem_bytes": r.memory.growth if r.memory else "",
                        "max_abs_err": "" if r.max_abs_err is None else r.max_abs_err,
                        "max_rel_err": "" if r.max_rel_err is None else r.max_rel_err, "reason": r.reason})
        return out


def to_csv(results: Sequence[BenchResult]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    w.writeheader()
    for res in results:
        w.writerows(res.csv_rows())
    return buf.getvalue()


def _per_process_cell(row: BenchRow) -> str:
    """``41.3 µs / 43.0 µs (4%)``: each worker process's median and how far apart they were."""
    gap = row.process_gap()
    if gap is None:
        return "—"
    return " / ".join(fmt_seconds(m) for m in row.process_medians) + f" ({gap:.0%})"


def _err_cell(r: BenchRow) -> str:
    if r.max_abs_err is None:
        return "—"
    return f"{r.max_abs_err:.1e}" + ("" if r.verified is not False else " FAIL")


def _short(text: str, n: int = 70) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"
