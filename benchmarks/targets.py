"""Benchmark mlcomp's targets against eager PyTorch and against the same tools used directly.

    .venv/bin/python benchmarks/targets.py                       # every zoo model, batch 1 and 32
    .venv/bin/python benchmarks/targets.py --models mlp,resnet18 --batches 1 --threads 1
    .venv/bin/python benchmarks/targets.py --tune-trials 64 --tune-models mlp --json out.json

For each (model, batch) it builds

* ``eager``: the ``nn.Module`` under ``torch.no_grad()``;
* ``mlcomp:cpu``, ``mlcomp:onnxruntime``, ``mlcomp:tvm`` (untuned; ``mlcomp:tvm-tuned`` for
  ``--tune-models`` when ``--tune-trials`` > 0): capture → lower → verify, timed end to end
  (compile = capture + lowering);
* the tools used directly on the eager module: ``direct:torchscript`` (``torch.jit.trace`` +
  ``torch.jit.freeze``), ``direct:torch.compile`` (inductor; compile = first call) and
  ``direct:onnxruntime`` (``torch.onnx.export(dynamo=True)`` + an ``ORT_ENABLE_ALL`` session called
  as ``session.run(None, {name: x.numpy()})``),

then times them *interleaved* (``--clock wall``, or ``--clock thread`` for the CPU time of
one thread, robust on a machine shared with other jobs): after warm-up, each round runs every runner for about the
same wall time and records its mean latency; the table shows the median over rounds, so
a change in machine load hits all runners alike.  Threads: ``--threads`` for torch, ORT
and TVM alike (default: all cores).  Max error is the norm-wise relative error of the
outputs against eager.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

# TVM reads its thread count when its runtime starts, so set it before anything imports tvm.
_pre = argparse.ArgumentParser(add_help=False)
_pre.add_argument("--threads", type=int, default=None)
_THREADS = _pre.parse_known_args()[0].threads or os.cpu_count() or 1
os.environ.setdefault("TVM_NUM_THREADS", str(_THREADS))

import torch  # noqa: E402

warnings.filterwarnings("ignore")


@dataclass
class Row:
    model: str
    batch: int
    runner: str
    latency_ms: float | None = None
    speedup: float | None = None
    compile_s: float | None = None
    max_rel: float | None = None
    note: str = ""
    samples: list[float] = field(default_factory=list, repr=False)


def _rel(expected: Any, actual: Any) -> float:
    from mlcomp.analysis.verify import compare

    return compare(expected, actual).max_rel


def _build_mlcomp(source, graph, target: str, *, threads: int, tune_trials: int = 0,
                  work_dir: str | None = None) -> tuple[Callable[..., Any], float, str]:
    from mlcomp.targets import CompileOptions, get_target

    t0 = time.perf_counter()
    art = get_target(target).compile(graph, CompileOptions(threads=threads, tune_trials=tune_trials,
                                                           work_dir=work_dir))
    seconds = time.perf_counter() - t0
    note = ""
    if target == "cpu":
        note = "optimize_for_inference" if art.runtime.optimize else "freeze only"
    if target == "tvm":
        stats = art.runtime.stats
        note = (f"tuned {tune_trials} trials ({stats.get('trials_run', 0)} run now)" if tune_trials
                else "untuned (DLight)")
    return art, seconds, note


def _direct_torchscript(module, inputs):
    with torch.no_grad():
        return torch.jit.freeze(torch.jit.trace(module, inputs, check_trace=False).eval())


def _direct_compile(module, inputs):
    compiled = torch.compile(module)
    with torch.no_grad():
        compiled(*inputs)            # compilation happens on the first call
    return compiled


def _direct_ort(module, inputs, threads: int):
    from mlcomp.base.quiet import quiet_converter
    from mlcomp.targets.onnx.target import make_session

    with quiet_converter():
        program = torch.onnx.export(module, inputs, dynamo=True)
    session = make_session(program.model_proto.SerializeToString(), threads=threads)
    names = [i.name for i in session.get_inputs()]
    if len(names) == 1:
        name = names[0]
        return lambda x: session.run(None, {name: x.numpy()})
    return lambda *xs: session.run(None, {n: x.numpy() for n, x in zip(names, xs)})


def _ort_outputs(fn):
    return lambda *xs: [torch.from_numpy(o) for o in fn(*xs)]


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def measure(runners: dict[str, Callable[[], Any]], *, budget: float, rounds: int,
            clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """Interleaved rounds; per round each runner gets ~budget/rounds seconds. Seconds per call.

    ``clock=time.thread_time`` counts only the CPU time of the calling thread: with one
    thread everywhere every runner computes on this thread, and time spent descheduled
    (a machine shared with other jobs) is not counted.
    """
    per_call: dict[str, float] = {}
    with torch.no_grad():
        for name, fn in runners.items():
            for _ in range(3):
                fn()
            t0 = time.perf_counter()
            fn()
            per_call[name] = max(time.perf_counter() - t0, 1e-7)
        samples: dict[str, list[float]] = {n: [] for n in runners}
        names = list(runners)
        slice_s = budget / rounds
        for r in range(rounds):
            # rotate the order each round: every runner sits in every position equally often
            # (what ran just before disturbs caches and leaves worker threads spinning)
            for name in names[r % len(names):] + names[:r % len(names)]:
                fn, cost = runners[name], per_call[name]
                if cost * len(samples[name]) > 2 * budget and len(samples[name]) >= 3:
                    continue   # very slow runner (e.g. untuned TVM convs): 3 samples are enough
                n = max(1, int(slice_s / cost))
                if cost < slice_s / 2:
                    for _ in range(max(2, n // 4)):   # re-warm: caches, and the previous runner's
                        fn()                          # spinning worker threads going back to sleep
                t0 = clock()
                for _ in range(n):
                    fn()
                samples[name].append((clock() - t0) / n)
    return samples


def bench_config(name: str, batch: int, args: argparse.Namespace) -> list[Row]:
    from mlcomp.targets import available_targets

    from mlcomp.frontend.loading import load_model

    torch.set_num_threads(_THREADS)
    source = load_model(name, batch=batch)
    module, inputs = source.eager, source.inputs()
    with torch.no_grad():
        expected = module(*inputs)
    t0 = time.perf_counter()
    graph = source.capture()
    if args.pipeline:
        from mlcomp.pipeline import run_pipeline

        graph, _ = run_pipeline(graph, args.pipeline, example_inputs=inputs)
    capture_s = time.perf_counter() - t0
    rows: dict[str, Row] = {"eager": Row(name, batch, "eager", note="nn.Module, no_grad")}
    runners: dict[str, Callable[[], Any]] = {"eager": lambda: module(*inputs)}
    outputs: dict[str, Callable[[], Any]] = {"eager": lambda: module(*inputs)}

    def add(label: str, build: Callable[[], tuple[Callable[..., Any], float, str]],
            to_torch: Callable[[Any], Any] = lambda f: f) -> None:
        try:
            fn, seconds, note = build()
        except Exception as exc:  # noqa: BLE001 - a failing tool is a row, not a crash
            rows[label] = Row(name, batch, label, note=f"failed: {type(exc).__name__}: {str(exc)[:80]}")
            return
        rows[label] = Row(name, batch, label, compile_s=seconds, note=note)
        runners[label] = lambda: fn(*inputs)
        outputs[label] = lambda: to_torch(fn)(*inputs)

    avail = available_targets()
    for target in args.targets:
        if avail[target] is None:
            add(f"mlcomp:{target}", lambda t=target: _timed_mlcomp(source, graph, t, capture_s, args))
    if args.tune_trials and name in args.tune_models and avail["tvm"] is None:
        add("mlcomp:tvm-tuned", lambda: _timed_mlcomp(source, graph, "tvm", capture_s, args, tuned=True))
    add("direct:torchscript", lambda: _timed(lambda: _direct_torchscript(module, inputs), "trace + freeze"))
    if not args.no_torch_compile:
        add("direct:torch.compile", lambda: _timed(lambda: _direct_compile(module, inputs), "inductor"))
    add("direct:onnxruntime", lambda: _timed(lambda: _direct_ort(module, inputs, _THREADS),
                                             "plain torch.onnx.export"), _ort_outputs)
    samples = measure(runners, budget=args.budget, rounds=args.rounds, clock=CLOCKS[args.clock])
    eager_ms = statistics.median(samples["eager"]) * 1e3
    for label, row in rows.items():
        if label not in samples:
            continue
        row.latency_ms = statistics.median(samples[label]) * 1e3
        row.speedup = eager_ms / row.latency_ms
        with torch.no_grad():
            row.max_rel = 0.0 if label == "eager" else _rel(expected, outputs[label]())
    return list(rows.values())


def _timed(build: Callable[[], Any], note: str) -> tuple[Any, float, str]:
    t0 = time.perf_counter()
    fn = build()
    return fn, time.perf_counter() - t0, note


def _timed_mlcomp(source, graph, target: str, capture_s: float, args: argparse.Namespace,
                  tuned: bool = False) -> tuple[Any, float, str]:
    fn, seconds, note = _build_mlcomp(source, graph, target, threads=_THREADS,
                                      tune_trials=args.tune_trials if tuned else 0,
                                      work_dir=args.tuning_dir if tuned else None)
    if args.pipeline:
        note = f"-p {args.pipeline}" + (f"; {note}" if note else "")
    return fn, capture_s + seconds, note


def format_table(rows: list[Row]) -> str:
    head = f"{'model':<12}{'batch':>5}  {'runner':<22}{'latency ms':>11}{'speedup':>9}{'compile s':>10}" \
           f"{'max rel err':>12}  note"
    lines = [head, "-" * len(head)]
    last = None
    for r in rows:
        if last is not None and (r.model, r.batch) != last:
            lines.append("")
        last = (r.model, r.batch)
        lat = f"{r.latency_ms:.3f}" if r.latency_ms is not None else "-"
        sp = f"{r.speedup:.2f}x" if r.speedup is not None else "-"
        cs = f"{r.compile_s:.1f}" if r.compile_s is not None else "-"
        err = f"{r.max_rel:.1e}" if r.max_rel is not None else "-"
        lines.append(f"{r.model:<12}{r.batch:>5}  {r.runner:<22}{lat:>11}{sp:>9}{cs:>10}{err:>12}  {r.note}")
    return "\n".join(lines)


def ort_ratios(rows: list[Row]) -> list[str]:
    """mlcomp's ORT target against ORT used directly (>= 1 means mlcomp is as fast or faster)."""
    out = []
    by = {(r.model, r.batch, r.runner): r for r in rows}
    for r in rows:
        if r.runner != "mlcomp:onnxruntime" or r.latency_ms is None:
            continue
        d = by.get((r.model, r.batch, "direct:onnxruntime"))
        if d and d.latency_ms:
            out.append(f"{r.model} b{r.batch}: {d.latency_ms / r.latency_ms:.2f}x")
    return out


