"""``mlcomp report MODEL -o DIR``: one HTML page with inspect, the pipeline's passes and the bench.

The folder holds

* ``index.html`` — the page (plain HTML, inline CSS, no scripts, images by
  relative path, so it opens from disk and survives being copied);
* ``bench.png`` — speedup per target and batch, latency vs batch size;
* ``roofline.png`` — with ``roofline=True``: every op measured on this machine's roofline;
* ``inspect.json``, ``pipeline.json``, ``bench.json``, ``bench.csv`` — the data behind it;
* ``precision.json`` — when the pipeline runs ``mixed-precision``: per node, the precision
  chosen and the error it introduced (:mod:`mlcomp.analysis.precision_error`).

The folder is written under a temporary name and renamed when complete
(:func:`mlcomp.base.files.atomic_dir`): a failure leaves no half-written report.
The destination is checked before any work (:func:`mlcomp.base.files.check_destination`):
a folder that is not empty and holds no earlier mlcomp output is refused, never emptied,
and the written folder carries the ``.mlcomp`` marker (``kind: report``).
"""
from __future__ import annotations

import copy

import datetime as _dt
import json
from dataclasses import dataclass, field, replace
from html import escape
from pathlib import Path
from typing import Any, Sequence

import torch

from mlcomp.analysis.inspect import inspect_graph
from mlcomp.analysis.precision_error import by_op, precision_errors
from mlcomp.analysis.training_graph import phase_flops, predicted_peak, saved_activations
from mlcomp.base.files import Kind, atomic_dir, check_destination
from mlcomp.base.table import Table
from mlcomp.frontend.joint import capture_joint, example_target, resolve_loss, without_dropout
from mlcomp.frontend.joint_origins import bytes_by_origin
from mlcomp.frontend.loading import load_model
from mlcomp.measure.bench import BenchConfig, Progress, plot_bench, run_bench
from mlcomp.measure.bench_results import BenchResult, to_csv
from mlcomp.pipeline import Pipeline, run_pipeline
from mlcomp.study.common import StudyConfig, StudyResult, machine_line

_CSS = """
body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;padding:0 1em;color:#222}
h1{font-size:1.5em}h2{font-size:1.2em;border-bottom:1px solid #ccc;padding-bottom:.2em;margin-top:2em}
pre{background:#f6f6f6;padding:.8em;overflow-x:auto;font-size:.85em}
table{border-collapse:collapse;font-size:.85em;margin:.5em 0}
caption{text-align:left;font-weight:600;padding:.3em 0}
th,td{border:1px solid #ddd;padding:.25em .6em;text-align:left}td.num,th.num{text-align:right}
th{background:#f0f0f0}img{max-width:100%;border:1px solid #eee}.muted{color:#777}
"""


@dataclass(frozen=True)
class ReportConfig:
    """What goes into a report: the bench configuration, the pipeline, optional roofline section."""

    bench: BenchConfig = BenchConfig()
    capture_method: str = "export"
    roofline: bool = False
    quick: bool = False                     # roofline microbenchmarks at tiny sizes
    training: bool = False                  # a section from the joint training graph
    crosscheck: bool = False                # a whole-process speedup column (mlcomp.measure.crosscheck)
    # run_bench keyword overrides (clock, sync_for, compiler, availability): fakes in tests, embedding
    bench_options: dict[str, Any] = field(default_factory=dict, hash=False)


@dataclass(frozen=True)
class Report:
    """Where the report went and what it contains."""

    directory: Path
    files: tuple[str, ...]
    bench: BenchResult
    pipeline_json: dict[str, Any] | None


