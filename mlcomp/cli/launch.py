"""``mlcomp launch``: run a distributed artifact on this host with torchrun.

    $ mlcomp compile resnet18 --target distributed -p "partition{stages=2}" -o out/r18-pp
    $ mlcomp launch out/r18-pp --nproc 2 --check              # torchrun on this host, gloo on CPU

``launch`` is a thin wrapper over ``torchrun`` (``python -m torch.distributed.run``
… ``-m mlcomp.targets.distributed.launch ARTIFACT``); for several hosts run torchrun with
``--nnodes``/``--node-rank``/``--master-addr`` yourself, same arguments.
"""
from __future__ import annotations

from pathlib import Path

import click

from mlcomp.analysis.parallel.pipeline_schedule import Schedule
from mlcomp.runtime.optim import OptimizerSpec
from mlcomp.targets.distributed.supervise import LaunchError, launch_plan, supervise
from mlcomp.targets.distributed.target import DEFAULT_OPTIMIZER, check_artifact, torchrun_command

__all__ = ["launch_cmd"]


@click.command("launch")
@click.argument("artifact", type=click.Path(path_type=Path))
@click.option("--nproc", type=click.IntRange(min=1), default=None, help="Processes (default: one per stage).")
@click.option("--schedule", type=click.Choice([s.value for s in Schedule]), default=None,
              help="Schedule (default: the artifact's).")
@click.option("--microbatches", type=click.IntRange(min=1), default=None,
              help="Microbatches per batch (default: the artifact's, one per stage).")
@click.option("--train", is_flag=True, help="Run one training step (loss on the last stage, an optimizer step "
                                              "per stage).")
@click.option("--optimizer", default=None,
              help=f'With --train: an optimizer spec, e.g. "adam{{lr=1e-3}}" (default "{DEFAULT_OPTIMIZER}").')
@click.option("--check", is_flag=True, help="Compare with a single-process run of the same stages.")
@click.option("--repeat", type=click.IntRange(min=0), default=0, help="Time this many more batches.")
def launch_cmd(artifact: Path, nproc: int | None, schedule: str | None, microbatches: int | None, train: bool,
               optimizer: str | None, check: bool, repeat: int) -> None:
    """Run a distributed artifact on this host with torchrun (gloo on CPU, NCCL on GPU)."""
    spec = OptimizerSpec.parse(optimizer) if optimizer is not None else None     # refused before any process
    manifest = check_artifact(artifact)
    nproc = nproc or int(manifest.get("runtime_info", {}).get("stages", 1))
    launch_plan(manifest, nproc, schedule=schedule, microbatches=microbatches)     # before any process starts
    extra = [*(["--schedule", schedule] if schedule else []),
             *(["--microbatches", str(microbatches)] if microbatches else []),
             *(["--train"] if train else []), *(["--check"] if check else []),
             *(["--optimizer", spec.text()] if spec is not None else []),
             *(["--repeat", str(repeat)] if repeat else [])]
    outcome = supervise(torchrun_command(artifact, nproc, extra=extra))     # Ctrl-C: ranks stopped, re-raised
    if outcome.stdout.strip():
        click.echo(outcome.stdout.rstrip("\n"))
    if outcome.code:
        error = LaunchError(outcome.message(f"the {nproc}-process launch of {artifact}"))
        error.exit_code = outcome.rank_exit_code() if outcome.rank_exit_code() in (2, 3, 4) else 3
        raise error
