"""``mlcomp bench MODEL --train``: an eager training step vs the compiled one.

For one model and batch size it

1. captures the joint graph (:func:`mlcomp.frontend.joint.capture_joint`) and
   compiles it (:func:`mlcomp.training.step.compile_training`) with the same
   optimizer spec the eager side uses (``torch.optim``, foreach);
2. checks the compiled gradients against eager autograd on the batch;
3. times both steps (forward, loss, backward, optimizer step) interleaved, with
   the timing protocol of :mod:`mlcomp.hardware.timing` (warm-up, median, p90);
4. measures each step's peak memory above what was allocated before it and sets
   it beside the liveness prediction (:func:`mlcomp.analysis.training_graph.predicted_peak`).
   On CPU the measured figure is torch's CPU allocator followed event by event
   (:class:`~mlcomp.hardware.peak_memory.PeakMemory` with ``MemorySource.ALLOCATOR``:
   ``torch.profiler`` memory events, the running sum of live tensor bytes); it is
   the method that sees an activation freed the moment the generated code drops
   it.  The kernel's peak RSS (``VmHWM`` reset before the step, heap trimmed) is
   reported beside it but is not what the prediction models: glibc keeps freed
   chunks of sizes it has seen in its heap, so RSS carries fragmentation and
   earlier steps' pages (on resnet18 b32 it reads above the allocator's peak).
   On CUDA the figure is ``torch.cuda.max_memory_allocated``.  The prediction
   adds each kernel's scratch (:func:`mlcomp.analysis.workspace.op_workspaces`:
   CPU convolution's im2col columns), which the allocator sees and no graph value shows;
5. reports saved-activation bytes and FLOPs per phase::

    row = bench_training("resnet18", batch=32)
    print(format_rows([row]))
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mlcomp import models
from mlcomp.analysis.training_graph import phase_flops, predicted_peak, saved_activations
from mlcomp.analysis.workspace import op_workspaces
from mlcomp.base.errors import InputSpecError
from mlcomp.base.table import Table
from mlcomp.base.units import fmt_bytes
from mlcomp.frontend.joint import (
    capture_joint,
    example_target,
    loss_function,
    model_output,
    without_dropout,
)
from mlcomp.hardware.peak_memory import MemoryReading, MemorySource, PeakMemory
from mlcomp.hardware.timing import (
    Timing,
    TimingPolicy,
    fmt_seconds,
    measure_interleaved,
    synchronizer,
)
from mlcomp.ir import Graph
from mlcomp.ir.node import Phase
from mlcomp.runtime.optim import OptimizerSpec
from mlcomp.training.step import compile_training, verify_gradients

__all__ = ["DEFAULT_POLICY", "TrainingBenchRow", "TrainingCase", "bench_training", "format_rows", "step_peak",
           "training_case"]

DEFAULT_POLICY = TimingPolicy(warmup=2, budget_s=2.0)


@dataclass(frozen=True)
class TrainingBenchRow:
    model: str
    batch: int
    device: str
    eager: Timing
    compiled: Timing
    eager_peak: int          # measured step peak above the state before the step, bytes
    compiled_peak: int
    memory_method: str
    compiled_rss: int        # kernel peak RSS growth of the compiled step (CPU; same as compiled_peak on CUDA)
    predicted_transient: int  # liveness over the joint graph (activations + gradients + kernel scratch)
    saved_bytes: int
    forward_flops: int
    loss_flops: int
    backward_flops: int
    grad_rel_error: float

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "batch": self.batch, "device": self.device,
                "eager": self.eager.to_json(), "compiled": self.compiled.to_json(),
                "eager_peak_bytes": self.eager_peak, "compiled_peak_bytes": self.compiled_peak,
                "memory_method": self.memory_method, "compiled_rss_bytes": self.compiled_rss,
                "predicted_transient_bytes": self.predicted_transient,
                "saved_activation_bytes": self.saved_bytes, "forward_flops": self.forward_flops,
                "loss_flops": self.loss_flops, "backward_flops": self.backward_flops,
                "grad_rel_error": self.grad_rel_error}


def step_peak(step: Any, device: str, source: MemorySource = MemorySource.ALLOCATOR) -> MemoryReading:
    """Peak memory of one call of ``step`` above the state before it, after one unmeasured call
    (optimizer state and lazily created buffers exist before the measured one)."""
    sync = synchronizer(device)
    step()
    sync()
    with PeakMemory(device, source=source) as mem:
        step()
        sync()
    assert mem.reading is not None
    return mem.reading


@dataclass(frozen=True)
class TrainingCase:
    """A model in training mode (dropout off), its batch, the loss's target and its joint graph."""

    name: str
    batch: int
    model: torch.nn.Module
    inputs: tuple[torch.Tensor, ...]
    target: torch.Tensor | None
    loss: Any
    graph: Graph

    def args(self, device: str) -> tuple[torch.Tensor, ...]:
        """The step's arguments on ``device``: the inputs, then the loss's target (if any)."""
        return tuple(t.to(device) for t in self.inputs) + ((self.target.to(device),) if self.target is not None
                                                           else ())


