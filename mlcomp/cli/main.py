"""The ``mlcomp`` command line.

Commands are registered lazily by name (``COMMANDS``, a :class:`~mlcomp.base.registry.LazyRegistry`), so ``mlcomp --help`` and
``mlcomp models list`` never import tvm or onnxruntime.  A user error
(:class:`~mlcomp.base.errors.MlcompError`) is printed as one paragraph without a
traceback and sets the exit code.
"""
from __future__ import annotations

import importlib.util
import json
from typing import Any

import click

from mlcomp.base.errors import BUG_HINT, MlcompError
from mlcomp.base.files import InterruptScope, Kind, check_destination
from mlcomp.base.registry import LazyRegistry

# command name -> "module:attribute"; each module owns its commands
COMMANDS: LazyRegistry[click.Command] = LazyRegistry("command", {
    "compile": "mlcomp.cli.compile:compile_cmd",
    "run": "mlcomp.cli.run:run_cmd",
    "export": "mlcomp.cli.export:export_cmd",
    "targets": "mlcomp.cli.targets:targets_cmd",
    "passes": "mlcomp.cli.passes:passes_cmd",
    "bench": "mlcomp.cli.bench:bench_cmd",
    "study": "mlcomp.cli.study:study_cmd",
    "report": "mlcomp.cli.report:report_cmd",
    "partition": "mlcomp.cli.partition:partition_cmd",
    "launch": "mlcomp.cli.launch:launch_cmd",
    "profile": "mlcomp.cli.profile:profile_cmd",
    "cache": "mlcomp.cli.cache:cache_group",
    "tune": "mlcomp.cli.tune:tune_cmd",
    "support": "mlcomp.cli.support:support_cmd",
})


TARGETS_IN_HELP = "{targets}"     # replaced by the registry's target list when help is shown


class _Group(click.Group):
    def list_commands(self, ctx: click.Context) -> list[str]:
        names = set(super().list_commands(ctx))
        for name in COMMANDS.names():
            if _importable(str(COMMANDS.ref(name))):
                names.add(name)
        return sorted(names)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        cmd = super().get_command(ctx, name)
        if cmd is not None or name not in COMMANDS:
            return cmd
        return COMMANDS.get(name)

    def format_help_text(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        from mlcomp.targets.registry import target_list     # at help time only: the targets package imports torch

        self.help = (self.help or "").replace(TARGETS_IN_HELP, target_list())
        super().format_help_text(ctx, formatter)

    def invoke(self, ctx: click.Context) -> Any:
        with InterruptScope() as interrupts:
            try:
                result = super().invoke(ctx)
                if interrupts.seen:       # Ctrl-C swallowed somewhere (a native library, a per-target guard)
                    _interrupted(ctx)
                return result
            except (click.exceptions.Exit, click.Abort):
                raise
            except KeyboardInterrupt:
                _interrupted(ctx)
            except MlcompError as err:
                if interrupts.seen:       # a native library turned Ctrl-C into its own error
                    _interrupted(ctx)
                click.echo(f"error: {err.message}", err=True)
                ctx.exit(err.exit_code)
            except click.UsageError as err:
                where = err.ctx.command_path if err.ctx is not None else "mlcomp"
                message = " ".join(err.format_message().split())
                click.echo(f"error: {message.rstrip('.')}. See `{where} --help`.", err=True)
                ctx.exit(err.exit_code)
            except Exception as exc:
                if interrupts.seen:
                    _interrupted(ctx)
                if ctx.meta.get(_TRACEBACK):
                    raise
                _unexpected(ctx, exc)


_TRACEBACK = "mlcomp.show_traceback"


def _unexpected(ctx: click.Context, exc: Exception) -> None:
    """Not a user error: still one paragraph, exit 3, and the way to get the traceback for a report."""
    text = " ".join(str(exc).split()) or "(no message)"
    if len(text) > 400:
        text = text[:400] + " …"
    sub = ctx.invoked_subcommand or "command"
    if isinstance(exc, OSError):
        what = f"mlcomp {sub} could not read or write a file: {text}"
        hint = "check the path, free disk space and permissions"
    else:
        what = f"mlcomp {sub} failed unexpectedly: {type(exc).__name__}: {text}"
        hint = BUG_HINT
    click.echo(f"error: {what.rstrip('.')}. {hint[0].upper() + hint[1:]}.", err=True)
    ctx.exit(3)


def _interrupted(ctx: click.Context) -> None:
    """Ctrl-C: one line, exit 130 (128 + SIGINT); temporaries were removed by the writers' context managers."""
    click.echo("interrupted", err=True)
    ctx.exit(130)


def _importable(ref: str) -> bool:
    module = ref.partition(":")[0]
    return importlib.util.find_spec(module) is not None


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="mlcomp")
@click.option("--traceback", "show_traceback", is_flag=True,
              help="On an unexpected failure (a bug, not a user error) show the Python traceback.")
