"""The anchors run's tables: median ms per tool, compile s / error, and each goal of the row.

``benchmarks/anchors.py`` times the cells; this module turns cells into tables and checks the goals, so the
same tables come from one run or from several runs' ``--json`` files combined::

    .venv/bin/python benchmarks/anchors.py --combine c1.json,c2.json,c3.json

Goals per row:

* ``auto`` — ``m:auto`` at least 0.95x the best fp32 anchor (ratio = anchor ms / auto ms);
* low precision — where the CPU has bf16 (``avx512_bf16`` or ``amx_bf16``), the best of ``m:ov-bf16`` /
  ``m:auto-mp`` at least 0.95x OpenVINO's default (its own conversion, the plugin's own precision); where it
  has none, the kernels OpenVINO runs for mlcomp's bf16 pipeline (``-O2,mixed-precision{dtype=bf16}``)
  against its own conversion, both compiled with ``INFERENCE_PRECISION_HINT=bf16``: no compute kernel (layer
  type and precision; a fused attention is ``Attention``) beyond OpenVINO's own, and no more element-wise
  (``Eltwise``, ``Subgraph``) or layout (``Reorder``, ``Transpose``, slices, gathers) kernels in all; views
  (``Reshape``/``Squeeze``/``Unsqueeze``) are listed, not counted (the plugin runs them in place).  Fewer
  kernels than OpenVINO's own (a mask folded at compile time) are listed as negative counts;
* tvm — untuned ``m:tvm`` at least as fast as eager (ratio = eager ms / tvm ms >= 1.0);
* auto compile — ``m:auto``'s build seconds <= 10 on zoo rows at batch 1.

Noise: each tool runs in ``--procs`` processes; ``gap`` is the larger of the two compared tools'
spreads between their processes (max / min - 1).  A ratio that misses its goal by less than the gap is
marked ``within noise``.
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field

from mlcomp.targets.openvino.layers import family

ANCHORS = ("eager", "torchscript", "torch.compile", "ort", "ov-f32", "ov-f32-mod")
LOW = ("m:ov-bf16", "m:auto-mp")
# kernel families compared in all, any precision (mlcomp.targets.openvino.layers.family); others by kind+precision
SUMMED = frozenset({"element-wise", "layout", "view"})
ZOO_AT_1 = ("resnet18@1", "transformer@1", "mobilenet@1", "mlp@1", "lenet@1", "gru@1")


@dataclass
class Cell:
    tool: str
    compile_s: float | None = None
    max_rel: float | None = None
    note: str = ""
    error: str | None = None
    samples: list[float] = field(default_factory=list)
    process_ms: list[float] = field(default_factory=list)   # each worker process's median, ms

    @property
    def ms(self) -> float | None:
        return statistics.median(self.samples) * 1e3 if self.samples else None

    @property
    def gap(self) -> float:
        return max(self.process_ms) / min(self.process_ms) - 1 if len(self.process_ms) > 1 else 0.0


def _fmt(v: float | None, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def _ms(v: float | None) -> str:
    if v is None:
        return "fail"
    return f"{v:.4f}" if v < 0.1 else f"{v:.3f}" if v < 10 else f"{v:.1f}"


def _best(cells: dict[str, Cell], names: tuple[str, ...]) -> tuple[str, float] | None:
    timed = [(cells[n].ms, n) for n in names if n in cells and cells[n].ms is not None]
    return (min(timed)[1], min(timed)[0]) if timed else None


def _verdict(ratio: float, goal: float, gap: float) -> str:
    if ratio >= goal:
        return f"met {ratio:.2f}"
    return f"**not met** {ratio:.2f}" + (f" (within noise, gap {gap:.0%})" if ratio * (1 + gap) >= goal else "")


def _ratio_goal(cells: dict[str, Cell], slow: str, fast: tuple[str, ...], goal: float) -> str:
    """``fast``'s best ms ÷ ``slow``'s ms against ``goal``, with the noise of the two tools compared."""
    mine, ref = cells.get(slow), _best(cells, fast)
    if mine is None:
        return "—"
    if mine.ms is None:
        return "**not met** (fails)"
    if ref is None:
        return "met (every anchor fails)" if any(t in cells for t in fast) else "—"
    return _verdict(ref[1] / mine.ms, goal, max(mine.gap, cells[ref[0]].gap))


def low_goal(cells: dict[str, Cell], graph: dict | None, bf16: bool) -> str:
    """The low-precision goal: timed against OpenVINO's default on a bf16 CPU, else the bf16-hint kernels."""
    if bf16:
        ovd, best = cells.get("ov-default"), _best(cells, LOW)
        if ovd is None or best is None:
            return "—" if ovd is None else "**not met** (mlcomp low precision fails)"
        if ovd.ms is None:
            return "met (OpenVINO's default fails)"
        return _verdict(ovd.ms / best[1], 0.95, max(ovd.gap, cells[best[0]].gap)) + f" ({best[0]})"
    if not graph:
        return "—"
    if graph.get("error"):
        return f"**not checked**: {graph['error'][:80]}"
    if graph.get("own_error"):
        return f"met (OpenVINO's own conversion fails; mlcomp's builds: {graph['ours_total']} kernels)"
    return kernels_verdict(graph["extra"], graph["missing"], graph["own_total"], graph["ours_total"])


