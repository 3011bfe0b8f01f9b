"""``mlcomp report``: one HTML page for a model (registered lazily in :mod:`mlcomp.cli.main`).

    mlcomp report resnet18 -o out/resnet18 -p -O2
"""
from __future__ import annotations

from pathlib import Path

import click

from mlcomp.base.files import Kind, check_destination
from mlcomp.cli.main import load_and_capture, model_options
from mlcomp.cli.measuring import (
    check_pt2_batches, check_targets, checked_pipeline, command_progress, comparison_config, comparison_options,
    int_list, name_list, set_threads, timing_options,
)
from mlcomp.cli.passes import preset_options

__all__ = ["report_cmd"]


@click.command("report")
@model_options(batch=False)
@click.option("-o", "--output", required=True, type=click.Path(), help="Report folder.")
@click.option("--force", is_flag=True,
              help="Replace an earlier mlcomp output at -o (never a folder mlcomp did not write).")
@preset_options
@click.option("--targets", default="eager,cpu,onnxruntime,tvm", show_default=True, callback=name_list,
              help="Comma-separated targets for the benchmark section; eager always runs as the reference.")
@click.option("--dtypes", default="fp32", show_default=True, callback=name_list,
              help="Comma-separated compute precisions, each target's side by side: fp32, bf16, int8 (int8 runs "
                   "quantize; a target without an int8 lowering is skipped with why).")
@click.option("--batch", "bench_batches", default=None, callback=int_list, metavar="1,32",
              help="Comma-separated batch sizes for the benchmark section (default 1,32); inspect and the "
                   "pipeline use the model's own batch.")
@click.option("--bench-batch", "old_bench_batches", default=None, callback=int_list, hidden=True,
              help="Old name of --batch.")
@click.option("--roofline", is_flag=True, help="Add a roofline section (measures this machine first).")
@click.option("--quick", is_flag=True, help="Roofline microbenchmarks at tiny sizes.")
@click.option("--train", is_flag=True, help="Add a training section from the joint forward+backward graph: FLOPs "
              "by phase, saved activations by module, predicted peak.")
@timing_options
@comparison_options
@click.option("--crosscheck", is_flag=True, help="Add a whole-process column: each artifact and eager timed as "
              "separate processes (start-up subtracted), a check on the in-process speedups from outside.")
def report_cmd(model: str, input_shapes: tuple[str, ...], capture_method: str,
               dynamic: str | None, trust_pickle: bool, output: str, pipeline: str | None, opt_level: str | None,
               targets: tuple[str, ...], dtypes: tuple[str, ...], bench_batches: tuple[int, ...] | None,
               old_bench_batches: tuple[int, ...] | None, roofline: bool, quick: bool, train: bool,
               budget: float, warmup: int, min_repeats: int, max_repeats: int, threads: int | None,
               show_progress: bool, force: bool, in_process: bool = False, precision: float = 0.03,
               settle_s: float = 0.0, crosscheck: bool = False, procs: int = 1) -> None:
    """One HTML page for MODEL: inspect, the pipeline's per-pass stats (default -O2), the bench table
    and plots."""
    from mlcomp.api import check_model_inputs
    from mlcomp.hardware.timing import TimingPolicy
    from mlcomp.measure.bench import BenchConfig
    from mlcomp.html_report import ReportConfig, build_report

    check_destination(output, Kind.DIR, force=force, inputs=(model,))
    bench_batches = bench_batches or old_bench_batches or (1, 32)
    pipeline = checked_pipeline(pipeline, opt_level)
    check_targets(targets)
    if not input_shapes and not model.endswith(".pt2"):
        check_model_inputs(model, (), max(bench_batches))
    check_pt2_batches((model,), bench_batches)
    set_threads(threads)
    progress = command_progress(show_progress)
    with progress.stage(f"capture {model}"):
        source, graph = load_and_capture(model, input_shapes, None, capture_method, dynamic, trust_pickle)
    config = ReportConfig(BenchConfig(targets, bench_batches, pipeline,
                                      TimingPolicy(warmup, budget, min_repeats, max_repeats), threads=threads,
                                      dtypes=dtypes,
                                      **comparison_config(in_process, precision, settle_s, procs)),
                          capture_method=capture_method, roofline=roofline, quick=quick, training=train,
                          crosscheck=crosscheck)
    rep = build_report(model, output, config, input_shapes=input_shapes, trust_pickle=trust_pickle,
                       source=source, graph=graph, progress=progress, force=force)
    progress.clear()
    click.echo(rep.bench.format())
    click.echo(f"wrote {Path(output) / 'index.html'} ({', '.join(rep.files)})")
