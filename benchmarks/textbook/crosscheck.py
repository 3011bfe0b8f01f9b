"""Whole-process cross-check of ``mlcomp bench``: no in-process clock, only hyperfine's.

One process either runs a zoo model eagerly or loads a saved artifact, then
calls it ``--calls`` times on one fixed input.  hyperfine times whole
processes; running each variant with ``--calls 0`` as well measures its
start-up (interpreter, imports, loading), so

    per call = (time(calls=N) - time(calls=0)) / N

Artifacts can equally be timed with the targets' own ``mlcomp run DIR --repeat N``
(one call at ``--repeat 1`` is then the baseline); ``summarize`` takes the
smallest and largest count of each command name.

is the steady-state cost of one call, measured from outside the process.  The
ratio eager / artifact is then compared with the bench's in-process speedup.

    python crosscheck.py eager mlp --batch 1 --calls 20000
    python crosscheck.py artifact out/mlp-cpu --calls 20000
    python crosscheck.py summarize hyperfine.json          # per-call times and the ratio
"""
from __future__ import annotations

import argparse
import json
import sys


def _eager(model: str, batch: int, calls: int) -> None:
    import torch
    from mlcomp.models import get

    zoo = get(model)
    net, (x,) = zoo.build(), zoo.example_inputs(batch)
    with torch.inference_mode():
        for _ in range(calls):
            net(x)


def _artifact(path: str, calls: int) -> None:
    import torch

    import mlcomp
    from mlcomp.frontend.loading import InputSpec

    art = mlcomp.load(path)
    xs = [InputSpec.from_json(spec).random(torch.Generator().manual_seed(i))
          for i, spec in enumerate(art.manifest["inputs"])]
    with torch.inference_mode():
        for _ in range(calls):
            art(*xs)


def _summarize(path: str) -> None:
    """Read hyperfine's JSON (commands named ``NAME N``) and print per-call costs and ratios.

    Two clocks: wall time (median of runs, ± from hyperfine's spread) and the
    process's own CPU time (user + system, mean of runs).  On a machine other processes keep busy, wall time
    also counts the time the process waited for a core; CPU time does not.
    """
    data = json.load(open(path))
    runs: dict[str, dict[int, dict]] = {}
    for r in data["results"]:
        name, n = r["command"].rsplit(" ", 1)
        runs.setdefault(name, {})[int(n)] = r
    per_call: dict[str, dict[str, tuple[float, float]]] = {}
    for name, by_n in runs.items():
        lo, hi = min(by_n), max(by_n)
        a, b, n = by_n[lo], by_n[hi], hi - lo
        wall = ((b["median"] - a["median"]) / n, ((b["stddev"] or 0) ** 2 + (a["stddev"] or 0) ** 2) ** 0.5 / n)
        cpu_a, cpu_b = a["user"] + a["system"], b["user"] + b["system"]
        cpu = ((cpu_b - cpu_a) / n, 0.0)      # hyperfine exports only the mean CPU time: no spread
        per_call[name] = {"wall": wall, "cpu": cpu}
        print(f"{name:<16} start-up {a['median']:6.3f} s wall, {cpu_a:6.3f} s cpu;  per call: "
              f"wall {wall[0] * 1e6:7.1f} ± {wall[1] * 1e6:5.1f} µs, cpu {cpu[0] * 1e6:7.1f} µs")
    base = next((k for k in per_call if k.startswith("eager")), None)
    if not base:
        return
    for name in per_call:
        if name == base:
            continue
        parts = []
        for clock in ("wall", "cpu"):
            (b, be), (t, te) = per_call[base][clock], per_call[name][clock]
            if t > 0 and b > 0:
                ratio = b / t
                spread = ratio * ((be / b) ** 2 + (te / t) ** 2) ** 0.5
                parts.append(f"{clock} {ratio:.2f}x" + (f" ± {spread:.2f}" if spread else ""))
        print(f"speedup of {name} over {base}: " + ", ".join(parts))


def main(argv: list[str]) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="what", required=True)
    e = sub.add_parser("eager")
    e.add_argument("model")
    e.add_argument("--batch", type=int, default=1)
    e.add_argument("--calls", type=int, default=10000)
    a = sub.add_parser("artifact")
    a.add_argument("path")
    a.add_argument("--calls", type=int, default=10000)
    s = sub.add_parser("summarize")
    s.add_argument("json")
    args = ap.parse_args(argv)
    if args.what == "eager":
        _eager(args.model, args.batch, args.calls)
    elif args.what == "artifact":
        _artifact(args.path, args.calls)
    else:
        _summarize(args.json)


if __name__ == "__main__":
    main(sys.argv[1:])
