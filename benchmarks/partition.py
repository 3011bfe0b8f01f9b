"""Pipeline partition benchmark: the DP's cut vs an even split by node count, predicted vs measured.

    .venv/bin/python benchmarks/partition.py                    # probe + all models, 2 and 4 stages
    .venv/bin/python benchmarks/partition.py --links            # only the link / schedule-overhead probe
    .venv/bin/python benchmarks/partition.py --models deep_mlp --stages 2 --json out.json

1. The probe (:class:`mlcomp.hardware.link.LinkProbe`, two gloo processes):
   per-message latency and bandwidth (ping-pong 4 KiB … 16 MiB), the schedule's
   fixed cost per (microbatch, stage) and per batch (an empty 2-stage pipeline
   at two microbatch counts), and the cores this process may use.
2. Per model, node times are measured at the microbatch size with one thread
   (what each torchrun process gets), the cost table uses them and the measured
   link, and the DP cuts the graph into S stages.  The same graph cut evenly
   by node count (what a user does by hand) is the baseline.  For both: the
   predicted stage times, max/mean balance, the simulated 1F1B schedule with
   compute (CPU seconds per node, measured in graph order on one thread) +
   overhead + communication events on the probed cores, sends that block as
   the probed link does (gloo: until the receive is posted) where the schedule
   waits for them, at the speed the host's load leaves each rank (other
   processes' busy cores from ``/proc/stat``, just before each launch; nothing
   spins while it runs), for as many back-to-back batches as the measurement
   times (bubble fraction, throughput, peak memory per stage), and the measured
   throughput of ``mlcomp.targets.distributed.launch`` on S gloo processes (inference, M
   microbatches).  ``pred_compute_only`` is what the model without overhead or
   cores predicts, ``pred_buffered`` the model with sends that never block;
   ``background`` / ``background_after`` the busy cores before / after the
   launch; ``pred_cpu_ms`` and ``meas_cpu_ms`` are each rank's CPU per batch
   (the model's work against the processes' CPU time), ``got_share`` the mean
   share of a core a rank got.

The machine has 2 cores: with 4 processes they are oversubscribed; the
simulator serialises compute beyond the probed core count.

Idle 2-core EPYC, 2026-11-24 (probe: 193 us latency, 3.2 GB/s, rendezvous sends),
4 microbatches of 4, 1F1B, inference; batches/s, pred ÷ meas::

    model        S  cut   balance  predicted  measured  pred/meas
    transformer  2  dp    1.004    6.73       7.37      0.91
    transformer  2  even  1.007    6.63       7.40      0.90
    transformer  4  dp    1.013    6.76       5.94      1.14
    transformer  4  even  1.003    6.65       6.34      1.05
    resnet18     2  dp    1.034    7.72       7.94      0.97
    resnet18     2  even  1.033    7.71       7.88      0.98
    resnet18     4  dp    1.062    7.85       7.23      1.09
    resnet18     4  even  1.062    7.85       7.19      1.09
    deep_mlp     2  dp    1.001    40.82      33.59     1.22
    deep_mlp     2  even  1.003    40.79      36.46     1.12
    deep_mlp     4  dp    1.022    37.85      32.30     1.17
    deep_mlp     4  even  1.025    37.84      32.69     1.16
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from mlcomp.analysis.parallel.pipeline_schedule import Schedule, simulate
from mlcomp.analysis.parallel.placement_cost import PlacementCost, measure_node_times
from mlcomp.frontend.loading import load_model
from mlcomp.hardware.link import LinkProbe, LinkProfile, background_now
from mlcomp.models import ZOO
from mlcomp.passes.placement.partition import even_cuts, plan_of, solve
from mlcomp.targets.distributed.target import DistributedTarget, launch_check

def deep_mlp() -> nn.Module:
    widths = [512, 1024, 256, 2048] * 8 + [512]
    layers: list[nn.Module] = []
    for a, b in zip(widths, widths[1:]):
        layers += [nn.Linear(a, b), nn.ReLU()]
    torch.manual_seed(0)
    return nn.Sequential(*layers).eval()


MODELS = {
    "transformer": (lambda: ZOO["transformer"].build(), lambda b: ZOO["transformer"].example_inputs(b)),
    "resnet18": (lambda: ZOO["resnet18"].build(), lambda b: ZOO["resnet18"].example_inputs(b)),
    "deep_mlp": (deep_mlp, lambda b: (torch.randn(b, 512, generator=torch.Generator().manual_seed(1)),)),
}


def one_thread_times(graph: Any, inputs: Any) -> dict[str, float]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return measure_node_times(graph, inputs, repeats=7, clock=time.thread_time)
    finally:
        torch.set_num_threads(before)


def run_cut(name: str, graph: Any, module: nn.Module, pc: PlacementCost, cuts: tuple[int, ...], micro: int,
            mb_inputs: Any, repeat: int, prof: LinkProfile, launch: bool = True) -> dict[str, Any]:
    stages = len(cuts) + 1
    plan = plan_of(pc, cuts, backward=0.0, flight=lambda s: 1)
    bounds = [0, *cuts, pc.n]
    compute = [pc.compute_seconds(bounds[s], bounds[s + 1]) for s in range(stages)]
    common = dict(microbatches=micro, schedule=Schedule.ONE_F_ONE_B, transfer=[pc.transfer_seconds(c) for c in cuts],
                  param_bytes=[pc.param_bytes(bounds[s], bounds[s + 1]) for s in range(stages)],
                  activation_bytes=[pc.activation_bytes(bounds[s], bounds[s + 1]) for s in range(stages)])
    # the host's load now: other processes' busy cores (/proc/stat; nothing spins meanwhile)
    background = background_now(prof.cores, 0.5)
    speed = prof.speed(stages, background)
    tl = simulate(compute, overhead=prof.op_overhead, step_overhead=prof.step_overhead, cores=prof.cores,
                  batches=repeat, speed=speed, rendezvous=prof.rendezvous, **common)
    buffered = simulate(compute, overhead=prof.op_overhead, step_overhead=prof.step_overhead, cores=prof.cores,
                        batches=repeat, speed=speed, **common)       # the model before: sends never block
    bare = simulate(compute, **common)          # compute + transfers, one batch
    staged = graph.copy()
    for node, s in pc.node_stage(cuts).items():
        staged.replace(staged.node(node).with_ann(stage=s))
    predicted = 1.0 / tl.batch_seconds
    row = {"model": name, "stages": stages, "cuts": list(cuts),
           "stage_ms": [round(t * 1e3, 3) for t in plan.stage_times], "balance": round(plan.balance, 3),
           "pred_compute_only": round(bare.throughput / micro, 2), "pred_buffered": round(1 / buffered.batch_seconds, 2),
           "predicted_batches_s": round(predicted, 2), "bubble": round(tl.bubble_fraction, 3),
           "background": round(background, 2), "speed": round(speed, 3),
           "peak_mem_MiB": [round(b / 2**20, 2) for b in tl.peak_memory]}
    if not launch:
        return row
    art = DistributedTarget(check_launch=False, microbatches=micro).compile(staged)
    with torch.no_grad():
        art.set_reference(mb_inputs, (module(*mb_inputs),))
    with tempfile.TemporaryDirectory() as tmp:
        folder = art.save(Path(tmp) / "art")
        result = launch_check(folder, stages, microbatches=micro, repeat=repeat)
    measured = 1.0 / result["seconds_per_batch"]
    after = background_now(prof.cores, 0.5)
    # CPU seconds per batch per rank: what the model says each rank works (compute + overhead on a core of
    # its own) against what each rank's process used; CPU / wall is the share of a core it got
    pred_cpu = [b * speed / repeat for b in tl.busy]
    meas_cpu = result["cpu_seconds_per_batch"]
    return dict(row, measured_batches_s=round(measured, 2), pred_over_meas=round(predicted / measured, 3),
                background_after=round(after, 2),
                pred_cpu_ms=[round(c * 1e3, 1) for c in pred_cpu], meas_cpu_ms=[round(c * 1e3, 1) for c in meas_cpu],
                got_share=round(sum(meas_cpu) / result["seconds_per_batch"] / stages, 3),
                passed=result["passed"], load=round(os.getloadavg()[0], 1))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--links", action="store_true", help="only measure the link")
    ap.add_argument("--models", nargs="*", default=list(MODELS))
    ap.add_argument("--stages", nargs="*", type=int, default=[2, 4])
    ap.add_argument("--micro", type=int, default=4, help="microbatches per batch")
    ap.add_argument("--mb-size", type=int, default=4, help="samples per microbatch")
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--predict-only", action="store_true", help="no launches: predictions only")
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    prof = LinkProbe().result
    print(prof.format(), flush=True)
    if args.links:
        return 0
    rows = []
    for name in args.models:
        build, inputs_of = MODELS[name]
        module = build()
        mb_inputs = inputs_of(args.mb_size)
        graph = load_model(module, example_inputs=mb_inputs).capture()
        pc = PlacementCost.of(graph, link=prof.link, times=one_thread_times(graph, mb_inputs))
        for stages in args.stages:
            for label, cuts in (("dp", solve(pc, stages).cuts), ("even", even_cuts(pc.n, stages))):
                row = run_cut(name, graph, module, pc, tuple(cuts), args.micro, mb_inputs, args.repeat, prof,
                              launch=not args.predict_only)
                row["cut"] = label
                rows.append(row)
                print(json.dumps(row), flush=True)
    cols = ["model", "stages", "cut", "stage_ms", "balance", "bubble", "peak_mem_MiB", "pred_compute_only",
            "pred_buffered", "background", "predicted_batches_s", "measured_batches_s", "pred_over_meas",
            "background_after", "got_share", "pred_cpu_ms", "meas_cpu_ms", "load"]
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "-")) for c in cols) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"probe": prof.to_json(), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
