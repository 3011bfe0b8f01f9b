"""``mlcomp bench``, ``mlcomp study`` and ``mlcomp report`` (registered lazily in :mod:`mlcomp.cli.main`).

    mlcomp bench mlp resnet18 --targets eager,cpu,onnxruntime,tvm --batch 1,32 --plot bench.png
    mlcomp bench --zoo --batch 1,32 --csv results.csv
    mlcomp study hybridize
    mlcomp study roofline --model resnet18 --plot roofline.png
    mlcomp report resnet18 -o out/resnet18 -p -O2
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from mlcomp.base.files import Kind, check_destination
from mlcomp.base.progress import Progress, ProgressLine
from mlcomp.cli.main import load_and_capture, model_options
from mlcomp.cli.passes import preset_options, resolve_pipeline
from mlcomp.hardware.timing import BenchConfigError

__all__ = ["ProgressLine", "bench_cmd", "report_cmd", "study_cmd"]


def _int_list(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        out = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers, e.g. 1,32") from None
    if not out or any(v < 1 for v in out):
        raise click.BadParameter(f"{value!r}: give positive integers, e.g. 1,32")
    return out


def _name_list(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))


def _progress(flag: bool, *, machine_output: bool = False) -> Progress:
    """The command's progress: a live line on a terminal (or with --progress), else a log line per stage."""
    return Progress.for_command(machine_output=machine_output, live=True if flag else None)


def _set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise BenchConfigError(f"--threads {threads} is not positive")
        import torch

        torch.set_num_threads(threads)


# each file option -> the format it writes (mlcomp.base.marks.FORMATS)
_OPTION_FORMATS = {"json": "json", "csv": "csv", "plot": "png"}


def _write(dest: str | None, fmt: str, text: str) -> None:
    """``-``: stdout; otherwise an atomically written file, marked as ``fmt``."""
    if dest == "-":
        click.echo(text.rstrip("\n"))
    elif dest:
        from mlcomp.base.files import write_text_atomic

        write_text_atomic(dest, text, fmt)
        click.echo(f"wrote {dest}", err=True)


def _check_outputs(force: bool, inputs: tuple[str, ...] = (), **dests: str | list[str] | None) -> None:
    """Every file destination (``--json FILE`` …) checked before any measuring; ``-`` is stdout."""
    for option, dest in dests.items():
        for path in dest if isinstance(dest, list) else [dest]:
            if path and path != "-":
                check_destination(path, Kind.FILE, option="--" + option, fmt=_OPTION_FORMATS[option],
                                  force=force, inputs=inputs)


_force_option = click.option("--force", is_flag=True,
                             help="Replace earlier mlcomp outputs at --json/--csv/--plot (never a user's file).")


def _pt2_batch(path: str) -> tuple[int, str] | None:
    """(batch, shape text) an ExportedProgram file was exported for; None if dynamic or unreadable."""
    import torch

    try:
        program = torch.export.load(path)
    except Exception:  # noqa: BLE001 - the loader reports unreadable files properly later
        return None
    nodes = {n.name: n for n in program.graph.nodes}
    for spec in program.graph_signature.input_specs:
        if spec.kind.name == "USER_INPUT":
            val = nodes[spec.arg.name].meta.get("val")
            shape = tuple(getattr(val, "shape", ()))
            if shape and isinstance(shape[0], int):
                return int(shape[0]), "x".join(map(str, shape))
            return None
    return None


def _check_pt2_batches(models: tuple[str, ...], batches: tuple[int, ...]) -> None:
    """A .pt2 runs only at the batch it was exported for (unless exported with a dynamic batch)."""
    import os

    for model in models:
        if not (model.endswith(".pt2") and os.path.isfile(model)):
            continue
        found = _pt2_batch(model)
        if found is None:
            continue
        batch, shape = found
        wrong = [b for b in batches if b != batch]
        if wrong:
            raise BenchConfigError(f"{model} was exported for batch {batch} (input {shape}); --batch "
                                   f"{','.join(map(str, wrong))} cannot run it",
                                   hint=f"give --batch {batch}, or export the model again with a dynamic batch")


def _checked_pipeline(pipeline: str | None, opt_level: str | None) -> str:
    """-p/-O (default -O2) parsed before any model is loaded, so a bad spec fails first."""
    from mlcomp.pipeline import Pipeline

    text = resolve_pipeline(pipeline, opt_level)
    Pipeline.coerce(text)
    return text


