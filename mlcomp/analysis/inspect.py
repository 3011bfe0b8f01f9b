"""``mlcomp inspect``: what a captured graph is made of and how parallel it is.

The report holds the op histogram, parameter count and bytes (integer
constants such as BatchNorm's ``num_batches_tracked`` are buffers, counted
apart), per-node and
total FLOPs (``torch.utils.flop_counter`` on meta tensors), bytes moved,
arithmetic intensity (all from :mod:`mlcomp.analysis.cost`), the peak memory of
live activations (:mod:`mlcomp.analysis.liveness`), and the *parallelism profile*: the width of every
topological generation (how many ops could run at once) and the critical-path
length: the textbook's "automatic parallelism" measured on the real graph.

    >>> from mlcomp.ir.builder import linear_relu_graph
    >>> graph = linear_relu_graph(batch=2, features=512, out=256)     # relu(x @ W.T + b)
    >>> r = inspect_graph(graph)
    >>> r.to_json()["flops"], r.to_json()["peak_activation_bytes"]
    (524288, 4096)
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from mlcomp.analysis import cost, liveness
from mlcomp.base.units import fmt_bytes
from mlcomp.ir import Graph, dtype_name
from mlcomp.ir.dtypes import itemsize
from mlcomp.ir.graph_tools import critical_path, generations
from mlcomp.ir.ops import GETITEM, PARAM


@dataclass(frozen=True)
class NodeRow:
    name: str
    op: str
    module: str
    shape: str
    flops: int
    bytes: int

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else 0.0


@dataclass(frozen=True)
class InspectReport:
    name: str
    inputs: list[str]
    outputs: list[str]
    nodes: int
    op_histogram: dict[str, int]
    params: int
    param_bytes: int
    param_dtypes: dict[str, int]
    flops: int
    bytes: int
    rows: list[NodeRow] = field(repr=False)
    generation_widths: list[int] = field(repr=False)
    critical_path: list[str] = field(repr=False)
    critical_path_flops: int = 0
    peak_activation_bytes: int = 0      # analysis.liveness, graph order, inputs/params not counted
    buffers: int = 0                    # integer/bool constants (BatchNorm's num_batches_tracked …)
    buffer_bytes: int = 0
    kept_ops: dict[str, str] = field(default_factory=dict)   # left undecomposed by capture → why

    @property
    def intensity(self) -> float:
        return self.flops / self.bytes if self.bytes else 0.0

    @property
    def max_width(self) -> int:
        return max(self.generation_widths, default=0)

    @property
    def average_parallelism(self) -> float:
        """Compute nodes per generation: the speedup an ideal scheduler could get from concurrency."""
        n = sum(self.generation_widths)
        return n / len(self.generation_widths) if self.generation_widths else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "inputs": self.inputs, "outputs": self.outputs, "nodes": self.nodes,
            "op_histogram": self.op_histogram, "params": self.params, "param_bytes": self.param_bytes,
            "param_dtypes": self.param_dtypes, "buffers": self.buffers, "buffer_bytes": self.buffer_bytes,
            "flops": self.flops, "bytes": self.bytes, "kept_ops": dict(self.kept_ops),
            "intensity": self.intensity, "peak_activation_bytes": self.peak_activation_bytes,
            "parallelism": {
                "generations": len(self.generation_widths), "widths": self.generation_widths,
                "max_width": self.max_width, "average": self.average_parallelism,
                "critical_path_length": len(self.critical_path), "critical_path": self.critical_path,
                "critical_path_flops": self.critical_path_flops,
            },
            "per_node": [{"name": r.name, "op": r.op, "module": r.module, "shape": r.shape,
                          "flops": r.flops, "bytes": r.bytes, "intensity": r.intensity} for r in self.rows],
        }

    def format(self, *, top: int = 10) -> str:
        lines = [f"model {self.name}",
                 f"  inputs   {', '.join(self.inputs)}",
                 f"  outputs  {', '.join(self.outputs)}",
                 f"  params   {self.params:,} ({_bytes(self.param_bytes)}; "
                 + ", ".join(f"{k}: {v:,}" for k, v in self.param_dtypes.items()) + ")"
                 + (f"; buffers {self.buffers:,} integer ({_bytes(self.buffer_bytes)})" if self.buffers else ""),
                 f"  nodes    {self.nodes} compute nodes",
                 f"  FLOPs    {_human(self.flops)}FLOP   bytes moved {_bytes(self.bytes)}   "
                 f"intensity {self.intensity:.2f} FLOP/B",
                 f"  memory   peak activations {_bytes(self.peak_activation_bytes)} "
                 "(graph order; inputs and params not counted)",
                 *(f"  kept     {op} undecomposed: {why}" for op, why in self.kept_ops.items()),
                 "", "op histogram"]
        width = max((len(k) for k in self.op_histogram), default=10)
        for op, n in sorted(self.op_histogram.items(), key=lambda kv: (-kv[1], kv[0])):
            lines.append(f"  {op:<{width}}  {n:>5}")
        lines += ["", f"top {min(top, len(self.rows))} nodes by FLOPs"]
        hdr = f"  {'node':<28} {'op':<34} {'module':<22} {'GFLOP':>9} {'bytes':>10} {'FLOP/B':>8}"
        lines.append(hdr)
        for r in sorted(self.rows, key=lambda r: -r.flops)[:top]:
            lines.append(f"  {r.name[:28]:<28} {r.op[:34]:<34} {r.module[:22]:<22} {r.flops / 1e9:>9.4f} "
                         f"{_bytes(r.bytes):>10} {r.intensity:>8.2f}")
        total_nodes = sum(self.generation_widths)
        lines += ["", "parallelism profile (automatic parallelism on the real graph)",
                  f"  generations {len(self.generation_widths)} (critical path {len(self.critical_path)} ops, "
                  f"{_human(self.critical_path_flops)}FLOP)",
                  f"  widest generation {self.max_width} ops; average {self.average_parallelism:.2f} ops "
                  f"per generation ({total_nodes} ops)",
                  "  widths " + _sparkline(self.generation_widths)]
        return "\n".join(lines)


def inspect_graph(graph: Graph) -> InspectReport:
    costs = cost.graph_cost(graph)
    compute = [n for n in graph.call_nodes() if n.op != GETITEM]
    hist = Counter(str(n.op) for n in compute)
    params = graph.nodes(PARAM)
    param_dtypes: Counter[str] = Counter()
    param_count = param_bytes = buffer_count = buffer_bytes = 0
    for p in params:
        t = graph.constants[p.name]
        if not (t.is_floating_point() or t.is_complex()):     # step counters, indices: state, not weights
            buffer_count += t.numel()
            buffer_bytes += t.numel() * itemsize(t.dtype)
            continue
        param_count += t.numel()
        param_bytes += t.numel() * itemsize(t.dtype)
        param_dtypes[dtype_name(t.dtype)] += t.numel()
    rows = [NodeRow(n.name, str(n.op), n.origin.module_path, str(n.meta) if n.meta is not None else "",
                    costs[n.name].flops, costs[n.name].bytes) for n in compute]
    total = cost.total(costs)
    path = critical_path(graph, weight=lambda n: float(costs[n.name].flops) if n.name in costs else 0.0)
    return InspectReport(
        name=graph.name,
        inputs=[f"{n.name}: {n.meta}" for n in graph.input_nodes],
        outputs=[f"{r.name}: {graph.node(r.name).meta}" for r in graph.output_refs],
        nodes=len(compute), op_histogram=dict(hist), params=param_count, param_bytes=param_bytes,
        param_dtypes=dict(param_dtypes), flops=total.flops, bytes=total.bytes, rows=rows,
        generation_widths=[len(g) for g in generations(graph)], critical_path=path,
        critical_path_flops=sum(costs[n].flops for n in path if n in costs),
        peak_activation_bytes=liveness.peak_bytes(graph), buffers=buffer_count, buffer_bytes=buffer_bytes,
        kept_ops=dict(graph.kept_ops))


def _human(x: float) -> str:
    for unit, scale in (("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.3f} {unit}"
    return f"{x:.0f} "


def _bytes(x: float) -> str:
    """Two decimals: inspect prints one model, so sizes are read closely."""
    return fmt_bytes(x, digits=2)


def _sparkline(widths: list[int], limit: int = 80) -> str:
    if not widths:
        return ""
    bars = " ▁▂▃▄▅▆▇█"
    top = max(widths)
    cells = [bars[max(1, round(w / top * 8))] for w in widths[:limit]]
    more = f" … (+{len(widths) - limit})" if len(widths) > limit else ""
    return "".join(cells) + more + f"  (max {top})"
