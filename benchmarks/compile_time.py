"""Cold compile time of the zoo, phase by phase, each compile in a fresh process (issue 14, part 6b).

    .venv/bin/python benchmarks/compile_time.py                         # zoo × cpu, onnxruntime; median of 3
    .venv/bin/python benchmarks/compile_time.py --models mlp,gru --targets cpu --repeat 5 --json out.json
    .venv/bin/python benchmarks/compile_time.py --child resnet18 cpu    # one compile, phases as JSON

A cold compile is what ``mlcomp compile MODEL --target T`` pays in a new
process: ``-O2`` (the CLI's default, adapted to the target), batch 1, verified
against eager.  The parent starts one child per (model, target, repeat); the
child times its phases with ``time.perf_counter`` and prints them as JSON:

* ``import``: ``import torch`` and mlcomp's modules that every compile imports
  (measured from the child's first line, so the interpreter's own start-up is in
  ``process`` only);
* ``capture``: model construction, ``torch.export``, core-ATen decomposition,
  conversion to the IR;
* ``passes``: the ``-O2`` pipeline with its default instruments (IR check, timing);
* ``lowering``: ``Target.compile`` (code generation, the backend's export and
  build, the backend's own imports such as onnxruntime);
* ``verify``: one eager run for the reference and ``Artifact.verify``;
* ``total``: the sum; ``process``: wall-clock of the child as the parent saw it.

Each cell is the median over the repeats.  Measured 2026-11-23 on the shared 2-core
EPYC, load average 13-19 (eight engineers' jobs; ``import torch`` alone took 11 s,
so every phase is several times its idle value; median of 3, seconds)::

    before (HEAD)   import capture passes lowering verify  total
    mlp/cpu          29.76    6.07   0.56     1.01   0.03  37.43
    mlp/ort          27.96    7.35   0.27    16.16   0.00  48.01
    lenet/cpu        22.58    7.89   0.81    11.41   0.68  43.46
    lenet/ort        25.27    9.95   0.33    21.41   0.36  57.49
    resnet18/cpu     37.02   20.65   4.10   100.36   8.35 148.85
    after
    mlp/cpu          28.03    6.87   0.48     0.18   0.31  34.84
    mlp/ort          43.47    8.88   0.29    23.38   0.04  77.79
    lenet/cpu        29.07    6.60   0.51    11.55   0.12  37.65
    lenet/ort        18.86    4.86   0.25    12.29   0.30  37.80

Under that load only an interleaved A/B says anything: cpu lowering of the same
``-O2`` graph, HEAD's ``cpu.py`` against this one, alternating in one process
(median of 3): mlp 0.60 → 0.07 s, transformer 25.91 → 1.86 s, gru 4.24 → 1.47 s,
lenet 8.68 → 8.80 s (convolutions: still timed).  What remains is torch's: its
import and torch.export's own imports (dynamo, sympy, torch.distributed) are
most of every cold compile, and the onnxruntime lowering's torch.onnx/onnxscript imports
are most of that phase.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

START = time.perf_counter()
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# everything a compile imports, timed from START as the child's ``import`` phase
import torch  # noqa: E402

from mlcomp.analysis.verify import flatten_outputs  # noqa: E402
from mlcomp.base.files import write_text_atomic  # noqa: E402
from mlcomp.frontend.loading import load_model  # noqa: E402
from mlcomp.pipeline import Pipeline, run_pipeline  # noqa: E402
from mlcomp.pipeline.presets import adapt_preset  # noqa: E402
from mlcomp.targets import CompileOptions, get_target  # noqa: E402

IMPORTED = time.perf_counter()
ZOO = ("mlp", "lenet", "resnet18", "mobilenet", "transformer", "gru")
TARGETS = ("cpu", "onnxruntime")
PHASES = ("import", "capture", "passes", "lowering", "verify", "total", "process")

def child(model: str, target: str) -> dict[str, float]:
    """One cold compile in this process; seconds per phase."""
    t0, t1 = START, IMPORTED
    source = load_model(model, batch=1)
    graph = source.capture()
    t2 = time.perf_counter()
    tgt = get_target(target)
    adapted = adapt_preset("-O2", target, tgt.rewrites)
    graph, _ = run_pipeline(graph, Pipeline.parse(adapted.text), example_inputs=source.inputs())
    t3 = time.perf_counter()
    artifact = tgt.compile(graph, CompileOptions.make())
    t4 = time.perf_counter()
    inputs = source.inputs()
    with torch.no_grad():
        expected = source.eager(*inputs)
    artifact.set_reference(inputs, tuple(flatten_outputs(expected)))
    result = artifact.verify(raise_on_failure=True)
    t5 = time.perf_counter()
    assert result.passed, result
    return {"import": t1 - t0, "capture": t2 - t1, "passes": t3 - t2, "lowering": t4 - t3,
            "verify": t5 - t4, "total": t5 - t0}


def run_one(model: str, target: str) -> dict[str, float]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--child", model, target], capture_output=True, text=True,
                         check=False, cwd=ROOT)
    wall = time.perf_counter() - t0
    if out.returncode != 0:
        raise SystemExit(f"{model}/{target} failed:\n{out.stderr[-3000:]}")
    phases = json.loads(out.stdout.strip().splitlines()[-1])
    phases["process"] = wall
    return phases


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(ZOO))
    ap.add_argument("--targets", default=",".join(TARGETS))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", help="write every run's phases here")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "TARGET"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child)))
        return
    rows, raw = [], {}
    print(f"{'model':<12} {'target':<12} " + " ".join(f"{p:>9}" for p in PHASES), flush=True)
    for model in args.models.split(","):
        for target in args.targets.split(","):
            runs = [run_one(model, target) for _ in range(args.repeat)]
            raw[f"{model}/{target}"] = runs
            med = {p: statistics.median(r[p] for r in runs) for p in PHASES}
            rows.append(med)
            print(f"{model:<12} {target:<12} " + " ".join(f"{med[p]:>9.2f}" for p in PHASES), flush=True)
    for target in args.targets.split(","):
        totals = [statistics.median(r["total"] for r in raw[k]) for k in raw if k.endswith("/" + target)]
        print(f"median total over the zoo, {target}: {statistics.median(totals):.2f} s")
    if args.json:
        write_text_atomic(args.json, json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