def main(argv: list[str] | None = None) -> int:
    from mlcomp.models import ZOO

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(ZOO), help="comma-separated zoo names")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--threads", type=int, default=None, help="threads for torch, ORT and TVM (default: all)")
    ap.add_argument("--tune-trials", type=int, default=0, help="TVM MetaSchedule budget for --tune-models")
    ap.add_argument("--tune-models", default="mlp")
    ap.add_argument("--tuning-dir", default="mlcomp-out/tvm-tuning", help="tuning database (reused)")
    ap.add_argument("--targets", default="cpu,onnxruntime,tvm", help="mlcomp targets to include")
    ap.add_argument("--pipeline", default=None, help="passes to run before the mlcomp targets (e.g. -O2)")
    ap.add_argument("--no-torch-compile", action="store_true", help="skip torch.compile (slow to compile)")
    ap.add_argument("--budget", type=float, default=3.0, help="seconds of timing per runner and config")
    ap.add_argument("--rounds", type=int, default=14)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall time, or CPU time of this thread (only meaningful with --threads 1)")
    ap.add_argument("--json", default=None, help="also write the rows as JSON")
    args = ap.parse_args(argv)
    args.tune_models = set(args.tune_models.split(","))
    args.targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    if args.clock == "thread" and _THREADS != 1:
        ap.error("--clock thread measures one thread's CPU time; use it with --threads 1")
    rows: list[Row] = []
    print(f"threads={_THREADS} (torch, ORT intra-op, TVM_NUM_THREADS={os.environ['TVM_NUM_THREADS']}); "
          f"clock={args.clock}; torch {torch.__version__}", flush=True)
    for name in args.models.split(","):
        for batch in (int(b) for b in args.batches.split(",")):
            t0 = time.perf_counter()
            config_rows = bench_config(name, batch, args)
            rows.extend(config_rows)
            print(format_table(config_rows).split("\n", 2)[2], f"   [{time.perf_counter() - t0:.0f}s]",
                  flush=True)
    print()
    print(format_table(rows))
    print()
    print("mlcomp:onnxruntime speed relative to direct:onnxruntime: " + ", ".join(ort_ratios(rows)))
    print("compile s for mlcomp:* = capture + pipeline + lowering; direct:torch.compile = first call")
    if args.json:
        from mlcomp.base.files import write_text_atomic

        write_text_atomic(args.json, json.dumps([{k: v for k, v in asdict(r).items() if k != "samples"}
                                                 for r in rows], indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