@click.pass_context
def main(ctx: click.Context, show_traceback: bool) -> None:
    """mlcomp: capture a PyTorch model, run a declared pipeline of passes, lower it to a
    target ({targets}) and compare it with eager PyTorch.

    MODEL is a zoo name (see `mlcomp models list`), a TorchScript archive (.pt), an
    ExportedProgram (.pt2) or a factory path/to/file.py:fn / package.module:fn.
    """
    ctx.meta[_TRACEBACK] = show_traceback


# ---------------------------------------------------------------------------
# shared options

def model_options(fn: Any = None, *, batch: bool = True) -> Any:
    """Options every command that loads a model accepts (``@model_options(batch=False)``: a command
    whose ``--batch`` is a list, such as report, declares its own)."""
    if fn is None:
        return lambda f: model_options(f, batch=batch)
    opts = [
        click.argument("model"),
        click.option("--input-shape", "input_shapes", multiple=True, metavar="1x3x32x32[:f32]",
                     help="Shape (and dtype) of one input; repeat per input. Needed when the model file "
                          "carries no shapes."),
        *([click.option("--batch", type=click.IntRange(min=1), default=None,
                        help="Batch size for zoo models (default 1).")] if batch else []),
        click.option("--capture", "capture_method", type=click.Choice(["export", "fx"]), default="export",
                     show_default=True, help="torch.export (ATen) or torch.fx.symbolic_trace then make_fx."),
        click.option("--dynamic-batch", "dynamic", flag_value="batch",
                     help="Mark the batch dimension dynamic: --dynamic batch (without either, a .pt2 saved with a "
                          "dynamic batch is compiled at the batch of its example inputs)."),
        click.option("--dynamic", "dynamic", default=None, metavar="NAME[@DIM][=MIN..MAX],...",
                     help="Keep these sizes symbolic, e.g. batch,seq=8..512 (batch is dim 0, seq dim 1 of every "
                          "input; other names need @DIM); one artifact serves every size in the ranges."),
        click.option("--trust-pickle", is_flag=True,
                     help="Allow loading a pickled module (torch.save(model)); this executes code from the file."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def checked_threads(ctx: click.Context, param: click.Parameter, value: int | None) -> int | None:
    """``--threads`` (a ``click.IntRange(min=1)``): above the cores this process may run on, one warning and the core count
    (more intra-op threads than cores only take turns on them)."""
    if value is None:
        return None
    from mlcomp.hardware.link import available_cores

    cores = available_cores()
    if value > cores:
        click.echo(f"warning: --threads {value} is more than the {cores} core(s) this process may run on; "
                   f"using {cores}", err=True)
        return cores
    return value


def auto_pool_starter(target: str, candidates: Any, deterministic: bool) -> tuple[list[Any], Any]:
    """For ``--target auto``: (a list that will hold the timing processes, a ``before_capture`` for
    :func:`load_and_capture` that starts them there, kept until the command ends: a cache hit or an error
    kills them); for other targets the callback is None."""
    from mlcomp.api.compiler import early_pool, is_auto

    pool: list[Any] = []

    def start(source: Any) -> None:
        pool.append(click.get_current_context().with_resource(
            early_pool(source, target, candidates, {"deterministic": deterministic})))
    return pool, start if is_auto(target) else None


def load_and_capture(model: str, input_shapes: tuple[str, ...], batch: int | None, capture_method: str,
                     dynamic: str | None, trust_pickle: bool, before_capture: Any = None):
    """The model loaded and captured; ``before_capture(source)`` runs between the two (e.g. auto's timing
    processes start there, so that their imports use the core the capture leaves)."""
    from mlcomp.api import check_model_inputs
    from mlcomp.frontend.loading import load_model

    check_model_inputs(model, input_shapes, batch, capture_method)
    source = load_model(model, input_shapes=input_shapes, trust_pickle=trust_pickle, batch=batch)
    for note in source.notes:
        click.echo(f"note: {note}", err=True)
    if before_capture is not None:
        before_capture(source)
    graph = source.capture(method=capture_method, dynamic=dynamic)
    return source, graph


# ---------------------------------------------------------------------------
# inspect

@main.command("inspect")
@model_options
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
@click.option("--ir", "show_ir", is_flag=True, help="Also print the IR text.")
@click.option("--dot", "dot_file", type=click.Path(), help="Write the graph as Graphviz dot.")
@click.option("--top", type=click.IntRange(min=1), default=10, show_default=True, help="Rows in the per-node FLOPs table.")
@click.option("--train", is_flag=True, help="Inspect the training graph: FLOPs forward/backward, saved activations.")
@click.option("--loss", default="cross_entropy", show_default=True, help="With --train: cross_entropy, mse or model.")
@click.option("--force", is_flag=True, help="Replace an earlier mlcomp output at --dot (never a user's file).")
def inspect_cmd(model: str, input_shapes: tuple[str, ...], batch: int | None, capture_method: str,
                dynamic: str | None, trust_pickle: bool, as_json: bool, show_ir: bool,
                dot_file: str | None, top: int, train: bool = False, loss: str = "cross_entropy",
                force: bool = False) -> None:
    """Op histogram, parameters, FLOPs, bytes, intensity and the parallelism profile of MODEL."""
    if train:   # the joint forward+backward graph: mlcomp.cli.training
        from mlcomp.cli.training import inspect_train

        return inspect_train(model, input_shapes, batch, trust_pickle, loss=loss, as_json=as_json,
                             show_ir=show_ir, top=top)
    from mlcomp.analysis.inspect import inspect_graph
    from mlcomp.base.files import write_text_atomic
    from mlcomp.ir.graph_tools import to_dot

    if dot_file is not None:
        check_destination(dot_file, Kind.FILE, option="--dot", fmt="dot", force=force, inputs=(model,))
    _, graph = load_and_capture(model, input_shapes, batch, capture_method, dynamic, trust_pickle)
    report = inspect_graph(graph)
    if dot_file:
        write_text_atomic(dot_file, to_dot(graph), fmt="dot")
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
@click.option("--json", "as_json", is_flag=True, help="Print the list as JSON (name, input shape, summary).")
def models_list(as_json: bool) -> None:
    """List zoo models with their default input shapes."""
    from mlcomp import models

    if as_json:
        click.echo(json.dumps([{"name": name, "input_shape": [1, *z.input_shape], "summary": z.summary}
                               for name, z in models.ZOO.items()], indent=2))
        return
    width = max(len(n) for n in models.ZOO)
    for name, z in models.ZOO.items():
        shape = "x".join(str(s) for s in (1, *z.input_shape))
        click.echo(f"{name:<{width}}  {shape:<14} {z.summary}")


@models_group.command("save")
@click.argument("name")
@click.option("--format", "fmt", type=click.Choice(["torchscript", "pt2"]), required=True,
              help="torchscript (a traced .pt archive) or pt2 (a torch.export ExportedProgram).")
@click.option("-o", "--output", required=True, type=click.Path(), help="File to write.")
@click.option("--batch", type=click.IntRange(min=1), default=1, show_default=True,
              help="Batch size of the example input recorded in the file.")
@click.option("--dynamic-batch", is_flag=True,
              help="pt2: export with the batch dimension symbolic (torch.export.Dim), so the file runs at any batch.")
@click.option("--force", is_flag=True, help="Replace an earlier mlcomp output at -o (never a user's file).")
def models_save(name: str, fmt: str, output: str, batch: int, dynamic_batch: bool = False,
                force: bool = False) -> None:
    """Write zoo model NAME as a TorchScript archive or an ExportedProgram."""
    from mlcomp import models
    from mlcomp.api import check_model_inputs
    from mlcomp.base.files import atomic_path
    from mlcomp.frontend.loading import save_torchscript

    check_destination(output, Kind.FILE, fmt=fmt, force=force)
    check_model_inputs(name, (), batch)
    z = models.get(name)
    module, inputs = z.build(), z.example_inputs(batch)
    if dynamic_batch and fmt != "pt2":
        raise click.UsageError("--dynamic-batch applies to --format pt2 (a traced TorchScript file fixes its shapes)")
    if dynamic_batch and batch == 1:
        raise click.UsageError("--dynamic-batch needs an example --batch of 2 or more (torch.export specialises "
                               "a size of 1)")
    with atomic_path(output, fmt) as tmp:
        if fmt == "torchscript":
            save_torchscript(module, inputs, tmp)
        else:
            import torch

            from mlcomp.base.quiet import quiet_torch

            dims = None
            if dynamic_batch:
                size = torch.export.Dim("batch", min=1, max=4096)
                dims = tuple({0: size} if t.dim() > 0 else {} for t in inputs)
            try:
                with quiet_torch():
                    program = torch.export.export(module, inputs, dynamic_shapes=dims)
            except Exception as exc:  # noqa: BLE001 - a zoo model whose code fixes its batch size
                if not dynamic_batch:
                    raise
                raise MlcompError(f"zoo model {name} cannot be exported with a dynamic batch: "
                                  f"{str(exc).strip().splitlines()[0]}", hint="save it without --dynamic-batch") from None
            torch.export.save(program, tmp)
    click.echo(f"wrote {output} ({fmt}, input {'x'.join(map(str, inputs[0].shape))}"
               + (", batch dynamic" if dynamic_batch else "") + ")")

