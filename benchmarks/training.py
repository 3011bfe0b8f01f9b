"""The training table: eager vs compiled training step for every zoo model.

    .venv/bin/python benchmarks/training.py                         # zoo, batch 32, cpu
    .venv/bin/python benchmarks/training.py --models mlp,lenet --batch 8 --json out.json
    .venv/bin/python benchmarks/training.py --target cuda            # on a GPU machine

Per model: median / p90 step time (forward, loss, backward, optimizer; the two
steps timed interleaved), measured peak memory of one step above the state
before it (CPU: torch's allocator events, the running sum of live tensor bytes;
CUDA: ``torch.cuda.max_memory_allocated``), the liveness prediction with kernel
scratch and its ratio to the measurement (``pred/meas``), the kernel's peak RSS
of the compiled step for reference, the bytes of saved activations and FLOPs by
phase.  Dropout is set to 0 on both sides.
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from mlcomp.hardware.timing import TimingPolicy
from mlcomp.measure.training_bench import bench_training, format_rows
from mlcomp.models import ZOO


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default=",".join(ZOO), help="comma-separated zoo models")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--target", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--optimizer", default="sgd{lr=0.01 momentum=0.9}")
    ap.add_argument("--budget", type=float, default=2.0, help="seconds of timing per variant")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the rows as JSON here")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = []
    for name in [m for m in args.models.split(",") if m]:
        rows.append(bench_training(name, batch=args.batch, optimizer=args.optimizer, target=args.target,
                                   policy=TimingPolicy(warmup=2, budget_s=args.budget)))
        print(f"done {name}", file=sys.stderr, flush=True)
    print(format_rows(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([r.to_json() for r in rows], fh, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
