"""The TVM build's small-GEMM probe across fresh processes: does every build choose the same?

    .venv/bin/python benchmarks/tvm_probe.py                                  # mlp@1, transformer@1, bert@2; 3 builds
    .venv/bin/python benchmarks/tvm_probe.py --rows mlp@1 --builds 3 --threads 2

Each build is ``mlcomp.compile(model, inputs, target="tvm", pipeline="-O2", threads=T)`` (the untuned
default, probe on) in its own fresh process, one after another.  Per row the script prints each
build's probe: per probed call the TVM and torch medians (µs per call), where it runs, whether the
figure was re-measured (a tvm/torch ratio beyond the probe's ``WILD`` limit), the other load during
the probe, and then whether all builds chose alike.  Times are the probe's own (the compiling
process, a few ms per call); the artifact's speed is ``benchmarks/anchors.py``'s.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

ROWS = ("mlp@1", "transformer@1", "bert@2")


def one_build(row: str, threads: int) -> dict:
    """Build ``row`` here and return the probe's record (``stats["small_gemms"]``) and the placement counts."""
    import torch

    import mlcomp
    from benchmarks.anchors import _model

    torch.set_num_threads(threads)
    model, inputs = _model(row)
    art = mlcomp.compile(model, inputs, target="tvm", pipeline="-O2", threads=threads)
    stats = art.runtime.stats
    return {"small_gemms": stats.get("small_gemms", {}), "in_torch": stats["offload"]["in_torch"],
            "in_tvm": stats["offload"]["in_tvm"], "parallel": stats["schedules"]["parallel"]}


def show(row: str, builds: list[dict]) -> None:
    choices = []
    for i, b in enumerate(builds):
        sg = b["small_gemms"]
        print(f"{row} build {i + 1}: heavy ops in torch {b['in_torch']}, as TVM code {b['in_tvm']}, "
              f"parallel TVM loops {b['parallel']}; probe load {sg.get('probe_load')}")
        for r in sg.get("probe", []):
            again = (" (re-measured)" if "re-measured" in r["why"] else "") + \
                (" (undecided: the default)" if r["why"].startswith("undecided") else "")
            print(f"    {r['call']:34s} tvm {r['tvm_us']:9.2f} us  torch {r['torch_us']:9.2f} us  -> {r['runs_in']}{again}")
        choices.append(tuple((r["call"], r["runs_in"]) for r in sg.get("probe", [])))
    print(f"{row}: {'the same choices in every build' if len(set(choices)) == 1 else 'CHOICES DIFFER between builds'}\n")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=",".join(ROWS))
    ap.add_argument("--builds", type=int, default=3, help="fresh processes per row")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)     # worker: build this row, print JSON
    args = ap.parse_args(argv)
    if args.one:
        print("PROBE " + json.dumps(one_build(args.one, args.threads)), flush=True)
        return 0
    for row in args.rows.split(","):
        builds = []
        for _ in range(args.builds):
            out = subprocess.run([sys.executable, "-m", "benchmarks.tvm_probe", "--one", row,
                                  "--threads", str(args.threads)], capture_output=True, text=True, check=True).stdout
            builds.append(json.loads(next(line for line in out.splitlines() if line.startswith("PROBE "))[6:]))
        show(row, builds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
