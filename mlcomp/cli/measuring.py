"""What ``mlcomp bench``, ``mlcomp report`` and ``mlcomp study`` share: option callbacks, checks made
before anything is measured (targets, pipeline, .pt2 batches, output files), the timing and --force
options, the progress display and output writing.
"""
from __future__ import annotations

from typing import Any

import click

from mlcomp.base.files import Kind, check_destination
from mlcomp.base.progress import Progress
from mlcomp.cli.main import checked_threads
from mlcomp.cli.passes import resolve_pipeline
from mlcomp.hardware.timing import BenchConfigError

__all__ = [
    "int_list", "name_list", "command_progress", "set_threads", "write_output", "check_outputs",
    "force_option", "pt2_batch", "check_pt2_batches", "checked_pipeline", "check_targets", "timing_options",
    "comparison_options", "comparison_config",
]


def int_list(ctx: click.Context, param: click.Parameter, value: str | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    try:
        out = tuple(int(v) for v in value.split(",") if v.strip())
    except ValueError:
        raise click.BadParameter(f"{value!r} is not a comma-separated list of integers, e.g. 1,32") from None
    if not out or any(v < 1 for v in out):
        raise click.BadParameter(f"{value!r}: give positive integers, e.g. 1,32")
    return out


def name_list(ctx: click.Context, param: click.Parameter, value: str) -> tuple[str, ...]:
    return tuple(dict.fromkeys(v.strip() for v in value.split(",") if v.strip()))


def command_progress(flag: bool, *, machine_output: bool = False) -> Progress:
    """The command's progress: a live line on a terminal (or with --progress), else a log line per stage."""
    return Progress.for_command(machine_output=machine_output, live=True if flag else None)


def set_threads(threads: int | None) -> None:
    if threads is not None:
        if threads < 1:
            raise BenchConfigError(f"--threads {threads} is not positive")
        import torch

        torch.set_num_threads(threads)


# each file option -> the format it writes (mlcomp.base.marks.FORMATS)
_OPTION_FORMATS = {"json": "json", "csv": "csv", "plot": "png"}


def write_output(dest: str | None, fmt: str, text: str) -> None:
    """``-``: stdout; otherwise an atomically written file, marked as ``fmt``."""
    if dest == "-":
        click.echo(text.rstrip("\n"))
    elif dest:
        from mlcomp.base.files import write_text_atomic

        write_text_atomic(dest, text, fmt)
        click.echo(f"wrote {dest}", err=True)


def check_outputs(force: bool, inputs: tuple[str, ...] = (), **dests: str | list[str] | None) -> None:
    """Every file destination (``--json FILE`` …) checked before any measuring; ``-`` is stdout."""
    for option, dest in dests.items():
        for path in dest if isinstance(dest, list) else [dest]:
            if path and path != "-":
                check_destination(path, Kind.FILE, option="--" + option, fmt=_OPTION_FORMATS[option],
                                  force=force, inputs=inputs)


force_option = click.option("--force", is_flag=True,
                             help="Replace earlier mlcomp outputs at --json/--csv/--plot (never a user's file).")


def pt2_batch(path: str) -> tuple[int, str] | None:
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


def check_pt2_batches(models: tuple[str, ...], batches: tuple[int, ...]) -> None:
    """A .pt2 runs only at the batch it was exported for (unless exported with a dynamic batch)."""
    import os

    for model in models:
        if not (model.endswith(".pt2") and os.path.isfile(model)):
            continue
        found = pt2_batch(model)
        if found is None:
            continue
        batch, shape = found
        wrong = [b for b in batches if b != batch]
        if wrong:
            raise BenchConfigError(f"{model} was exported for batch {batch} (input {shape}); --batch "
                                   f"{','.join(map(str, wrong))} cannot run it",
                                   hint=f"give --batch {batch}, or export the model again with a dynamic batch")


def checked_pipeline(pipeline: str | None, opt_level: str | None) -> str:
    """-p/-O (default -O2) parsed before any model is loaded, so a bad spec fails first."""
    from mlcomp.pipeline import Pipeline

    text = resolve_pipeline(pipeline, opt_level)
    Pipeline.coerce(text)
    return text


def check_targets(targets: tuple[str, ...]) -> None:
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
        click.option("--threads", type=click.IntRange(min=1), default=None, callback=checked_threads,
                     help="Intra-op threads for eager torch and every compiled runtime (default: each one's own)."),
        click.option("--progress", "show_progress", is_flag=True,
                     help="Show the live progress line on stderr even when it is not a terminal (otherwise "
                          "a plain line per stage is logged)."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def comparison_options(fn: Any) -> Any:
    """How a comparison (eager and the targets, timed in rotated rounds) is run: in worker processes or
    here, when it may stop early, and whether it first waits for a quiet machine."""
    opts = [
        click.option("--in-process", is_flag=True,
                     help="Time every variant in this process (default: a worker process each, as deployed, "
                          "so no two runtimes' thread pools compete)."),
        click.option("--precision", type=click.FloatRange(0, 1, max_open=True), default=0.03, show_default=True,
                     help="Stop timing once every speedup's 95%% interval is within +-this (0: spend the budget)."),
        click.option("--settle", "settle_s", type=click.FloatRange(min=0), default=0.0, show_default=True,
                     metavar="SECONDS", help="Before each comparison wait up to SECONDS for the machine to be "
                                             "quiet (no other load on the cores this run needs, no steal)."),
        click.option("--procs", type=click.IntRange(1, 4), default=1, show_default=True, metavar="N",
                     help="Worker processes per variant (1-4): each runtime timed in N processes, every round "
                          "taking a sample of each; the table adds each process's median and their gap (one "
                          "runtime can differ between two processes by tens of per cent on a VM)."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def comparison_config(in_process: bool, precision: float, settle_s: float, procs: int = 1) -> dict[str, Any]:
    """The :class:`~mlcomp.measure.bench.BenchConfig` fields of :func:`comparison_options`."""
    return {"isolate": not in_process, "precision": precision or None, "settle_s": settle_s, "procs": procs}
