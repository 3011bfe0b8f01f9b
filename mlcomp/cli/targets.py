"""CLI commands for targets: ``compile``, ``run``, ``export`` and ``targets``.

    $ mlcomp compile resnet18 --target onnxruntime -p -O2 -o out/r18
    captured resnet18: 213 nodes in 4.1s
    compiled for onnxruntime in 3.9s
    verified against eager: passed: 1 output(s), max abs 6.7e-08, max rel 5.2e-07 (...)
    saved out/r18 (model.onnx 44.7 MB); reloaded from disk and verified again
    $ mlcomp run out/r18 --input x.npy --output y.npz
    $ mlcomp export mlp --format onnx -o mlp.onnx
    $ mlcomp targets

Registered lazily by :mod:`mlcomp.cli.main`; user errors are :class:`MlcompError`
and are printed there without a traceback.
"""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import click

from mlcomp.analysis.verify import check_tolerance
from mlcomp.base.errors import ArtifactError, InputSpecError, OptionError
from mlcomp.base.files import Kind, check_destination
from mlcomp.cli.main import load_and_capture, model_options
from mlcomp.cli.passes import pipeline_from_cli, pipeline_options

__all__ = ["compile_cmd", "run_cmd", "export_cmd", "targets_cmd"]


def _tolerance(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    return check_tolerance(value)


def _force_option(fn: Any) -> Any:
    return click.option("--force", is_flag=True,
                        help="Replace an earlier mlcomp output at -o (never a folder mlcomp did not write).")(fn)


def _check_target_flags(target: str, tune_trials: int, tuning_dir: str | None) -> str:
    """Unknown target names and flags that do not apply to the target, before any capture."""
    from mlcomp.targets import get_target

    name = get_target(target).name
    if name != "tvm" and (tune_trials or tuning_dir):
        flag = "--tune-trials" if tune_trials else "--tuning-dir"
        raise OptionError(f"{flag} applies to the tvm target only, not to {name}",
                          hint=f"drop {flag}, or compile with --target tvm")
    return name


def _size(path: Path) -> str:
    total = sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size
    return f"{total / 1e6:.1f} MB" if total >= 1e5 else f"{total / 1e3:.1f} kB"


@click.command("compile")
@model_options
@click.option("-t", "--target", default=None, metavar="TARGET",
              help="cpu, cuda, onnxruntime (ort) or tvm (default: the pipeline file's target, else cpu).")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="Artifact folder to write (default mlcomp-out/MODEL-TARGET).")
@pipeline_options
@click.option("--tolerance", type=float, default=None, callback=_tolerance,
              help="Relative tolerance for verification (default by dtype).")
@click.option("--fallback", type=click.Choice(["none", "eager"]), default="none", show_default=True,
              help="What to do with ops the target cannot run: fail, or run them in torch.")
@click.option("--threads", type=click.IntRange(min=1), default=None, help="Intra-op threads of the runtime.")
@click.option("--device", default=None, help="Device for the target (cpu, cuda:0); default: the target's own.")
@click.option("--tune-trials", type=click.IntRange(min=0), default=0, show_default=True,
              help="TVM MetaSchedule trial budget (0 = untuned).")
@click.option("--tuning-dir", type=click.Path(file_okay=False), default=None,
              help="TVM tuning database folder, reused across runs.")
@click.option("--fresh-check", is_flag=True, help="Also reload and verify the artifact in a new Python process.")
@_force_option
@click.option("--train", is_flag=True, help="Compile a training step (forward, loss, backward, optimizer).")
@click.option("--loss", default="cross_entropy", show_default=True, help="With --train: cross_entropy, mse or model.")
@click.option("--optimizer", default="sgd{lr=0.01 momentum=0.9}", show_default=True,
              help='With --train: e.g. "sgd{lr=0.05 momentum=0.9}" or "adam{lr=1e-3}".')
@click.option("--steps", type=click.IntRange(min=1), default=5, show_default=True,
              help="With --train: compiled steps compared with as many eager steps.")