def _check_targets(targets: tuple[str, ...]) -> None:
    """Every name in --targets known (eager, or a target `mlcomp targets` lists) before any capture."""
    from mlcomp.base.registry import did_you_mean
    from mlcomp.targets import TargetName

    known = ["eager", *(t.value for t in TargetName)]
    unknown = [t for t in targets if t not in known]
    if unknown:
        close = did_you_mean(unknown[0], known)
        raise BenchConfigError(f"unknown target {unknown[0]!r} in --targets" + (f" (did you mean {close!r}?)"
                                                                                 if close else ""),
                               hint=f"known targets: {', '.join(known)} (see `mlcomp targets`)")


def timing_options(fn: Any) -> Any:
    opts = [
        click.option("--budget", type=float, default=1.0, show_default=True,
                     help="Seconds of timing per measurement (repeats stop when it is spent)."),
        click.option("--warmup", type=int, default=3, show_default=True, help="Untimed calls first."),
        click.option("--min-repeats", type=int, default=5, show_default=True,
                     help="Timed calls per measurement at least, even when the budget is spent."),
        click.option("--max-repeats", type=int, default=10_000, show_default=True,
                     help="Timed calls per measurement at most, even when budget is left."),
        click.option("--threads", type=int, default=None,
                     help="Intra-op threads for eager torch and every compiled runtime (default: each one's own)."),
        click.option("--progress", "show_progress", is_flag=True,
                     help="Show the live progress line on stderr even when it is not a terminal (otherwise "
                          "a plain line per stage is logged)."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


@click.command("bench")
@click.argument("models", nargs=-1)
@click.option("--zoo", "all_zoo", is_flag=True, help="Benchmark every zoo model.")
@click.option("--targets", default="eager,cpu,onnxruntime,tvm", show_default=True, callback=_name_list,
              help="Comma-separated targets; eager always runs as the reference. Add cuda on a GPU machine.")
@click.option("--batch", "batches", default="1", show_default=True, callback=_int_list,
              help="Comma-separated batch sizes, e.g. 1,32.")
@preset_options
@click.option("--input-shape", "input_shapes", multiple=True, metavar="1x3x32x32[:float32]",
              help="Shape of one input (repeat per input) for model files that carry none.")
@click.option("--trust-pickle", is_flag=True, help="Allow loading a pickled module (executes its code).")
@timing_options
@click.option("--no-memory", is_flag=True, help="Skip peak-memory measurement.")
@click.option("--json", "json_out", is_flag=False, flag_value="-", default=None, metavar="[FILE]",
              help="Write results as JSON (to stdout when no FILE).")
@click.option("--csv", "csv_out", is_flag=False, flag_value="-", default=None, metavar="[FILE]",
              help="Write results as CSV (to stdout when no FILE).")
@click.option("--plot", "plot_file", type=click.Path(), default=None,
              help="PNG: speedup per target and batch, latency vs batch size (log axes).")
@click.option("--train", is_flag=True, help="Time a training step (eager vs compiled on cpu/cuda) instead.")
@click.option("--loss", default="cross_entropy", show_default=True, help="With --train: cross_entropy, mse or model.")
@click.option("--optimizer", default="sgd{lr=0.01 momentum=0.9}", show_default=True, help="With --train.")
@click.option("--loss-scale", default=None, metavar="SPEC",
              help='With --train: dynamic, none, a static scale (1024) or "dynamic{init=65536 growth_interval=2000}" '
                   "(default: dynamic when the graph computes in fp16, else none).")
@click.option("--remat-sweep", is_flag=True, help="With --train: remat budgets 1.0/0.5/0.25/0.1/sqrt (mincut) vs "
              "peak memory and step time; --plot draws memory vs step time.")
@_force_option
def bench_cmd(models: tuple[str, ...], all_zoo: bool, targets: tuple[str, ...], batches: tuple[int, ...],
              pipeline: str | None, opt_level: str | None, input_shapes: tuple[str, ...], trust_pickle: bool,
              budget: float, warmup: int,
              min_repeats: int, max_repeats: int, threads: int | None, show_progress: bool, no_memory: bool,
              json_out: str | None, csv_out: str | None, plot_file: str | None, train: bool = False,
              loss: str = "cross_entropy", optimizer: str = "sgd", remat_sweep: bool = False,
              loss_scale: str | None = None, force: bool = False) -> None:
    """Time MODEL(s) eager vs compiled targets: median and p90 latency, speedup, cold compile time,
    peak memory, max error vs eager. One table per model."""
    from mlcomp.hardware.timing import TimingPolicy
    from mlcomp.measure.bench import BenchConfig, plot_bench, run_bench
    from mlcomp.measure.bench_results import to_csv

    if all_zoo:
        from mlcomp.models import ZOO

        models = tuple(dict.fromkeys(models + tuple(ZOO)))
    if not models:
        raise BenchConfigError("no model given", hint="name one or more models, or pass --zoo")
    _check_outputs(force, models, json=json_out, csv=csv_out, plot=plot_file)
    pipeline = _checked_pipeline(pipeline, opt_level)
    _check_targets(targets)
    from mlcomp.api import check_model_inputs

    for model in models:
        check_model_inputs(model, input_shapes, None)
        if not input_shapes and not model.endswith(".pt2"):      # a .pt2's batch: _check_pt2_batches
            check_model_inputs(model, (), max(batches))
    _check_pt2_batches(models, batches)
    _set_threads(threads)
    if remat_sweep:   # the remat budget sweep: mlcomp.measure.remat_sweep
        from mlcomp.measure.remat_sweep import sweep_models

        if not train:
            raise BenchConfigError("--remat-sweep measures training steps", hint="add --train")
        _write(json_out, "json", sweep_models(models, batches, loss=loss, optimizer=optimizer, plot_file=plot_file,
                                      policy=TimingPolicy(warmup, budget, min_repeats, max_repeats),
                                      echo=click.echo if json_out != "-" else None))
        return
    if train:   # eager vs compiled training step: mlcomp.cli.training
        from mlcomp.cli.training import bench_train

        given = click.get_current_context().get_parameter_source("targets") is not click.core.ParameterSource.DEFAULT
        train_targets = targets if given else ("cpu",)
        _write(json_out, "json", bench_train(models, batches, targets=train_targets, loss=loss, optimizer=optimizer,
                                     policy=TimingPolicy(warmup, budget, min_repeats, max_repeats),
                                     json_out=json_out, loss_scale=loss_scale))
        return
    config = BenchConfig(targets, batches, pipeline, TimingPolicy(warmup, budget, min_repeats, max_repeats),
                         memory=not no_memory, threads=threads)
    progress = _progress(show_progress, machine_output="-" in (json_out, csv_out))
    results = []
    for model in models:
        res = run_bench(model, config, input_shapes=input_shapes, trust_pickle=trust_pickle, progress=progress)
        results.append(res)
        progress.clear()
        if json_out != "-" and csv_out != "-":
            click.echo(res.format())
            click.echo()
    _write(json_out, "json", json.dumps([r.to_json() for r in results], indent=2))
    _write(csv_out, "csv", to_csv(results))
    if plot_file:
        plot_bench(results, plot_file)
        click.echo(f"wrote {plot_file}", err=True)


@click.command("study")
@click.argument("name", required=False)
@click.option("--quick", is_flag=True, help="Tiny sizes: a smoke run in seconds (figures are not meaningful).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where the study runs: auto picks cuda when a GPU is available, else cpu.")
@click.option("--budget", type=float, default=0.5, show_default=True, help="Seconds of timing per measurement.")
@click.option("--targets", default="cpu,onnxruntime,tvm", show_default=True, callback=_name_list,
              help="hybridize: comma-separated compiled targets to compare with eager.")
@click.option("--model", default=None, help="roofline: the model whose ops are placed (default resnet18; "
                                             "mlp with --quick).")
@click.option("--batch", type=int, default=1, show_default=True, help="roofline: batch size.")
@click.option("--threads", type=int, default=None,
              help="Intra-op threads for torch (and, in hybridize, every compiled runtime).")
@click.option("--json", "json_out", is_flag=False, flag_value="-", default=None, metavar="[FILE]",
              help="Write the result as JSON (to stdout when no FILE).")
@click.option("--plot", "plot_file", type=click.Path(), default=None,
              help="PNG of the study (with NAME=all: one file per study, suffixed with its name).")
@_force_option
def study_cmd(name: str | None, quick: bool, device: str, budget: float, targets: tuple[str, ...],
              model: str | None, batch: int, threads: int | None, json_out: str | None,
              plot_file: str | None, force: bool = False) -> None:
    """Run one of the chapter's experiments (NAME, or `all`) and print the measured figures beside
    the chapter's. Without NAME, list the studies."""
    from mlcomp.study import STUDIES, StudyConfig, plot_study, run_study

    if not name:
        width = max(map(len, STUDIES))
        for key, (_, summary) in STUDIES.items():
            click.echo(f"{key:<{width}}  {summary}")
        return
    names = list(STUDIES) if name == "all" else [name]
    plots = [plot_file if len(names) == 1 else _suffixed(plot_file, key) for key in names] if plot_file else None
    _check_outputs(force, json=json_out, plot=plots)
    _set_threads(threads)
    config = StudyConfig(quick=quick, device=device, budget_s=budget, targets=targets,
                         model=model or ("mlp" if quick else "resnet18"), batch=batch, threads=threads)
    results = []
    for key in names:
        res = run_study(key, config)
        results.append(res)
        if json_out != "-":
            click.echo(res.format())
            click.echo()
        if plot_file:
            path = plot_file if len(names) == 1 else _suffixed(plot_file, key)
            plot_study(res, path)
            click.echo(f"wrote {path}", err=True)
    payload = results[0].to_json() if len(results) == 1 else [r.to_json() for r in results]
    _write(json_out, "json", json.dumps(payload, indent=2, default=str))


def _suffixed(path: str, key: str) -> str:
    p = Path(path)
    return str(p.with_name(f"{p.stem}-{key}{p.suffix or '.png'}"))


@click.command("report")
@model_options(batch=False)
@click.option("-o", "--output", required=True, type=click.Path(), help="Report folder.")
@click.option("--force", is_flag=True,
              help="Replace an earlier mlcomp output at -o (never a folder mlcomp did not write).")
@preset_options
@click.option("--targets", default="eager,cpu,onnxruntime,tvm", show_default=True, callback=_name_list,
              help="Comma-separated targets for the benchmark section; eager always runs as the reference.")
@click.option("--batch", "bench_batches", default=None, callback=_int_list, metavar="1,32",
              help="Comma-separated batch sizes for the benchmark section (default 1,32); inspect and the "
                   "pipeline use the model's own batch.")
@click.option("--bench-batch", "old_bench_batches", default=None, callback=_int_list, hidden=True,
              help="Old name of --batch.")
@click.option("--roofline", is_flag=True, help="Add a roofline section (measures this machine first).")
@click.option("--quick", is_flag=True, help="Roofline microbenchmarks at tiny sizes.")
@click.option("--train", is_flag=True, help="Add a training section from the joint forward+backward graph: FLOPs "
              "by phase, saved activations by module, predicted peak.")
@timing_options
def report_cmd(model: str, input_shapes: tuple[str, ...], capture_method: str,
               dynamic_batch: bool, trust_pickle: bool, output: str, pipeline: str | None, opt_level: str | None,
               targets: tuple[str, ...], bench_batches: tuple[int, ...] | None,
               old_bench_batches: tuple[int, ...] | None, roofline: bool, quick: bool, train: bool,
               budget: float, warmup: int, min_repeats: int, max_repeats: int, threads: int | None,
               show_progress: bool, force: bool) -> None:
    """One HTML page for MODEL: inspect, the pipeline's per-pass stats (default -O2), the bench table
    and plots."""
    from mlcomp.api import check_model_inputs
    from mlcomp.hardware.timing import TimingPolicy
    from mlcomp.measure.bench import BenchConfig
    from mlcomp.report import ReportConfig, build_report

    check_destination(output, Kind.DIR, force=force, inputs=(model,))
    bench_batches = bench_batches or old_bench_batches or (1, 32)
    pipeline = _checked_pipeline(pipeline, opt_level)
    _check_targets(targets)
    if not input_shapes and not model.endswith(".pt2"):
        check_model_inputs(model, (), max(bench_batches))
    _check_pt2_batches((model,), bench_batches)
    _set_threads(threads)
    progress = _progress(show_progress)
    with progress.stage(f"capture {model}"):
        source, graph = load_and_capture(model, input_shapes, None, capture_method, dynamic_batch, trust_pickle)
    config = ReportConfig(BenchConfig(targets, bench_batches, pipeline,
                                      TimingPolicy(warmup, budget, min_repeats, max_repeats), threads=threads),
                          capture_method=capture_method, roofline=roofline, quick=quick, training=train)
    rep = build_report(model, output, config, input_shapes=input_shapes, trust_pickle=trust_pickle,
                       source=source, graph=graph, progress=progress, force=force)
    progress.clear()
    click.echo(rep.bench.format())
    click.echo(f"wrote {Path(output) / 'index.html'} ({', '.join(rep.files)})")
