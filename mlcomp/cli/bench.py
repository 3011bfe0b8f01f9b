"""``mlcomp bench``: time models on targets against eager torch (registered lazily in :mod:`mlcomp.cli.main`).

    mlcomp bench mlp resnet18 --targets eager,cpu,onnxruntime,tvm --batch 1,32 --plot bench.png
    mlcomp bench --zoo --batch 1,32 --csv results.csv
    mlcomp bench resnet18 --targets eager,onnxruntime,openvino --dtypes fp32,bf16,int8 --batch 1,32
"""
from __future__ import annotations

import json
from typing import Any

import click

from mlcomp.base.errors import VerificationError
from mlcomp.base.progress import ProgressLine
from mlcomp.cli.measuring import (
    check_outputs, check_pt2_batches, check_targets, checked_pipeline, command_progress, comparison_config,
    comparison_options, force_option, int_list, name_list, set_threads, timing_options, write_output,
)
from mlcomp.cli.passes import preset_options
from mlcomp.hardware.timing import BenchConfigError, TimingPolicy

__all__ = ["ProgressLine", "bench_cmd"]


@click.command("bench")
@click.argument("models", nargs=-1)
@click.option("--zoo", "all_zoo", is_flag=True, help="Benchmark every zoo model.")
@click.option("--targets", default="eager,cpu,onnxruntime,tvm", show_default=True, callback=name_list,
              help="Comma-separated targets; eager always runs as the reference. Add cuda on a GPU machine.")
@click.option("--dtypes", default="fp32", show_default=True, callback=name_list,
              help="Comma-separated compute precisions, each target's side by side: fp32, bf16, int8 (int8 runs "
                   "quantize; a target without an int8 lowering is skipped with why).")
@click.option("--batch", "batches", default="1", show_default=True, callback=int_list,
              help="Comma-separated batch sizes, e.g. 1,32.")
@preset_options
@click.option("--input-shape", "input_shapes", multiple=True, metavar="1x3x32x32[:float32]",
              help="Shape of one input (repeat per input) for model files that carry none.")
@click.option("--trust-pickle", is_flag=True, help="Allow loading a pickled module (executes its code).")
@timing_options
@comparison_options
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
@click.option("--keep-going", is_flag=True, help="Exit 0 even when a target's outputs differ from eager (by default "
              "bench exits 4 after writing every result).")
@click.option("--remat-sweep", is_flag=True, help="With --train: remat caps on the saved activations (saved=1.0/0.5/0.25/0.1) and sqrt (mincut) vs "
              "peak memory and step time; --plot draws memory vs step time.")
@click.option("--generate", type=click.IntRange(min=1), default=None, metavar="N",
              help="Decoder LMs: time to first token and tokens/s of greedy generation of N tokens, eager vs "
                   "inductor vs compiled generators (targets: eager, inductor, cpu, onnxruntime, openvino).")