def build_report(model: Any, out_dir: str | Path, config: ReportConfig = ReportConfig(), *,
                 input_shapes: Sequence[str] = (), trust_pickle: bool = False, source: Any = None,
                 graph: Any = None, progress: Progress | None = None, force: bool = True) -> Report:
    """Inspect, run the pipeline, bench, plot, and write ``out_dir`` atomically.

    ``source``/``graph`` may be given already loaded and captured (the CLI does,
    through :func:`mlcomp.cli.main.load_and_capture`); otherwise they are loaded here.
    ``out_dir`` may replace an earlier mlcomp output only with ``force``.
    """
    out = check_destination(out_dir, Kind.DIR, force=force, inputs=(model,) if isinstance(model, (str, Path)) else ())
    if source is None:
        source = load_model(model, input_shapes=input_shapes, trust_pickle=trust_pickle,
                            batch=config.bench.batches[0])
    if graph is None:
        graph = source.capture(method=config.capture_method)
    inspected = inspect_graph(graph)
    pipe_text, pipe_json, pipe_note, piped = _pipeline_section(graph, source.inputs(), config.bench.pipeline)
    precision = _precision_section(graph, piped, source.inputs(), pipe_json)
    training = _training_section(source) if config.training else None
    bench_config = replace(config.bench, crosscheck=config.crosscheck or config.bench.crosscheck)
    bench = run_bench(model, bench_config, input_shapes=input_shapes, trust_pickle=trust_pickle,
                      progress=progress, **config.bench_options)
    roof: StudyResult | None = None
    if config.roofline:
        from mlcomp.study import roofline

        roof = roofline.run(StudyConfig(quick=config.quick, model=str(model), batch=config.bench.batches[0],
                                        input_shapes=tuple(input_shapes)))
    with atomic_dir(out, label="report") as tmp:
        files = ["index.html", "bench.png", "bench.json", "bench.csv", "inspect.json"]
        plot_bench([bench], str(tmp / "bench.png"))
        (tmp / "bench.json").write_text(json.dumps(bench.to_json(), indent=2))
        (tmp / "bench.csv").write_text(to_csv([bench]))
        (tmp / "inspect.json").write_text(json.dumps(inspected.to_json(), indent=2))
        if pipe_json is not None:
            (tmp / "pipeline.json").write_text(json.dumps(pipe_json, indent=2, default=str))
            files.append("pipeline.json")
        if precision is not None:
            (tmp / "precision.json").write_text(json.dumps(precision[1], indent=2, default=str))
            files.append("precision.json")
        if roof is not None:
            roofline.plot(roof, str(tmp / "roofline.png"))
            (tmp / "roofline.json").write_text(json.dumps(roof.to_json(), indent=2, default=str))
            files += ["roofline.png", "roofline.json"]
        if training is not None:
            (tmp / "training.json").write_text(json.dumps(training[1], indent=2, default=str))
            files.append("training.json")
        inspect_text = inspected.format(top=15) + (f"\n\n{training[0]}" if training is not None else "")
        page = _page(bench.model, inspect_text, pipe_text, pipe_note, bench, roof, config,
                     precision[0] if precision is not None else "")
        (tmp / "index.html").write_text(page)
    return Report(out, tuple(files), bench, pipe_json)


def _training_section(source: Any) -> tuple[str, dict[str, Any]] | None:
    """One training step from the joint graph: FLOPs by phase, saved activations by module (the
    nodes' origins), predicted peak.  ``None`` for a source without a Python module to train."""
    if not isinstance(source.eager, torch.nn.Module):
        return None
    model, inputs = without_dropout(copy.deepcopy(source.eager)), source.inputs()
    loss = resolve_loss(source, None)
    graph = capture_joint(model, inputs, example_target(model, inputs, loss), loss=loss, name=source.name)
    saved = saved_activations(graph)
    data = {"flops": {p.value: n for p, n in phase_flops(graph).items()}, "saved_bytes": sum(s.nbytes for s in saved),
            "saved_bytes_by_module": bytes_by_origin(graph, saved), "predicted_peak": predicted_peak(graph).total}
    lines = [f"training step (joint graph, {len(graph)} nodes): FLOPs " + ", ".join(
        f"{k} {v:.3g}" for k, v in data["flops"].items()) + f"; predicted peak {data['predicted_peak']} B",
        f"saved activations {data['saved_bytes']} B, by module:"]
    lines += [f"  {m:<32} {n} B" for m, n in list(data["saved_bytes_by_module"].items())[:10]]
    return "\n".join(lines), data


def _pipeline_section(graph: Any, inputs: tuple, spec: str | None) -> tuple[str | None, dict | None, str, Any]:
    """(text, json, note, output graph) for the pipeline's per-pass stats; a note only when there is nothing."""
    if not spec:
        return None, None, "No pipeline given (pass -p PIPELINE to run one and show its per-pass stats).", None
    out, report = run_pipeline(graph.copy(), Pipeline.coerce(spec), example_inputs=inputs)
    return report.format(), report.to_json(), "", out


# ---------------------------------------------------------------------------
# Mixed precision: per op, the precision chosen and the error it introduced

_PRECISION_ROWS = 60     # nodes shown, largest introduced error first (all of them in precision.json)


def _precision_section(graph: Any, piped: Any, inputs: tuple, pipe_json: dict | None) -> tuple[str, dict] | None:
    """(html, json) when the pipeline ran ``mixed-precision``: the pass's decision and a per-node error table."""
    stats = [p.get("stats", {}) for p in (pipe_json or {}).get("passes", []) if p.get("name") == "mixed-precision"]
    if piped is None or not stats:
        return None
    rows = precision_errors(graph, piped, inputs)
    decision = stats[-1]
    shown = sorted(rows, key=lambda r: -(r.introduced if r.introduced == r.introduced else 0.0))[:_PRECISION_ROWS]
    nodes = Table(f"per node ({len(shown)} of {len(rows)}, largest introduced error first)",
                  ("node", "op", "module", "precision", "why", "introduced", "max abs error", "rel error"),
                  tuple((r.name, r.op, r.module or "<root>", r.precision, r.reason or "-", f"{r.introduced:.2e}",
                         f"{r.error:.2e}", f"{r.rel_error:.2e}") for r in shown), right=frozenset({5, 6, 7}))
    ops = by_op(rows)
    per_op = Table("per op kind", ("op", "nodes", "precisions", "max introduced", "max abs error"),
                   tuple((op, str(e["nodes"]), ", ".join(e["precisions"]), f"{e['introduced']:.2e}",
                          f"{e['error']:.2e}") for op, e in sorted(ops.items(), key=lambda kv: -kv[1]["introduced"])),
                   right=frozenset({1, 3, 4}))
    head = (f"dtype {decision.get('dtype')} ({decision.get('choice', '')}); nodes per precision "
            f"{decision.get('nodes')}; weights {decision.get('param_bytes_before')} → "
            f"{decision.get('param_bytes_after')} bytes; declared tolerance {decision.get('declared_tolerance')}")
    html = "\n".join([
        "<h2>Mixed precision: per op, the precision chosen and the error it introduced</h2>",
        f"<p>{escape(head)}</p>",
        "<p>Both graphs run on the example inputs. <em>introduced</em>: the op alone, re-run in its precision on "
        "the fp32 values of its inputs; <em>max abs error</em>: the node's value against fp32, everything "
        "upstream included.</p>", per_op.to_html(), nodes.to_html()])
    return html, {"decision": decision, "nodes": [r.to_json() for r in rows], "by_op": ops}


