"""What ``mlcomp bench`` measured: one row per (target, batch), one result per model.

A :class:`BenchRow` is a cell (ok, skipped or failed, with timing, compile time,
peak memory and error against eager); a :class:`BenchResult` holds a model's
rows and renders them as a text table, JSON or CSV (:func:`to_csv`)::

    print(result.format())
    mlp  input 1x784:f32  pipeline (none)  budget 0.5 s/measurement
    target  batch  median    p90       speedup  compile  ...
    eager   1      <t>       <t>       —        —
    cpu     1      <t>       <t>       <x>      <s>
"""
from __future__ import annotations

import csv
import io
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mlcomp.base.table import Table
from mlcomp.base.units import fmt_bytes
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
    speedup: float | None = None          # eager median / this median, same device and batch

    @property
    def label(self) -> str:
        return self.target if self.device == "cpu" or self.target != EAGER else f"{EAGER} ({self.device})"

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "target": self.target, "batch": self.batch, "device": self.device,
                "status": self.status, "reason": self.reason or None,
                "timing": self.timing.to_json() if self.timing else None, "compile_s": self.compile_s,
                "first_call_s": self.first_call_s,
                "memory": self.memory.to_json() if self.memory else None, "max_abs_err": self.max_abs_err,
                "max_rel_err": self.max_rel_err, "verified": self.verified, "speedup": self.speedup}


CSV_FIELDS = ("model", "target", "device", "batch", "status", "median_s", "p90_s", "repeats", "speedup",
              "compile_s", "first_call_s", "peak_mem_bytes", "max_abs_err", "max_rel_err", "reason")


@dataclass(frozen=True)
class BenchResult:
    """All cells of one model."""

    model: str
    inputs: str
    pipeline: str | None
    machine: str
    policy: TimingPolicy
    rows: tuple[BenchRow, ...]

    def table(self) -> Table:
        cols = ("target", "batch", "median", "p90", "speedup", "compile", "1st call", "peak mem", "max abs err",
                "runs", "note")
        rows = []
        for r in self.rows:
            if r.status != "ok":
                rows.append((r.label, str(r.batch), "—", "—", "—", fmt_seconds(r.compile_s), "—", "—", "—", "—",
                             f"{r.status}: {_short(r.reason)}"))
                continue
            t = r.timing
            assert t is not None
            rows.append((r.label, str(r.batch), fmt_seconds(t.median), fmt_seconds(t.p90),
                         f"{r.speedup:.2f}x" if r.speedup else "—", fmt_seconds(r.compile_s),
                         fmt_seconds(r.first_call_s), fmt_bytes(r.memory.growth, sign=True) if r.memory else "—",
                         _err_cell(r), str(t.repeats), r.reason))
        title = (f"{self.model}  input {self.inputs}  pipeline {self.pipeline or '(none)'}  "
                 f"budget {self.policy.budget_s:g} s/measurement")
        return Table(title, cols, tuple(rows), frozenset({1, 2, 3, 4, 5, 6, 7, 8, 9}))

    def format(self) -> str:
        return (self.table().format() + f"\n({self.machine})\n"
                "compile: wall time of mlcomp.compile (capture, passes, lowering; a target's first compile "
                "includes importing its backend). 1st call: the first call after compiling, also the first "
                "warm-up call. peak mem: RSS growth over the baseline around compile + "
                "runs (GPU: allocated bytes). speedup: eager median / median, same device and batch.")

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "inputs": self.inputs, "pipeline": self.pipeline, "machine": self.machine,
                "policy": {"warmup": self.policy.warmup, "budget_s": self.policy.budget_s,
                           "min_repeats": self.policy.min_repeats, "max_repeats": self.policy.max_repeats},
                "rows": [r.to_json() for r in self.rows]}

    def csv_rows(self) -> list[dict[str, Any]]:
        out = []
        for r in self.rows:
            t = r.timing
            out.append({"model": r.model, "target": r.target, "device": r.device, "batch": r.batch,
                        "status": r.status, "median_s": t.median if t else "", "p90_s": t.p90 if t else "",
                        "repeats": t.repeats if t else "", "speedup": r.speedup or "",
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


def _err_cell(r: BenchRow) -> str:
    if r.max_abs_err is None:
        return "—"
    return f"{r.max_abs_err:.1e}" + ("" if r.verified is not False else " FAIL")


def _short(text: str, n: int = 70) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"
