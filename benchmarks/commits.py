"""Two checkouts of mlcomp timed against each other: did a change that should keep behaviour keep speed?

    git worktree add --detach ../before COMMIT
    .venv/bin/python benchmarks/commits.py --before ../before --after . \\
        --models mlp@1,resnet18@1,transformer@1 --targets eager,cpu,onnxruntime,openvino,tvm

For each model and target, ``--procs`` processes per checkout (``benchmarks/tree_worker.py`` run
with ``PYTHONPATH`` set to that checkout, so each imports its own mlcomp) compile the model with
``--pipeline`` and check it against eager; they are then timed in rotated rounds (each round one
sample of every process, the first one rotating; a side's figure for the round is the mean of its
processes, so one process's memory placement does not decide), and the table gives each side's
median, the per-round ratio before ÷ after with its 95 % interval
(:func:`mlcomp.hardware.intervals.speedup_of`; above 1: the after checkout is faster) and
whether the interval includes 1 ("same" within noise).  ``eager`` is a control: the same torch
in both processes, so its interval shows the noise floor of the run itself.  Nothing else
should run meanwhile; the load average is printed with the table.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from mlcomp.hardware.intervals import paired_ratios, speedup_of  # noqa: E402


@dataclass
class Pair:
    model: str
    target: str
    before_ms: float | None = None
    after_ms: float | None = None
    ratio: float | None = None
    lo: float | None = None
    hi: float | None = None
    compile_s: tuple[float, float] | None = None
    max_rel_err: tuple[float, float] | None = None
    error: str | None = None

    def verdict(self) -> str:
        if self.ratio is None:
            return "—"
        return "same" if self.lo <= 1.0 <= self.hi else ("after faster" if self.lo > 1.0 else "after slower")


class Worker:
    """A tree_worker.py process for one checkout."""

    def __init__(self, tree: Path, model: str, batch: int, target: str, pipeline: str, threads: int) -> None:
        env = dict(os.environ, PYTHONPATH=str(tree.resolve()))
        self.proc = subprocess.Popen(
            [sys.executable, str(HERE / "tree_worker.py"), model, str(batch), target, pipeline, str(threads)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        line = self.proc.stdout.readline().split()
        if not line or line[0] != "ready":
            self.proc.kill()
            raise RuntimeError(" ".join(self.proc.stderr.read().split()[-40:]) or "the worker exited")
        self.compile_s, self.max_rel_err = float(line[1]), float(line[2])

    def sample(self, seconds: float) -> float:
        self.proc.stdin.write(f"sample {seconds}\n")
        self.proc.stdin.flush()
        return float(self.proc.stdout.readline())

    def close(self) -> None:
        try:
            self.proc.stdin.write("quit\n")
            self.proc.stdin.flush()
            self.proc.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()


def measure(before: Path, after: Path, row: str, target: str, args: argparse.Namespace) -> Pair:
    model, batch = row.split("@") if "@" in row else (row, "1")
    pair = Pair(row, target)
    workers: list[Worker] = []
    try:
        for _ in range(args.procs):
            for tree in (before, after):
                workers.append(Worker(tree, model, int(batch), target, args.pipeline, args.threads))
        samples: list[list[float]] = [[], []]
        n = len(workers)
        for r in range(args.rounds):
            got = [0.0] * n
            for i in [*range(r % n, n), *range(r % n)]:
                got[i] = workers[i].sample(args.block)
            for side in (0, 1):
                samples[side].append(statistics.mean(got[side::2]))
    except Exception as exc:  # noqa: BLE001 - one failed cell is reported, the run goes on
        pair.error = " ".join(str(exc).split())[:200]
        return pair
    finally:
        for w in workers:
            w.close()
    speed = speedup_of(paired_ratios(samples[0], samples[1]))
    pair.before_ms, pair.after_ms = (statistics.median(s) * 1e3 for s in samples)
    pair.ratio, pair.lo, pair.hi = speed.median, speed.lo, speed.hi
    pair.compile_s = (workers[0].compile_s, workers[1].compile_s)
    pair.max_rel_err = (workers[0].max_rel_err, workers[1].max_rel_err)
    return pair


def table(pairs: list[Pair], before: str, after: str) -> str:
    lines = [f"| model | target | before ms ({before}) | after ms ({after}) | before ÷ after [95% CI] | verdict | "
             "compile s before / after | max rel err before / after |", "|---|---|--:|--:|--:|---|--:|--:|"]
    for p in pairs:
        if p.error:
            lines.append(f"| {p.model} | {p.target} | — | — | — | failed: {p.error} | — | — |")
            continue
        lines.append(f"| {p.model} | {p.target} | {p.before_ms:.4g} | {p.after_ms:.4g} | {p.ratio:.3f} "
                     f"[{p.lo:.3f}-{p.hi:.3f}] | {p.verdict()} | {p.compile_s[0]:.1f} / {p.compile_s[1]:.1f} | "
                     f"{p.max_rel_err[0]:.1e} / {p.max_rel_err[1]:.1e} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", type=Path, required=True, help="checkout timed as 'before'")
    ap.add_argument("--after", type=Path, default=HERE.parent, help="checkout timed as 'after' (default: this one)")
    ap.add_argument("--models", default="mlp@1,resnet18@1,transformer@1", help="zoo model@batch list")
    ap.add_argument("--targets", default="eager,cpu,onnxruntime,openvino,tvm")
    ap.add_argument("--pipeline", default="-O2")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--rounds", type=int, default=20)
    ap.add_argument("--procs", type=int, default=2, help="worker processes per checkout")
    ap.add_argument("--block", type=float, default=0.05, help="seconds of calls per sample")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    pairs = []
    for row in args.models.split(","):
        for target in args.targets.split(","):
            pairs.append(measure(args.before, args.after, row, target, args))
            print(f"  {row} {target}: {pairs[-1].verdict()}", file=sys.stderr, flush=True)
    names = [subprocess.run(["git", "-C", str(t), "rev-parse", "--short", "HEAD"], capture_output=True,
                            text=True).stdout.strip() or str(t) for t in (args.before, args.after)]
    print(table(pairs, *names))
    print(f"\nthreads {args.threads}, {args.procs} processes per checkout, {args.rounds} rounds x {args.block:g} s "
          "per process; "
          f"load average {os.getloadavg()[0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps([asdict(p) for p in pairs], indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
