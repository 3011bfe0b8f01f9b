"""Benchmark structured pruning: MACs saved against latency measured, per target.

    .venv/bin/python benchmarks/pruning.py                        # the four models, 0.25/0.5/0.75, batch 1 and 32
    .venv/bin/python benchmarks/pruning.py --models resnet18 --sparsities 0.5 --batches 32 --json out.json

For each model (zoo ResNet-18, the transformer, LeNet, the MobileNet-style model) and
batch, the model is captured once; ``prune{sparsity=s}`` is run at each sparsity
(batch 1 with ``--verify``: the pruned graph must equal its masked reference), and the
unpruned and pruned graphs are compiled for the ``cpu`` and ``onnxruntime`` targets and
timed *interleaved* (one sample of each per round) so that load drift on a shared
machine hits every variant alike.  ``--clock thread`` (the default) times the CPU time
of the calling thread with one thread everywhere, which is what a busy 2-core machine
can measure honestly; ``--clock wall`` times wall-clock.

Speedup is against the unpruned model through the same target.  Deviation is the
pruned output against the unpruned one on random inputs of the batch (relative L2
error, cosine, top-1 agreement).  Torch-Pruning (DepGraph, L2 magnitude importance,
the same ratios) prunes the ResNet-18 ``nn.Module`` in the same run; its rows are eager
PyTorch against eager PyTorch.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

warnings.filterwarnings("ignore")


@dataclass
class Row:
    model: str
    sparsity: float
    batch: int
    target: str
    latency_ms: float
    speedup: float | None = None
    macs_m: float | None = None
    macs_reduction: float | None = None
    params_k: float | None = None
    rel_error: float | None = None
    cosine: float | None = None
    top1: float | None = None
    masked_max_rel: float | None = None


def _time(fns: dict[str, Callable[[], Any]], clock: Callable[[], float], budget: float) -> dict[str, float]:
    from mlcomp.hardware.timing import TimingPolicy, measure_interleaved

    timings = measure_interleaved(fns, TimingPolicy(warmup=2, budget_s=budget, min_repeats=5), clock=clock)
    return {k: statistics.median(t.samples) * 1e3 for k, t in timings.items()}


def _compile(graph, target: str):
    from mlcomp.targets import CompileOptions, get_target

    return get_target(target).compile(graph, CompileOptions(threads=1))


def run_model(name: str, sparsities: list[float], batches: list[int], targets: list[str], clock, budget: float,
              rows: list[Row]) -> None:
    from mlcomp import models
    from mlcomp.frontend.capture import capture_module
    from mlcomp.pipeline import run_pipeline

    zoo = models.get(name)
    module = zoo.build()
    for batch in batches:
        inputs = zoo.example_inputs(batch)
        graph = capture_module(module, inputs, name=name)
        variants = {0.0: (graph, {})}
        for s in sparsities:
            out, report = run_pipeline(graph, f"prune{{sparsity={s}}}", example_inputs=inputs, verify=batch == 1)
            stats = dict(report.records[0].stats)
            stats["masked_max_rel"] = report.records[0].max_error if batch == 1 else None
            variants[s] = (out, stats)
        base_stats = variants[sparsities[0]][1]
        for target in targets:
            arts = {s: _compile(g, target) for s, (g, _) in variants.items()}
            lat = _time({str(s): (lambda a=a: a(*inputs)) for s, a in arts.items()}, clock, budget)
            for s, (g, st) in variants.items():
                rows.append(Row(name, s, batch, target, round(lat[str(s)], 3),
                                round(lat["0.0"] / lat[str(s)], 2),
                                round((st.get("macs_after") or base_stats["macs_before"]) / batch / 1e6, 2),
                                st.get("macs_reduction", 1.0),
                                round((st.get("params_after") or base_stats["params_before"]) / 1e3, 1),
                                st.get("output_rel_error"), st.get("output_cosine"), st.get("top1_agreement"),
                                st.get("masked_max_rel")))
            print(_table([r for r in rows if r.model == name and r.batch == batch and r.target == target]),
                  flush=True)


def run_torch_pruning(sparsities: list[float], batches: list[int], clock, budget: float, rows: list[Row]) -> None:
    """Torch-Pruning's DepGraph with L2 importance on the zoo ResNet-18, eager against eager."""
    import torch_pruning as tp

    from mlcomp import models

    zoo = models.get("resnet18")
    for batch in batches:
        inputs = zoo.example_inputs(batch)
        example = zoo.example_inputs(1)
        variants = {0.0: zoo.build()}
        for s in sparsities:
            m = zoo.build()
            pruner = tp.pruner.MagnitudePruner(m, example, importance=tp.importance.MagnitudeImportance(p=2),
                                               pruning_ratio=s, ignored_layers=[m.fc])
            pruner.step()
            variants[s] = m.eval()
        macs = {s: tp.utils.count_ops_and_params(m, example)[0] for s, m in variants.items()}
        params = {s: sum(p.numel() for p in m.parameters()) for s, m in variants.items()}
        with torch.no_grad():
            ref = variants[0.0](*inputs)

            def call(m=None):
                with torch.no_grad():
                    return m(*inputs)

            lat = _time({str(s): (lambda m=m: call(m)) for s, m in variants.items()}, clock, budget)
            for s, m in variants.items():
                out = m(*inputs)
                err = float((out - ref).norm() / ref.norm())
                cos = float(torch.nn.functional.cosine_similarity(out.flatten(), ref.flatten(), dim=0))
                top1 = float((out.argmax(-1) == ref.argmax(-1)).float().mean())
                rows.append(Row("resnet18 (Torch-Pruning)", s, batch, "eager", round(lat[str(s)], 3),
                                round(lat["0.0"] / lat[str(s)], 2), round(macs[s] / 1e6, 2),
                                round(macs[0.0] / macs[s], 3), round(params[s] / 1e3, 1),
                                round(err, 6), round(cos, 6), round(top1, 4)))
        print(_table([r for r in rows if r.model.endswith("(Torch-Pruning)") and r.batch == batch]), flush=True)


def _table(rows: list[Row]) -> str:
    head = ("model", "sparsity", "batch", "target", "ms", "speedup", "MMACs/sample", "MACs÷", "params k",
            "rel err", "cos", "top1", "vs masked")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = (r.model, r.sparsity, r.batch, r.target, r.latency_ms, r.speedup, r.macs_m, r.macs_reduction,
                 r.params_k, r.rel_error, r.cosine, r.top1,
                 f"{r.masked_max_rel:.1e}" if r.masked_max_rel is not None else "")
        lines.append("| " + " | ".join("" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet18,transformer,lenet,mobilenet")
    ap.add_argument("--sparsities", default="0.25,0.5,0.75")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--targets", default="cpu,onnxruntime")
    ap.add_argument("--clock", choices=("thread", "wall"), default="thread")
    ap.add_argument("--budget", type=float, default=0.5, help="seconds per variant per measurement")
    ap.add_argument("--no-torch-pruning", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    clock = time.thread_time if args.clock == "thread" else time.perf_counter
    sparsities = [float(s) for s in args.sparsities.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    rows: list[Row] = []
    for name in args.models.split(","):
        run_model(name, sparsities, batches, args.targets.split(","), clock, args.budget, rows)
    if not args.no_torch_pruning and "resnet18" in args.models:
        run_torch_pruning(sparsities, batches, clock, args.budget, rows)
    print("\n" + _table(rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump([asdict(r) for r in rows], f, indent=1)


if __name__ == "__main__":
    main()
