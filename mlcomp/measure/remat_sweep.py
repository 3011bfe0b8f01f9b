"""``mlcomp bench MODEL --train --remat-sweep``: caps on the saved activations against memory and step time.

For one model and batch the joint graph is captured once, compiled without
remat (the reference) and once per cap through the ``remat`` pass
(``remat{saved=B solver=S}``: at most the fraction B of the saved-activation
bytes kept, then the pass's default budget 0.1: the cheapest plan within a tenth of
the way from the lowest predicted peak under that cap to the peak without remat; plus Chen's
``remat{solver=sqrt}``).  Per point:

* **predicted peak** -- :func:`mlcomp.analysis.step_peak.step_memory` of the
  rewritten graph: the whole step (optimizer update included) above parameters, buffers and inputs, with
  kernels' scratch (:func:`mlcomp.analysis.workspace.op_workspaces`);
* **measured peak** -- one compiled step's peak above the state before it,
  on CPU from torch's allocator events (:func:`~mlcomp.measure.training_bench.step_peak`);
* **activations saved** -- the drop in bytes the backward keeps from the
  forward (:func:`~mlcomp.analysis.training_graph.saved_activations`, graph inputs
  left out: they are resident either way), relative to no remat;
* **step time** and **overhead** -- medians of all points timed interleaved;
* **gradient error** -- the worst parameter's ``max|g - g_ref| / max|g_ref|``
  against the no-remat step on the same batch (remat recomputes the same ops, so
  it should be 0 or rounding).

A cap the solver cannot meet is a row saying so (with the minimum the pass
reported), not a failure of the sweep.  A cap is a fraction of the
saved-activation bytes without remat (graph inputs included, as the pass counts
them).  The zoo MLP at batch 16 (its input, which cannot be recomputed, is 57%
of what the backward saves, so 0.5 is below the minimum; columns abridged)::

    print(remat_sweep("mlp", batch=16).format())
    remat sweep: mlp, batch 16, cpu, solver mincut
    remat  predicted   measured  pred/meas  acts kept  acts saved  ...  grad err  recomputed
    none   658.5 KiB  658.5 KiB      1.000   24.1 KiB          0%  ...   0.0e+00           0
    1.0    658.5 KiB  658.5 KiB      1.000   24.1 KiB          0%  ...   0.0e+00           0
    0.5            —          —          —          —           —  ...         —           —  cap not met
    sqrt   658.5 KiB  658.5 KiB      1.000    8.0 KiB         67%  ...   0.0e+00           4
"""
from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mlcomp.analysis.step_peak import step_memory
from mlcomp.analysis.training_graph import saved_activations
from mlcomp.analysis.workspace import op_workspaces
from mlcomp.base.errors import PassFailure
from mlcomp.base.files import atomic_path
from mlcomp.base.table import Table
from mlcomp.base.units import fmt_bytes
from mlcomp.hardware.timing import (
    Timing,
    TimingPolicy,
    fmt_seconds,
    measure_interleaved,
    synchronizer,
)
from mlcomp.ir import Graph
from mlcomp.ir.ops import INPUT
from mlcomp.measure.training_bench import (
    DEFAULT_POLICY,
    TrainingCase,
    step_peak,
    training_case,
)
from mlcomp.pipeline.manager import run_pipeline
from mlcomp.pipeline.spec import Pipeline
from mlcomp.runtime.optim import OptimizerSpec
from mlcomp.training.step import TrainingArtifact, compile_training

__all__ = [
    "SWEEP_BUDGETS",
    "RematSweep",
    "SweepPoint",
    "activation_bytes",
    "grad_error",
    "plot_sweeps",
    "remat_spec",
    "remat_sweep",
    "sweep_models",
]

SWEEP_BUDGETS = ("1.0", "0.5", "0.25", "0.1", "sqrt")
NONE = "none"      # the reference point: the joint graph as captured


def remat_spec(budget: str, solver: str = "mincut") -> str:
    """The pipeline text of one sweep point: ``sqrt`` is Chen's plan, anything else a cap on the saved bytes."""
    return "remat{solver=sqrt}" if budget == "sqrt" else f"remat{{saved={budget} solver={solver}}}"


def activation_bytes(graph: Graph) -> int:
    """Bytes the backward reads from the forward, graph inputs left out (they are resident anyway)."""
    return sum(s.nbytes for s in saved_activations(graph) if graph.node(s.name).op != INPUT)