def training_case(model: str | torch.nn.Module, *, batch: int = 32, inputs: Sequence[torch.Tensor] | None = None,
                  loss: Any = "cross_entropy", name: str | None = None) -> TrainingCase:
    """Capture the joint graph of ``model`` (a zoo name, or a module with ``inputs``) on one batch."""
    if isinstance(model, str):
        z = models.get(model)
        name = name or model
        model, inputs = z.build(), z.example_inputs(batch)
    name = name or type(model).__name__
    if inputs is None:
        raise InputSpecError(f"bench --train of {name} needs example inputs", hint="pass inputs=(x,)")
    model = without_dropout(model).train()
    inputs = tuple(inputs)
    y = example_target(model, inputs, loss)
    graph = capture_joint(model, inputs, y, loss=loss, name=name)
    return TrainingCase(name, int(inputs[0].shape[0]) if inputs and inputs[0].dim() else batch, model, inputs, y,
                        loss, graph)


def bench_training(model: str | torch.nn.Module, *, batch: int = 32, inputs: Sequence[torch.Tensor] | None = None,
                   loss: Any = "cross_entropy", optimizer: str = "sgd{lr=0.01 momentum=0.9}",
                   target: str = "cpu", policy: TimingPolicy = DEFAULT_POLICY,
                   name: str | None = None, loss_scale: Any = None) -> TrainingBenchRow:
    """Eager vs compiled training step of ``model`` (a zoo name or a module with ``inputs``)."""
    case = training_case(model, batch=batch, inputs=inputs, loss=loss, name=name)
    name, model, graph = case.name, case.model, case.graph
    loss_fn = loss_function(loss)
    spec = OptimizerSpec.parse(optimizer)
    eager = copy.deepcopy(model)
    art = compile_training(graph, target=target, optimizer=spec, state_keys=list(model.state_dict()),
                           loss_scale=loss_scale)
    device = art.device
    args = case.args(device)
    check = verify_gradients(art, eager, loss_fn, args, tolerance=1e-4)
    eager = eager.to(device).train()
    opt = spec.build(p for p in eager.parameters() if p.requires_grad)

    def eager_step() -> None:
        opt.zero_grad(set_to_none=True)
        out = eager(*args[:-1]) if loss_fn is not None else eager(*args)
        value = loss_fn(model_output(out), args[-1]) if loss_fn is not None else model_output(out)
        value.backward()
        opt.step()

    def compiled_step() -> None:
        art.step(*args)

    sync = synchronizer(device)
    timings = measure_interleaved({"eager": eager_step, "compiled": compiled_step}, policy, sync=sync)
    peaks = {key: step_peak(fn, device) for key, fn in (("eager", eager_step), ("compiled", compiled_step))}
    rss = step_peak(compiled_step, device, MemorySource.RSS) if device == "cpu" else peaks["compiled"]
    flops = phase_flops(graph)
    return TrainingBenchRow(
        name, case.batch, device, timings["eager"], timings["compiled"], peaks["eager"].growth,
        peaks["compiled"].growth, peaks["compiled"].method, rss.growth,
        predicted_peak(graph, op_workspaces(graph, device=device)).transient,
        sum(s.nbytes for s in saved_activations(graph)), flops[Phase.FORWARD], flops[Phase.LOSS],
        flops[Phase.BACKWARD], check["worst_rel"])


def format_rows(rows: Sequence[TrainingBenchRow]) -> str:
    """The training table: step times, peaks (measured / predicted), saved bytes, FLOPs by phase."""
    columns = ("model", "batch", "eager step (med / p90)", "compiled step (med / p90)", "speedup",
               "peak eager", "peak compiled", "predicted", "pred/meas", "RSS compiled", "saved acts", "fwd GFLOP",
               "bwd GFLOP", "bwd/fwd")
    cells = []
    for r in rows:
        cells.append((r.model, str(r.batch), f"{fmt_seconds(r.eager.median)} / {fmt_seconds(r.eager.p90)}",
                      f"{fmt_seconds(r.compiled.median)} / {fmt_seconds(r.compiled.p90)}",
                      f"{r.eager.median / r.compiled.median:.2f}x", fmt_bytes(r.eager_peak),
                      fmt_bytes(r.compiled_peak), fmt_bytes(r.predicted_transient),
                      f"{r.predicted_transient / r.compiled_peak:.3f}" if r.compiled_peak else "—",
                      fmt_bytes(r.compiled_rss), fmt_bytes(r.saved_bytes),
                      f"{(r.forward_flops + r.loss_flops) / 1e9:.3g}", f"{r.backward_flops / 1e9:.3g}",
                      f"{r.backward_flops / max(r.forward_flops + r.loss_flops, 1):.2f}"))
    table = Table(f"training step on {rows[0].device if rows else '?'}", columns, tuple(cells),
                  right=frozenset(range(1, len(columns))))
    methods = sorted({r.memory_method for r in rows})
    return table.format() + "\npeak memory: measured " + "; ".join(methods) + \
        ", above the state before the step; predicted = liveness over the joint graph (activations + gradients + " \
        "kernel scratch); " \
        "RSS = kernel peak RSS growth of the compiled step, for reference"
