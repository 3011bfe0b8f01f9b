"""What every study shares: its configuration, result records, text tables and a bar plot.

A study prints *measured* figures beside the *chapter's* figures.  The two are
never mixed: a :class:`Figure` keeps the number measured here (``measured``)
apart from the text of the chapter's number and where it comes from
(``chapter``), so nothing printed can pass a quoted figure off as ours.
"""
from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from mlcomp.base.table import Table
from mlcomp.base.units import fmt_bytes
from mlcomp.hardware.probe import machine_line  # noqa: F401 - re-exported
from mlcomp.hardware.intervals import paired_ratios, speedup_of
from mlcomp.hardware.noise import noise_reasons
from mlcomp.hardware.timing import Clock, Timing, TimingPolicy, fmt_rate, fmt_seconds


@dataclass(frozen=True)
class StudyConfig:
    """Options shared by all studies; ``quick`` shrinks every size for tests and smoke runs."""

    quick: bool = False
    device: str = "auto"                  # auto | cpu | cuda
    budget_s: float = 0.5                 # per measurement
    targets: tuple[str, ...] = ("cpu", "onnxruntime", "tvm")
    model: str = "resnet18"               # roofline
    batch: int = 1                        # roofline
    input_shapes: tuple[str, ...] = ()    # roofline, for models that carry no input shapes
    threads: int | None = None            # hybridize: intra-op threads of every compiled runtime
    clock: Clock | None = None            # None: time.perf_counter

    def policy(self, *, warmup: int = 2, min_repeats: int = 3) -> TimingPolicy:
        if self.quick:
            return TimingPolicy(warmup=1, budget_s=min(self.budget_s, 0.02), min_repeats=1, max_repeats=3)
        return TimingPolicy(warmup=warmup, budget_s=self.budget_s, min_repeats=min_repeats)

    @property
    def timer(self) -> Clock:
        """The clock every measurement uses (``time.perf_counter`` unless a fake was injected)."""
        import time

        return self.clock or time.perf_counter

    def resolved_device(self) -> str:
        """``cuda`` when asked for (or ``auto`` and a GPU is present), else ``cpu``."""
        import torch

        if self.device == "auto":
            return "cuda" if torch.cuda.is_available() else "cpu"
        return self.device


@dataclass(frozen=True)
class Figure:
    """One measured quantity, optionally beside the chapter's figure for the same experiment."""

    label: str
    measured: float | None               # None: not measured (skipped; see note)
    unit: str = "s"                      # s | B | x | FLOP/s | B/s | %
    chapter: str = ""                    # the chapter's figure as text, with its source
    note: str = ""

    def value_text(self) -> str:
        return format_value(self.measured, self.unit)

    def to_json(self) -> dict[str, Any]:
        return {"label": self.label, "measured": self.measured, "unit": self.unit,
                "chapter": self.chapter or None, "note": self.note or None}


@dataclass(frozen=True)
class StudyResult:
    """The outcome of one study: measured figures, optional extra tables, notes and raw data."""

    name: str
    title: str
    setup: str
    figures: tuple[Figure, ...]
    tables: tuple[Table, ...] = ()
    notes: tuple[str, ...] = ()
    data: dict[str, Any] = field(default_factory=dict)   # raw numbers for plots and JSON

    def figure_table(self) -> Table:
        rows = tuple((f.label, f.value_text(), f.chapter or "—", f.note) for f in self.figures)
        return Table("", ("measurement", "measured here", "the chapter", "note"), rows, frozenset({1}))

    def format(self) -> str:
        parts = [f"== {self.title} ==", self.setup, "", self.figure_table().format()]
        for t in self.tables:
            parts += ["", t.format()]
        if self.notes:
            parts += [""] + [wrap(n, prefix="* ") for n in self.notes]
        return "\n".join(parts)

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StudyResult:
        """Rebuild a result from :meth:`to_json` (to re-plot or re-print without measuring again)."""
        figures = tuple(Figure(f["label"], f["measured"], f["unit"], f["chapter"] or "", f["note"] or "")
                        for f in d["figures"])
        tables = tuple(Table(t["title"], tuple(t["columns"]), tuple(tuple(r) for r in t["rows"]),
                             frozenset(t.get("right", ()))) for t in d["tables"])
        return cls(d["study"], d["title"], d["setup"], figures, tables, tuple(d["notes"]), dict(d["data"]))

    def to_json(self) -> dict[str, Any]:
        return {"study": self.name, "title": self.title, "setup": self.setup,
                "figures": [f.to_json() for f in self.figures], "tables": [t.to_json() for t in self.tables],
                "notes": list(self.notes), "data": self.data}


def paired(timings: Mapping[str, Timing], reference: str, variant: str) -> str:
    """``reference``'s time over ``variant``'s from the rounds of an interleaved measurement (sample ``i`` of
    each is round ``i``): the median ratio with its 95 % interval, and UNRELIABLE with the reason when the
    rounds spread too far or the interval includes 1 (:func:`mlcomp.hardware.noise.noise_reasons`).

        >>> from mlcomp.hardware.timing import Timing
        >>> paired({"a": Timing((2.0,) * 8), "b": Timing((1.0,) * 8)}, "a", "b")
        '2.00x [2.00-2.00]'
    """
    s = speedup_of(paired_ratios(timings[reference].samples, timings[variant].samples))
    why = noise_reasons(None, 1, s)
    return s.text() + (f" UNRELIABLE ({why[0]})" if why else "")


def format_value(v: float | None, unit: str) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "skipped"
    if unit == "s":
        return fmt_seconds(v)
    if unit == "B":
        return fmt_bytes(v, sign=True)
    if unit == "x":
        return f"{v:.2f}x"
    if unit == "%":
        return f"{v:.0f}%"
    if unit in ("FLOP/s", "B/s"):
        return fmt_rate(v, unit)
    return f"{v:.4g} {unit}"


def wrap(text: str, *, width: int = 100, prefix: str = "") -> str:
    import textwrap

    return textwrap.fill(text, width=width, initial_indent=prefix, subsequent_indent=" " * len(prefix))