def grad_error(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> tuple[float, float]:
    """``(worst relative, worst absolute)`` gradient difference over parameters: per parameter
    ``max|g - g_ref|``, relative to ``max|g_ref|`` (0 when both are 0)."""
    rel = absolute = 0.0
    for name, r in ref.items():
        diff = (got[name].double() - r.double()).abs().max().item() if r.numel() else 0.0
        scale = r.double().abs().max().item() if r.numel() else 0.0
        absolute = max(absolute, diff)
        rel = max(rel, diff / scale if scale > 0 else diff)
    return rel, absolute


@dataclass(frozen=True)
class SweepPoint:
    """One budget of the sweep (``label`` is the budget, ``sqrt`` or ``none``)."""

    label: str
    spec: str
    predicted_peak: int = 0
    measured_peak: int = 0
    activation_bytes: int = 0
    step: Timing | None = None
    grad_rel_error: float = 0.0
    grad_abs_error: float = 0.0
    stats: dict[str, Any] | None = None      # the remat pass's stats
    note: str = ""                           # why there is no measurement (cap not met)

    @property
    def ok(self) -> bool:
        return not self.note


@dataclass(frozen=True)
class RematSweep:
    model: str
    batch: int
    device: str
    solver: str
    memory_method: str
    points: tuple[SweepPoint, ...]      # the reference (``none``) first

    @property
    def reference(self) -> SweepPoint:
        return self.points[0]

    def saved_pct(self, p: SweepPoint) -> float:
        """Activation memory saved by ``p``, percent of the reference's."""
        ref = self.reference.activation_bytes
        return 100.0 * (1 - p.activation_bytes / ref) if ref else 0.0

    def overhead_pct(self, p: SweepPoint) -> float:
        assert p.step is not None and self.reference.step is not None
        return 100.0 * (p.step.median / self.reference.step.median - 1)

    def table(self) -> Table:
        columns = ("remat", "predicted", "measured", "pred/meas", "acts kept", "acts saved", "step (med)",
                   "overhead", "grad err", "recomputed", "recompute GFLOP")
        rows = []
        for p in self.points:
            if not p.ok:
                rows.append((p.label, *(["—"] * (len(columns) - 2)), "cap not met"))
                continue
            st = p.stats or {}
            rows.append((p.label, fmt_bytes(p.predicted_peak), fmt_bytes(p.measured_peak),
                         f"{p.predicted_peak / p.measured_peak:.3f}" if p.measured_peak else "—",
                         fmt_bytes(p.activation_bytes), f"{self.saved_pct(p):.0f}%",
                         fmt_seconds(p.step.median if p.step else None),
                         f"{self.overhead_pct(p):+.1f}%" if p.step else "—", f"{p.grad_rel_error:.1e}",
                         str(st.get("nodes_recomputed", 0)), f"{st.get('recompute_flops', 0) / 1e9:.3g}"))
        return Table(f"remat sweep: {self.model}, batch {self.batch}, {self.device}, solver {self.solver}",
                     columns, tuple(rows), right=frozenset(range(1, len(columns) - 1)))

    def format(self) -> str:
        return self.table().format() + (
            f"\nmeasured: {self.memory_method}, one step above the state before it; predicted: liveness over the "
            "rewritten joint graph; acts = bytes the backward reads from the forward (inputs left out); "
            "grad err = worst parameter's max|g - g_ref| / max|g_ref| vs no remat") + "".join(
            f"\n{p.label}: {p.note}" for p in self.points if not p.ok)

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "batch": self.batch, "device": self.device, "solver": self.solver,
                "memory_method": self.memory_method, "points": [
                    {"label": p.label, "spec": p.spec, "note": p.note, "predicted_peak_bytes": p.predicted_peak,
                     "measured_peak_bytes": p.measured_peak, "activation_bytes": p.activation_bytes,
                     "activation_saved_pct": self.saved_pct(p) if p.ok else None,
                     "step": p.step.to_json() if p.step else None,
                     "overhead_pct": self.overhead_pct(p) if p.step else None,
                     "grad_rel_error": p.grad_rel_error, "grad_abs_error": p.grad_abs_error,
                     "stats": p.stats} for p in self.points]}


def _rewrite(graph: Graph, spec: str, inputs: Sequence[torch.Tensor]) -> tuple[Graph | None, dict[str, Any], str]:
    """The graph after ``spec`` and the pass's stats, or ``(None, {}, why)`` when the cap cannot be met."""
    try:
        out, report = run_pipeline(graph, Pipeline.parse(spec), example_inputs=inputs)
    except PassFailure as exc:
        return None, {}, exc.what
    stats = next((r.stats for r in report.records if r.name == "remat"), {})
    return out, dict(stats), ""


