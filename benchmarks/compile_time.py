"""Cold compile time of the zoo, phase by phase, each compile in a fresh process.

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

Each cell is the median over the repeats.  ``import torch`` and the modules
``torch.export`` needs are a floor no compile can cut, so the figure to compare is
``total - import`` (capture + passes + lowering + verify).  Measured tables:
``benchmarks/RESULTS.md`` ("Cold compile").
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
START_CPU = time.process_time()      # --clock cpu: this process's CPU seconds (robust to a loaded machine)
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
IMPORTED_CPU = time.process_time()
ZOO = ("mlp", "lenet", "resnet18", "mobilenet", "transformer", "gru")
TARGETS = ("cpu", "onnxruntime")
PHASES = ("import", "capture", "passes", "lowering", "verify", "total", "process")

def _compile_verified(model: str, target: str) -> None:
    """An untimed compile of ``model`` (``--warm``: what an earlier compile in the process leaves imported)."""
    source = load_model(model, batch=1)
    tgt = get_target(target)
    graph, _ = run_pipeline(source.capture(), Pipeline.parse(adapt_preset("-O2", target, tgt.rewrites).text),
                            example_inputs=source.inputs())
    artifact = tgt.compile(graph, CompileOptions.make())
    inputs = source.inputs()
    with torch.no_grad():
        artifact.set_reference(inputs, tuple(flatten_outputs(source.eager(*inputs))))
    assert artifact.verify(raise_on_failure=True).passed


def child(model: str, target: str, clock: str = "wall", warm: bool = False) -> dict[str, float]:
    """One cold compile in this process; seconds per phase (wall-clock, or CPU time of this process).

    ``warm``: first an untimed compile of another zoo model for the same target, counted in ``import``
    (torch's and the backend's lazy imports are then done, as in a session's second compile)."""
    now = time.process_time if clock == "cpu" else time.perf_counter
    t0, t1 = (START_CPU, IMPORTED_CPU) if clock == "cpu" else (START, IMPORTED)
    if warm:
        _compile_verified("lenet" if model != "lenet" else "mlp", target)
        t1 = now()
    source = load_model(model, batch=1)
    graph = source.capture()
    t2 = now()
    tgt = get_target(target)
    adapted = adapt_preset("-O2", target, tgt.rewrites)
    graph, _ = run_pipeline(graph, Pipeline.parse(adapted.text), example_inputs=source.inputs())
    t3 = now()
    artifact = tgt.compile(graph, CompileOptions.make())
    t4 = now()
    inputs = source.inputs()
    with torch.no_grad():
        expected = source.eager(*inputs)
    artifact.set_reference(inputs, tuple(flatten_outputs(expected)))
    result = artifact.verify(raise_on_failure=True)
    t5 = now()
    assert result.passed, result
    return {"import": t1 - t0, "capture": t2 - t1, "passes": t3 - t2, "lowering": t4 - t3,
            "verify": t5 - t4, "total": t5 - t0}


def run_one(model: str, target: str, clock: str = "wall", warm: bool = False) -> dict[str, float]:
    t0 = time.perf_counter()
    out = subprocess.run([sys.executable, __file__, "--child", model, target, "--clock", clock]
                         + (["--warm"] if warm else []),
                         capture_output=True, text=True, check=False, cwd=ROOT)
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
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="time phases by wall-clock (default) or by the child's CPU time (a loaded machine)")
    ap.add_argument("--warm", action="store_true",
                    help="each child first compiles another zoo model (untimed, counted in `import`): a "
                         "session's second compile, with torch's and the backend's lazy imports done")
    ap.add_argument("--child", nargs=2, metavar=("MODEL", "TARGET"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, clock=args.clock, warm=args.warm)))
        return
    rows, raw = [], {}
    print(f"{'model':<12} {'target':<12} " + " ".join(f"{p:>9}" for p in PHASES), flush=True)
    for model in args.models.split(","):
        for target in args.targets.split(","):
            runs = [run_one(model, target, args.clock, args.warm) for _ in range(args.repeat)]
            raw[f"{model}/{target}"] = runs
            med = {p: statistics.median(r[p] for r in runs) for p in PHASES}
            rows.append(med)
            print(f"{model:<12} {target:<12} " + " ".join(f"{med[p]:>9.2f}" for p in PHASES), flush=True)
    for target in args.targets.split(","):
        totals = [statistics.median(r["total"] for r in raw[k]) for k in raw if k.endswith("/" + target)]
        compiles = [statistics.median(r["total"] - r["import"] for r in raw[k]) for k in raw
                    if k.endswith("/" + target)]
        print(f"median total over the zoo, {target}: {statistics.median(totals):.2f} s; without `import` "
              f"(capture + passes + lowering + verify): {statistics.median(compiles):.2f} s")
    if args.json:
        write_text_atomic(args.json, json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
