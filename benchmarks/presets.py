"""Does the default pipeline ever break or slow a model?  -O0 against -O2 on every model × target.

    .venv/bin/python benchmarks/presets.py                          # everything available
    .venv/bin/python benchmarks/presets.py --models mlp,bert --targets cpu,onnxruntime --budget 0.5
    .venv/bin/python benchmarks/presets.py --explicit                # also the unadapted cleanup,fuse,cleanup

Models: the zoo (mlp, lenet, resnet18, transformer, gru) and third-party models
built from ``transformers`` config classes with random weights (bert, vit,
distilbert, gpt2; no downloads) plus a GRU tagger with ``nn.Embedding``.  For each
(model, target) it compiles with ``-O0`` and ``-O2`` (the preset adapted to the
target: see ``mlcomp.pipeline.presets``), each verified against eager, then
times both *interleaved* in one process (``measure_interleaved``: one call of
each per round, the median over rounds), so a change in machine load hits both
alike.  ``--explicit`` adds the pipeline ``cleanup,fuse,cleanup`` written out
(never adapted) where the preset dropped passes, to show what they would cost.

TVM is untuned and slow: it runs at batch 1 only, and only for models whose
``-O0`` call takes under ``--tvm-max-call`` seconds.  Columns: latency (ms,
median), speedup of -O2 over -O0, compile time (s, pipeline + lowering +
verification), max error (norm-wise relative, against eager), dropped passes.
"""
from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

warnings.filterwarnings("ignore")

import mlcomp
from mlcomp.analysis.verify import flatten_outputs
from mlcomp.hardware.timing import TimingPolicy, measure_interleaved
from mlcomp.models import ZOO
from mlcomp.models.third_party import THIRD_PARTY, build_third_party
from mlcomp.targets import available_targets


def build(name: str, batch: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    if name in ZOO:
        return ZOO[name].build(), ZOO[name].example_inputs(batch)
    return build_third_party(name, batch)


@dataclass
class Cell:
    model: str
    target: str
    batch: int
    variant: str
    latency_ms: float | None = None
    speedup: float | None = None
    compile_s: float | None = None
    max_err: float | None = None
    note: str = ""


def _rel_err(got: Any, want: Any) -> float:
    errs = []
    for g, w in zip(flatten_outputs(got), flatten_outputs(want)):
        g, w = g.detach().double(), w.detach().double()
        errs.append(float((g - w).norm() / w.norm().clamp_min(1e-12)))
    return max(errs, default=0.0)


def compile_variant(model: torch.nn.Module, inputs: tuple[torch.Tensor, ...], target: str,
                    pipeline: str) -> tuple[Callable[[], Any] | None, Cell]:
    cell = Cell("", target, inputs[0].shape[0], pipeline)
    t0 = time.perf_counter()
    try:
        art = mlcomp.compile(model, inputs, target=target, pipeline=pipeline or None, verify=True)
    except Exception as exc:  # noqa: BLE001 - a failing cell is a finding, printed in the table
        cell.note = f"FAILED {type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        return None, cell
    cell.compile_s = time.perf_counter() - t0
    with torch.no_grad():
        cell.max_err = _rel_err(art(*inputs), model(*inputs))
    dropped = (art.manifest.get("pipeline_report") or {}).get("dropped") or []
    cell.note = "dropped " + ", ".join(d.split(" ")[0] for d in dropped) if dropped else ""
    return (lambda: art(*inputs)), cell


def run_pair(name: str, target: str, batch: int, args: argparse.Namespace) -> list[Cell]:
    model, inputs = build(name, batch)
    variants = {"-O0": "", "-O2": "-O2"}
    fns: dict[str, Callable[[], Any]] = {}
    cells: dict[str, Cell] = {}
    for label, pipe in variants.items():
        fn, cell = compile_variant(model, inputs, target, pipe)
        cell.model, cell.variant = name, label
        cells[label] = cell
        if fn is not None:
            fns[label] = fn
    if args.explicit and cells["-O2"].note.startswith("dropped"):
        fn, cell = compile_variant(model, inputs, target, "cleanup,fuse,cleanup")
        cell.model, cell.variant = name, "explicit fuse"
        cells[cell.variant] = cell
        if fn is not None:
            fns[cell.variant] = fn
    if target == "tvm" and "-O0" in fns:
        t0 = time.perf_counter()
        fns["-O0"]()
        if time.perf_counter() - t0 > args.tvm_max_call:
            for c in cells.values():
                c.note = (c.note + "; " if c.note else "") + "not timed (slow untuned TVM call)"
            return list(cells.values())
    if fns:
        policy = TimingPolicy(warmup=3, budget_s=args.budget, min_repeats=args.rounds)
        timings = measure_interleaved(fns, policy)
        base = timings["-O0"].median if "-O0" in timings else None
        for label, t in timings.items():
            cells[label].latency_ms = t.median * 1e3
            cells[label].speedup = base / t.median if base else None
    return list(cells.values())


def _fmt(v: float | None, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def print_table(cells: list[Cell], out: Any = sys.stdout) -> None:
    head = ("model", "target", "batch", "pipeline", "latency ms", "speedup", "compile s", "max err", "note")
    rows = [head] + [(c.model, c.target, str(c.batch), c.variant, _fmt(c.latency_ms, ".3f"), _fmt(c.speedup, ".2f"),
                      _fmt(c.compile_s, ".1f"), _fmt(c.max_err, ".1e"), c.note) for c in cells]
    widths = [max(len(r[i]) for r in rows) for i in range(len(head) - 1)]
    for r in rows:
        print("| " + " | ".join(x.ljust(w) for x, w in zip(r, widths)) + " | " + r[-1], file=out, flush=True)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join([*ZOO, *THIRD_PARTY]))
    ap.add_argument("--targets", default="cpu,onnxruntime,tvm")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--budget", type=float, default=1.0, help="seconds of timing per variant")
    ap.add_argument("--rounds", type=int, default=20, help="fewest interleaved rounds")
    ap.add_argument("--tvm-max-call", type=float, default=1.0)
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    ap.add_argument("--explicit", action="store_true", help="also time cleanup,fuse,cleanup where -O2 dropped fuse")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    avail = available_targets()
    cells: list[Cell] = []
    for target in args.targets.split(","):
        if avail.get(target) is not None:
            print(f"# skipping {target}: {avail[target]}", flush=True)
            continue
        for name in args.models.split(","):
            batch = 1 if target == "tvm" else args.batch
            got = run_pair(name, target, batch, args)
            print_table(got)
            cells += got
    print("\n## all cells")
    print_table(cells)


if __name__ == "__main__":
    main()
