"""mlcomp's ``onnxruntime`` target against ONNX Runtime on a direct export, model by model.

    .venv/bin/python benchmarks/ort_parity.py                          # every model, 2 threads
    .venv/bin/python benchmarks/ort_parity.py --models gru-tagger,bert --threads 1 --diff
    .venv/bin/python benchmarks/ort_parity.py --models resnet18@1,transformer@1    # one batch of a model
    .venv/bin/python benchmarks/ort_parity.py --threads 1 --clock thread     # on a busy machine
    .venv/bin/python benchmarks/ort_parity.py --json out.json

For each model:

* ``plain``: ``torch.onnx.export(module, inputs, dynamo=True)`` of the eager module and an
  ``ORT_ENABLE_ALL`` session, called as ``session.run(None, {name: x.numpy()})`` (as in
  ``benchmarks/targets.py``: torch tensors in, a numpy view made per call);
* ``-O0`` / ``-O2``: ``mlcomp.compile(module, inputs, target="onnxruntime", pipeline=...)``,
  called as the artifact (what a user gets);

same session options and intra-op threads on every side.  Latency is the median over
interleaved rounds (each round runs every runner for about the same wall time, so load
changes hit all alike); ratio = plain ÷ mlcomp (≥ 1: mlcomp as fast or faster).  Compile is
capture + passes + lowering + verification for mlcomp, export + session for plain.

``--diff`` prints, per model, the node counts by op type of the graphs ORT actually runs
(each session saves its optimised model through ``SessionOptions.optimized_model_filepath``)
where plain and mlcomp ``-O2`` differ, e.g.::

    gru-tagger: op type        plain  mlcomp
                GRU                1       0     # ours: the recurrence unrolled
                MatMul             1      64

and, where the op types agree, the counts by op type and number of inputs, which the
histogram alone hides (GPT-2, before the emitter left zero biases off)::

    gpt2 (2): 66 vs 64 nodes, mlcomp -O2; op type[/inputs]  plain  mlcomp
        Reshape                             24      22
        Gemm/2                               8       0
        Gemm/3                               0       8
        Split/1                              2       0     # num_outputs vs explicit sizes
        Split/2                              0       2
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

warnings.filterwarnings("ignore")

ZOO_ROWS = [("mlp", 1), ("lenet", 1), ("resnet18", 1), ("resnet18", 32), ("mobilenet", 1),
            ("transformer", 1), ("gru", 1)]
THIRD_ROWS = [("bert", 2), ("vit", 2), ("gpt2", 2), ("distilbert", 2), ("t5-encoder", 2), ("gru-tagger", 2)]
PRESETS = ("-O0", "-O2")


def build(name: str, batch: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    from mlcomp import models
    from mlcomp.models.third_party import THIRD_PARTY, build_third_party

    if name in THIRD_PARTY:
        return build_third_party(name, batch)
    zoo = models.get(name)
    return zoo.build(), zoo.example_inputs(batch)


def session(model: bytes, threads: int, optimized: Path | None = None):
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.intra_op_num_threads = threads
    so.log_severity_level = 3          # no warning about hardware-specific optimised files
    if optimized is not None:
        so.optimized_model_filepath = str(optimized)
    return ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])


def op_counts(model: bytes, threads: int) -> tuple[Counter, Counter]:
    """Node counts of the graph ORT runs after its own optimisations: by op type, and by op type
    and number of (non-empty) inputs (``Gemm/3``: with a bias)."""
    import onnx

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "optimized.onnx"
        session(model, threads, path)
        proto = onnx.load(str(path), load_external_data=False)
    kinds = [n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}" for n in proto.graph.node]
    arity = [f"{k}/{sum(1 for i in n.input if i)}" for k, n in zip(kinds, proto.graph.node)]
    return Counter(kinds), Counter(arity)


def plain(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], threads: int):
    from mlcomp.base.quiet import quiet_converter

    t0 = time.perf_counter()
    with quiet_converter():
        program = torch.onnx.export(module, inputs, dynamo=True, verbose=False)
    model = program.model_proto.SerializeToString()
    sess = session(model, threads)
    seconds = time.perf_counter() - t0
    names = [i.name for i in sess.get_inputs()]
    # torch in, as benchmarks/targets.py calls it: a numpy view of each input per call
    return (lambda: sess.run(None, {n: t.numpy() for n, t in zip(names, inputs)})), model, seconds


def ours(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], threads: int, preset: str):
    import mlcomp

    t0 = time.perf_counter()
    art = mlcomp.compile(module, inputs, target="onnxruntime", pipeline=preset, threads=threads)
    seconds = time.perf_counter() - t0
    return (lambda: art(*inputs)), art.runtime.model, seconds


CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}


def interleaved(fns: dict[str, Callable[[], Any]], rounds: int, round_s: float,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, float]:
    """Median seconds per call over ``rounds`` interleaved rounds of about ``round_s`` each.

    ``clock=time.thread_time`` counts the calling thread's CPU time only: with one intra-op
    thread ORT computes on the caller, so a machine shared with other jobs does not inflate it.
    """
    per_call = {}
    for name, fn in fns.items():      # warm up, and size each runner's round
        fn()
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < 0.1:
            fn()
            n += 1
        per_call[name] = (time.perf_counter() - t0) / n
    reps = {name: max(1, int(round_s / t)) for name, t in per_call.items()}
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            t0 = clock()
            for _ in range(reps[name]):
                fn()
            samples[name].append((clock() - t0) / reps[name])
    return {name: statistics.median(s) for name, s in samples.items()}


def measure(name: str, batch: int, threads: int, rounds: int, round_s: float, clock: str = "wall",
            presets: tuple[str, ...] = PRESETS) -> dict[str, Any]:
    torch.set_num_threads(threads)
    module, inputs = build(name, batch)
    row: dict[str, Any] = {"model": name, "batch": batch}
    fns, models = {}, {}
    try:
        fns["plain"], models["plain"], row["plain_compile_s"] = plain(module, inputs, threads)
    except Exception as exc:  # noqa: BLE001 - a row says what failed
        row["plain_error"] = str(exc).splitlines()[0][:120]
    for preset in presets:
        try:
            fns[preset], models[preset], row[f"{preset}_compile_s"] = ours(module, inputs, threads, preset)
        except Exception as exc:  # noqa: BLE001
            row[f"{preset}_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
    times = interleaved(fns, rounds, round_s, CLOCKS[clock])
    for key, t in times.items():
        row[f"{key}_ms"] = t * 1e3
    for preset in presets:
        if "plain" in times and preset in times:
            row[f"{preset}_ratio"] = times["plain"] / times[preset]
    ours_key = "-O2" if "-O2" in models else "-O0"
    if "plain" in models and ours_key in models:
        (a, a_in), (b, b_in) = op_counts(models["plain"], threads), op_counts(models[ours_key], threads)
        row["ops_plain"], row["ops_mlcomp"], row["ops_of"] = dict(a), dict(b), ours_key
        row["arity_plain"], row["arity_mlcomp"] = dict(a_in), dict(b_in)
    return row


def _fmt(v: Any, spec: str) -> str:
    return format(v, spec) if isinstance(v, (int, float)) else "—"


def print_table(rows: list[dict[str, Any]]) -> None:
    print("| model (batch) | plain ms | -O0 ms | -O0 ratio | -O2 ms | -O2 ratio | compile s plain/-O0/-O2 |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        compile_s = "/".join(_fmt(r.get(k), ".2f") for k in ("plain_compile_s", "-O0_compile_s", "-O2_compile_s"))
        print(f"| {r['model']} ({r['batch']}) | {_fmt(r.get('plain_ms'), '.3f')} | {_fmt(r.get('-O0_ms'), '.3f')} "
              f"| {_fmt(r.get('-O0_ratio'), '.2f')} | {_fmt(r.get('-O2_ms'), '.3f')} | "
              f"{_fmt(r.get('-O2_ratio'), '.2f')} | {compile_s} |")
        for key in ("plain_error", "-O0_error", "-O2_error"):
            if key in r:
                print(f"|   {key}: {r[key]} |")


def print_diff(rows: list[dict[str, Any]]) -> None:
    for r in rows:
        a, b = Counter(r.get("ops_plain", {})), Counter(r.get("ops_mlcomp", {}))
        if not a and not b:
            continue
        diff = sorted(op for op in set(a) | set(b) if a[op] != b[op])
        total = f"{sum(a.values())} vs {sum(b.values())} nodes, mlcomp {r.get('ops_of', '-O0')}"
        # by op type and number of inputs, for the op types whose counts agree (Gemm/2 vs Gemm/3)
        x, y = Counter(r.get("arity_plain", {})), Counter(r.get("arity_mlcomp", {}))
        hidden = sorted(k for k in set(x) | set(y) if x[k] != y[k] and k.split("/")[0] not in diff)
        if not diff and not hidden:
            print(f"{r['model']} ({r['batch']}): same op counts and inputs ({total})")
            continue
        print(f"{r['model']} ({r['batch']}): {total}; op type[/inputs]  plain  mlcomp")
        for op in diff:
            print(f"    {op:<32}{a[op]:>6}{b[op]:>8}")
        for op in hidden:
            print(f"    {op:<32}{x[op]:>6}{y[op]:>8}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="",
                        help="comma-separated model names, NAME@BATCH for one row (default: all rows)")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads for ORT and torch")
    parser.add_argument("--rounds", type=int, default=15, help="interleaved timing rounds")
    parser.add_argument("--round-s", type=float, default=0.05, help="seconds per runner per round")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                        help="wall time, or the calling thread's CPU time (use with --threads 1 on a busy machine)")
    parser.add_argument("--presets", default=",".join(PRESETS), help="mlcomp pipelines to compare")
    parser.add_argument("--diff", action="store_true", help="print per-op-type diffs of the optimised graphs")
    parser.add_argument("--json", default=None, help="write the rows as JSON here")
    args = parser.parse_args(argv)
    wanted = [m for m in args.models.split(",") if m]
    every = ZOO_ROWS + THIRD_ROWS
    # in the order asked; "resnet18@1" picks one batch of a model listed with several
    rows_spec = [(m, b) for w in wanted for m, b in every
                 if m == w.split("@")[0] and ("@" not in w or str(b) == w.split("@")[1])] if wanted else every
    rows = []
    for name, batch in rows_spec:
        rows.append(measure(name, batch, args.threads, args.rounds, args.round_s, args.clock,
                            tuple(p for p in args.presets.split(",") if p)))
        print(f"done {name} ({batch}): "
              f"{json.dumps({k: v for k, v in rows[-1].items() if not k.startswith(('ops', 'arity'))})}",
              file=sys.stderr, flush=True)
        if args.json:        # after every row, so an interrupted run keeps what it measured
            Path(args.json).write_text(json.dumps(rows, indent=1))
    print_table(rows)
    if args.diff:
        print()
        print_diff(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
