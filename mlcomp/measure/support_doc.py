"""The support matrix as JSON and as ``docs/SUPPORT.md``: the table, totals, the host and the versions.

:func:`matrix_json` is the one record of a run (host, versions, columns, every cell
with its status, first error line and seconds); :func:`render_markdown` reads only
that record, so the document can be rebuilt from the JSON::

    >>> host = {"cpu": "Some CPU", "flags": {"avx2": True}, "cores": 2, "python": "3.11",
    ...         "versions": {"torch": "2.13"}, "date": "2026-01-01 00:00 UTC"}
    >>> doc = render_markdown(matrix_json(Matrix([]), host))
    >>> doc.splitlines()[0], "- Host: Some CPU, 2 cores; flags: avx2 yes" in doc
    ('# Support matrix', True)
"""
from __future__ import annotations

import datetime as _dt
import importlib
import os
import platform
from typing import Any

from mlcomp.measure.support_cells import Status
from mlcomp.measure.support_matrix import Matrix

__all__ = ["host_info", "matrix_json", "merge_runs", "render_markdown", "summary", "HOST_FLAGS"]

HOST_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8", "amx_fp16")
_VERSIONED = ("torch", "onnxruntime", "openvino", "tvm", "transformers")
_MARK = {Status.VERIFIED.value: "✅", Status.REFUSED.value: "🚫", Status.FAILED.value: "❌"}
NOT_RUN = "·"


def _flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def _version(module: str) -> str:
    try:
        return str(getattr(importlib.import_module(module), "__version__", "?"))
    except Exception as exc:   # noqa: BLE001 - a missing or broken package is reported, not raised
        return f"not importable ({type(exc).__name__})"


