"""Issue 14's anchor table in one run: mlcomp against the tools a user would otherwise pick.

    .venv/bin/python benchmarks/anchors.py                                  # every row, every tool
    .venv/bin/python benchmarks/anchors.py --rows mlp,resnet18@1,bert,gru-tagger --skip torch.compile
    .venv/bin/python benchmarks/anchors.py --rows mlp --tune-trials 64 --json anchors.json

Rows (model@batch): zoo ``mlp@1``, ``resnet18@1``, ``resnet18@32``, ``transformer@1``; third-party
(:mod:`mlcomp.models.third_party`, random weights) ``bert@2``, ``vit@2``, ``gru-tagger@2``, ``gpt2@2``; on
request (``--rows``) the held-out models (:mod:`mlcomp.models.held_out`) ``gru-tagger-2l``, ``mlp-mixer``, ``unet``.
Tools: ``eager``, ``torchscript`` (trace + freeze), ``torch.compile`` (inductor), ``ort`` (ONNX Runtime
on ``torch.onnx.export(dynamo=True)``), ``ov-f32`` / ``ov-default`` (OpenVINO on ``ov.convert_model``
of the module, precision hint f32 / the plugin's default, bf16 where the CPU has it; thread pinning
off for both, as in mlcomp's target), and mlcomp
(``mlcomp.compile(..., pipeline="-O2")``): ``m:cpu``, ``m:ort``, ``m:ov``, ``m:tvm`` (untuned),
``m:auto`` (fastest verified target), ``m:tvm-tuned`` with ``--tune-trials``.

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
tools; the gap is printed under the tables.

Columns of the summary: best fp32 anchor (eager, torchscript, torch.compile, ORT, OpenVINO f32),
best mlcomp, ratio = anchor ÷ mlcomp (> 1: mlcomp is faster), OpenVINO default and its ratio.
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
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

ROWS = ("mlp@1", "resnet18@1", "resnet18@32", "transformer@1", "bert@2", "vit@2", "gru-tagger@2", "gpt2@2")
ANCHORS = ("eager", "torchscript", "torch.compile", "ort", "ov-f32")
MLCOMP = ("m:cpu", "m:ort", "m:ov", "m:tvm", "m:auto")
TOOLS = (*ANCHORS, "ov-default", *MLCOMP)
# untimed calls before each timing request: the previous tool's thread pools spin on after its
# slice (ONNX Runtime's for ~50 ms of CPU), and a tool that syncs its threads often loses most
SETTLE_S = 0.1


@dataclass
class Cell:
    tool: str
    compile_s: float | None = None
    max_rel: float | None = None
    note: str = ""
    error: str | None = None
    samples: list[float] = field(default_factory=list)
    process_ms: list[float] = field(default_factory=list)   # each worker process's median, ms

    @property
    def ms(self) -> float | None:
        return statistics.median(self.samples) * 1e3 if self.samples else None


# ---------------------------------------------------------------------------
# worker side: one tool, one process


def _model(row: str):
    import torch

    from mlcomp.models import ZOO
    from mlcomp.models.held_out import HELD_OUT, build_held_out
    from mlcomp.models.third_party import build_third_party

    name, batch = row.split("@")
    if name in ZOO:
        return ZOO[name].build(seed=0).eval(), ZOO[name].example_inputs(int(batch))
    if name in HELD_OUT:
        return build_held_out(name, int(batch))
    model, inputs = build_third_party(name, int(batch), seed=0)
    torch.manual_seed(0)
    return model, inputs


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
    if tool in ("ov-f32", "ov-default"):
        import openvino as ov

        model = ov.convert_model(module, example_input=inputs)
        # pinning off as in mlcomp's target: pinned threads wait for their core on a shared machine
        config: dict[str, Any] = {"INFERENCE_NUM_THREADS": threads, "ENABLE_CPU_PINNING": False}
        if tool == "ov-f32":
            config["INFERENCE_PRECISION_HINT"] = "f32"
        compiled = ov.Core().compile_model(model, "CPU", config)
        hint = compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
        return (lambda *xs: compiled([x.numpy() for x in xs])), f"convert_model; runs {hint}"
    import mlcomp

    target = {"m:cpu": "cpu", "m:ort": "onnxruntime", "m:ov": "openvino", "m:tvm": "tvm", "m:auto": "auto",
              "m:tvm-tuned": "tvm"}[tool]
    extra = {"tune_trials": tune_trials, "work_dir": work_dir} if tool == "m:tvm-tuned" else {}
    art = mlcomp.compile(module, inputs, target=target, pipeline="-O2", threads=threads, **extra)
    note = f"-O2 → {art.target}"
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
        module, inputs = _model(row)
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


def _fmt(v: float | None, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def _ms(v: float | None) -> str:
    if v is None:
        return "fail"
    return f"{v:.4f}" if v < 0.1 else f"{v:.3f}" if v < 10 else f"{v:.1f}"


def _best(cells: dict[str, Cell], names: tuple[str, ...]) -> tuple[str, float] | None:
    timed = [(cells[n].ms, n) for n in names if n in cells and cells[n].ms is not None]
    return (min(timed)[1], min(timed)[0]) if timed else None


def tables(results: dict[str, dict[str, Cell]], tools: list[str]) -> str:
    out = ["| row | " + " | ".join(tools) + " |", "|---|" + "---|" * len(tools)]
    for row, cells in results.items():
        out.append(f"| {row} | " + " | ".join(_ms(cells[t].ms) if t in cells else "—" for t in tools) + " |")
    out += ["", "| row | best fp32 anchor (ms) | best mlcomp (ms) | ratio | OpenVINO default (ms) | ratio |",
            "|---|---|---|---|---|---|"]
    mlcomp_tools = tuple(t for t in tools if t.startswith("m:"))
    for row, cells in results.items():
        anchor, best = _best(cells, ANCHORS), _best(cells, mlcomp_tools)
        ovd = cells.get("ov-default")
        ratio = f"{anchor[1] / best[1]:.2f}" if anchor and best else "—"
        ovr = f"{ovd.ms / best[1]:.2f}" if ovd and ovd.ms and best else "—"
        out.append(f"| {row} | {anchor[0] + ' ' + _ms(anchor[1]) if anchor else '—'} | "
                   f"{best[0] + ' ' + _ms(best[1]) if best else '—'} | {ratio} | "
                   f"{_ms(ovd.ms) if ovd else '—'} | {ovr} |")
    out += ["", "compile s / max rel error vs eager:", "",
            "| row | " + " | ".join(tools) + " |", "|---|" + "---|" * len(tools)]
    for row, cells in results.items():
        out.append(f"| {row} | " + " | ".join(
            (f"{_fmt(cells[t].compile_s, '.1f')} / {_fmt(cells[t].max_rel, '.0e')}" if cells[t].error is None
             else "fail") if t in cells else "—" for t in tools) + " |")
    notes = [f"- {row} {t}: {c.error or c.note}" for row, cells in results.items() for t, c in cells.items()
             if c.error or t in ("m:auto", "ov-default", "m:ov")]
    gaps = [(max(c.process_ms) / min(c.process_ms) - 1, row, t) for row, cells in results.items()
            for t, c in cells.items() if len(c.process_ms) > 1]
    if gaps:
        gap, row, tool = max(gaps)
        notes.append(f"- largest gap between two processes of one tool: {gap:.1%} ({row} {tool}); "
                     f"median gap {statistics.median(g for g, _, _ in gaps):.1%}")
    return "\n".join(out + ["", "notes:", *notes])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS), help="model@batch list (batch defaults: zoo 1, others 2)")
    ap.add_argument("--skip", default="", help="tools to leave out, comma-separated")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="threads for every tool")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--procs", type=int, default=2, help="worker processes per tool (their samples pooled)")
    ap.add_argument("--slice", type=float, default=0.2, help="seconds per timing request")
    ap.add_argument("--build-timeout", type=float, default=900.0, help="seconds a worker may take to build")
    ap.add_argument("--tune-trials", type=int, default=0, help="add m:tvm-tuned with this MetaSchedule budget")
    ap.add_argument("--tuning-dir", default="mlcomp-out/tvm-tuning")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    tools = [t for t in TOOLS if t not in skip] + (["m:tvm-tuned"] if args.tune_trials else [])
    rows = [r if "@" in r else f"{r}@{1 if r in ('mlp', 'resnet18', 'transformer', 'lenet', 'gru') else 2}"
            for r in (x.strip() for x in args.rows.split(",")) if r]
    print(f"threads={args.threads}, rounds={args.rounds} x {args.slice}s per process, {args.procs} per tool; load {os.getloadavg()}",
          file=sys.stderr, flush=True)
    results: dict[str, dict[str, Cell]] = {}
    for row in rows:
        t0 = time.perf_counter()
        results[row] = bench_row(row, tools, args)
        print(f"{row} done in {time.perf_counter() - t0:.0f} s; load {os.getloadavg()}", file=sys.stderr,
              flush=True)
        print(tables({row: results[row]}, tools), file=sys.stderr, flush=True)   # a long run shows rows early
    print(tables(results, tools))
    if args.json:
        from mlcomp.base.files import write_text_atomic

        write_text_atomic(args.json, json.dumps({r: {t: dict(asdict(c), ms=c.ms) for t, c in cells.items()}
                                                 for r, cells in results.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
