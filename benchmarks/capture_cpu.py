"""CPU and wall seconds of inference capture, each capture in a fresh process: one trace against two, or
this checkout against another.

    python benchmarks/capture_cpu.py --models resnet18,transformer --rounds 3
    python benchmarks/capture_cpu.py --models mlp,resnet18,transformer --rounds 5 --baseline /work/main

A child builds the zoo model at batch 1 (``--batch``) after importing ``mlcomp.api.compiler`` (what
``mlcomp.compile`` has imported when it captures), then times ``load_model(m, example_inputs=x).capture()``,
the call ``mlcomp.compile`` times as its capture phase: user+system CPU seconds (``resource.getrusage``),
wall seconds, the cyclic garbage collections that ran (a count, independent of load), and then the CPU
seconds of one full collection (``gc.collect()``: what any version owes afterwards, for what it left).  Without
``--baseline`` the two paths run interleaved (one trace, then two: ``torch.export`` + ``run_decompositions``);
with it, this checkout's capture and PATH's (``PYTHONPATH=PATH``), interleaved, each as it is by default.
A cell is the median over rounds; the graph's ``capture_trace`` says which path ran.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

CHILD = r"""
import gc, json, resource, sys, time, warnings
warnings.filterwarnings("ignore")
from unittest import mock
import torch
import mlcomp.api.compiler
from mlcomp import models
from mlcomp.frontend import capture as cap
from mlcomp.frontend.loading import load_model

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

name, path, batch = sys.argv[1], sys.argv[2], int(sys.argv[3])
zoo = models.get(name)
module, x = zoo.build().eval(), zoo.example_inputs(batch)
runs = []
gc.callbacks.append(lambda phase, info: runs.append(info["generation"]) if phase == "start" else None)
t0, w0 = cpu(), time.perf_counter()
if path == "two":
    with mock.patch.object(cap, "_one_trace", lambda *a: (None, "two traces: switched off")):
        graph = load_model(module, example_inputs=x).capture()
else:
    graph = load_model(module, example_inputs=x).capture()
cpu_s, wall_s, collections = cpu() - t0, time.perf_counter() - w0, len(runs)
t1 = cpu()
gc.collect()                       # the full collection every version owes after it (walks what survived)
print(json.dumps({"cpu_s": cpu_s, "wall_s": wall_s, "trace": graph.capture_trace, "nodes": len(graph),
                  "collections": collections, "collect_s": cpu() - t1}))
"""


def run_once(name: str, path: str, batch: int, root: Path = ROOT) -> dict:
    out = subprocess.run([sys.executable, "-c", CHILD, name, path, str(batch)], capture_output=True, text=True,
                         check=True, cwd=root, env={**os.environ, "PYTHONPATH": str(root)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,lenet,resnet18,transformer,gru,mobilenet")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--baseline", help="another checkout: its capture against this one's")
    args = parser.parse_args()
    names = args.models.split(",")
    runs = {"two": ("two", ROOT), "one": ("one", ROOT)} if not args.baseline else \
        {"baseline": ("one", Path(args.baseline).resolve()), "this": ("one", ROOT)}
    got: dict[tuple[str, str], list[dict]] = {}
    for _ in range(args.rounds):
        for name in names:
            for label, (path, root) in runs.items():
                got.setdefault((name, label), []).append(run_once(name, path, args.batch, root))
    first, second = runs
    print(f"| model | {first} CPU-s | {second} CPU-s | ratio | {first} wall-s | {second} wall-s | "
          f"collections ({first} / {second}) | full collection after, CPU-s | path taken ({second}) |")
    print("|---|--:|--:|--:|--:|--:|--:|--:|---|")
    for name in names:
        med = {(label, k): statistics.median(r[k] for r in got[(name, label)])
               for label in runs for k in ("cpu_s", "wall_s", "collections", "collect_s")}
        print(f"| {name} | {med[(first, 'cpu_s')]:.2f} | {med[(second, 'cpu_s')]:.2f} | "
              f"{med[(first, 'cpu_s')] / med[(second, 'cpu_s')]:.2f}x | {med[(first, 'wall_s')]:.2f} | "
              f"{med[(second, 'wall_s')]:.2f} | {med[(first, 'collections')]:.0f} / {med[(second, 'collections')]:.0f} | "
              f"{med[(first, 'collect_s')]:.2f} / {med[(second, 'collect_s')]:.2f} | "
              f"{got[(name, second)][-1]['trace']} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
