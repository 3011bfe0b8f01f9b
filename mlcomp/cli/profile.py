"""``mlcomp profile``: measure every node's time on this machine (for ``mlcomp partition --times``).

    $ mlcomp profile resnet18 --batch 8 -o r18-times.json          # measured seconds per node
"""
from __future__ import annotations

import json

import click

from mlcomp.analysis.parallel.placement_cost import measure_node_times
from mlcomp.base.files import Kind, check_destination, write_text_atomic
from mlcomp.cli.main import load_and_capture, model_options

__all__ = ["profile_cmd"]


@click.command("profile")
@model_options
@click.option("-o", "--output", type=click.Path(), required=True, help="JSON file of seconds per node.")
@click.option("--repeats", type=click.IntRange(min=1), default=5, show_default=True,
              help="Timed runs per node (the median is kept).")
@click.option("--force", is_flag=True, help="Replace an earlier mlcomp output at -o (never a user's file).")
def profile_cmd(model: str, input_shapes: tuple[str, ...], batch: int | None, capture_method: str,
                dynamic: str | None, trust_pickle: bool, output: str, repeats: int, force: bool = False) -> None:
    """Measure every node's time on this machine (for `mlcomp partition --times`)."""
    check_destination(output, Kind.FILE, fmt="json", force=force, inputs=(model,))
    source, graph = load_and_capture(model, input_shapes, batch, capture_method, dynamic, trust_pickle)
    seconds = measure_node_times(graph, source.inputs(), repeats=repeats)
    write_text_atomic(output, json.dumps({"model": graph.name, "repeats": repeats, "seconds": seconds}, indent=1),
                      "json")
    click.echo(f"{len(seconds)} node times of {graph.name} ({sum(seconds.values()) * 1e3:.2f} ms in all) "
               f"written to {output}")
