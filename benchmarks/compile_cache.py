"""Cold (cache miss) against warm (cache hit) compile, per stage, for zoo models on cpu and onnxruntime.

    .venv/bin/python benchmarks/compile_cache.py                       # mlp, resnet18, transformer × cpu, ort
    .venv/bin/python benchmarks/compile_cache.py --models mlp --targets cpu --repeats 3

Each repeat of each (model, target) runs in a fresh Python process with an empty cache
folder (a temporary directory, never ~/.cache): capture, then ``compile_model`` (a miss:
pipeline ``-O2`` adapted to the target, lowering, verification against eager, storing
the entry); then a second capture of the same model and ``compile_model`` again (a hit:
key, lookup with checksums, loading the artifact, verification against eager).
The process's own import time is outside both.  Cells are medians over repeats.

Columns: capture (s), then cold: pipeline, lowering, verify+store, total without capture;
warm: key+lookup+load+verify; speedup of the compile (cold total / warm total, capture
excluded) and of the whole command's work (capture included in both).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

CHILD = r"""
import json, sys, time, warnings
warnings.filterwarnings("ignore")
from mlcomp.api import CompileCache, compile_model
from mlcomp.frontend.loading import load_model
model, target, folder = sys.argv[1:4]
out = {}
t0 = time.perf_counter(); source = load_model(model); graph = source.capture()
out["capture"] = time.perf_counter() - t0
cache = CompileCache(folder)
t0 = time.perf_counter()
cold = compile_model(source, graph, target=target, pipeline="-O2", cache=cache)
out["cold_total"] = time.perf_counter() - t0
out["pipeline"] = cold.pipeline_seconds; out["lowering"] = cold.artifact.compile_seconds
out["cold_status"] = cold.cache.status.value; out["cold_verified"] = cold.check.passed
t0 = time.perf_counter(); source = load_model(model); graph = source.capture()
out["capture2"] = time.perf_counter() - t0
t0 = time.perf_counter()
warm = compile_model(source, graph, target=target, pipeline="-O2", cache=cache)
out["warm_total"] = time.perf_counter() - t0
out["warm_status"] = warm.cache.status.value; out["warm_verified"] = warm.check.passed
print(json.dumps(out))
"""


def run_cell(model: str, target: str) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="mlcomp-cache-bench.") as folder:
        proc = subprocess.run([sys.executable, "-c", CHILD, model, target, folder], capture_output=True, text=True,
                              cwd=REPO, env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=1200)
    if proc.returncode != 0:
        raise SystemExit(f"{model}/{target} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,resnet18,transformer")
    ap.add_argument("--targets", default="cpu,onnxruntime")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    print(f"# compile cache, cold vs warm; {args.repeats} fresh process(es) per cell, medians; "
          f"load average at start {load:.1f} on {os.cpu_count()} cores")
    head = ("model", "target", "capture s", "pipeline s", "lowering s", "verify+store s", "cold s",
            "warm s", "compile speedup", "with capture")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for model in args.models.split(","):
        for target in args.targets.split(","):
            t0 = time.perf_counter()
            runs = [run_cell(model, target) for _ in range(args.repeats)]
            bad = [r for r in runs if (r["cold_status"], r["warm_status"]) != ("stored", "hit")
                   or not (r["cold_verified"] and r["warm_verified"])]
            med = {k: statistics.median(r[k] for r in runs)
                   for k in ("capture", "capture2", "pipeline", "lowering", "cold_total", "warm_total")}
            rest = med["cold_total"] - med["pipeline"] - med["lowering"]
            whole = (med["capture"] + med["cold_total"]) / (med["capture2"] + med["warm_total"])
            print(f"| {model} | {target} | {med['capture']:.2f} | {med['pipeline']:.2f} | {med['lowering']:.2f} | "
                  f"{rest:.2f} | {med['cold_total']:.2f} | {med['warm_total']:.3f} | "
                  f"{med['cold_total'] / med['warm_total']:.1f}× | {whole:.1f}× |"
                  + (f" ({len(bad)} run(s) not miss→hit!)" if bad else ""), flush=True)
            print(f"#   {model}/{target}: {time.perf_counter() - t0:.0f} s for {args.repeats} run(s)",
                  file=sys.stderr)


if __name__ == "__main__":
    main()
