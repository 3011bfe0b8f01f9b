"""Fusion benchmark: what `fuse` buys on the zoo and on a chain of elementwise ops.

    .venv/bin/python benchmarks/fusion.py                      # both tables, 1 thread
    .venv/bin/python benchmarks/fusion.py --only chain --elements 16777216
    .venv/bin/python benchmarks/fusion.py --json results.json

Table 1, per zoo model, compares ``-O1`` (cleanup, no fusion) with ``-O2``
(cleanup, fuse, cleanup): IR nodes, kernels (nodes that move data: not views,
projections or parameters), ATen ops in the frozen TorchScript graph, estimated
bytes moved (mlcomp.analysis.cost: every kernel reads its inputs and writes its outputs
once) and latency of the compiled model.

Table 2 runs ``y = f_k(...f_2(f_1(x)))`` for k = 1..8 elementwise ops on a
tensor much larger than the caches (64M floats by default): eager PyTorch,
the compiled graph without fusion and with fusion.  Unfused, every op streams
the whole tensor through memory; fused, one kernel runs all k ops tile by tile
while each tile is in cache, so the tensor crosses memory once.

Latency is measured on the ``cpu`` target (TorchScript trace + freeze) when
``mlcomp.targets`` is installed, else on a frozen trace of the interpreter;
variants are interleaved round by round and the best round is reported, because
the machine is shared.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from typing import Any, Callable, Sequence

import torch
from mlcomp.passes import patterns as P
from torch import nn

from mlcomp.analysis.cost import node_bytes
from mlcomp.ir import Graph
from mlcomp.ir.ops import GETITEM
from mlcomp.pipeline import run_pipeline

UNFUSED, FUSED = "-O1", "-O2"


# ---------------------------------------------------------------------------
# compiling and timing


def compile_cpu(graph: Graph, inputs: Sequence[torch.Tensor], threads: int) -> tuple[Callable[..., Any], Any]:
    """(callable, frozen TorchScript module or None) for the graph on the CPU."""
    try:
        from mlcomp.targets import get_target
        from mlcomp.targets.base import CompileOptions
    except ImportError:                                   # no targets yet: trace the interpreter
        from mlcomp.ir.interpreter import Interpreter

        interp = Interpreter(graph, check_inputs=False)
        module = torch.jit.freeze(torch.jit.trace(_Call(interp), tuple(inputs), check_trace=False).eval())
        return module, module
    art = get_target("cpu").compile(graph, CompileOptions(threads=threads, optimize=False))
    runtime = getattr(art, "runtime", None)
    return art, getattr(runtime, "module", None)


class _Call(nn.Module):
    def __init__(self, interp: Any) -> None:
        super().__init__()
        self.interp = interp

    def forward(self, *xs: torch.Tensor) -> Any:
        return self.interp.run(*xs)


def interleaved(fns: dict[str, Callable[..., Any]], inputs: Sequence[torch.Tensor], *, rounds: int,
                calls: int, warmup: int = 2) -> dict[str, float]:
    """Seconds per call of each function: the best round, alternating between them every round.

    The best round rather than the median: on a shared machine the slow rounds
    measure the neighbours, and interleaving keeps any drift from favouring one variant.
    """
    times: dict[str, list[float]] = {k: [] for k in fns}
    with torch.no_grad():
        for fn in fns.values():
            for _ in range(warmup):
                fn(*inputs)
        for _ in range(rounds):
            for name, fn in fns.items():
                t0 = time.perf_counter()
                for _ in range(calls):
                    fn(*inputs)
                times[name].append((time.perf_counter() - t0) / calls)
    return {k: min(v) for k, v in times.items()}


# ---------------------------------------------------------------------------
# graph statistics


def kernels(graph: Graph) -> int:
    return sum(1 for n in graph.call_nodes() if n.op != GETITEM and n.op not in P.VIEW_LIKE)


def bytes_moved(graph: Graph) -> int:
    return sum(sum(node_bytes(graph, n)) for n in graph.call_nodes())


def aten_ops(module: Any) -> int | None:
    if module is None or not hasattr(module, "graph"):
        return None

    def count(block: Any) -> int:
        total = 0
        for node in block.nodes():
            total += node.kind().startswith("aten::")
            total += sum(count(b) for b in node.blocks())
        return total

    return count(module.graph)


# ---------------------------------------------------------------------------
# table 1: the zoo


def zoo_table(models: Sequence[str], batch: int, threads: int, rounds: int) -> list[dict[str, Any]]:
    from mlcomp.models import ZOO

    from mlcomp.frontend.loading import load_model

    rows = []
    for name in models:
        z = ZOO[name]
        module, inputs = z.build(), z.example_inputs(batch)
        graph = load_model(module, example_inputs=inputs).capture()
        row: dict[str, Any] = {"model": name}
        fns: dict[str, Callable[..., Any]] = {"eager": module}
        for label, spec in (("unfused", UNFUSED), ("fused", FUSED)):
            out, report = run_pipeline(graph, spec, example_inputs=inputs, verify=True)
            fn, frozen = compile_cpu(out, inputs, threads)
            fns[label] = fn
            row[label] = {"nodes": len(out.call_nodes()), "kernels": kernels(out), "aten_ops": aten_ops(frozen),
                          "bytes": bytes_moved(out)}
            if label == "fused":
                row["fuse_stats"] = report.stats("fuse")
        calls = 50 if name in ("mlp", "lenet", "gru") else 5
        t = interleaved(fns, inputs, rounds=rounds, calls=calls)
        row.update(eager_ms=t["eager"] * 1e3, unfused_ms=t["unfused"] * 1e3, fused_ms=t["fused"] * 1e3)
        rows.append(row)
        print(f"  {name}: done", file=sys.stderr, flush=True)
    return rows


def format_zoo(rows: list[dict[str, Any]]) -> str:
    head = ("| model | nodes -O1 → -O2 | kernels | ATen ops (frozen) | est. bytes moved | groups | "
            "eager ms | -O1 ms | -O2 ms | -O2 vs -O1 |")
    lines = [head, "|" + "|".join(["---"] * (head.count("|") - 1)) + "|"]
    for r in rows:
        u, f = r["unfused"], r["fused"]
        ops = f"{u['aten_ops']} → {f['aten_ops']}" if u["aten_ops"] is not None else "n/a"
        lines.append(
            f"| {r['model']} | {u['nodes']} → {f['nodes']} | {u['kernels']} → {f['kernels']} | {ops} | "
            f"{_mb(u['bytes'])} → {_mb(f['bytes'])} | {r['fuse_stats'].get('groups_formed', 0)} | "
            f"{r['eager_ms']:.3f} | {r['unfused_ms']:.3f} | {r['fused_ms']:.3f} | "
            f"{r['unfused_ms'] / r['fused_ms']:.2f}x |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------
# table 2: the chain


class Chain(nn.Module):
    """k elementwise ops in a row (the first k of a fixed list of 8)."""

    OPS: list[Callable[[torch.Tensor], torch.Tensor]] = [
        lambda t: t * 1.5, lambda t: t + 0.25, torch.relu, torch.sigmoid,
        lambda t: t - 0.5, torch.tanh, lambda t: t * t, torch.abs]

    def __init__(self, k: int) -> None:
        super().__init__()
        self.k = k

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for op in self.OPS[:self.k]:
            x = op(x)
        return x


def chain_table(elements: int, ks: Sequence[int], threads: int, rounds: int) -> list[dict[str, Any]]:
    from mlcomp.frontend.loading import load_model

    x = torch.randn(elements)
    rows = []
    for k in ks:
        module = Chain(k).eval()
        graph = load_model(module, example_inputs=(x,)).capture()
        fns: dict[str, Callable[..., Any]] = {"eager": module}
        row: dict[str, Any] = {"k": k}
        for label, spec in (("unfused", UNFUSED), ("fused", FUSED)):
            out, report = run_pipeline(graph, spec, example_inputs=(x,))
            fns[label], _ = compile_cpu(out, (x,), threads)
            row[f"{label}_kernels"] = kernels(out)
            if label == "fused":
                row["tiled"] = report.stats("fuse").get("groups_tiled", 0)
        with torch.no_grad():
            torch.testing.assert_close(_first(fns["fused"](x)), module(x))
        t = interleaved(fns, (x,), rounds=rounds, calls=1, warmup=1)
        row.update(eager_ms=t["eager"] * 1e3, unfused_ms=t["unfused"] * 1e3, fused_ms=t["fused"] * 1e3)
        rows.append(row)
        print(f"  chain k={k}: done", file=sys.stderr, flush=True)
    return rows


def format_chain(rows: list[dict[str, Any]], elements: int) -> str:
    gb = elements * 4 / 2**30
    lines = [f"| k | eager ms | unfused ms | fused ms | fused vs eager | fused vs unfused | "
             f"eager GB/s ({gb:.2f} GiB x 2k) |", "|---|---|---|---|---|---|---|"]
    for r in rows:
        traffic = 2 * r["k"] * gb
        lines.append(f"| {r['k']} | {r['eager_ms']:.1f} | {r['unfused_ms']:.1f} | {r['fused_ms']:.1f} | "
                     f"{r['eager_ms'] / r['fused_ms']:.2f}x | {r['unfused_ms'] / r['fused_ms']:.2f}x | "
                     f"{traffic / (r['eager_ms'] / 1e3):.1f} |")
    return "\n".join(lines)


def _first(value: Any) -> Any:
    return value[0] if isinstance(value, (tuple, list)) else value


def _mb(n: int) -> str:
    return f"{n / 2**20:.1f} MB"


# ---------------------------------------------------------------------------


def main(argv: Sequence[str] | None = None) -> int:
    from mlcomp.models import ZOO

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", choices=["zoo", "chain"], help="run one table")
    ap.add_argument("--models", nargs="*", default=list(ZOO))
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads for every variant (default 1)")
    ap.add_argument("--elements", type=int, default=64 * 2**20, help="chain tensor size (default 64M floats)")
    ap.add_argument("--ks", type=int, nargs="*", default=list(range(1, 9)))
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--json", help="also write the raw numbers here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    result: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "threads": args.threads,
                              "torch": torch.__version__}
    if args.only in (None, "zoo"):
        result["zoo"] = zoo_table(args.models, args.batch, args.threads, args.rounds)
        print(f"\nZoo models, batch {args.batch}, {args.threads} thread(s), best of {args.rounds} rounds\n")
        print(format_zoo(result["zoo"]))
    if args.only in (None, "chain"):
        result["chain"] = chain_table(args.elements, args.ks, args.threads, args.rounds)
        print(f"\nElementwise chain on {args.elements / 2**20:.0f}M floats, {args.threads} thread(s), "
              f"best of {args.rounds} rounds\n")
        print(format_chain(result["chain"], args.elements))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(result, fh, indent=2, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
