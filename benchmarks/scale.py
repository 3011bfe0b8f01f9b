"""How compile time grows with graph size: capture, ``-O2`` and lowering on synthetic models.

    .venv/bin/python benchmarks/scale.py                          # ~100 / 1k / 10k nodes, both families
    .venv/bin/python benchmarks/scale.py --family resmlp --blocks 8,32,128
    .venv/bin/python benchmarks/scale.py --profile 128            # cProfile of -O2 on 128 blocks

Two model families, scaled by their block count:

* ``resmlp``: residual MLP blocks ``x + Linear(ReLU(Linear(LayerNorm(x))))``, width 64,
  batch 2 (about 14 IR nodes a block: 8 blocks ≈ 114 nodes, 128 ≈ 1.8k, 714 ≈ 10k);
* ``branchy``: wide blocks where ``LayerNorm(x)`` feeds four parallel ``Linear → GELU``
  branches whose results are summed back onto ``x`` (many users per value, many short
  paths; about 28 nodes a block: 36 blocks ≈ 1k nodes, 357 ≈ 10k).

Each row is one model: its node count after capture, seconds for capture
(``torch.export`` + conversion to the IR), ``-O2`` (with ``Graph.verify()`` after every
pass, as ``mlcomp compile`` runs it; the cleanup and fuse parts listed separately) and
lowering to the ``cpu`` target (TorchScript trace + freeze, ``optimize=False``), then
microseconds per node for ``-O2``.  Times are CPU seconds of this process (torch is
limited to one thread), so other jobs on a shared machine disturb them little.  Flat
µs/node from 1k to 10k nodes means the pipeline scales linearly (or n log n).  Measured (2 cores shared with other jobs)::

    model           nodes  after  capture_s     O2_s  cleanup_s   fuse_s  lower_s  O2_us/node
    resmlp-72        1010    722       8.08     0.47       0.54     0.88     0.38         468
    resmlp-714       9998   7142     103.04     5.54       8.47    20.42    37.40         554

(``cleanup_s``/``fuse_s`` are the pipeline report's wall-clock seconds.)
"""
from __future__ import annotations

import argparse
import cProfile
import pstats
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlcomp.frontend.capture import capture_module  # noqa: E402
from mlcomp.pipeline import run_pipeline  # noqa: E402
from mlcomp.targets import CompileOptions, get_target  # noqa: E402

WIDTH = 64
BATCH = 2


class ResidualBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, width)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(self.act(self.fc1(self.norm(x))))


class BranchyBlock(nn.Module):
    def __init__(self, width: int, branches: int = 4) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)   # keeps deep stacks finite
        self.branches = nn.ModuleList(nn.Sequential(nn.Linear(width, width), nn.GELU()) for _ in range(branches))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        out = x
        for b in self.branches:
            out = out + b(h)
        return out


def _clock() -> float:
    """CPU seconds of this process: robust when other jobs share the machine (torch runs one thread)."""
    return time.process_time()


def make_model(family: str, blocks: int) -> nn.Module:
    block = {"resmlp": ResidualBlock, "branchy": BranchyBlock}[family]
    torch.manual_seed(0)
    return nn.Sequential(*(block(WIDTH) for _ in range(blocks))).eval()


@dataclass
class Row:
    model: str
    nodes: int
    capture_s: float
    o2_s: float
    cleanup_s: float
    fuse_s: float
    lower_s: float
    nodes_after: int

    @property
    def us_per_node(self) -> float:
        return 1e6 * self.o2_s / max(self.nodes, 1)


def measure(family: str, blocks: int, *, lower: bool = True) -> Row:
    model = make_model(family, blocks)
    x = torch.randn(BATCH, WIDTH)
    t0 = _clock()
    graph = capture_module(model, (x,), name=f"{family}{blocks}")
    capture_s = _clock() - t0
    t0 = _clock()
    out, report = run_pipeline(graph, "-O2", example_inputs=(x,))
    o2_s = _clock() - t0
    cleanup_s = sum(r.seconds for r in report.records if r.name == "cleanup")    # wall-clock, per the report
    fuse_s = sum(r.seconds for r in report.records if r.name == "fuse")
    lower_s = float("nan")
    if lower:
        t0 = _clock()
        artifact = get_target("cpu").compile(out, CompileOptions.make(optimize=False))
        lower_s = _clock() - t0
        with torch.no_grad():
            got = artifact(x)
            want = model(x)
        got = got[0] if isinstance(got, (tuple, list)) else got
        if not torch.allclose(got, want, rtol=1e-4, atol=1e-4):
            raise SystemExit(f"{family}-{blocks}: compiled output differs from eager")
    return Row(f"{family}-{blocks}", len(graph), capture_s, o2_s, cleanup_s, fuse_s, lower_s, len(out))


def format_table(rows: list[Row]) -> str:
    head = (f"{'model':<14}{'nodes':>7}{'after':>7}{'capture_s':>11}{'O2_s':>9}{'cleanup_s':>11}"
            f"{'fuse_s':>9}{'lower_s':>9}{'O2_us/node':>12}")
    lines = [head]
    for r in rows:
        lines.append(f"{r.model:<14}{r.nodes:>7}{r.nodes_after:>7}{r.capture_s:>11.2f}{r.o2_s:>9.2f}"
                     f"{r.cleanup_s:>11.2f}{r.fuse_s:>9.2f}{r.lower_s:>9.2f}{r.us_per_node:>12.0f}")
    return "\n".join(lines)


def profile(family: str, blocks: int, top: int) -> None:
    model = make_model(family, blocks)
    x = torch.randn(BATCH, WIDTH)
    graph = capture_module(model, (x,), name=f"{family}{blocks}")
    prof = cProfile.Profile()
    prof.enable()
    run_pipeline(graph, "-O2", example_inputs=(x,))
    prof.disable()
    print(f"-O2 on {family}-{blocks} ({len(graph)} nodes)")
    pstats.Stats(prof).sort_stats("cumulative").print_stats(top)
    pstats.Stats(prof).sort_stats("tottime").print_stats(top)


# blocks per family for ~100 / 1k / 10k nodes
DEFAULT_BLOCKS = {"resmlp": [8, 72, 128, 714], "branchy": [4, 36, 357]}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--family", choices=["resmlp", "branchy", "all"], default="all")
    ap.add_argument("--blocks", help="comma-separated block counts (default: ~100/1k/10k nodes)")
    ap.add_argument("--no-lower", action="store_true", help="skip lowering to the cpu target")
    ap.add_argument("--profile", type=int, metavar="BLOCKS", help="cProfile -O2 on this many blocks and exit")
    ap.add_argument("--top", type=int, default=30, help="rows of the profile to print")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    families = ["resmlp", "branchy"] if args.family == "all" else [args.family]
    if args.profile:
        profile(families[0], args.profile, args.top)
        return
    rows = []
    for fam in families:
        blocks = [int(b) for b in args.blocks.split(",")] if args.blocks else DEFAULT_BLOCKS[fam]
        for n in blocks:
            rows.append(measure(fam, n, lower=not args.no_lower))
            print(format_table(rows[-1:]).splitlines()[1], flush=True)
    print()
    print(format_table(rows))


if __name__ == "__main__":
    main()
