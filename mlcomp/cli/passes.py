"""``mlcomp passes`` and the pipeline options other commands share.

``mlcomp passes`` lists every registered pass with its options (type, default,
one-line help), what each composite runs (``cleanup``, ``fuse``), the graph
modes a pass is limited to, and the ``-O`` presets.  Commands that run a pipeline (``compile``
and friends) take the same options through :func:`pipeline_options` and turn
them into a :class:`PipelineRequest` with :func:`pipeline_from_cli`::

    @click.command()
    @pipeline_options
    def compile_cmd(..., pipeline, opt_level, dump_after, dump_dir, verify_passes, explain):
        request = pipeline_from_cli(pipeline, opt_level, dump_after, dump_dir, verify_passes, explain)
        graph, report = request.run(graph, example_inputs=inputs)   # instruments from the flags
        if request.explain:
            click.echo(report.format(nested=True))
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import click

from mlcomp.base.errors import PipelineSpecError

__all__ = [
    "DEFAULT_PIPELINE",
    "TOML_EXAMPLE",
    "PipelineRequest",
    "passes_cmd",
    "pipeline_from_cli",
    "pipeline_options",
    "preset_options",
    "resolve_pipeline",
]

# The pipeline every command runs when neither -p nor -O is given (compile, export, bench, report).
DEFAULT_PIPELINE = "-O2"

# The TOML pipeline format, as `mlcomp passes --help` and the README show it (tests/integration/test_cli_options.py
# parses this text, and the README's copy of it, with Pipeline.from_toml_text).
TOML_EXAMPLE = """\
target = "onnxruntime"        # optional: the target when --target is not given
[[passes]]
name = "cleanup"
[[passes]]
name = "fuse"
max_group_size = 16           # any option `mlcomp passes` lists, with its type
"""


@click.command("passes", epilog="A pipeline file (-p my.toml) is TOML: an optional target, then one [[passes]] "
                                "table per pass with its name and options, in order:\n\n\b\n"
                                + "\n".join("    " + line for line in TOML_EXAMPLE.splitlines())
                                + "\n\nInstead of [[passes]] a file may give the inline form: "
                                  'pipeline = "cleanup,fuse{max_group_size=16}"; a [[passes]] name may be a '
                                  "preset (-O2). Unknown keys, passes and options are refused with the list "
                                  "of known ones.")
@click.option("--json", "as_json", is_flag=True, help="Print passes and presets as JSON.")
def passes_cmd(as_json: bool) -> None:
    """List the passes a pipeline can name, their options, and the -O presets.

    A pipeline is written inline (-p "cleanup,fuse{max_group_size=16}"), as a
    preset (-O0 .. -O3; -O2 is the default), or as a TOML file (-p file.toml).
    """
    from mlcomp.pipeline import PRESETS
    from mlcomp.pipeline.composite import CompositePass, children, describe
    from mlcomp.pipeline.pass_base import REGISTRY

    infos = REGISTRY.infos()
    bodies = {i.name: i.make({}).body() for i in infos if issubclass(i.cls, CompositePass)}
    if as_json:
        click.echo(json.dumps({
            "passes": [{"name": i.name, "summary": i.summary,
                        "modes": sorted(m.value for m in i.cls.modes),
                        "requires": sorted(r.value for r in i.cls.requires),
                        "children": [s.pass_.name for s in children(bodies[i.name])] if i.name in bodies else None,
                        "options": [
                {"name": o.name, "type": o.type_text(), "default": o.format_value(o.default), "help": o.help}
                for o in i.options]} for i in infos],
            "presets": {f"-{k}": v for k, v in PRESETS.items()}, "default": DEFAULT_PIPELINE}, indent=2))
        return
    click.echo('passes (write a pipeline as -p "name,name{option=value,...}"):')
    width = max(len(i.name) for i in infos)
    for info in infos:
        limits = [f"on {' and '.join(sorted(m.value for m in info.cls.modes))} graphs only"
                  ] if len(info.cls.modes) == 1 else []
        limits += [f"needs {r.value}" for r in sorted(info.cls.requires, key=lambda r: r.value)]
        click.echo(f"  {info.name:<{width}}  {info.summary}")
        if limits:
            click.echo(f"  {'':<{width}}    runs {'; '.join(limits)}")
        if info.name in bodies:
            click.echo(f"  {'':<{width}}    runs: {describe(bodies[info.name])}")
        if info.options:
            cols = [(o.name, o.type_text(), o.format_value(o.default)) for o in info.options]
            w0 = max(len(c[0]) for c in cols)
            w1 = max(len(c[1]) for c in cols)
            w2 = max(len(c[2]) for c in cols)
            for (name, typ, default), opt in zip(cols, info.options):
                click.echo(f"  {'':<{width}}    {name:<{w0}}  {typ:<{w1}}  = {default:<{w2}}  {opt.help}")
    click.echo("presets:")
    for name, spec in PRESETS.items():
        default = "   (the default, adapted to the target)" if f"-{name}" == DEFAULT_PIPELINE else ""
        click.echo(f"  -{name}  {spec or '(no passes)'}{default}")


# ---------------------------------------------------------------------------
# Shared options


def preset_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Click options every command that runs a pipeline shares: -p/--pipeline and -O0..-O3.

    Turn the two values into the pipeline text with :func:`resolve_pipeline`.
    """
    opts = [
        click.option("-p", "--pipeline", default=None, metavar="SPEC|FILE.toml",
                     help='Passes to run, e.g. "cleanup,fuse{max_group_size=16}", a preset "-O2" or a TOML '
                          f"file (see `mlcomp passes --help`). Default: {DEFAULT_PIPELINE}."),
        click.option("-O", "opt_level", type=click.Choice(["0", "1", "2", "3"]), default=None,
                     help=f"Preset pipeline -O0 (no passes) .. -O3, adapted to the target; instead of -p. "
                          f"Default: {DEFAULT_PIPELINE}."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return fn


def resolve_pipeline(pipeline: str | None, opt_level: str | None, *,
                     default: str | None = DEFAULT_PIPELINE) -> str | None:
    """The pipeline text for -p/-O (``-O2`` stays a preset name, so it adapts to the target).

    ``-p`` and ``-O`` exclude each other; with neither, ``default``.

        >>> resolve_pipeline(None, "1"), resolve_pipeline("dce", None), resolve_pipeline(None, None)
        ('-O1', 'dce', '-O2')
    """
    if pipeline is not None and opt_level is not None:
        raise PipelineSpecError(f"both -p {pipeline!r} and -O{opt_level} were given",
                                hint="use one: a preset (-O0..-O3) or an explicit pipeline (-p)")
    if opt_level is not None:
        return f"-O{opt_level}"
    return pipeline if pipeline is not None else default


def pipeline_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Click options: :func:`preset_options` plus --dump-after, --dump-dir, --verify, --explain."""
    opts = [
        click.option("--dump-after", default=None, metavar="PASS|all",
                     help="Write the IR (text and dot) after this pass, at any depth (comma-separated; "
                          "'fuse.fold-bias' for one composite's child; 'all' for every top-level pass)."),
        click.option("--dump-dir", default="mlcomp-dump", show_default=True, type=click.Path(file_okay=False),
                     help="Folder for --dump-after."),
        click.option("--verify", "verify_passes", is_flag=True,
                     help="Check every pass against the input graph; name the innermost pass and the first "
                          "node that change the numbers."),
        click.option("--explain", is_flag=True,
                     help="Print what each pass changed: nodes, ops, fusion groups, bytes, modules."),
    ]
    for opt in reversed(opts):
        fn = opt(fn)
    return preset_options(fn)


@dataclass(frozen=True)
class PipelineRequest:
    """A pipeline and the instruments asked for on the command line."""

    pipeline: Any                 # mlcomp.pipeline.spec.Pipeline
    verify: bool = False
    dump_after: str | None = None
    dump_dir: str | None = None
    explain: bool = False
    text: str | None = None       # as given (-O2 stays a preset name, adapted to the target later)

    def instruments(self) -> list[Any]:
        """The pass manager's instruments for these flags (IR check and timing always)."""
        from mlcomp.pipeline import standard_instruments

        return standard_instruments(verify=self.verify, dump_after=self.dump_after,
                                    dump_dir=self.dump_dir if self.dump_after else None, explain=self.explain)

    def check_dump_dir(self, force: bool, inputs: Sequence[str] = ()) -> None:
        """The --dump-dir folder obeys the output rule (:mod:`mlcomp.base.files`), checked before any work."""
        if self.dump_after and self.dump_dir is not None:
            from mlcomp.base.files import Kind, check_destination

            check_destination(self.dump_dir, Kind.DIR, force=force, option="--dump-dir", inputs=inputs)

    def run(self, graph: Any, example_inputs: Sequence[Any] | None = None) -> tuple[Any, Any]:
        from mlcomp.pipeline import run_pipeline

        return run_pipeline(graph, self.pipeline, example_inputs=example_inputs, instruments=self.instruments())


def pipeline_from_cli(pipeline: str | None = None, opt_level: str | None = None, dump_after: str | None = None,
                      dump_dir: str | None = "mlcomp-dump", verify_passes: bool = False, explain: bool = False,
                      *, default: str | None = DEFAULT_PIPELINE) -> PipelineRequest:
    """The :class:`PipelineRequest` for the values :func:`pipeline_options` parsed.

    ``-p`` and ``-O`` exclude each other; with neither, ``default`` (a preset name
    or pipeline text, None for no passes) is used.
    """
    from mlcomp.pipeline import Pipeline

    text = resolve_pipeline(pipeline, opt_level, default=default)
    return PipelineRequest(Pipeline.coerce(text), verify_passes, dump_after, dump_dir, explain, text)
