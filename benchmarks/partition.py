"""Pipeline partition benchmark: the DP's cut vs an even split by node count, predicted vs measured.

    .venv/bin/python benchmarks/partition.py                    # links + all models, 2 and 4 stages
    .venv/bin/python benchmarks/partition.py --links            # only the gloo loopback link
    .venv/bin/python benchmarks/partition.py --models deep_mlp --stages 2 --json out.json

1. The link: two processes (gloo over TCP loopback) send tensors of 4 KiB … 16 MiB
   back and forth; ``latency + bytes / bandwidth`` is fitted by least squares.
2. Per model, node times are measured at the microbatch size with one thread
   (what each torchrun process gets), the cost table uses them and the measured
   link, and the DP cuts the graph into S stages.  The same graph cut evenly
   by node count (what a user does by hand) is the baseline.  For both: the
   predicted stage times, max/mean balance, the simulated 1F1B schedule
   (bubble fraction, throughput, peak memory per stage) and the measured
   throughput of ``mlcomp.launch`` on S gloo processes (inference, M
   microbatches, median of timed batches).

The machine has 2 cores: with 4 processes they are oversubscribed, so the
4-stage measurements say how the schedule degrades, not what 4 cores would give.
"""
from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from mlcomp.analysis.pipeline_schedule import Schedule, simulate
from mlcomp.analysis.placement_cost import Link, PlacementCost, measure_node_times
from mlcomp.frontend.loading import load_model
from mlcomp.models import ZOO
from mlcomp.passes.partition import even_cuts, plan_of, solve
from mlcomp.targets.distributed import DistributedTarget, launch_check

SIZES = [1 << k for k in range(12, 25, 2)]     # 4 KiB … 16 MiB


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pingpong(rank: int, port: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    times = {}
    for size in SIZES:
        t = torch.zeros(size // 4)
        samples = []
        for _ in range(12):
            dist.barrier()
            start = time.perf_counter()
            if rank == 0:
                dist.send(t, 1)
                dist.recv(t, 1)
            else:
                dist.recv(t, 0)
                dist.send(t, 0)
            samples.append((time.perf_counter() - start) / 2)
        times[size] = statistics.median(samples[2:])
    if rank == 0:
        Path(out).write_text(json.dumps(times))
    dist.destroy_process_group()


def measure_link() -> Link:
    with tempfile.TemporaryDirectory() as tmp:
        out = str(Path(tmp) / "link.json")
        mp.spawn(_pingpong, args=(_free_port(), out), nprocs=2, join=True)
        times = {int(k): v for k, v in json.loads(Path(out).read_text()).items()}
    xs, ys = list(times), list(times.values())
    mx, my = statistics.mean(xs), statistics.mean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    latency = max(my - slope * mx, times[min(xs)] * 0.5)
    for size, t in times.items():
        print(f"  {size / 2**10:8.0f} KiB  {t * 1e6:9.1f} us  {size / t / 1e9:6.2f} GB/s")
    return Link("gloo over TCP loopback (measured)", 1.0 / slope, latency)


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
        return measure_node_times(graph, inputs, repeats=7)
    finally:
        torch.set_num_threads(before)


def run_cut(name: str, graph: Any, module: nn.Module, pc: PlacementCost, cuts: tuple[int, ...], micro: int,
            mb_inputs: Any, repeat: int, launch: bool = True) -> dict[str, Any]:
    stages = len(cuts) + 1
    plan = plan_of(pc, cuts, backward=0.0, flight=lambda s: 1)
    bounds = [0, *cuts, pc.n]
    tl = simulate(list(plan.stage_times), microbatches=micro, schedule=Schedule.ONE_F_ONE_B,
                  param_bytes=[pc.param_bytes(bounds[s], bounds[s + 1]) for s in range(stages)],
                  activation_bytes=[pc.activation_bytes(bounds[s], bounds[s + 1]) for s in range(stages)])
    staged = graph.copy()
    for node, s in pc.node_stage(cuts).items():
        staged.replace(staged.node(node).with_ann(stage=s))
    predicted = tl.throughput / micro
    row = {"model": name, "stages": stages, "cuts": list(cuts),
           "stage_ms": [round(t * 1e3, 3) for t in plan.stage_times], "balance": round(plan.balance, 3),
           "predicted_batches_s": round(predicted, 2), "bubble": round(tl.bubble_fraction, 3),
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
    return dict(row, measured_batches_s=round(measured, 2), pred_over_meas=round(predicted / measured, 3),
                passed=result["passed"])


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
    print("gloo loopback link (ping-pong, one direction):")
    link = measure_link()
    print(f"  fit: latency {link.latency * 1e6:.1f} us, bandwidth {link.bandwidth / 1e9:.2f} GB/s")
    if args.links:
        return 0
    rows = []
    for name in args.models:
        build, inputs_of = MODELS[name]
        module = build()
        mb_inputs = inputs_of(args.mb_size)
        graph = load_model(module, example_inputs=mb_inputs).capture()
        pc = PlacementCost.of(graph, link=link, times=one_thread_times(graph, mb_inputs))
        for stages in args.stages:
            for label, cuts in (("dp", solve(pc, stages).cuts), ("even", even_cuts(pc.n, stages))):
                row = run_cut(name, graph, module, pc, tuple(cuts), args.micro, mb_inputs, args.repeat,
                              launch=not args.predict_only)
                row["cut"] = label
                rows.append(row)
                print(json.dumps(row), flush=True)
    cols = ["model", "stages", "cut", "stage_ms", "balance", "predicted_batches_s", "measured_batches_s",
            "pred_over_meas", "bubble", "peak_mem_MiB"]
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(str(r.get(c, "-")) for c in cols) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps({"link": vars(link), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
