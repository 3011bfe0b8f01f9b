"""``mlcomp export``: write a model as a standalone file, reload it with the plain tool, verify it.

    $ mlcomp export mlp --format onnx -o mlp.onnx

Registered lazily by :mod:`mlcomp.cli.main`; the formats are :mod:`mlcomp.targets.export`.
"""
from __future__ import annotations

import time
from pathlib import Path

import click

from mlcomp.base.files import Kind, check_destination
from mlcomp.base.progress import Progress
from mlcomp.base.units import fmt_bytes
from mlcomp.cli.compile import force_option, names_of, size_on_disk, tolerance_callback
from mlcomp.cli.main import load_and_capture, model_options
from mlcomp.cli.passes import preset_options, resolve_pipeline

__all__ = ["export_cmd"]


@click.command("export")
@model_options
@click.option("-f", "--format", "fmt", type=click.Choice(["onnx", "torchscript", "pt2", "tvm"]), required=True,
              help="onnx (model.onnx), torchscript (frozen .pt), pt2 (ExportedProgram), tvm (folder).")
@click.option("-o", "--output", required=True, type=click.Path(path_type=Path), help="File (folder for tvm).")
@preset_options
@click.option("--tolerance", type=float, default=None, callback=tolerance_callback,
              help="Relative tolerance for verification.")
@force_option
def export_cmd(model: str, input_shapes: tuple[str, ...], batch: int | None, capture_method: str,
               dynamic: str | None, trust_pickle: bool, fmt: str, output: Path, pipeline: str | None,
               opt_level: str | None, tolerance: float | None, force: bool) -> None:
    """Write MODEL as a standalone file, reload it with the plain tool and verify it.

    A preset (-O2, the default) adapts to the format's runtime as compile does for a target.
    """
    import torch

    from mlcomp.pipeline import run_pipeline
    from mlcomp.targets.export import ExportFormat, export_graph, export_pipeline

    fmt_ = ExportFormat.parse(fmt)
    tvm = fmt_ is ExportFormat.TVM
    check_destination(output, Kind.DIR if tvm else Kind.FILE, force=force, fmt=None if tvm else fmt_.value,
                      inputs=(model,))
    pipe, adapted = export_pipeline(fmt_, resolve_pipeline(pipeline, opt_level))    # parsed before capture
    progress = Progress.for_command()
    with progress.stage(f"capture {model}"):
        source, graph = load_and_capture(model, input_shapes, batch, capture_method, dynamic, trust_pickle)
    inputs = source.inputs()
    if pipe.passes:
        with progress.stage(f"pipeline {pipe.spec}"):
            graph, _ = run_pipeline(graph, pipe, example_inputs=inputs)
    with torch.no_grad():
        expected = source.eager(*inputs)
    t0 = time.perf_counter()
    with progress.stage(f"export {fmt} and reload"):
        path, result = export_graph(graph, fmt_, output, inputs, expected, tolerance=tolerance,
                                    names=names_of(expected, len(graph.output_refs)))
    progress.clear()
    if adapted is not None and adapted.dropped:
        click.echo(f"pipeline {adapted.preset} for {adapted.target}: {pipe.spec or '(no passes)'}; dropped "
                   + "; ".join(str(d) for d in adapted.dropped))
    click.echo(f"exported {graph.name} as {fmt} to {path} ({fmt_bytes(size_on_disk(path))}) "
               f"in {time.perf_counter() - t0:.1f}s")
    click.echo(f"reloaded with the plain tool and verified: {result.summary()}")
    if tvm:   # a pure TVM build (targets/export.py): no torch kernel calls
        click.echo(f"needs only apache-tvm: relax.VirtualMachine(tvm.runtime.load_module('{path}/model.so'), "
                   "tvm.cpu())['main'](...) runs it, without torch or mlcomp")