@click.option("--prompt-len", type=click.IntRange(min=1), default=8, show_default=True, help="With --generate.")
@force_option
def bench_cmd(models: tuple[str, ...], all_zoo: bool, targets: tuple[str, ...], dtypes: tuple[str, ...],
              batches: tuple[int, ...],
              pipeline: str | None, opt_level: str | None, input_shapes: tuple[str, ...], trust_pickle: bool,
              budget: float, warmup: int,
              min_repeats: int, max_repeats: int, threads: int | None, show_progress: bool, no_memory: bool,
              json_out: str | None, csv_out: str | None, plot_file: str | None, train: bool = False,
              loss: str = "cross_entropy", optimizer: str = "sgd", remat_sweep: bool = False,
              loss_scale: str | None = None, force: bool = False, keep_going: bool = False,
              in_process: bool = False, precision: float = 0.03, settle_s: float = 0.0, procs: int = 1,
              generate: int | None = None, prompt_len: int = 8) -> None:
    """Time MODEL(s) eager vs compiled targets: median and p90 latency, speedup, cold compile time,
    peak memory, max error vs eager. One table per model."""
    from mlcomp.measure.bench import BenchConfig, plot_bench, run_bench
    from mlcomp.measure.bench_results import to_csv

    if all_zoo:
        from mlcomp.models import ZOO

        models = tuple(dict.fromkeys(models + tuple(ZOO)))
    if not models:
        raise BenchConfigError("no model given", hint="name one or more models, or pass --zoo")
    check_outputs(force, models, json=json_out, csv=csv_out, plot=plot_file)
    pipeline = checked_pipeline(pipeline, opt_level)
    if generate is not None:      # greedy generation: mlcomp.measure.generation_bench
        return _bench_generate(models, generate, targets, pipeline, batches, prompt_len, threads, json_out,
                               TimingPolicy(warmup, budget, min_repeats, max_repeats))
    check_targets(targets)
    from mlcomp.api import check_model_inputs

    for model in models:
        check_model_inputs(model, input_shapes, None)
        if not input_shapes and not model.endswith(".pt2"):      # a .pt2's batch: check_pt2_batches
            check_model_inputs(model, (), max(batches))
    check_pt2_batches(models, batches)
    set_threads(threads)
    if remat_sweep:   # the remat budget sweep: mlcomp.measure.remat_sweep
        from mlcomp.measure.remat_sweep import sweep_models

        if not train:
            raise BenchConfigError("--remat-sweep measures training steps", hint="add --train")
        write_output(json_out, "json",
                     sweep_models(models, batches, loss=loss, optimizer=optimizer, plot_file=plot_file,
                                  policy=TimingPolicy(warmup, budget, min_repeats, max_repeats),
                                  echo=click.echo if json_out != "-" else None))
        return
    if train:   # eager vs compiled training step: mlcomp.cli.training
        from mlcomp.cli.training import bench_train

        given = click.get_current_context().get_parameter_source("targets") is not click.core.ParameterSource.DEFAULT
        train_targets = targets if given else ("cpu",)
        write_output(json_out, "json",
                     bench_train(models, batches, targets=train_targets, loss=loss, optimizer=optimizer,
                                 policy=TimingPolicy(warmup, budget, min_repeats, max_repeats),
                                 json_out=json_out, loss_scale=loss_scale))
        return
    config = BenchConfig(targets, batches, pipeline, TimingPolicy(warmup, budget, min_repeats, max_repeats),
                         memory=not no_memory, threads=threads, dtypes=dtypes,
                         **comparison_config(in_process, precision, settle_s, procs))
    progress = command_progress(show_progress, machine_output="-" in (json_out, csv_out))
    results = []
    for model in models:
        res = run_bench(model, config, input_shapes=input_shapes, trust_pickle=trust_pickle, progress=progress)
        results.append(res)
        progress.clear()
        if json_out != "-" and csv_out != "-":
            click.echo(res.format())
            click.echo()
    write_output(json_out, "json", json.dumps([r.to_json() for r in results], indent=2))
    write_output(csv_out, "csv", to_csv(results))
    if plot_file:
        plot_bench(results, plot_file)
        click.echo(f"wrote {plot_file}", err=True)
    if not keep_going:
        _fail_unverified(results)


def _bench_generate(models: tuple[str, ...], tokens: int, targets: tuple[str, ...], pipeline: Any,
                    batches: tuple[int, ...], prompt_len: int, threads: int | None, json_out: str | None,
                    policy: Any) -> None:
    from mlcomp.measure.generation_bench import DEFAULT_VARIANTS, bench_generation

    given = click.get_current_context().get_parameter_source("targets") is not click.core.ParameterSource.DEFAULT
    set_threads(threads)
    results = []
    for model in models:
        for batch in batches:
            res = bench_generation(model, tokens, targets=targets if given else DEFAULT_VARIANTS,
                                   pipeline=pipeline or "-O2", policy=policy, prompt_len=prompt_len, batch=batch,
                                   threads=threads, note=lambda text: click.echo(text, err=True))
            results.append(res)
            if json_out != "-":
                click.echo(res.table().format())
                click.echo()
    write_output(json_out, "json", json.dumps([r.to_json() for r in results], indent=2))
    bad = [(r.model, row.variant) for r in results for row in r.rows if row.tokens_equal is False]
    if bad:
        raise VerificationError(f"{len(bad)} generator(s) generate other tokens than eager, the first {bad[0][1]} "
                                f"on {bad[0][0]}", hint="the table has every row; compile that model with "
                                                        "`mlcomp compile MODEL --generate N` to see where")


def _fail_unverified(results: list[Any]) -> None:
    """Exit 4 (after every result is written) when a cell's outputs differ from eager."""
    bad = [(r, row) for r in results for row in r.rows if row.verified is False]
    if bad:
        first, row = bad[0]
        cells = sum(len(r.rows) for r in results)
        raise VerificationError(f"{len(bad)} of {cells} bench cells failed verification against eager, the first "
                                f"{first.model} on {row.label} at batch {row.batch}: {' '.join(row.reason.split())}",
                                hint="the table has every cell; fix or drop that target, or pass --keep-going "
                                     "to exit 0 anyway")
