"""CPU seconds of inference capture, one trace against two, each capture in a fresh process.

    python benchmarks/capture_cpu.py --models resnet18,transformer --rounds 3

For each round and model the two paths run interleaved (one, then two), each in
its own process: ``load_model(m, example_inputs=x).capture()`` with the
one-trace path, or with it switched off (``torch.export`` + ``run_decompositions``).
A cell is the capture's user+system CPU seconds (``resource.getrusage``) or its
wall-clock seconds, the median over rounds; the graph's ``capture_trace`` says which path ran.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

CHILD = r"""
import json, resource, sys, time, warnings
warnings.filterwarnings("ignore")
from unittest import mock
import torch
from mlcomp import models
from mlcomp.frontend import capture as cap
from mlcomp.frontend.loading import load_model

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

name, path = sys.argv[1], sys.argv[2]
zoo = models.get(name)
module, x = zoo.build().eval(), zoo.example_inputs(1)
t0, w0 = cpu(), time.perf_counter()
if path == "two":
    with mock.patch.object(cap, "_one_trace", lambda *a: (None, "two traces: switched off")):
        graph = load_model(module, example_inputs=x).capture()
else:
    graph = load_model(module, example_inputs=x).capture()
print(json.dumps({"cpu_s": cpu() - t0, "wall_s": time.perf_counter() - w0, "trace": graph.capture_trace, "nodes": len(graph)}))
"""


def run_once(name: str, path: str) -> dict:
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", CHILD, name, path], capture_output=True, text=True, check=True,
                         cwd=root, env={**__import__("os").environ, "PYTHONPATH": str(root)})
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="mlp,lenet,resnet18,transformer,gru,mobilenet")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    names = args.models.split(",")
    cells: dict[tuple[str, str], list[float]] = {}
    walls: dict[tuple[str, str], list[float]] = {}
    traces: dict[tuple[str, str], str] = {}
    for _ in range(args.rounds):
        for name in names:
            for path in ("one", "two"):
                got = run_once(name, path)
                cells.setdefault((name, path), []).append(got["cpu_s"])
                walls.setdefault((name, path), []).append(got["wall_s"])
                traces[(name, path)] = got["trace"]
    print("| model | two traces CPU-s | one trace CPU-s | ratio | two traces wall-s | one trace wall-s | path taken |")
    print("|---|--:|--:|--:|--:|--:|---|")
    for name in names:
        two, one = (statistics.median(cells[(name, p)]) for p in ("two", "one"))
        wtwo, wone = (statistics.median(walls[(name, p)]) for p in ("two", "one"))
        print(f"| {name} | {two:.2f} | {one:.2f} | {two / one:.2f}x | {wtwo:.2f} | {wone:.2f} | "
              f"{traces[(name, 'one')]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
