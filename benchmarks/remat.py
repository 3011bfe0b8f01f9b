"""Rematerialisation: mlcomp's remat pass against torch's min-cut partitioner, in one run.

    .venv/bin/python benchmarks/remat.py                              # resnet18, transformer, mlp32; batch 32
    .venv/bin/python benchmarks/remat.py --models mlp32 --solvers mincut,sqrt --repeats 3 --json out.json
    .venv/bin/python benchmarks/remat.py --anchor-only                # the 6x(Linear, GELU, LayerNorm) anchor

Per model (batch 32, dropout off, SGD with momentum) every variant's training
step is compiled once and then measured in the same process:

* ``none`` -- mlcomp's joint graph without remat, the reference;
* ``S@B`` -- ``remat{budget=B solver=S}`` for each solver ``S`` and budget
  ``B`` in 1.0 / 0.5 / 0.25 / 0.1, and ``sqrt`` (Chen's segments, no budget);
* ``torch@B`` -- the same model through ``aot_module`` with
  ``min_cut_rematerialization_partition`` under
  ``torch._functorch.config.activation_memory_budget = B`` (set with the
  config's ``patch`` context manager, so it is restored), forward and backward
  run as the partitioner's fx modules (no inductor), the same optimizer.

Columns: predicted peak (mlcomp's liveness with kernel scratch,
:mod:`mlcomp.analysis.workspace`; torch has none), measured peak of
one step above the state before it (torch's CPU allocator events,
:func:`mlcomp.measure.training_bench.step_peak`), saved activations (tensors
and bytes the backward reads from the forward; parameters and graph inputs
left out, for torch: the forward's extra outputs that are not its inputs),
their reduction against ``none``, median step time of interleaved repeats and
its overhead against ``none``, and the worst parameter's gradient error against
``none`` on the same batch.  Budgets are close but not the same: mlcomp's is a
fraction of the saved-activation bytes without remat (graph inputs included,
so the inputs set a floor), torch's is normalised between saving only the
inputs (0) and what its default min-cut saves (1).

The anchor: 6x(Linear 256, GELU, LayerNorm) at batch 64, torch's
saved tensors at budgets 1.0, 0.5 and 0.0 beside mlcomp's at 1.0, 0.5 and its
smallest budget.
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from typing import Any

import torch
import torch._functorch.config as functorch_config
from functorch.compile import aot_module, make_boxed_func
from torch import nn
from torch._functorch.partitioners import min_cut_rematerialization_partition

from mlcomp.analysis.training_graph import predicted_peak, saved_activations
from mlcomp.analysis.workspace import op_workspaces
from mlcomp.base.errors import MlcompError
from mlcomp.base.table import Table
from mlcomp.base.units import fmt_bytes
from mlcomp.frontend.joint import loss_function, model_output
from mlcomp.hardware.timing import (
    TimingPolicy,
    fmt_seconds,
    measure_interleaved,
)
from mlcomp.ir import Graph
from mlcomp.ir.ops import INPUT
from mlcomp.measure.remat_sweep import activation_bytes, grad_error, remat_spec
from mlcomp.measure.training_bench import TrainingCase, step_peak, training_case
from mlcomp.pipeline.manager import run_pipeline
from mlcomp.pipeline.spec import Pipeline
from mlcomp.runtime.optim import OptimizerSpec
from mlcomp.training.step import compile_training

BUDGETS = ("1.0", "0.5", "0.25", "0.1")
OPTIMIZER = "sgd{lr=0.01 momentum=0.9}"


def deep_mlp(depth: int = 32, width: int = 256) -> nn.Module:
    """``depth`` x (Linear(width, width), ReLU), then a 10-way classifier."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 10))


def anchor_model() -> nn.Module:
    """The anchor: 6 x (Linear 256, GELU, LayerNorm)."""
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(6):
        layers += [nn.Linear(256, 256), nn.GELU(), nn.LayerNorm(256)]
    return nn.Sequential(*layers)


def make_case(name: str, batch: int) -> TrainingCase:
    if name == "mlp32":
        x = torch.randn(batch, 256, generator=torch.Generator().manual_seed(1))
        return training_case(deep_mlp(), inputs=(x,), name="mlp32")
    if name == "anchor":
        x = torch.randn(batch, 256, generator=torch.Generator().manual_seed(1))
        return training_case(anchor_model(), inputs=(x,), loss="mse", name="anchor")
    return training_case(name, batch=batch)


def count_saved(graph: Graph) -> tuple[int, int]:
    """(tensors, bytes) the backward reads from the forward, graph inputs and parameters left out."""
    acts = [s for s in saved_activations(graph) if graph.node(s.name).op != INPUT]
    return len(acts), activation_bytes(graph)


# ---------------------------------------------------------------------------
# torch's partitioner


class _WithLoss(nn.Module):
    def __init__(self, model: nn.Module, loss: Any) -> None:
        super().__init__()
        self.model = model
        self.loss = loss_function(loss)

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        if self.loss is None:
            return model_output(self.model(*args))
        return self.loss(model_output(self.model(*args[:-1])), args[-1])


