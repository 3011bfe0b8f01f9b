"""``--target auto`` compile seconds and picks per zoo model at batch 1 (``--batch``), this checkout against another.

    .venv/bin/python benchmarks/auto_compile.py                                    # mlp, resnet18, transformer
    .venv/bin/python benchmarks/auto_compile.py --baseline /work/main --repeat 3   # against the previous auto
    .venv/bin/python benchmarks/auto_compile.py --models mlp --repeat 1 --no-record --json out.json

Each compile runs in a fresh process, as ``anchors.py``'s ``m:auto`` does: the model is built,
then ``mlcomp.compile(module, inputs, target="auto", pipeline="-O2", threads=T)`` is timed from
the call to its return (capture, every candidate's compile, the timing processes, the ranking).
``cold``: no compile cache, so no record of an earlier ranking.  ``record``: a second process
compiles the same architecture with other weights (seed 1) into a cache folder that the first
one filled (seed 0): a cache miss whose ranking comes from the record (``api/auto/record.py``).
With ``--baseline PATH`` every run is repeated with PATH's mlcomp (``PYTHONPATH=PATH``),
interleaved with this checkout's, so load hits both alike.

Printed per run: seconds, the pick, each timed candidate's median (ms), those eliminated and those tied with
the pick within the timing processes' noise (each process's median ratio),
and the manifest's phase seconds; then per model and checkout the median seconds and the picks
counted.  Compile seconds depend on the other load: run it alone, at high priority.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ("mlp", "resnet18", "transformer")


def child(model: str, threads: int, seed: int, cache: str | None, batch: int = 1) -> None:
    """One auto compile in this process; its figures as one JSON line."""
    import warnings

    import torch

    import mlcomp
    from mlcomp.models import ZOO

    warnings.filterwarnings("ignore")
    torch.set_num_threads(threads)
    module, inputs = ZOO[model].build(seed=seed).eval(), ZOO[model].example_inputs(batch)
    t0, c0 = time.perf_counter(), time.process_time()
    art = mlcomp.compile(module, inputs, target="auto", pipeline="-O2", threads=threads, cache=cache)
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    auto = art.manifest.get("auto", {})
    timing = auto.get("timing", {})
    print(json.dumps({"seconds": seconds, "picked": art.target,
                      "medians_ms": {c["target"]: c["median_ms"] for c in auto.get("candidates", [])
                                     if c.get("median_ms") is not None},
                      "process_ms": {c["target"]: c["process_medians_ms"] for c in auto.get("candidates", [])
                                     if c.get("process_medians_ms")},
                      "compile_s": {c["target"]: c["compile_seconds"] for c in auto.get("candidates", [])
                                    if c.get("compile_seconds") is not None},
                      "eliminated": sorted(timing.get("eliminated", {})), "timed_in": timing.get("timed_in"),
                      "noise_ties": {n: t.get("per_process") for n, t in timing.get("noise_ties", {}).items()},
                      "rounds": [timing.get("rounds"), timing.get("tie_break_rounds")],
                      "processes": timing.get("processes"), "phases": timing.get("phase_seconds", {}),
                      "capture_s": art.manifest.get("capture_seconds"), "call_cpu_s": cpu, "before_cpu_s": c0,
                      "phase_cpu": timing.get("phase_cpu_seconds", {}),
                      "worker_cpu": timing.get("timing_process_cpu_seconds", []),
                      "cache": (art.manifest.get("cache") or {}).get("status")}))


def run(checkout: Path, model: str, threads: int, seed: int, cache: str | None, variant: str = "",
        batch: int = 1) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout), "TVM_NUM_THREADS": str(threads),
           **dict(kv.split("=", 1) for kv in variant.split(",") if kv)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", model, "--threads", str(threads),
           "--seed", str(seed), "--batch", str(batch)] + (["--cache", cache] if cache else [])
    t0, before = time.perf_counter(), resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1200)
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime     # it and the processes it waited for
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode or not lines:
        tail = " | ".join(proc.stderr.strip().splitlines()[-3:])
        return {"error": f"exit {proc.returncode}: {tail[:300]}", "process_s": wall}
    return {**json.loads(lines[-1]), "process_s": wall, "process_cpu_s": cpu}


def line(label: str, r: dict) -> str:
    if "error" in r:
        return f"  {label}: FAILED {r['error']}"
    medians = ", ".join(f"{t} {m:.4g}" for t, m in sorted(r["medians_ms"].items(), key=lambda kv: kv[1]))
    phases = ", ".join(f"{k} {v:.1f}" for k, v in {"capture": r.get("capture_s") or 0.0, **r["phases"]}.items())
    return (f"  {label}: {r['seconds']:.1f} s (process {r['process_s']:.1f} s) -> {r['picked']}; ms: {medians or '—'}"
            f"; eliminated: {', '.join(r['eliminated']) or '—'}; rounds (+ tie-break): {r.get('rounds')}"
            + (f"; tied within the processes' noise: {r['noise_ties']}" if r.get("noise_ties") else "")
            + f"; processes: {r['processes']}; phases: {phases or '—'}"
            + (f"; cache {r['cache']}" if r.get("cache") else "")
            + (f"; compile s: {', '.join(f'{t} {v:.1f}' for t, v in r['compile_s'].items())}" if r.get("compile_s") else "")
            + f"\n    per timing process ms: "
            + "; ".join(f"{t} {', '.join(f'{m:.4g}' for m in ms)}" for t, ms in r.get("process_ms", {}).items())
            + f"\n    CPU s: {_cpu(r)}")


def _cpu(r: dict) -> str:
    """CPU seconds: the compiling process before the call and in it (per phase), each timing process, all."""
    phases = ", ".join(f"{k} {v:.1f}" for k, v in r.get("phase_cpu", {}).items())
    workers = "; ".join(", ".join(f"{k} {v:.1f}" for k, v in w.items()) for w in r.get("worker_cpu", []))
    return (f"before the call {r.get('before_cpu_s', 0):.1f}, the call {r.get('call_cpu_s', 0):.1f} ({phases}); "
            f"timing processes [{workers}]; all processes {r.get('process_cpu_s', 0):.1f}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(MODELS))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--batch", type=int, default=1, help="the example inputs' batch (the goal's figure: 1)")
    ap.add_argument("--baseline", type=Path, default=None, help="another checkout's root (the previous auto)")
    ap.add_argument("--no-record", action="store_true", help="cold compiles only")
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--variants", default="", help="';'-separated environments compared in turn, e.g. "
                    "'MLCOMP_AUTO_PROCESSES=spawn;MLCOMP_AUTO_SETTLE=fixed' (api/auto/workers.py:_variant)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child, args.threads, args.seed, args.cache, args.batch)
        return 0
    checkouts = {"this": ROOT, **({"baseline": args.baseline.resolve()} if args.baseline else {})}
    variants = {"": ""} | {v: v for v in args.variants.split(";") if v}
    results: dict[str, dict[str, dict[str, list[dict]]]] = {}
    print(f"# auto compile at batch {args.batch}, {args.threads} threads; checkouts: "
          + ", ".join(f"{k} {v}" for k, v in checkouts.items()), flush=True)
    for rep in range(args.repeat):
        for model in args.models.split(","):
            for (name, checkout), variant in itertools.product(checkouts.items(), variants):
                label = name + (f" {variant}" if variant else "")
                cell = results.setdefault(model, {}).setdefault(label, {"cold": [], "record": []})
                cell["cold"].append(run(checkout, model, args.threads, 0, None, variant, args.batch))
                print(f"{model} #{rep}", line(f"{label} cold", cell["cold"][-1]), flush=True)
                if args.no_record:
                    continue
                with tempfile.TemporaryDirectory(prefix="mlcomp-auto-bench-") as cache:
                    run(checkout, model, args.threads, 0, cache, variant, args.batch)       # measures and records
                    cell["record"].append(run(checkout, model, args.threads, 1, cache, variant, args.batch))
                print(f"{model} #{rep}", line(f"{label} record", cell["record"][-1]), flush=True)
    print("\n| model | checkout | cold s (median) | cold picks | record s (median) | record picks |")
    print("|---|---|--:|---|--:|---|")
    for model, cells in results.items():
        for label, cell in cells.items():
            print(f"| {model} | {label} | {_median(cell['cold'])} | {_picks(cell['cold'])} | "
                  f"{_median(cell['record'])} | {_picks(cell['record'])} |")
    if args.json:
        from mlcomp.base.files import write_text_atomic

        write_text_atomic(args.json, json.dumps(results, indent=1), fmt="json")
    return 0


def _median(runs: list[dict]) -> str:
    ok = [r["seconds"] for r in runs if "error" not in r]
    return f"{statistics.median(ok):.1f}" if ok else "—"


def _picks(runs: list[dict]) -> str:
    return ", ".join(f"{t} {n}" for t, n in Counter(r.get("picked", "failed") for r in runs).most_common()) or "—"


if __name__ == "__main__":
    sys.exit(main())