def host_info(precision_probe: bool = True) -> dict[str, Any]:
    """CPU model and flags, core count, versions, and what the probe measures for bf16/fp16 on cpu."""
    from mlcomp.hardware.probe import cpu_name

    flags = _flags()
    info: dict[str, Any] = {
        "cpu": cpu_name() or platform.processor() or "unknown",
        "flags": {f: f in flags for f in HOST_FLAGS},
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "versions": {m: _version(m) for m in _VERSIONED},
        "date": _dt.datetime.now(_dt.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    if precision_probe:
        from mlcomp.hardware.probe import measure_precisions

        speeds = measure_precisions("cpu", ("bf16", "fp16"))
        info["probe"] = {k: speeds.describe(k) for k in ("bf16", "fp16")}
    return info


def matrix_json(matrix: Matrix, host: dict[str, Any]) -> dict[str, Any]:
    """The run as plain data: host, columns, rows (family + cells), left-out items, seconds."""
    return {
        "host": host,
        "columns": [c.key for c in matrix.cells],
        "rows": [{"architecture": name, "family": matrix.families.get(name, ""),
                  "cells": {k: r.to_json() for k, r in cells.items()}} for name, cells in matrix.rows.items()],
        "left_out": dict(matrix.left_out),
        "seconds": round(matrix.seconds, 1),
    }


def merge_runs(earlier: dict[str, Any], later: dict[str, Any]) -> dict[str, Any]:
    """``earlier``'s record with ``later``'s cells in place of the same cells; the rest stay as they were.

    New architectures and columns are appended; ``updates`` lists each re-run (command, date,
    columns, architectures, seconds), so the document says which cells came from which run.
    ``earlier`` is not modified.
    """
    rows = {r["architecture"]: {**r, "cells": dict(r["cells"])} for r in earlier["rows"]}
    for row in later["rows"]:
        rows.setdefault(row["architecture"], {**row, "cells": {}})["cells"].update(row["cells"])
    columns = list(earlier["columns"]) + [c for c in later["columns"] if c not in earlier["columns"]]
    for row in rows.values():
        row["cells"] = {k: row["cells"][k] for k in columns if k in row["cells"]}
    update = {"command": later.get("command", ""), "date": later["host"]["date"], "columns": list(later["columns"]),
              "architectures": [r["architecture"] for r in later["rows"]], "seconds": later["seconds"]}
    return {**earlier, "columns": columns, "rows": list(rows.values()),
            "left_out": {**earlier.get("left_out", {}), **later.get("left_out", {})},
            "updates": [*earlier.get("updates", []), update]}


def summary(data: dict[str, Any]) -> dict[str, dict[str, int]]:
    """Per column, then per target (``O2:T`` and ``<dtype>:T`` together): counts of each status."""
    out: dict[str, dict[str, int]] = {}
    for row in data["rows"]:
        for key, cell in row["cells"].items():
            groups = [key] + ([f"target {key.split(':', 1)[1]}"] if ":" in key else [])
            for group in groups:
                counts = out.setdefault(group, {s.value: 0 for s in Status})
                counts[cell["status"]] += 1
    return out


def _pct(counts: dict[str, int]) -> str:
    total = sum(counts.values())
    return f"{100.0 * counts[Status.VERIFIED.value] / total:.0f}%" if total else "-"


def _host_lines(host: dict[str, Any]) -> list[str]:
    flags = ", ".join(f"{f} {'yes' if on else 'no'}" for f, on in host["flags"].items())
    versions = ", ".join(f"{m} {v}" for m, v in host["versions"].items())
    lines = [f"- Host: {host['cpu']}, {host['cores']} cores; flags: {flags}",
             f"- Versions: python {host['python']}, {versions}", f"- Date: {host['date']}"]
    for key, text in host.get("probe", {}).items():
        lines.append(f"- Probe, {key}: {text}")
    return lines


def _totals(data: dict[str, Any]) -> list[str]:
    counts = summary(data)
    lines = ["| column | verified | refused | failed | % verified |", "|---|---|---|---|---|"]
    for key in [*data["columns"], *sorted(k for k in counts if k.startswith("target "))]:
        c = counts.get(key)
        if c:
            lines.append(f"| {key} | {c['verified']} | {c['refused']} | {c['failed']} | {_pct(c)} |")
    return lines


def _notes(data: dict[str, Any]) -> list[str]:
    lines = []
    for row in data["rows"]:
        for key, cell in row["cells"].items():
            if cell["status"] != Status.VERIFIED.value:
                lines.append(f"- **{row['architecture']}** `{key}` {cell['status']}: {cell['detail']}")
    return lines or ["- none: every cell verified"]


def _verified_notes(data: dict[str, Any]) -> list[str]:
    """Verified cells whose detail carries a note after the figure (``max |diff| 0.003; …``)."""
    return [f"- **{row['architecture']}** `{key}`: {cell['detail'].split('; ', 1)[1]}"
            for row in data["rows"] for key, cell in row["cells"].items()
            if cell["status"] == Status.VERIFIED.value and "; " in cell["detail"]] or ["- none"]


def _update_lines(data: dict[str, Any]) -> list[str]:
    lines = []
    for u in data.get("updates", []):
        which = "every architecture" if len(u["architectures"]) == len(data["rows"]) else ", ".join(u["architectures"])
        lines.append(f"Re-run on {u['date']}: {', '.join(f'`{c}`' for c in u['columns'])} for {which}, by "
                     f"`{u['command']}` ({u['seconds'] / 60:.1f} min); these cells replace the first run's.")
    return ["", *lines] if lines else []


def render_markdown(data: dict[str, Any], command: str = "python benchmarks/support_matrix.py") -> str:
    """``docs/SUPPORT.md`` from :func:`matrix_json`'s record."""
    cols = data["columns"]
    table = ["| architecture | family | " + " | ".join(cols) + " |", "|---|---|" + "---|" * len(cols)]
    for row in data["rows"]:
        marks = [_MARK[row["cells"][k]["status"]] if k in row["cells"] else NOT_RUN for k in cols]
        table.append(f"| {row['architecture']} | {row['family']} | " + " | ".join(marks) + " |")
    left = [f"- {k}: {v}" for k, v in data.get("left_out", {}).items()]
    if not any(c.startswith("fp16:") for c in cols):
        left.append("- fp16 columns: this host has no GPU and no native CPU fp16 (avx512_fp16/amx_fp16); "
                    "bf16 runs everywhere torch does (emulated here where the probe says so)")
    left = left or ["- nothing"]
    parts = [
        "# Support matrix", "",
        f"What mlcomp compiles and verifies, per architecture and per cell, from "
        f"{'the runs' if '; then, for the cells it names:' in command else 'one run'} of `{command}` "
        f"({len(data['rows'])} architectures x {len(cols)} cells, {data['seconds'] / 60:.1f} min). "
        "The zoo models run at batch 1; the `transformers` models are built from tiny configs "
        "(random weights, nothing downloaded; see `mlcomp/models/architectures.py`), decoder LMs with their "
        "default cache settings.", *_update_lines(data), "",
        *_host_lines(data["host"]), "",
        "## Legend", "",
        "- ✅ verified: compiled (or captured) and the outputs (training: the gradients) match eager",
        "- 🚫 refused: mlcomp said up front that it cannot, with a reason (listed below)",
        "- ❌ failed: anything else — a capture or backend error, a mismatch, a crash or a timeout "
        "(first error line below)",
        f"- {NOT_RUN} not run (the run ended before this cell)",
        "- columns: `capture` (torch.export capture + IR verifier); `O2:T` (`-O2` inference on target T); "
        "`bf16:T` / `fp16:T` (`-O2` as it runs for T, then `mixed-precision{dtype=…}`: on cpu "
        "`cleanup,fuse,cleanup,mixed-precision{…}`, elsewhere `cleanup,mixed-precision{…}`); `train` (one SGD step with an mse loss "
        "on cpu, gradients against eager autograd; training-mode randomness drawn outside the graph — LayerDrop, "
        "SpecAugment — is off for the step, `randomness=\"off\"`, and the cell says so)", "",
        "## Table", "", *table, "",
        "## Totals", "", *_totals(data), "",
        "## Cells not verified", "", *_notes(data), "",
        "## Cells verified with a note", "", *_verified_notes(data), "",
        "## Left out of this run", "", *left, "",
    ]
    return "\n".join(parts)
