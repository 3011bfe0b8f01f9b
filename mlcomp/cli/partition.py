"""``mlcomp partition``: cut a model into pipeline stages, cost and simulate the schedule.

``mlcomp profile`` (:mod:`mlcomp.cli.profile`) measures the node times it reads; ``mlcomp launch``
(:mod:`mlcomp.cli.launch`) runs a distributed artifact.

    $ mlcomp profile resnet18 --batch 8 -o r18-times.json          # measured seconds per node
    $ mlcomp partition resnet18 --batch 8 --stages 4 --times r18-times.json --plot timeline.png
    stage  nodes  time ms  memory MiB  sends MiB
    0         17    5.133        0.60       0.25
    ...
    balance (slowest / mean) 1.145; simulated 1f1b, 4 microbatches: bubble 42.9%, 70.1 batches/s
    $ mlcomp partition deep.py:model --stages 4 --probe        # + measured link, schedule overhead, cores
    $ mlcomp compile resnet18 --target distributed -p "partition{stages=2}" -o out/r18-pp
    $ mlcomp launch out/r18-pp --nproc 2 --check              # torchrun on this host, gloo on CPU
"""
from __future__ import annotations

import json
from pathlib import Path

import click

from mlcomp.analysis.parallel.pipeline_schedule import Schedule, plot_timeline, simulate
from mlcomp.analysis.parallel.placement_cost import PlacementCost
from mlcomp.base.errors import MlcompError
from mlcomp.base.files import Kind, check_destination
from mlcomp.base.table import Table
from mlcomp.cli.main import load_and_capture, model_options
from mlcomp.hardware.link import LinkProbe
from mlcomp.passes.placement.partition import Objective, even_cuts, parse_bytes, plan_of, solve

__all__ = ["partition_cmd"]


def _read_times(path: str | None) -> dict[str, float] | None:
    if path is None:
        return None
    try:
        data = json.loads(Path(path).read_text())
        return {str(k): float(v) for k, v in data["seconds"].items()}
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise MlcompError(f"cannot read node times from {path}: {type(exc).__name__}: {exc}",
                          hint="write them with `mlcomp profile MODEL -o FILE`") from None


@click.command("partition")
@model_options
@click.option("--stages", type=click.IntRange(min=1), default=2, show_default=True, help="Pipeline stages.")
@click.option("--objective", type=click.Choice([o.value for o in Objective]), default="throughput",
              show_default=True, help="Minimise the slowest stage, the sum of stage times, or stage memory.")
@click.option("--microbatches", type=click.IntRange(min=1), default=4, show_default=True,
              help="Microbatches per batch (memory in flight, simulated schedule).")
@click.option("--schedule", type=click.Choice([s.value for s in Schedule]), default="1f1b", show_default=True,
              help="Pipeline schedule to cost and simulate.")
@click.option("--memory-limit", default=None, help="Bytes per stage (512MiB, 2GiB).")
@click.option("--training", is_flag=True, help="Cost forward and backward.")
@click.option("--times", "times_file", default=None, help="Per-node seconds from `mlcomp profile`.")
@click.option("--plot", "plot_file", type=click.Path(), default=None, help="Draw the simulated timeline (PNG).")
@click.option("--probe", is_flag=True, help="Measure the gloo link, the schedule's overhead and the cores "
              "here first (2 processes, seconds) and simulate with them.")
@click.option("--json", "as_json", is_flag=True, help="Print the plan as JSON.")
@click.option("--force", is_flag=True, help="Replace an earlier mlcomp output at --plot (never a user's file).")
def partition_cmd(model: str, input_shapes: tuple[str, ...], batch: int | None, capture_method: str,
                  dynamic: str | None, trust_pickle: bool, stages: int, objective: str, microbatches: int,
                  schedule: str, memory_limit: str | None, training: bool, times_file: str | None,
                  plot_file: str | None, probe: bool, as_json: bool, force: bool = False) -> None:
    """Cut MODEL into pipeline stages (exact DP) and simulate the schedule; nothing is compiled."""
    if plot_file:
        check_destination(plot_file, Kind.FILE, option="--plot", fmt="png", force=force,
                          inputs=(model, *([times_file] if times_file else [])))
    times = _read_times(times_file)
    _, graph = load_and_capture(model, input_shapes, batch, capture_method, dynamic, trust_pickle)
    prof = LinkProbe().result if probe else None
    pc = PlacementCost.of(graph, times=times, link=prof.link if prof else None)
    kind = Schedule(schedule)
    plan = solve(pc, stages, Objective(objective), training=training, microbatches=microbatches, schedule=kind,
                 memory_limit=parse_bytes(memory_limit))
    even = plan_of(pc, even_cuts(pc.n, stages), backward=2.0 if training else 0.0, flight=lambda s: 1)
    bounds = [0, *plan.cuts, pc.n]
    fwd = [pc.compute_seconds(bounds[s], bounds[s + 1]) for s in range(stages)]    # transfers are delays
    virtual = 2 if kind is Schedule.INTERLEAVED and stages % 2 == 0 and microbatches % (stages // 2) == 0 else 1
    tl = simulate(fwd, [2 * t for t in fwd] if training else None, microbatches=microbatches,
                  schedule=kind if virtual > 1 or kind is not Schedule.INTERLEAVED else Schedule.ONE_F_ONE_B,
                  virtual=virtual, param_bytes=[pc.param_bytes(bounds[s], bounds[s + 1]) for s in range(stages)],
                  activation_bytes=[pc.activation_bytes(bounds[s], bounds[s + 1]) for s in range(stages)],
                  transfer=[pc.transfer_seconds(c) for c in plan.cuts],
                  overhead=prof.op_overhead if prof else 0.0, step_overhead=prof.step_overhead if prof else 0.0,
                  cores=prof.cores if prof else None, speed=prof.speed(stages // virtual) if prof else 1.0,
                  rendezvous=prof.rendezvous if prof else False)
    rows = [[s, sum(len(pc.units[u]) for u in range(bounds[s], bounds[s + 1])), f"{plan.stage_times[s] * 1e3:.3f}",
             f"{plan.stage_memory[s] / 2**20:.2f}", f"{pc.cut_bytes[bounds[s + 1]] / 2**20:.3f}"]
            for s in range(stages)]
    facts = {"model": graph.name, "stages": stages, "cuts": list(plan.cuts),
             "stage_seconds": list(plan.stage_times), "stage_memory_bytes": list(plan.stage_memory),
             "balance": plan.balance, "even_split_balance": even.balance, "bubble_fraction": tl.bubble_fraction,
             "batches_per_second": tl.throughput / microbatches, "measured_times": times is not None,
             "probe": prof.to_json() if prof else None}
    if plot_file:
        plot_timeline(tl, plot_file, title=f"{graph.name}: {stages} stages, {kind.value}, {microbatches} microbatches")
    if as_json:
        click.echo(json.dumps(facts, indent=1))
        return
    click.echo(Table(f"{graph.name} in {stages} stages ({objective})",
                     ("stage", "nodes", "time ms", "memory MiB", "sends MiB"),
                     tuple(tuple(str(c) for c in r) for r in rows), right=frozenset({0, 1, 2, 3, 4})).format())
    click.echo(f"balance (slowest / mean) {plan.balance:.3f} (even split by node count: {even.balance:.3f}); "
               f"simulated {kind.value}, {microbatches} microbatches: bubble {tl.bubble_fraction:.1%}, "
               f"{tl.throughput / microbatches:.1f} batches/s")
    if prof:
        click.echo(prof.format())
    if plot_file:
        click.echo(f"timeline written to {plot_file}")