def remat_sweep(model: str | torch.nn.Module | TrainingCase, *, batch: int = 32,
                inputs: Sequence[torch.Tensor] | None = None, loss: Any = "cross_entropy",
                optimizer: str = "sgd{lr=0.01 momentum=0.9}", target: str = "cpu",
                budgets: Sequence[str] = SWEEP_BUDGETS, solver: str = "mincut",
                policy: TimingPolicy = DEFAULT_POLICY, name: str | None = None) -> RematSweep:
    """Compile ``model``'s training step without remat and at each budget; measure every point."""
    case = model if isinstance(model, TrainingCase) else training_case(model, batch=batch, inputs=inputs, loss=loss,
                                                                        name=name)
    spec = OptimizerSpec.parse(optimizer)
    keys = list(case.model.state_dict())
    graphs: dict[str, tuple[Graph | None, str, dict[str, Any], str]] = {NONE: (case.graph, "", {}, "")}
    for b in budgets:
        text = remat_spec(str(b), solver)
        g, stats, note = _rewrite(case.graph, text, case.args("cpu"))
        graphs[str(b)] = (g, text, stats, note)
    scratch: dict[tuple[Any, ...], int] = {}       # kernel workspaces, measured once per distinct shape
    arts: dict[str, TrainingArtifact] = {}
    for label, (g, _, _, note) in graphs.items():
        if g is not None and not note:
            arts[label] = compile_training(g, target=target, optimizer=spec, state_keys=keys)
    device = arts[NONE].device
    args = case.args(device)
    ref = {k: v.detach().clone() for k, v in arts[NONE].gradients(*args)[1].items()}
    errors = {label: grad_error(art.gradients(*args)[1], ref) for label, art in arts.items()}
    steps = {label: (lambda a=art: a.step(*args)) for label, art in arts.items()}
    peaks = {label: step_peak(fn, device) for label, fn in steps.items()}
    timings = measure_interleaved(steps, policy, sync=synchronizer(device))
    points = []
    for label, (g, text, stats, note) in graphs.items():
        if label not in arts:
            points.append(SweepPoint(label, text, stats=stats, note=note))
            continue
        assert g is not None
        predicted = step_memory(g, workspace=op_workspaces(g, device=device, cache=scratch),
                                scratch=spec.scratch()).peak_bytes
        points.append(SweepPoint(label, text, predicted, peaks[label].growth, activation_bytes(g),
                                 timings[label], *errors[label], stats=stats))
    return RematSweep(case.name, case.batch, device, solver, peaks[NONE].method, tuple(points))


def sweep_models(models: Sequence[str], batches: Sequence[int], *, loss: Any = "cross_entropy",
                 optimizer: str = "sgd{lr=0.01 momentum=0.9}", target: str = "cpu",
                 policy: TimingPolicy = DEFAULT_POLICY, plot_file: str | None = None,
                 echo: Callable[[str], Any] | None = None) -> str:
    """``mlcomp bench MODEL --train --remat-sweep``: one sweep per model and batch, each table handed to
    ``echo`` as it is done, the plot written to ``plot_file``; returns the JSON text."""
    sweeps = []
    for model in models:
        for batch in batches:
            sweeps.append(remat_sweep(model, batch=batch, loss=loss, optimizer=optimizer, target=target,
                                      policy=policy))
            if echo is not None:
                echo(sweeps[-1].format() + "\n")
    if plot_file:
        plot_sweeps(sweeps, plot_file)
    return json.dumps([s.to_json() for s in sweeps], indent=2)


def plot_sweeps(sweeps: Sequence[RematSweep], path: str) -> None:
    """Measured (filled) and predicted (hollow) peak memory against median step time, one panel per model."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(len(sweeps), 1)
    fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 4.2), squeeze=False)
    for ax, sw in zip(axes[0], sweeps):
        pts = [p for p in sw.points if p.ok and p.step is not None]
        xs = [p.step.median * 1e3 for p in pts]
        ax.plot(xs, [p.measured_peak / 2**20 for p in pts], "o", color="C0", label="measured peak")
        ax.plot(xs, [p.predicted_peak / 2**20 for p in pts], "o", mfc="none", color="C1", label="predicted peak")
        for x, p in zip(xs, pts):
            ax.annotate(p.label, (x, p.measured_peak / 2**20), textcoords="offset points", xytext=(4, 4), fontsize=8)
        ax.set_xlabel("training step, ms (median)")
        ax.set_ylabel("peak memory above the state before the step, MiB")
        ax.set_title(f"{sw.model} b{sw.batch}: remat ({sw.solver})", fontsize=10)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    with atomic_path(path, "png") as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