def compile_cmd(model: str, input_shapes: tuple[str, ...], batch: int | None, capture_method: str,
                dynamic_batch: bool, trust_pickle: bool, target: str | None, output: Path | None,
                pipeline: str | None, opt_level: str | None, dump_after: str | None, dump_dir: str,
                verify_passes: bool, explain: bool, tolerance: float | None, fallback: str,
                threads: int | None, device: str | None, tune_trials: int, tuning_dir: str | None,
                fresh_check: bool, force: bool, train: bool = False, loss: str = "cross_entropy",
                optimizer: str = "sgd", steps: int = 5) -> None:
    """Capture MODEL, run a pipeline, lower it to a target, verify against eager and save it."""
    from mlcomp.api import compile_source

    request = pipeline_from_cli(pipeline, opt_level, dump_after, dump_dir, verify_passes, explain, default=None)
    pipeline = request.pipeline.spec if opt_level is not None else pipeline
    if train:   # the training path: mlcomp.cli.training
        from mlcomp.cli.training import compile_train

        return compile_train(model, input_shapes, batch, trust_pickle, target=target, output=output, loss=loss,
                             optimizer=optimizer, steps=steps, tolerance=tolerance, device=device,
                             pipeline=pipeline, instruments=request.instruments(), force=force)

    if output is not None:
        check_destination(output, Kind.DIR, force=force)
    if target is not None:
        _check_target_flags(target, tune_trials, tuning_dir)
    t0 = time.perf_counter()
    source, graph = load_and_capture(model, input_shapes, batch, capture_method, dynamic_batch, trust_pickle)
    capture_seconds = time.perf_counter() - t0
    click.echo(f"captured {graph.name}: {len(graph)} nodes in {capture_seconds:.1f}s")
    if target is None and pipeline and pipeline.strip().endswith(".toml"):
        from mlcomp.pipeline import Pipeline

        target = Pipeline.from_toml(pipeline.strip()).target
    target = target or "cpu"
    canonical = _check_target_flags(target, tune_trials, tuning_dir)
    output = check_destination(output or Path("mlcomp-out") / f"{graph.name}-{canonical}", Kind.DIR, force=force)
    result = compile_source(source, graph, target=target, pipeline=pipeline, verify=False,
                            instruments=request.instruments(),
                            capture_seconds=capture_seconds, tolerance=tolerance, fallback=fallback,
                            threads=threads, device=device, tune_trials=tune_trials, work_dir=tuning_dir)
    art = result.artifact
    if result.pipeline_report is not None:
        click.echo(result.pipeline_report.format(nested=request.explain))
    click.echo(f"compiled for {art.target} in {art.compile_seconds:.1f}s")
    for region in art.manifest.get("fallback_regions", []):
        if region["runs_on"] != art.target:
            click.echo(f"fallback: region {region['region']} ({region['nodes']} nodes: "
                       f"{', '.join(region['ops'])}) runs in {region['runs_on']}")
    stats = getattr(art.runtime, "stats", None)
    if isinstance(stats, dict) and stats.get("tune_trials"):
        click.echo(f"tvm tuning: {stats.get('trials_run', 0)} trials run, tasks reused: "
                   f"{len(stats.get('tasks_reused', []))} (database {stats.get('work_dir')})")
    check = art.verify(tolerance=tolerance, raise_on_failure=False)
    click.echo(f"verified against eager: {check.summary()}")
    check.raise_if_failed(where=f"target {art.target}, model {graph.name}")
    art.save(output, force=force)
    payload = ", ".join(f"{e['path']}" for e in art.manifest["payload"][:4])
    from mlcomp.targets.artifact import Artifact

    again = Artifact.load(output).verify(record=False)
    click.echo(f"saved {output} ({payload}; {_size(output)}); reloaded from disk: {again.summary()}")
    if fresh_check:
        _fresh_check(output)


def _fresh_check(output: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "mlcomp", "run", str(output), "--verify"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise ArtifactError(f"reloading {output} in a fresh process failed: "
                            f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:]}",
                            hint="the artifact depends on state of this process; report it")
    last = [ln for ln in proc.stdout.splitlines() if ln.startswith("verified")]
    click.echo(f"fresh process: {last[-1] if last else 'ok'}")


def _read_inputs(files: Sequence[str]) -> list[Any]:
    import numpy as np
    import torch

    values: list[Any] = []
    for name in files:
        path = Path(name)
        suffix = path.suffix.lower()
        try:
            if suffix == ".npy":
                values.append(torch.from_numpy(np.load(path, allow_pickle=False)))
            elif suffix == ".npz":
                with np.load(path, allow_pickle=False) as data:
                    values.extend(torch.from_numpy(data[k]) for k in data.files)
            elif suffix in (".pt", ".pth"):
                obj = torch.load(path, map_location="cpu", weights_only=True)
                values.extend(obj if isinstance(obj, (list, tuple)) else [obj])
            else:
                raise InputSpecError(f"input file {name} is neither .npy, .npz nor .pt",
                                     hint="save inputs with numpy.save or torch.save")
        except (OSError, ValueError, RuntimeError) as exc:
            raise InputSpecError(f"input file {name} could not be read: {exc}",
                                 hint="give a .npy/.npz written by numpy or a .pt holding tensors") from None
    return values


@click.command("run")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("-i", "--input", "input_files", multiple=True, type=click.Path(exists=True, dir_okay=False),
              help="Input tensor file (.npy, .npz or .pt); repeat per input. Default: random inputs.")
@click.option("-o", "--output", type=click.Path(), default=None,
              help="Write the outputs to this .npz (or .pt) file.")
@click.option("--verify", "do_verify", is_flag=True,
              help="Run the artifact's stored reference inputs and compare with eager outputs.")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True,
              help="Run this many times and report the median latency.")
