"""The ``mlcomp`` command line.

Commands are registered lazily by name (``_LAZY``), so ``mlcomp --help`` and
``mlcomp models list`` never import tvm or onnxruntime.  A user error
(:class:`~mlcomp.base.errors.MlcompError`) is printed as one paragraph without a
traceback and sets the exit code.
"""
from __future__ import annotations

import importlib
import json
import sys
from typing import Any

import click

from mlcomp.base.errors import MlcompError

# command name -> "module:attribute"; each module owns its commands
_LAZY: dict[str, str] = {
    "compile": "mlcomp.cli.targets:compile_cmd",
    "run": "mlcomp.cli.targets:run_cmd",
    "export": "mlcomp.cli.targets:export_cmd",
    "targets": "mlcomp.cli.targets:targets_cmd",
    "passes": "mlcomp.cli.passes:passes_cmd",
    "bench": "mlcomp.cli.study:bench_cmd",
    "study": "mlcomp.cli.study:study_cmd",
    "report": "mlcomp.cli.study:report_cmd",
}


class _Group(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        names = set(super().list_commands(ctx))
        for name, ref in _LAZY.items():
            if _importable(ref):
                names.add(name)
        return sorted(names)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        cmd = super().get_command(ctx, name)
        if cmd is not None or name not in _LAZY:
            return cmd
        module, _, attr = _LAZY[name].partition(":")
        return getattr(importlib.import_module(module), attr)

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except MlcompError as err:
            click.echo(f"error: {err.message}", err=True)
            ctx.exit(err.exit_code)


def _importable(ref: str) -> bool:
    module = ref.partition(":")[0]
    return importlib.util.find_spec(module) is not None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mlcomp")
def main() -> None:
    """mlcomp: capture a PyTorch model, run a declared pipeline of passes, lower it to a
    target (cpu, cuda, onnxruntime, tvm) and compare it with eager PyTorch.

    MODEL is a zoo name (see `mlcomp models list`), a TorchScript archive (.pt), an
    ExportedProgram (.pt2) or a factory path/to/file.py:fn / package.module:fn.
    """


# ---------------------------------------------------------------------------
# shared options

def model_options(fn: Any) -> Any:
    """Options every command that loads a model accepts."""
    opts = [
        click.argument("model"),
        click.option("--input-shape", "input_shapes", multiple=True, metavar="1x3x32x32[:float32]",
                     help="Shape (and dtype) of one input; repeat per input. Needed when the model file "
                          "carries no shapes."),
        click.option("--batch", type=int, default=None, help="Batch size for zoo models (default 1)."),
        click.option("--capture", "capture_method", type=click.Choice(["export", "fx"]), default="export",
                     show_default=True, help="torch.export (ATen) or torch.fx.symbolic_trace then make_fx."),
        click.option("--dynamic-batch", is_flag=True, help="Mark the batch dimension dynamic."),
        click.option("--trust-pickle", is_flag=True,
                     help="Allow loading a pickled module (torch.save(model)); this executes code from the file."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def load_and_capture(model: str, input_shapes: tuple[str, ...], batch: int | None, capture_method: str,
                     dynamic_batch: bool, trust_pickle: bool):
    from mlcomp.frontend.loading import load_model

    source = load_model(model, input_shapes=input_shapes, trust_pickle=trust_pickle, batch=batch)
    graph = source.capture(method=capture_method, dynamic_batch=dynamic_batch)
    return source, graph


# ---------------------------------------------------------------------------
# inspect

@main.command("inspect")
@model_options
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--ir", "show_ir", is_flag=True, help="Also print the IR text.")
@click.option("--dot", "dot_file", type=click.Path(dir_okay=False), help="Write the graph as Graphviz dot.")
@click.option("--top", type=int, default=10, show_default=True, help="Rows in the per-node FLOPs table.")
def inspect_cmd(model: str, input_shapes: tuple[str, ...], batch: int | None, capture_method: str,
                dynamic_batch: bool, trust_pickle: bool, as_json: bool, show_ir: bool,
                dot_file: str | None, top: int) -> None:
    """Op histogram, parameters, FLOPs, bytes, intensity and the parallelism profile of MODEL."""
    from mlcomp.analysis.inspect import inspect_graph
    from mlcomp.base.files import write_text_atomic

    _, graph = load_and_capture(model, input_shapes, batch, capture_method, dynamic_batch, trust_pickle)
    report = inspect_graph(graph)
    if dot_file:
        write_text_atomic(dot_file, graph.to_dot())
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
        return
    if show_ir:
        click.echo(graph.format())
        click.echo()
    click.echo(report.format(top=top))


# ---------------------------------------------------------------------------
# models

@main.group("models")
def models_group() -> None:
    """The built-in model zoo."""


@models_group.command("list")
def models_list() -> None:
    """List zoo models with their default input shapes."""
    from mlcomp import models

    width = max(len(n) for n in models.ZOO)
    for name, z in models.ZOO.items():
        shape = "x".join(str(s) for s in (1, *z.input_shape))
        click.echo(f"{name:<{width}}  {shape:<14} {z.summary}")


@models_group.command("save")
@click.argument("name")
@click.option("--format", "fmt", type=click.Choice(["torchscript", "pt2"]), required=True)
@click.option("-o", "--output", required=True, type=click.Path(dir_okay=False))
@click.option("--batch", type=int, default=1, show_default=True)
def models_save(name: str, fmt: str, output: str, batch: int) -> None:
    """Write zoo model NAME as a TorchScript archive or an ExportedProgram."""
    from mlcomp import models
    from mlcomp.base.files import atomic_path
    from mlcomp.frontend.loading import save_torchscript

    z = models.get(name)
    module, inputs = z.build(), z.example_inputs(batch)
    with atomic_path(output) as tmp:
        if fmt == "torchscript":
            save_torchscript(module, inputs, tmp)
        else:
            import torch

            from mlcomp.frontend.capture import _quiet

            with _quiet():
                torch.export.save(torch.export.export(module, inputs), tmp)
    click.echo(f"wrote {output} ({fmt}, input {'x'.join(map(str, inputs[0].shape))})")

