"""``mlcomp tune``: MetaSchedule-tune a model's TVM tasks into a database that every later build reuses.

    $ mlcomp tune mlp --trials 64 --tuning-dir tvm-db
    captured mlp: 11 nodes in 0.4s
    [64/64    41s] task 2: 8/8 ran
    tuned mlp for tvm: 3 tasks, 0 reused from tvm-db, 64 trials in 41.2s
    $ mlcomp tune mlp --trials 64 --tuning-dir tvm-db --batch 2     # other shapes: new tasks
    $ mlcomp compile mlp --target tvm --tuning-dir tvm-db   # uses the records, tunes nothing

The database (``--tuning-dir``, the flag ``compile`` reads it with; ``--db`` is a hidden old name; default ``mlcomp-out/tvm-tuning``) is MetaSchedule's JSON
database plus mlcomp's ledger of trials per (target, task workload): a task of
another model with the same workload (same layer shapes and fused epilogue) is
reused, not tuned again.  The pipeline is the one ``compile --target tvm`` runs
(``-O2`` adapted to tvm unless ``-p``/``-O`` says otherwise), so compile finds the
same workloads.  Progress is one line per measured batch (live on a terminal).
"""
from __future__ import annotations

import json
import time
from pathlib import Path

import click

from mlcomp.base.errors import OptionError
from mlcomp.base.files import Kind, check_destination
from mlcomp.base.progress import Progress
from mlcomp.cli.main import load_and_capture, model_options
from mlcomp.cli.passes import preset_options, resolve_pipeline

__all__ = ["DEFAULT_DB", "check_tuning_db", "tune_cmd"]

DEFAULT_DB = Path("mlcomp-out") / "tvm-tuning"


def _tuning_dir(given: Path, alias: Path | None) -> Path:
    """``--tuning-dir``, or the deprecated ``--db`` (a note after the run); both at once must agree."""
    if alias is None:
        return given
    source = click.get_current_context().get_parameter_source("db")
    if source is not click.core.ParameterSource.DEFAULT and given != alias:
        raise OptionError(f"--db {alias} and --tuning-dir {given} name two tuning folders",
                          hint="give --tuning-dir only (--db is its old name)")
    return alias


def check_tuning_db(db: str | Path, option: str, model: str) -> None:
    """A tuning database is extended, not replaced: new, empty or mlcomp's own (its ``.mlcomp`` marker, or
    the ledger an older mlcomp left, which then gets the marker); never a user's folder or the input."""
    from mlcomp.base.files import MARKER, mark_folder

    folder = Path(db)
    if folder.is_dir() and not (folder / MARKER).exists() and (folder / "mlcomp_ledger.json").is_file():
        mark_folder(folder, "tuning database")
    check_destination(folder, Kind.DIR, force=True, option=option, inputs=(model,))


@click.command("tune")
@model_options
@click.option("--trials", type=click.IntRange(min=1), required=True,
              help="MetaSchedule trial budget for this model, shared evenly by its tasks.")
@click.option("--tuning-dir", "db", type=click.Path(file_okay=False, path_type=Path), default=DEFAULT_DB,
              show_default=True, help="Tuning database folder, shared across models and reused by "
                                      "`mlcomp compile --target tvm --tuning-dir DIR`.")
@click.option("--db", "db_alias", type=click.Path(file_okay=False, path_type=Path), default=None, hidden=True,
              help="Deprecated name of --tuning-dir.")
@preset_options
@click.option("--device", default=None, help="Device to tune for (cpu, cuda:0); default cpu.")
@click.option("--build-timeout", type=click.FloatRange(min=1), default=180.0, show_default=True,
              help="Seconds one candidate may take to build.")
@click.option("--run-timeout", type=click.FloatRange(min=1), default=60.0, show_default=True,
              help="Seconds one candidate may take to run.")
@click.option("--json", "as_json", is_flag=True, help="Print the tuning summary as one JSON object on stdout.")
def tune_cmd(model: str, input_shapes: tuple[str, ...], batch: int | None, capture_method: str,
             dynamic: str | None, trust_pickle: bool, trials: int, db: Path, pipeline: str | None,
             opt_level: str | None, device: str | None, build_timeout: float, run_timeout: float,
             as_json: bool = False, db_alias: Path | None = None) -> None:
    """Tune MODEL's TVM kernels with MetaSchedule into a database shared across models."""
    db = _tuning_dir(db, db_alias)
    from mlcomp.api.lowering import adapted_pipeline
    from mlcomp.pipeline import run_pipeline
    from mlcomp.targets import CompileOptions, get_target

    target = get_target("tvm")
    reason = target.available()
    if reason:
        raise OptionError(f"mlcomp tune needs the tvm target, which is not available: {reason}",
                          hint="install apache-tvm (make install) and run again")
    check_tuning_db(db, "--db" if db_alias is not None else "--tuning-dir", model)
    options = CompileOptions.make(tune_trials=trials, work_dir=str(db), device=device,
                                  tune_build_timeout=build_timeout, tune_run_timeout=run_timeout)
    progress = Progress.for_command(machine_output=as_json)
    t0 = time.perf_counter()
    with progress.stage(f"capture {model}"):
        source, graph = load_and_capture(model, input_shapes, batch, capture_method, dynamic, trust_pickle)
    pipe, _ = adapted_pipeline(resolve_pipeline(pipeline, opt_level), target)
    if pipe is not None:
        with progress.stage(f"pipeline {pipe.spec} for tvm"):
            graph, _report = run_pipeline(graph, pipe, example_inputs=source.inputs(), target=target.facts(options))
    progress.note(f"tune {graph.name}: {trials} trials into {db}")
    t1 = time.perf_counter()
    runtime = target.tune(graph, options, progress=progress)
    progress.clear()
    stats = runtime.stats
    facts = {"model": graph.name, "db": str(db), "tasks": stats.get("tasks", 0),
             "tasks_reused": list(stats.get("tasks_reused", [])), "trials_run": stats.get("trials_run", 0),
             "trials_before": stats.get("trials_before", 0), "records_per_task": stats.get("records_per_task", {}),
             "tuning_seconds": round(time.perf_counter() - t1, 2), "total_seconds": round(time.perf_counter() - t0, 2)}
    if db_alias is not None:
        click.echo("note: --db is the old name of --tuning-dir (the flag `mlcomp compile` reads the database "
                   "with); use --tuning-dir", err=True)
    if as_json:
        click.echo(json.dumps(facts, indent=2))
        return
    click.echo(f"tuned {graph.name} for tvm: {facts['tasks']} tasks, {len(facts['tasks_reused'])} reused from "
               f"{db}, {facts['trials_run']} trials in {facts['tuning_seconds']:.1f}s")
    for name in facts["tasks_reused"]:
        click.echo(f"  reused: {name}")