def _boxed(gm: torch.fx.GraphModule, _inputs: Any) -> Any:
    return make_boxed_func(gm.forward)


def _base(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose storage ``node`` uses (through view ops)."""
    while node.op == "call_function" and getattr(node.target, "is_view", False) and node.args \
            and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def torch_partitioned(case: TrainingCase, budget: float) -> tuple[nn.Module, dict[str, Any]]:
    """``(module, saved)``: the model under aot_module + min-cut partitioner at ``budget``, compiled by one
    call inside the config patch; ``saved`` counts the forward's extra outputs: all of them, and those that
    are neither inputs (parameters, the batch) nor views of inputs."""
    saved: dict[str, Any] = {}

    def partition(joint: torch.fx.GraphModule, inputs: Any, **kw: Any) -> Any:
        fw, bw = min_cut_rematerialization_partition(joint, inputs, compiler="aten", **kw)
        extra = list(fw.graph.find_nodes(op="output")[0].args[0])[kw["num_fwd_outputs"]:]
        tensors = [(n, n.meta.get("val")) for n in extra]
        tensors = [(n, v) for n, v in tensors if isinstance(v, torch.Tensor)]
        size = lambda v: v.numel() * v.element_size()
        acts = [v for n, v in tensors if _base(n).op != "placeholder"]   # a view of a weight holds nothing new
        saved.update(tensors=len(acts), bytes=sum(size(v) for v in acts), all_tensors=len(tensors),
                     all_bytes=sum(size(v) for _, v in tensors))
        return fw, bw

    model = copy.deepcopy(case.model)
    for m in model.modules():
        # aot_module saves BatchNorm's running-stat buffers for the backward and then updates them in
        # place, which autograd refuses (version counter): torch's side normalises by batch statistics
        # without tracking running ones (the same gradients; it skips the tiny running-stat update)
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            m.track_running_stats = False
            m.running_mean = m.running_var = m.num_batches_tracked = None
    module = _WithLoss(model, case.loss).train()
    with functorch_config.patch(activation_memory_budget=budget):
        compiled = aot_module(module, fw_compiler=_boxed, bw_compiler=_boxed, partition_fn=partition)
        compiled(*case.args("cpu")).backward()          # traces and partitions now, under the budget
    for p in module.parameters():
        p.grad = None
    return compiled, saved


# ---------------------------------------------------------------------------
# one model


def bench_model(case: TrainingCase, solvers: list[str], policy: TimingPolicy, torch_budgets: tuple[str, ...],
                log: Any) -> list[dict[str, Any]]:
    spec = OptimizerSpec.parse(OPTIMIZER)
    keys = list(case.model.state_dict())
    args = case.args("cpu")
    rows: dict[str, dict[str, Any]] = {}
    steps: dict[str, Any] = {}
    grads: dict[str, dict[str, torch.Tensor]] = {}
    variants = [("none", None)] + [(f"{s}@{b}", remat_spec(b, s)) for s in solvers if s != "sqrt" for b in BUDGETS]
    if "sqrt" in solvers:
        variants.append(("sqrt", remat_spec("sqrt")))
    failed: set[str] = set()      # solvers that missed a budget: smaller budgets are not tried
    scratch: dict[Any, int] = {}  # kernel workspaces (analysis.workspace), one measurement per shape
    for label, text in variants:
        row: dict[str, Any] = {"variant": label, "spec": text or ""}
        solver = label.partition("@")[0]
        if solver in failed:
            row["note"] = "not tried: a larger budget was not met"
            rows[label] = row
            continue
        graph = case.graph
        t0 = time.perf_counter()
        if text is not None:
            try:
                graph, report = run_pipeline(case.graph, Pipeline.parse(text), example_inputs=args)
                row["stats"] = next((r.stats for r in report.records if r.name == "remat"), {})
            except MlcompError as exc:   # a budget a solver cannot meet is a row, not the end of the run
                row["note"] = getattr(exc, "what", str(exc))[:300]
                rows[label] = row
                failed.add(solver)
                log(f"  {label} ({time.perf_counter() - t0:.1f} s): {row['note'][:120]}")
                continue
        art = compile_training(graph, optimizer=spec, state_keys=keys)
        row["predicted"] = predicted_peak(graph, op_workspaces(graph, cache=scratch)).transient
        row["tensors"], row["bytes"] = count_saved(graph)
        grads[label] = {k: v.detach().clone() for k, v in art.gradients(*args)[1].items()}
        steps[label] = lambda a=art: a.step(*args)
        rows[label] = row
        log(f"  {label}: pass {row.setdefault('pass_s', time.perf_counter() - t0):.1f} s, compiled")
    for b in torch_budgets:
        label = f"torch@{b}"
        module, saved = torch_partitioned(case, float(b))
        params = dict(module.named_parameters())
        module(*args).backward()
        grads[label] = {k.split("model.", 1)[1]: p.grad.detach().clone() for k, p in params.items()
                        if p.grad is not None}
        for p in params.values():
            p.grad = None
        opt = spec.build(params.values())

        def torch_step(m: Any = module, o: Any = opt) -> None:
            m(*args).backward()
            o.step()
            o.zero_grad(set_to_none=True)    # like the mlcomp step: gradients die inside the measured step

        steps[label] = torch_step
        rows[label] = {"variant": label, "spec": f"min_cut_rematerialization_partition, budget {b}",
                       "tensors": saved["tensors"], "bytes": saved["bytes"], "all_tensors": saved["all_tensors"],
                       "all_bytes": saved["all_bytes"]}
        log(f"  {label}: compiled")
    ref = grads["none"]
    for label, step in steps.items():
        rows[label]["grad_rel"], rows[label]["grad_abs"] = grad_error(grads[label], ref)
        rows[label]["measured"] = step_peak(step, "cpu").growth
    log(f"  timing {len(steps)} variants interleaved")
    timings = measure_interleaved(steps, policy)
    for label, t in timings.items():
        rows[label]["step"] = t.median
        rows[label]["step_samples"] = list(t.samples)
    return list(rows.values())


def table(model: str, batch: int, rows: list[dict[str, Any]]) -> Table:
    ref = next(r for r in rows if r["variant"] == "none")
    columns = ("variant", "predicted", "measured", "pred/meas", "saved tensors", "saved bytes", "acts saved",
               "step (med)", "overhead", "grad err", "note")
    cells = []
    for r in rows:
        if "step" not in r:
            cells.append((r["variant"], *(["—"] * 9), "not tried" if "not tried" in r["note"] else "not met"))
            continue
        cells.append((r["variant"], fmt_bytes(r.get("predicted")) if r.get("predicted") else "—",
                      fmt_bytes(r["measured"]),
                      f"{r['predicted'] / r['measured']:.3f}" if r.get("predicted") and r["measured"] else "—",
                      str(r["tensors"]), fmt_bytes(r["bytes"]),
                      f"{100 * (1 - r['bytes'] / ref['bytes']):.0f}%" if ref["bytes"] else "—",
                      fmt_seconds(r["step"]), f"{100 * (r['step'] / ref['step'] - 1):+.1f}%",
                      f"{r['grad_rel']:.1e}", ""))
    return Table(f"{model}, batch {batch}, cpu", columns, tuple(cells), right=frozenset(range(1, 10)))


# ---------------------------------------------------------------------------
# the anchor


def anchor(solvers: list[str], log: Any) -> Table:
    case = make_case("anchor", 64)
    args = case.args("cpu")
    cells = []
    for b in ("1.0", "0.5", "0.0"):
        _, saved = torch_partitioned(case, float(b))
        cells.append((f"torch min-cut @{b}", str(saved["tensors"]), fmt_bytes(saved["bytes"]),
                      str(saved["all_tensors"]), fmt_bytes(saved["all_bytes"])))
    n, nbytes = count_saved(case.graph)
    cells.append(("mlcomp none", str(n), fmt_bytes(nbytes), "", ""))
    for s in solvers:
        for b in (("sqrt",) if s == "sqrt" else ("1.0", "0.5", "0.25", "0.1")):
            try:
                graph, _ = run_pipeline(case.graph, Pipeline.parse(remat_spec(b, s)), example_inputs=args)
                n, nbytes = count_saved(graph)
                cells.append((f"mlcomp {s} @{b}", str(n), fmt_bytes(nbytes), "", ""))
            except MlcompError as exc:
                cells.append((f"mlcomp {s} @{b}", "—", "—", "", "not met"))
                log(f"  anchor {s}@{b}: {getattr(exc, 'what', exc)}"[:160])
    return Table("anchor: 6x(Linear 256, GELU, LayerNorm), batch 64 (saved for backward; 'all' adds inputs "
                 "and parameters torch saves)", ("variant", "saved tensors", "saved bytes", "all tensors",
                                                 "all bytes"), tuple(cells), right=frozenset({1, 2, 3, 4}))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet18,transformer,mlp32")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--solvers", default="mincut,knapsack,milp,sqrt")
    ap.add_argument("--milp-models", default="mlp32", help="models milp runs on (an exact MILP: small graphs)")
    ap.add_argument("--torch-budgets", default=",".join(BUDGETS))
    ap.add_argument("--repeats", type=int, default=5, help="interleaved timing rounds (median reported)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--anchor-only", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    log = lambda m: print(m, file=sys.stderr, flush=True)
    solvers = [s for s in args.solvers.split(",") if s]
    print(anchor(solvers, log).format() + "\n", flush=True)
    out: dict[str, Any] = {}
    if not args.anchor_only:
        policy = TimingPolicy(warmup=1, budget_s=1e-3, min_repeats=args.repeats, max_repeats=args.repeats)
        for model in [m for m in args.models.split(",") if m]:
            log(f"{model}:")
            use = [s for s in solvers if s != "milp" or model in args.milp_models.split(",")]
            rows = bench_model(make_case(model, args.batch), use, policy,
                               tuple(b for b in args.torch_budgets.split(",") if b), log)
            out[model] = rows
            notes = [f"{r['variant']}: {r['note']}" for r in rows if r.get("note") and "not tried" not in r["note"]]
            print(table(model, args.batch, rows).format() + "".join(f"\n{n}" for n in notes) + "\n", flush=True)
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
