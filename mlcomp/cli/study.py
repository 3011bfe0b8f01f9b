"""``mlcomp study``: run one of the chapter's experiments (registered lazily in :mod:`mlcomp.cli.main`).

    mlcomp study hybridize
    mlcomp study roofline --model resnet18 --plot roofline.png
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from mlcomp.cli.main import checked_threads
from mlcomp.cli.measuring import check_outputs, force_option, name_list, set_threads, write_output

__all__ = ["study_cmd"]


@click.command("study")
@click.argument("name", required=False)
@click.option("--quick", is_flag=True, help="Tiny sizes: a smoke run in seconds (figures are not meaningful).")
@click.option("--device", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
              help="Where the study runs: auto picks cuda when a GPU is available, else cpu.")
@click.option("--budget", type=float, default=0.5, show_default=True, help="Seconds of timing per measurement.")
@click.option("--targets", default="cpu,onnxruntime,tvm", show_default=True, callback=name_list,
              help="hybridize: comma-separated compiled targets to compare with eager.")
@click.option("--model", default=None, help="roofline: the model whose ops are placed (default resnet18; "
                                             "mlp with --quick).")
@click.option("--batch", type=int, default=1, show_default=True, help="roofline: batch size.")
@click.option("--threads", type=click.IntRange(min=1), default=None, callback=checked_threads,
              help="Intra-op threads for torch (and, in hybridize, every compiled runtime).")
@click.option("--json", "json_out", is_flag=False, flag_value="-", default=None, metavar="[FILE]",
              help="Write the result as JSON (to stdout when no FILE).")
@click.option("--plot", "plot_file", type=click.Path(), default=None,
              help="PNG of the study (with NAME=all: one file per study, suffixed with its name).")
@force_option
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
    check_outputs(force, json=json_out, plot=plots)
    set_threads(threads)
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
    write_output(json_out, "json", json.dumps(payload, indent=2, default=str))


def _suffixed(path: str, key: str) -> str:
    p = Path(path)
    return str(p.with_name(f"{p.stem}-{key}{p.suffix or '.png'}"))