def run_cmd(directory: Path, input_files: tuple[str, ...], output: str | None, do_verify: bool,
            repeat: int) -> None:
    """Load the artifact in DIRECTORY and run it."""
    import statistics


    from mlcomp.targets.artifact import Artifact

    if output:
        if not output.endswith((".npz", ".pt")):
            raise InputSpecError(f"--output {output} must end in .npz or .pt",
                                 hint="name the file out.npz (numpy) or out.pt (torch)")
        check_destination(output, Kind.FILE, option="--output")
    art = Artifact.load(directory)
    click.echo(f"loaded {art.manifest['model']} for {art.target} ({', '.join(map(str, art.inputs))})")
    if do_verify:
        result = art.verify(record=False, raise_on_failure=False)
        click.echo(f"verified against stored eager outputs: {result.summary()}")
        result.raise_if_failed(where=f"artifact {directory}")
        if not input_files and not output and repeat == 1:
            return
    if input_files:
        inputs = tuple(_read_inputs(input_files))
        source = "from " + ", ".join(input_files)
    elif do_verify and art.reference is not None:
        inputs, source = art.reference[0], "the stored reference inputs"
    else:
        inputs, source = art.random_inputs(), "random inputs from the input spec"
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = art(*inputs)
        times.append(time.perf_counter() - t0)
    outs = out if isinstance(out, tuple) else (out,)
    click.echo(f"ran on {source}: median {statistics.median(times) * 1e3:.3f} ms over {repeat} run(s)")
    for spec, value in zip(art.outputs, outs):
        flat = value.detach().float().flatten()
        head = ", ".join(f"{v:.4g}" for v in flat[:6].tolist())
        click.echo(f"  {spec.name}: {list(value.shape)} {str(value.dtype).replace('torch.', '')} "
                   f"[{head}{', ...' if flat.numel() > 6 else ''}]")
    if output:
        _write_outputs(output, [s.name for s in art.outputs], outs)
        click.echo(f"wrote {output}")


def _write_outputs(path: str, names: list[str], outs: Sequence[Any]) -> None:
    import numpy as np
    import torch

    from mlcomp.base.files import atomic_path

    with atomic_path(path) as tmp:
        if path.endswith(".pt"):
            torch.save({n: o.detach().cpu() for n, o in zip(names, outs)}, tmp)
        elif path.endswith(".npz"):
            with open(tmp, "wb") as fh:
                np.savez(fh, **{n: o.detach().cpu().float().numpy() if o.dtype == torch.bfloat16
                                else o.detach().cpu().numpy() for n, o in zip(names, outs)})
        else:
            raise InputSpecError(f"--output {path} must end in .npz or .pt")


@click.command("export")
@model_options
@click.option("-f", "--format", "fmt", type=click.Choice(["onnx", "torchscript", "pt2", "tvm"]), required=True,
              help="onnx (model.onnx), torchscript (frozen .pt), pt2 (ExportedProgram), tvm (folder).")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="File (folder for tvm).")
@click.option("-p", "--pipeline", default=None, metavar="SPEC|FILE.toml", help="Passes to run first.")
@click.option("--tolerance", type=float, default=None, callback=_tolerance,
              help="Relative tolerance for verification.")
@_force_option
def export_cmd(model: str, input_shapes: tuple[str, ...], batch: int | None, capture_method: str,
               dynamic_batch: bool, trust_pickle: bool, fmt: str, output: Path, pipeline: str | None,
               tolerance: float | None, force: bool) -> None:
    """Write MODEL as a standalone file, reload it with the plain tool and verify it."""
    import torch

    from mlcomp.pipeline import Pipeline, run_pipeline
    from mlcomp.targets.export import ExportFormat, export_graph

    check_destination(output, Kind.DIR if fmt == "tvm" else Kind.FILE, force=force)
    source, graph = load_and_capture(model, input_shapes, batch, capture_method, dynamic_batch, trust_pickle)
    inputs = source.inputs()
    if pipeline:
        graph, _ = run_pipeline(graph, Pipeline.coerce(pipeline), example_inputs=inputs)
    with torch.no_grad():
        expected = source.eager(*inputs)
    t0 = time.perf_counter()
    path, result = export_graph(graph, ExportFormat.parse(fmt), output, inputs, expected, tolerance=tolerance)
    click.echo(f"exported {graph.name} as {fmt} to {path} ({_size(path)}) in {time.perf_counter() - t0:.1f}s")
    click.echo(f"reloaded with the plain tool and verified: {result.summary()}")


@click.command("targets")
def targets_cmd() -> None:
    """List the targets, what each compiles (modes, dtypes, devices) and whether it can run here."""
    from mlcomp.targets import TargetName, get_target

    width = max(len(t.value) for t in TargetName)
    for name in TargetName:
        target = get_target(name)
        reason = target.available()
        state = "available" if reason is None else f"unavailable: {reason}"
        click.echo(f"{name.value:<{width}}  {state}")
        click.echo(f"{'':<{width}}  {target.description}")
        click.echo(f"{'':<{width}}  compiles: {target.capabilities.describe()}")