def _page(name: str, inspect_text: str, pipe_text: str | None, pipe_note: str, bench: BenchResult,
          roof: StudyResult | None, config: ReportConfig, precision_html: str = "") -> str:
    when = _dt.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M %Z")
    parts = [f"<!doctype html><html><head><meta charset='utf-8'><title>mlcomp report: {escape(name)}</title>",
             f"<style>{_CSS}</style></head><body>",
             f"<h1>mlcomp report: {escape(name)}</h1>",
             f"<p class='muted'>{escape(when)} · {escape(machine_line())}</p>",
             "<h2>Graph (inspect)</h2>", f"<pre>{escape(inspect_text)}</pre>",
             f"<h2>Pipeline {escape(config.bench.pipeline or '')}</h2>"]
    parts.append(f"<pre>{escape(pipe_text)}</pre>" if pipe_text else f"<p class='muted'>{escape(pipe_note)}</p>")
    if precision_html:
        parts.append(precision_html)
    parts += ["<h2>Benchmark: eager vs compiled targets</h2>",
              _bench_method_html(bench), bench.table().to_html(),
              "<img src='bench.png' alt='speedup and latency vs batch size'>"]
    if "tvm" in config.bench.targets:
        parts.append(_tvm_policy_html())
    if roof is not None:
        parts += ["<h2>Roofline of this machine, every op measured</h2>", f"<p>{escape(roof.setup)}</p>",
                  roof.figure_table().to_html()]
        parts += [t.to_html() for t in roof.tables]
        parts.append("<img src='roofline.png' alt='roofline'>")
        parts += [f"<p class='muted'>{escape(n)}</p>" for n in roof.notes]
    parts.append("<p class='muted'>Data: bench.json, bench.csv, inspect.json"
                 + (", pipeline.json" if pipe_text else "") + (", precision.json" if precision_html else "")
                 + (", roofline.json" if roof else "") + ".</p>")
    parts.append("</body></html>")
    return "\n".join(parts)


def _bench_method_html(bench: BenchResult) -> str:
    """How the bench section was measured, how each comparison went, and which figures are unreliable."""
    bad = [r for r in bench.rows if r.unreliable and r.interval]
    head = (f"<p>Per batch, eager and every target are timed together in rotated rounds (one sample of each "
            f"per round, {bench.policy.budget_s:g} s per variant at most, fewer once every interval is tight), "
            "so load that comes and goes falls on all of them alike. A speedup is the median over rounds of "
            "eager's sample over the target's in the same round, shown with its 95% interval; a cell is marked "
            "UNRELIABLE, with the reason in its note, when the machine was busy, the hypervisor stole time, "
            "the per-round ratios spread too far or the interval includes 1. Peak memory is the growth "
            "over a baseline around compile and first call; errors are the largest absolute difference from "
            "eager.</p>")
    timed = "".join(f"<li>{escape(n)}</li>" for n in bench.notes)
    warn = (f"<p><strong>{len(bad)} speedup(s) UNRELIABLE</strong>: "
            + escape("; ".join(f"{r.label} batch {r.batch}: {r.unreliable[0]}" for r in bad)) + "</p>") if bad else ""
    return head + (f"<ul class='muted'>{timed}</ul>" if timed else "") + warn


def _tvm_policy_html() -> str:
    """The TVM target's offload policy (:mod:`mlcomp.targets.tvm.offload.policy`): which ops its module runs in
    torch's kernels and which as TVM code, row by row (``mlcomp compile --explain`` gives them per op)."""
    from mlcomp.targets.tvm.offload.policy import table_lines

    return ("<h2>TVM: which ops run in torch's kernels</h2><p>On CPU the tvm target's module calls torch's kernels "
            "for the heavy ops and runs the rest as TVM code, by these rules (first match wins; "
            "<code>mlcomp compile --target tvm --explain</code> lists each op with its rule):</p>"
            f"<pre>{escape(chr(10).join(table_lines()))}</pre>")
