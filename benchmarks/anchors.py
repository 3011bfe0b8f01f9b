"""The anchor table in one run: mlcomp against the tools a user would otherwise pick, goals per row.

    .venv/bin/python benchmarks/anchors.py                                  # the 11 rows, every tool
    .venv/bin/python benchmarks/anchors.py --rows resnet18@1,bert --skip torch.compile --json c1.json
    .venv/bin/python benchmarks/anchors.py --combine c1.json,c2.json        # several runs, one table
    .venv/bin/python benchmarks/anchors.py --rows mlp --tune-trials 64

Rows (model@batch): zoo ``resnet18@1``, ``resnet18@32``, ``transformer@1``, ``transformer@32``,
``mobilenet@2``; third-party (:mod:`mlcomp.models.third_party`, random weights) ``bert@2``, ``vit@2``,
``gpt2@2``, ``gru-tagger@2``; held-out (:mod:`mlcomp.models.held_out`) ``mlp-mixer@2``, ``unet@1``; any
other zoo/third-party/held-out name through ``--rows``.
Tools: ``eager``, ``torchscript`` (trace + freeze), ``torch.compile`` (inductor), ``ort`` (ONNX Runtime
on ``torch.onnx.export(dynamo=True)``), ``ov-f32`` / ``ov-default`` (OpenVINO's own conversion,
``ov.convert_model`` of ``torch.export`` or of the module where export fails, precision hint f32 / the
plugin's default, bf16 where the CPU has it; thread pinning off, as in mlcomp's target), ``ov-f32-mod``
(``ov.convert_model`` of the module itself, f32: its TorchScript path keeps ``nn.GRU`` whole), and mlcomp
(``mlcomp.compile(..., pipeline="-O2")``): ``m:cpu``, ``m:ort``, ``m:ov``, ``m:tvm`` (untuned),
``m:auto`` (fastest verified target), ``m:tvm-tuned`` with ``--tune-trials``; low precision where the CPU
has bf16 (``--low``): ``m:ov-bf16`` (openvino, ``-O2,mixed-precision{dtype=bf16}``) and ``m:auto-mp``
(auto, ``-O2,mixed-precision{dtype=auto}``).  Per row, unless ``--no-graphs``, the kernels OpenVINO runs
at the bf16 hint for mlcomp's bf16 pipeline and for its own conversion (``mlcomp.measure.executed``).

Protocol: EACH TOOL RUNS IN ITS OWN PROCESSES.  For one row the driver starts ``--procs`` workers
per tool (default 2), one after another (so compile times are not inflated by each other); a worker builds
its runner, checks it against eager on the same inputs and waits.  Then the driver runs
rounds: in each it asks every worker in turn (order rotated per round) to "time for S
seconds" (first ``SETTLE_S`` of untimed calls, while the previous tool's thread pools spin
down; then :func:`mlcomp.hardware.timing.measure`: warm-up, per-call samples; the worker
answers their median).  The table gives the median over rounds and processes, so load on a
shared machine hits every tool alike, and no tool's threads or allocator state disturb another's.
Two processes of one tool: the same runner differs by up to ~5 % between processes on this
kind of VM (memory placement), which one process per tool would report as a difference between
tools; each row's spread is printed under the tables, and a goal missed by less than it says so.

Tables (``anchors_report``): median ms per tool; the goals per row (``auto`` ≥ 0.95× the best fp32
anchor; low precision; untuned tvm ≥ eager; ``auto``'s compile seconds); compile s and max error.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
import traceback
from dataclasses import asdict
from typing import Any, Callable

from anchors_graphs import GRAPH_PIPELINE, build_row, graph_row
from anchors_report import ANCHORS, LOW, Cell, cells_from_json, tables

ROWS = ("resnet18@1", "resnet18@32", "transformer@1", "transformer@32", "bert@2", "vit@2", "mobilenet@2", "gpt2@2",
        "gru-tagger@2", "mlp-mixer@2", "unet@1")
MLCOMP = ("m:cpu", "m:ort", "m:ov", "m:tvm", "m:auto")
TOOLS = (*ANCHORS, "ov-default", *MLCOMP, *LOW)
# mlcomp tool -> (target, pipeline)
MLCOMP_BUILD = {"m:cpu": ("cpu", "-O2"), "m:ort": ("onnxruntime", "-O2"), "m:ov": ("openvino", "-O2"),
                "m:tvm": ("tvm", "-O2"), "m:auto": ("auto", "-O2"), "m:tvm-tuned": ("tvm", "-O2"),
                "m:ov-bf16": ("openvino", GRAPH_PIPELINE),
                "m:auto-mp": ("auto", "-O2,mixed-precision{dtype=auto}")}
BF16_FLAGS = ("avx512_bf16", "amx_bf16")
# untimed calls before each timing request: the previous tool's thread pools spin on after its
# slice (ONNX Runtime's for ~50 ms of CPU), and a tool that syncs its threads often loses most
SETTLE_S = 0.1


# ---------------------------------------------------------------------------
# worker side: one tool, one process


def _outputs(value: Any) -> list:
    import numpy as np
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, np.ndarray):
        return [torch.from_numpy(value)]
    if hasattr(value, "values") and not isinstance(value, dict):     # OpenVINO's OVDict
        value = list(value.values())
    if isinstance(value, dict):
        value = list(value.values())
    out = []
    for v in value:
        out.extend(_outputs(v))
    return out


def _build(tool: str, module, inputs, threads: int, tune_trials: int, work_dir: str) -> tuple[Callable, str]:
    """The runner (called with ``*inputs``) and a note; compile happens here."""
    import torch

    if tool == "eager":
        return module, "nn.Module under no_grad"
    if tool == "torchscript":
        with torch.no_grad():
            return torch.jit.freeze(torch.jit.trace(module, inputs, check_trace=False).eval()), "trace + freeze"
    if tool == "torch.compile":
        compiled = torch.compile(module)
        with torch.no_grad():
            compiled(*inputs)                 # inductor compiles on the first call
        return compiled, "inductor"
    if tool == "ort":
        from mlcomp.base.quiet import quiet_converter
        from mlcomp.targets.onnx.target import make_session

        with quiet_converter():
            program = torch.onnx.export(module, inputs, dynamo=True)
        session = make_session(program.model_proto.SerializeToString(), threads=threads)
        names = [i.name for i in session.get_inputs()]
        return (lambda *xs: session.run(None, {n: x.numpy() for n, x in zip(names, xs)})), "dynamo export"
    if tool in ("ov-f32", "ov-default", "ov-f32-mod"):
        import openvino as ov

        from mlcomp.measure.executed import ov_own

        if tool == "ov-f32-mod":               # the module path (TorchScript inside): nn.GRU as GRUSequence
            model, how = ov.convert_model(module, example_input=inputs), "ov.convert_model(module)"
        else:
            model, how = ov_own(module, inputs)     # torch.export first, the module where export fails
        # pinning off as in mlcomp's target: pinned threads wait for their core on a shared machine
        config: dict[str, Any] = {"INFERENCE_NUM_THREADS": threads, "ENABLE_CPU_PINNING": False}
        if tool != "ov-default":
            config["INFERENCE_PRECISION_HINT"] = "f32"
        compiled = ov.Core().compile_model(model, "CPU", config)
        hint = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
        return (lambda *xs: compiled([x.numpy() for x in xs])), f"{how}; runs {hint}"
    import mlcomp

    target, pipeline = MLCOMP_BUILD[tool]
    extra = {"tune_trials": tune_trials, "work_dir": work_dir} if tool == "m:tvm-tuned" else {}
    art = mlcomp.compile(module, inputs, target=target, pipeline=pipeline, threads=threads, **extra)
    note = f"{pipeline} → {art.target}"
    precision = getattr(art.runtime, "precision", None)
    if isinstance(precision, dict) and "effective" in precision:
        note += f", OpenVINO runs {precision['effective']}"
    if art.manifest.get("fallback_regions"):
        note += f", {len(art.manifest['fallback_regions'])} regions"
    return art, note


def worker(conn, row: str, tool: str, threads: int, tune_trials: int, work_dir: str) -> None:
    os.environ["TVM_NUM_THREADS"] = str(threads)      # this process only; TVM reads it at start-up
    devnull = os.open(os.devnull, os.O_WRONLY)         # backends print progress: keep the table clean
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    import warnings

    import torch

    from mlcomp.analysis.verify import compare
    from mlcomp.hardware.timing import TimingPolicy, measure

    warnings.filterwarnings("ignore")
    torch.set_num_threads(threads)
    try:
        module, inputs = build_row(row)
        with torch.no_grad():
            expected = _outputs(module(*inputs))
        t0 = time.perf_counter()
        fn, note = _build(tool, module, inputs, threads, tune_trials, work_dir)
        seconds = time.perf_counter() - t0
        with torch.no_grad():
            actual = _outputs(fn(*inputs))
        max_rel = compare(expected, actual).max_rel
    except BaseException as exc:  # noqa: BLE001 - a failing tool is a cell, not a crash
        line = " ".join(f"{type(exc).__name__}: {exc}".split())
        conn.send({"error": line[:160], "trace": traceback.format_exc()[-2000:]})
        return
    conn.send({"compile_s": seconds, "max_rel": max_rel, "note": note})
    run = (lambda: fn(*inputs))
    with torch.no_grad():
        while True:
            request = conn.recv()
            if request is None:
                return
            settle = time.perf_counter() + SETTLE_S      # the last tool's thread pools spin down meanwhile
            while time.perf_counter() < settle:
                run()
            timing = measure(run, TimingPolicy(warmup=2, budget_s=request, min_repeats=1, max_repeats=1_000_000))
            conn.send(timing.median)


# ---------------------------------------------------------------------------
# driver side


def bench_row(row: str, tools: list[str], args: argparse.Namespace) -> dict[str, Cell]:
    ctx = mp.get_context("spawn")
    cells: dict[str, Cell] = {}
    live: dict[tuple[str, int], tuple[Any, Any]] = {}
    try:
        for tool in tools:
            cell = cells[tool] = Cell(tool)
            for copy in range(args.procs):
                started = _start(ctx, row, tool, args)
                if isinstance(started, str):
                    cell.error = started
                    break
                proc, conn, info = started
                if copy == 0:
                    cell.compile_s, cell.max_rel, cell.note = info["compile_s"], info["max_rel"], info["note"]
                live[tool, copy] = (proc, conn)
                print(f"  {row} {tool} #{copy}: built in {info['compile_s']:.1f} s", file=sys.stderr, flush=True)
            if cell.error:
                for copy in range(args.procs):
                    _stop(*live.pop((tool, copy), (None, None)))
        names = list(live)
        per_process: dict[tuple[str, int], list[float]] = {key: [] for key in names}
        for r in range(args.rounds):
            for key in names[r % len(names):] + names[:r % len(names)]:
                proc, conn = live[key]
                conn.send(args.slice)
                per_process[key].append(conn.recv())
        for (tool, _), samples in per_process.items():
            cells[tool].samples.extend(samples)
            cells[tool].process_ms.append(statistics.median(samples) * 1e3)
    finally:
        for proc, conn in live.values():
            _stop(proc, conn)
    return cells


def _start(ctx, row: str, tool: str, args: argparse.Namespace):
    """A built worker ``(process, connection, info)``, or why there is none."""
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=worker, args=(child, row, tool, args.threads, args.tune_trials, args.tuning_dir),
                       daemon=True)
    proc.start()
    child.close()
    if not parent.poll(args.build_timeout):
        proc.terminate()
        return f"no runner within {args.build_timeout:.0f} s"
    try:
        info = parent.recv()
    except EOFError:
        return f"worker died (exit code {proc.join(5) or proc.exitcode})"
    if "error" in info:
        proc.join(10)
        return info["error"]
    return proc, parent, info


def _stop(proc, conn) -> None:
    if proc is None:
        return
    try:
        conn.send(None)
    except (BrokenPipeError, OSError):
        pass
    proc.join(10)
    if proc.is_alive():
        proc.terminate()


def host() -> tuple[str, bool]:
    """The CPU line of the tables (name, cores, AVX-512/AMX flags) and whether it has bf16 instructions."""
    from mlcomp.hardware.probe import cpu_flags, cpu_info, cpu_name

    flags = ("avx2",) * ("avx2" in cpu_info().flags) + cpu_flags()
    bf16 = any(f in flags for f in BF16_FLAGS)
    line = (f"{cpu_name()}, {os.cpu_count()} cores, flags: {' '.join(flags) or 'no AVX2/AVX-512'}; "
            f"{'bf16: yes' if bf16 else 'no AVX-512 BF16, no AMX'}")
    return line, bf16


def combine(paths: list[str], tools: list[str]) -> str:
    """The tables of several ``--json`` runs, rows in the order given (same host required)."""
    results, graphs, hosts, source = {}, {}, set(), {}
    if not paths:
        raise SystemExit("--combine needs at least one --json file of an earlier run")
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        hosts.add(data["host"])
        for row, entry in data["rows"].items():
            if row in source:
                raise SystemExit(f"row {row} is in both {source[row]} and {path}: combine each row's run once")
            source[row] = path
            results[row] = cells_from_json(entry["cells"])
            if entry.get("graph"):
                graphs[row] = entry["graph"]
    if len(hosts) > 1:
        raise SystemExit(f"the runs come from different hosts: {sorted(hosts)}")
    line = next(iter(hosts))
    order = {row: i for i, row in enumerate(ROWS)}        # the default rows' order; other rows after, as given
    results = dict(sorted(results.items(), key=lambda item: order.get(item[0], len(ROWS))))
    used = [t for t in tools if any(t in cells for cells in results.values())]
    return f"host: {line}\n\n" + tables(results, used, graphs, bf16="bf16: yes" in line)


def _write_json(path: str, line: str, results: dict[str, dict[str, Cell]], graphs: dict[str, dict]) -> None:
    data = {"host": line, "rows": {r: {"cells": {t: dict(asdict(c), ms=c.ms) for t, c in cells.items()},
                                       "graph": graphs.get(r)} for r, cells in results.items()}}
    from mlcomp.base.files import write_text_atomic

    write_text_atomic(path, json.dumps(data, indent=1), fmt="json")   # marked: this run may rewrite it, not a user's


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS), help="model@batch list (batch defaults: zoo 1, others 2)")
    ap.add_argument("--skip", default="", help="tools to leave out, comma-separated")
    ap.add_argument("--low", choices=("auto", "on", "off"), default="auto",
                    help="time m:ov-bf16 and m:auto-mp: auto = where the CPU has bf16 (elsewhere they run f32)")
    ap.add_argument("--no-graphs", action="store_true", help="leave out the executed-graph check at the bf16 hint")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for every tool")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--procs", type=int, default=2, help="worker processes per tool (their samples pooled)")
    ap.add_argument("--slice", type=float, default=0.2, help="seconds per timing request")
    ap.add_argument("--build-timeout", type=float, default=900.0, help="seconds a worker may take to build")
    ap.add_argument("--tune-trials", type=int, default=0, help="add m:tvm-tuned with this MetaSchedule budget")
    ap.add_argument("--tuning-dir", default="mlcomp-out/tvm-tuning")
    ap.add_argument("--json", default=None, help="write the cells here (for --combine)")
    ap.add_argument("--combine", default=None, help="print the tables of these --json files, comma-separated")
    args = ap.parse_args(argv)
    all_tools = [*TOOLS, "m:tvm-tuned"]
    if args.combine:
        print(combine([p for p in args.combine.split(",") if p], all_tools))
        return 0
    if args.json:              # refused now, not after the first row: a file mlcomp did not write is never replaced
        from mlcomp.base.files import Kind, check_destination

        check_destination(args.json, Kind.FILE, option="--json", fmt="json", force=True)
    line, bf16 = host()
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if args.low == "off" or (args.low == "auto" and not bf16):
        skip |= set(LOW)
    tools = [t for t in TOOLS if t not in skip] + (["m:tvm-tuned"] if args.tune_trials else [])
    rows = [r if "@" in r else f"{r}@{1 if r in ('mlp', 'resnet18', 'transformer', 'lenet', 'gru') else 2}"
            for r in (x.strip() for x in args.rows.split(",")) if r]
    print(f"host: {line}\nthreads={args.threads}, rounds={args.rounds} x {args.slice}s per process, "
          f"{args.procs} per tool; load {os.getloadavg()}", file=sys.stderr, flush=True)
    results: dict[str, dict[str, Cell]] = {}
    graphs: dict[str, dict] = {}
    for row in rows:
        t0 = time.perf_counter()
        results[row] = bench_row(row, tools, args)
        if not args.no_graphs:
            graphs[row] = graph_row(row, args)
        print(f"{row} done in {time.perf_counter() - t0:.0f} s; load {os.getloadavg()}", file=sys.stderr,
              flush=True)
        print(tables({row: results[row]}, tools, graphs, bf16), file=sys.stderr, flush=True)   # rows show early
        if args.json:          # after every row: a chunk stopped by its time limit keeps the rows it finished
            _write_json(args.json, line, results, graphs)
    print(f"host: {line}\n\n" + tables(results, tools, graphs, bf16))
    return 0


if __name__ == "__main__":
    sys.exit(main())
