"""Study ``roofline``: this machine's peaks, and every op of a model placed on its roofline.

1. :func:`mlcomp.hardware.probe.measure_hardware` measures peak FLOP/s (fp32, bf16
   matrix products), memory bandwidth (large copy / add) and per-op dispatch
   overhead, giving a :class:`~mlcomp.analysis.cost.HardwareSpec`.
2. The model is captured; :mod:`mlcomp.analysis.cost` gives every node's FLOPs, bytes
   and arithmetic intensity.
3. The graph runs node by node, as the interpreter runs it (each node's op
   callable on the real values its inputs produced), and every compute node
   is timed on its own.
4. Per op: which roof bounds it here (memory or compute), the roofline time
   ``max(flops / peak, bytes / bandwidth)``, the achieved fraction of that
   bound, and which roof would bound it on the spec-sheet GPUs
   (:data:`mlcomp.analysis.cost.SPEC_SHEETS`).

Ops that only re-describe memory (views) move nothing and are not placed.
FLOPs are ``torch.utils.flop_counter``'s, which counts matrix products and
convolutions only; elementwise ops therefore sit at intensity 0 (memory-bound).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from mlcomp.hardware.timing import TimingPolicy, fmt_rate, fmt_seconds, measure, synchronizer
from mlcomp.study import chapter
from mlcomp.study.common import Figure, StudyConfig, StudyResult, Table, machine_line


@dataclass(frozen=True)
class OpPoint:
    """One node on the roofline."""

    name: str
    op: str
    module: str
    flops: int
    bytes: int
    intensity: float
    bound: str                      # memory | compute, on this machine
    seconds: float                  # measured median of the op alone
    roofline_s: float               # max(flops/peak, bytes/bandwidth) on this machine
    other_bounds: tuple[str, ...]   # bound on each spec-sheet device, in SPEC_SHEETS order

    @property
    def fraction(self) -> float:
        """Achieved fraction of the roofline bound (1.0 = at the roof)."""
        return self.roofline_s / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "op": self.op, "module": self.module, "flops": self.flops, "bytes": self.bytes,
                "intensity": self.intensity, "bound": self.bound, "seconds": self.seconds,
                "roofline_s": self.roofline_s, "fraction": self.fraction, "spec_bounds": list(self.other_bounds)}


def place_ops(graph: Any, inputs: tuple, spec: Any, policy: TimingPolicy, *, device: str = "cpu",
              clock: Any = None) -> list[OpPoint]:
    """Run ``graph`` node by node in topological order, timing each compute node alone.

    Every node gets the real values its inputs produced (parameters moved to
    ``device``), is timed with ``policy`` and placed on ``spec``'s roofline.
    """
    import time

    import torch

    from mlcomp.analysis.cost import node_cost
    from mlcomp.hardware.spec import SPEC_SHEETS
    from mlcomp.ir import TensorMeta, map_refs
    from mlcomp.ir.interpreter import check_input
    from mlcomp.ir.ops import INPUT, OUTPUT, PARAM

    sync = synchronizer(device)
    feed = dict(zip((n.name for n in graph.input_nodes), inputs))
    env: dict[str, Any] = {}
    points: list[OpPoint] = []
    for node in graph.nodes():
        if node.op == INPUT:
            check_input(node, feed[node.name])
            env[node.name] = feed[node.name]
            continue
        if node.op == PARAM:
            env[node.name] = graph.constants[node.name].to(device)
            continue
        if node.op == OUTPUT:
            continue
        fn = node.op.resolve()                       # the same op callable the interpreter runs
        args = map_refs(node.inputs, lambda r: env[r.name])
        kwargs = map_refs(dict(node.attrs), lambda r: env[r.name])
        env[node.name] = fn(*args, **kwargs)
        cost = node_cost(graph, node)
        if cost.bytes == 0 and cost.flops == 0:      # views and bookkeeping move nothing
            continue
        t = measure(lambda: fn(*args, **kwargs), policy, clock=clock or time.perf_counter, sync=sync)
        dtype = node.meta.dtype if isinstance(node.meta, TensorMeta) else torch.float32
        roof = max(cost.flops / spec.peak(dtype), cost.bytes / spec.bandwidth)
        points.append(OpPoint(node.name, node.op.name, node.origin.module_path or "<root>", cost.flops,
                              cost.bytes, cost.intensity, spec.bound(cost, dtype), t.median, roof,
                              tuple(s.bound(cost, dtype) for s in SPEC_SHEETS.values())))
    return points


def run(config: StudyConfig) -> StudyResult:
    import torch

    from mlcomp.frontend.loading import load_model
    from mlcomp.hardware.probe import measure_hardware
    from mlcomp.hardware.spec import SPEC_SHEETS

    device = config.resolved_device()
    profile = measure_hardware(device, quick=config.quick, budget_s=config.budget_s, clock=config.clock)
    spec = profile.spec
    model = config.model
    source = load_model(model, batch=config.batch, input_shapes=config.input_shapes)
    graph = source.capture()
    inputs = tuple(t.to(device) for t in source.inputs())
    policy = (TimingPolicy(warmup=1, budget_s=0.005, min_repeats=1, max_repeats=3) if config.quick
              else TimingPolicy(warmup=2, budget_s=min(config.budget_s, 0.1), min_repeats=5))
    eager = source.eager.to(device)
    with torch.inference_mode():
        points = place_ops(graph, inputs, spec, policy, device=device, clock=config.clock)
        whole = measure(lambda: eager(*inputs), config.policy(), clock=config.timer,
                        sync=synchronizer(device)).median
    total_flops = sum(p.flops for p in points)
    total_bytes = sum(p.bytes for p in points)
    op_sum = sum(p.seconds for p in points)
    roof_sum = sum(p.roofline_s for p in points)
    m = {x.label: x for x in profile.measurements}
    figures = [
        Figure("peak fp32 (matrix product)", spec.peak_flops["fp32"], "FLOP/s", "",
               max((k for k in m if "fp32" in k), key=lambda k: m[k].rate)),
        Figure("peak bf16 (matrix product)", spec.peak_flops["bf16"], "FLOP/s", "",
               f"{spec.peak_flops['bf16'] / spec.peak_flops['fp32']:.2f}x fp32; CPU flags: "
               f"{' '.join(profile.cpu_flags) or 'n/a'}"),
        Figure("memory bandwidth (best of copy/add)", spec.bandwidth, "B/s", chapter.HARDWARE["dram_bw"]),
        Figure("dispatch overhead per op", spec.launch_overhead, "s"),
        Figure("ridge point fp32 (FLOP/byte)", spec.ridge_point(), "FLOP/B", "",
               "ops with lower intensity are memory-bound here"),
    ]
    for key, s in SPEC_SHEETS.items():
        figures.append(Figure(f"ridge point fp32 on {key} (spec sheet)", s.ridge_point(), "FLOP/B",
                              chapter.HARDWARE.get(key, ""), f"{s.name}: peaks from mlcomp.analysis.cost.SPEC_SHEETS"))
    figures += [
        Figure(f"{model}: whole model, eager", whole, "s"),
        Figure(f"{model}: sum of ops timed alone", op_sum, "s", "", f"{len(points)} ops"),
        Figure(f"{model}: sum of roofline bounds", roof_sum, "s", "",
               f"{roof_sum / op_sum:.0%} of the measured op time" if op_sum else ""),
    ]
    for key, s in SPEC_SHEETS.items():
        est = sum(max(p.flops / s.peak(torch.float32), p.bytes / s.bandwidth) + s.launch_overhead for p in points)
        figures.append(Figure(f"{model}: cost-model estimate on {key}", est, "s", "",
                              "roofline + launch overhead per op; a prediction, not a measurement"))
    specs = tuple(SPEC_SHEETS)
    rows = tuple((p.name, p.op, p.module, fmt_rate(p.flops, "FLOP") if p.flops else "0",
                  fmt_rate(p.bytes, "B"), f"{p.intensity:.2f}", p.bound, fmt_seconds(p.seconds),
                  fmt_seconds(p.roofline_s), f"{p.fraction:.0%}", "/".join(b[0].upper() for b in p.other_bounds))
                 for p in sorted(points, key=lambda p: -p.seconds))
    table = Table(f"every op of {model} (batch {config.batch}) alone, slowest first; bound on "
                  f"{'/'.join(specs)}: M = memory, C = compute",
                  ("node", "op", "module", "FLOPs", "bytes", "FLOP/B", "bound", "measured", "roofline",
                   "of bound", "/".join(specs)), rows, frozenset({3, 4, 5, 7, 8, 9}))
    notes = [
        f"{sum(p.bound == 'memory' for p in points)} of {len(points)} ops are memory-bound on this machine "
        f"(ridge point {spec.ridge_point():.1f} FLOP/B); on {specs[-1]} "
        f"{sum(p.other_bounds[-1][0] == 'm' for p in points)} would be "
        f"(ridge point {SPEC_SHEETS[specs[-1]].ridge_point():.1f} FLOP/B).",
        "'of bound' is roofline time / measured time: far below 100% means the op is dominated by "
        "dispatch overhead or runs below peak, typical of small ops at batch 1.",
        _cache_note(points, device),
        f"Totals: {fmt_rate(total_flops, 'FLOP')}, {fmt_rate(total_bytes, 'B')} moved (each op's operands "
        "crossing main memory once).",
    ]
    setup = (f"{profile.spec.name}; model {model} batch {config.batch} on {device}; each op timed alone "
             f"(median, budget {policy.budget_s:g} s). {machine_line()}")
    data = {"hardware": profile.to_json(), "ops": [p.to_json() for p in points], "model": model,
            "spec_sheets": {k: {"name": s.name, "peak_flops": dict(s.peak_flops), "bandwidth": s.bandwidth}
                            for k, s in SPEC_SHEETS.items()}}
    return StudyResult("roofline", "Roofline: this machine and every op of a model", setup, tuple(figures),
                       (table,), tuple(notes), data)


def _cache_note(points: list[OpPoint], device: str) -> str:
    """Ops beating the memory roof: say whether their data fits in the last-level cache."""
    from mlcomp.hardware.probe import last_level_cache_bytes

    over = [p for p in points if p.bound == "memory" and p.fraction > 1.0]
    if not over:
        return "No memory-bound op beat the measured memory roof."
    llc = last_level_cache_bytes() if device == "cpu" else 0
    biggest = max(p.bytes for p in over)
    text = (f"{len(over)} memory-bound op(s) ran faster than the DRAM roof allows (up to "
            f"{max(p.fraction for p in over):.1f}x); the largest moves {fmt_rate(biggest, 'B')}")
    if llc:
        fits = "less than" if biggest < llc else "more than"
        text += (f", {fits} the {fmt_rate(llc, 'B')} last-level cache: "
                 + ("their operands stay in cache between repeats, whose bandwidth the DRAM roof does not "
                    "describe" if biggest < llc else "noise or a bandwidth measurement below the true peak"))
    return text + "."


def plot(result: StudyResult, path: str) -> None:
    """Left: roofline with measured and spec-sheet roofs, ops as points; right: fraction of bound per op."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from mlcomp.base.files import atomic_path

    hw, ops = result.data["hardware"], result.data["ops"]
    fig, (ax, ax_f) = plt.subplots(1, 2, figsize=(13, 5))
    xs = np.logspace(-2, 4, 200)
    bw = hw["bandwidth"]
    for key, style in (("fp32", "-"), ("bf16", "--")):
        ax.plot(xs, np.minimum(hw["peak_flops"][key], xs * bw), "k" + style, lw=1.6,
                label=f"this machine {key} (measured)")
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for (key, s), c in zip(result.data["spec_sheets"].items(), colours[3:]):
        ax.plot(xs, np.minimum(s["peak_flops"]["fp32"], xs * s["bandwidth"]), color=c, lw=0.9, alpha=0.7,
                label=f"{key} fp32 (spec sheet)")
    kinds = sorted({o["op"] for o in ops if o["flops"] > 0})
    for kind, c in zip(kinds, colours):
        pts = [o for o in ops if o["op"] == kind and o["flops"] > 0]
        ax.scatter([o["intensity"] for o in pts], [o["flops"] / o["seconds"] for o in pts], s=22, color=c,
                   label=f"{kind} (achieved)", zorder=3, edgecolors="black", linewidths=0.4)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("arithmetic intensity, FLOP/byte")
    ax.set_ylabel("FLOP/s")
    ax.set_title(f"{result.data['model']}: ops with FLOPs on the roofline", fontsize=10)
    ax.grid(True, which="both", alpha=0.25)
    ax.legend(fontsize=7, loc="lower right")
    mem = [o for o in ops if o["bound"] == "memory"]
    comp = [o for o in ops if o["bound"] == "compute"]
    for group, c, lb in ((mem, "#4c72b0", "memory-bound here"), (comp, "#dd8452", "compute-bound here")):
        ax_f.scatter([max(o["bytes"], 1) for o in group], [max(o["fraction"], 1e-4) for o in group], s=18,
                     color=c, label=lb)
    ax_f.axhline(1.0, color="black", lw=0.8, ls="--")
    ax_f.set_xscale("log")
    ax_f.set_yscale("log")
    ax_f.set_xlabel("bytes moved by the op")
    ax_f.set_ylabel("achieved fraction of roofline bound")
    ax_f.set_title("how close each op gets to its roof (all ops)", fontsize=10)
    ax_f.grid(True, which="both", alpha=0.25)
    ax_f.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path, "png") as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