def kernels_verdict(extra: dict[str, int], missing: dict[str, int], own_total: int, ours_total: int) -> str:
    """Met when mlcomp's executed graph runs no compute kernel (kind and precision) beyond OpenVINO's own,
    and no more element-wise or layout kernels in all; views are listed only."""
    change: dict[str, int] = {}
    for key, n in [*extra.items(), *((k, -v) for k, v in missing.items())]:
        group = family(key.split()[0])
        group = group if group in SUMMED else key
        change[group] = change.get(group, 0) + n
    beyond = {k: n for k, n in change.items() if n > 0 and k != "view"}
    head = "met: no kernel beyond OV's own" if not beyond else "**not met**"
    if not change:
        head = "met: same kernels"
    detail = ", ".join(f"{k} {n:+d}" for k, n in sorted(change.items()) if n)
    return f"{head} ({own_total} vs {ours_total}{'; mlcomp ' + detail if detail else ''})"


def goals_table(results: dict[str, dict[str, Cell]], graphs: dict[str, dict], bf16: bool) -> list[str]:
    low_head = "low precision ≥ 0.95× OV default" if bf16 else "bf16 hint: same kernels as OV's own"
    out = [f"| row | best fp32 anchor | m:auto (picked) | auto ≥ 0.95× anchor | {low_head} | eager / m:tvm "
           f"| tvm ≥ 1.0× eager | auto compile s (≤ 10 at zoo @1) |", "|---|---|---|---|---|---|---|---|"]
    for row, cells in results.items():
        anchor, auto, tvm, eager = _best(cells, ANCHORS), cells.get("m:auto"), cells.get("m:tvm"), cells.get("eager")
        picked = auto.note.split("→")[-1].split(",")[0].strip() if auto and auto.note else ""
        tvm_ratio = f"{eager.ms / tvm.ms:.2f}" if tvm and eager and tvm.ms and eager.ms else "—"
        compile_s = auto.compile_s if auto else None
        c_goal = "" if compile_s is None or row not in ZOO_AT_1 else (" met" if compile_s <= 10 else " **not met**")
        out.append(f"| {row} | {anchor[0] + ' ' + _ms(anchor[1]) if anchor else '—'} | "
                   f"{_ms(auto.ms) if auto else '—'} ({picked}) | {_ratio_goal(cells, 'm:auto', ANCHORS, 0.95)} | "
                   f"{low_goal(cells, graphs.get(row), bf16)} | {tvm_ratio} | "
                   f"{_ratio_goal(cells, 'm:tvm', ('eager',), 1.0)} | {_fmt(compile_s, '.1f')}{c_goal} |")
    return out


def tables(results: dict[str, dict[str, Cell]], tools: list[str], graphs: dict[str, dict] | None = None,
           bf16: bool = False) -> str:
    out = ["| row | " + " | ".join(tools) + " |", "|---|" + "---|" * len(tools)]
    for row, cells in results.items():
        out.append(f"| {row} | " + " | ".join(_ms(cells[t].ms) if t in cells else "—" for t in tools) + " |")
    out += ["", *goals_table(results, graphs or {}, bf16)]
    out += ["", "compile s / max rel error vs eager:", "",
            "| row | " + " | ".join(tools) + " |", "|---|" + "---|" * len(tools)]
    for row, cells in results.items():
        out.append(f"| {row} | " + " | ".join(
            (f"{_fmt(cells[t].compile_s, '.1f')} / {_fmt(cells[t].max_rel, '.0e')}" if cells[t].error is None
             else "fail") if t in cells else "—" for t in tools) + " |")
    notes = [f"- {row} {t}: {c.error or c.note}" for row, cells in results.items() for t, c in cells.items()
             if c.error or t in ("m:auto", "ov-default", "m:ov", *LOW)]
    for row, cells in results.items():
        spread = sorted(((c.gap, t) for t, c in cells.items() if len(c.process_ms) > 1), reverse=True)
        if spread:
            notes.append(f"- {row}: gap between two processes of one tool: largest {spread[0][0]:.1%} "
                         f"({spread[0][1]}), median {statistics.median(g for g, _ in spread):.1%}")
    return "\n".join(out + ["", "notes:", *notes])


def cells_from_json(data: dict) -> dict[str, Cell]:
    return {tool: Cell(**{k: v for k, v in cell.items() if k != "ms"}) for tool, cell in data.items()}
