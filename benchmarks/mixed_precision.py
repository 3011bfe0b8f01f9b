"""Mixed precision on every target: fp32 vs ``mixed-precision{dtype=bf16}`` next to eager autocast.

    .venv/bin/python benchmarks/mixed_precision.py                      # every zoo model, batch 1 and 32
    .venv/bin/python benchmarks/mixed_precision.py --models mlp,lenet --batches 1 --targets cpu,onnxruntime
    .venv/bin/python benchmarks/mixed_precision.py --json out.json --budget 0.5
    .venv/bin/python benchmarks/mixed_precision.py --models resnet18 --batches 32 --targets cpu,onnxruntime \
        --budget 0.01 --repeats 3 --warmup 1    # one row, quickly

For each (model, batch) it captures the model once, runs ``mixed-precision{dtype=auto}``
(to print what ``auto`` picks on this machine and why) and ``mixed-precision{dtype=bf16}``
(the bf16 graph is measured even where ``auto`` keeps fp32), compiles the fp32 and the
bf16 graph for every target asked for (``cpu``, ``onnxruntime``, ``tvm``), and times,
*interleaved* (one sample of every runner per round, median over rounds, so load drift
on a shared machine hits all runners alike):

* ``eager``: the module under ``torch.no_grad()`` (fp32), the reference;
* ``autocast``: the module under ``torch.autocast("cpu", torch.bfloat16)`` (re-casts weights per call);
* ``<target>:fp32`` and ``<target>:bf16``: mlcomp artifacts.

Columns: median latency, speedup over eager fp32, model bytes (weights in the graph; the
ONNX file for onnxruntime), max abs error against eager fp32 on the same inputs, and a note
(ORT: nodes kept fp32 for lack of a bf16 kernel; TVM: refusals).  The header says whether
the CPU has native bf16 (from :func:`mlcomp.hardware.probe.cpu_flags`) and what ``auto`` chose.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

# TVM sizes its thread pool when its runtime starts: give it the thread count torch and ORT get
# (as benchmarks/targets.py does); on a loaded machine a pool of spinning threads is 10-100x slower
_pre = argparse.ArgumentParser(add_help=False)
_pre.add_argument("--threads", type=int, default=1)
os.environ.setdefault("TVM_NUM_THREADS", str(_pre.parse_known_args()[0].threads))

import torch  # noqa: E402

from mlcomp.base.table import Table  # noqa: E402
from mlcomp.frontend.loading import load_model  # noqa: E402
from mlcomp.hardware.probe import cpu_flags, machine_line  # noqa: E402
from mlcomp.hardware.timing import TimingPolicy, measure_interleaved  # noqa: E402
from mlcomp.models import ZOO  # noqa: E402
from mlcomp.pipeline import Pipeline, run_pipeline  # noqa: E402
from mlcomp.targets import CompileOptions, get_target  # noqa: E402

warnings.filterwarnings("ignore")
MODELS = ("mlp", "lenet", "resnet18", "transformer", "gru")


@dataclass
class Row:
    model: str
    batch: int
    runner: str
    latency_ms: float | None = None
    speedup: float | None = None
    bytes: int | None = None
    max_abs: float | None = None
    note: str = ""


def _bytes(graph) -> int:
    return sum(t.numel() * t.element_size() for t in graph.constants.values())


def _pass_stats(report: Any) -> dict[str, Any]:
    return report.to_json()["passes"][0]["stats"] if report is not None else {}


def _first(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out[0]


def native_bf16() -> tuple[bool, str]:
    flags = [f for f in cpu_flags() if "bf16" in f or f.startswith("amx")]
    return bool(flags), (", ".join(flags) if flags else "no avx512_bf16 / amx_bf16: bf16 is emulated here")


def run_one(name: str, batch: int, targets: list[str], policy: TimingPolicy, threads: int) -> tuple[list[Row], dict]:
    z = ZOO[name]
    model, inputs = z.build(), z.example_inputs(batch)
    graph = load_model(model, example_inputs=inputs).capture()
    _, auto_report = run_pipeline(graph, Pipeline.parse("mixed-precision{dtype=auto}"), example_inputs=inputs)
    bf16_graph, bf16_report = run_pipeline(graph, Pipeline.parse("mixed-precision{dtype=bf16}"),
                                           example_inputs=inputs)
    info = {"auto": _pass_stats(auto_report), "bf16": _pass_stats(bf16_report)}
    with torch.no_grad():
        expected = _first(model(*inputs))
    runners: dict[str, Callable[[], Any]] = {}
    rows: dict[str, Row] = {}

    def eager() -> Any:
        with torch.no_grad():
            return model(*inputs)

    def autocast() -> Any:
        with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
            return model(*inputs)

    for key, fn, nbytes in (("eager", eager, _bytes(graph)), ("autocast", autocast, _bytes(graph))):
        runners[key] = fn
        rows[key] = Row(name, batch, key, bytes=nbytes)
    for target in targets:
        for label, g in (("fp32", graph), ("bf16", bf16_graph)):
            key = f"{target}:{label}"
            row = rows[key] = Row(name, batch, key, bytes=_bytes(g))
            try:
                art = get_target(target).compile(g, CompileOptions(threads=threads))
            except Exception as exc:  # noqa: BLE001 - a refusal is a result
                row.note = f"{type(exc).__name__}: {str(exc)[:160]}"
                continue
            precision = getattr(art.runtime, "precision", None)
            if target == "onnxruntime":
                row.bytes = len(art.runtime.model)
            if precision:
                row.note = f"{precision['kept_fp32']} ONNX nodes kept fp32 (no bf16 CPU kernel: " + \
                    ", ".join(f"{op} {n}" for op, n in precision["by_op"].items()) + ")"
            runners[key] = (lambda a=art: a(*inputs))
    for key, fn in list(runners.items()):
        try:
            out = _first(fn())
            rows[key].max_abs = float((out.float() - expected).abs().max())
        except Exception as exc:  # noqa: BLE001
            rows[key].note = f"run failed: {type(exc).__name__}: {str(exc)[:120]}"
            del runners[key]
    timings = measure_interleaved(runners, policy)
    base = timings["eager"].median
    for key, t in timings.items():
        rows[key].latency_ms = t.median * 1e3
        rows[key].speedup = base / t.median
    return list(rows.values()), info


def table(rows: list[Row]) -> Table:
    def f(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)
    cells = tuple((r.model, str(r.batch), r.runner, f(r.latency_ms, ".3f"), f(r.speedup, ".2f"),
                   "-" if r.bytes is None else f"{r.bytes / 1e6:.3f}", f(r.max_abs, ".2e"), r.note) for r in rows)
    return Table("fp32 vs mixed precision (bf16) vs eager autocast", ("model", "batch", "runner", "median ms",
                 "speedup", "MB", "max abs err", "note"), cells, right=frozenset({1, 3, 4, 5, 6}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--targets", default="cpu,onnxruntime,tvm")
    ap.add_argument("--threads", type=int, default=1, help="torch/ORT threads (default 1: a shared machine)")
    ap.add_argument("--budget", type=float, default=0.5, help="seconds per runner per (model, batch)")
    ap.add_argument("--repeats", type=int, default=3,
                    help="fewest timed rounds per runner (1 with a small --budget: a quick row on a loaded machine)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed rounds per runner")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    has_bf16, why = native_bf16()
    print(machine_line())
    print(f"native bf16: {'yes' if has_bf16 else 'NO'} ({why}); load: {os.getloadavg()[0]:.1f}")
    policy = TimingPolicy(warmup=args.warmup, budget_s=args.budget, min_repeats=args.repeats, max_repeats=1000)
    rows: list[Row] = []
    infos: dict[str, Any] = {}
    for name in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            t0 = time.perf_counter()
            got, info = run_one(name, batch, args.targets.split(","), policy, args.threads)
            rows += got
            infos[f"{name}@{batch}"] = info
            auto = info["auto"]
            print(f"{name} batch {batch}: auto chose {auto.get('dtype')} ({auto.get('choice')}); bf16 weights "
                  f"{info['bf16'].get('param_bytes_before')} -> {info['bf16'].get('param_bytes_after')} bytes, "
                  f"declared tolerance {info['bf16'].get('declared_tolerance')} [{time.perf_counter() - t0:.0f} s]",
                  flush=True)
            if args.json:
                with open(args.json, "w") as fh:
                    json.dump({"rows": [asdict(r) for r in rows], "passes": infos}, fh, indent=1, default=str)
    print(table(rows).format())
    return 0


if __name__ == "__main__":
    sys.exit(main())
