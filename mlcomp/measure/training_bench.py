"""``mlcomp bench MODEL --train``: an eager training step vs the compiled one.

For one model and batch size it

1. captures the joint graph (:func:`mlcomp.frontend.joint.capture_joint`) and
   compiles it (:func:`mlcomp.targets.training.compile_training`) with the same
   optimizer spec the eager side uses (``torch.optim``, foreach);
2. checks the compiled gradients against eager autograd on the batch;
3. times both steps (forward, loss, backward, optimizer step) interleaved, with
   the timing protocol of :mod:`mlcomp.hardware.timing` (warm-up, median, p90);
4. measures each step's peak memory above what was allocated before it
   (:class:`~mlcomp.hardware.timing.PeakMemory`: on CPU the kernel's peak RSS,
   ``VmHWM``, reset before the step, after trimming the heap, so freed activations
   are seen; on CUDA ``torch.cuda.max_memory_allocated``) and sets it beside the
   liveness prediction (:func:`mlcomp.analysis.training.predicted_peak`);
5. reports saved-activation bytes and FLOPs per phase.

    >>> row = bench_training("resnet18", batch=32)
    >>> print(format_rows([row]))
"""
from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mlcomp.analysis.training import phase_flops, predicted_peak, saved_activations
from mlcomp.base.table import Table
from mlcomp.frontend.joint import (
    capture_joint,
    example_target,
    loss_function,
    without_dropout,
)
from mlcomp.hardware.timing import (
    PeakMemory,
    Timing,
    TimingPolicy,
    fmt_bytes,
    fmt_seconds,
    measure_interleaved,
    synchronizer,
)
from mlcomp.ir.node import Phase
from mlcomp.targets.optim import OptimizerSpec
from mlcomp.targets.training import compile_training, verify_gradients

__all__ = ["DEFAULT_POLICY", "TrainingBenchRow", "bench_training", "format_rows"]

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
    predicted_transient: int  # liveness over the joint graph (activations + gradients)
    saved_bytes: int
    forward_flops: int
    loss_flops: int
    backward_flops: int
    grad_rel_error: float

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "batch": self.batch, "device": self.device,
                "eager": self.eager.to_json(), "compiled": self.compiled.to_json(),
                "eager_peak_bytes": self.eager_peak, "compiled_peak_bytes": self.compiled_peak,
                "memory_method": self.memory_method, "predicted_transient_bytes": self.predicted_transient,
                "saved_activation_bytes": self.saved_bytes, "forward_flops": self.forward_flops,
                "loss_flops": self.loss_flops, "backward_flops": self.backward_flops,
                "grad_rel_error": self.grad_rel_error}


def _zoo_model(name: str, batch: int) -> tuple[torch.nn.Module, tuple[torch.Tensor, ...]]:
    from mlcomp import models

    z = models.get(name)
    return z.build(), z.example_inputs(batch)


def bench_training(model: str | torch.nn.Module, *, batch: int = 32, inputs: Sequence[torch.Tensor] | None = None,
                   loss: Any = "cross_entropy", optimizer: str = "sgd{lr=0.01 momentum=0.9}",
                   target: str = "cpu", policy: TimingPolicy = DEFAULT_POLICY,
                   name: str | None = None) -> TrainingBenchRow:
    """Eager vs compiled training step of ``model`` (a zoo name or a module with ``inputs``)."""
    if isinstance(model, str):
        name = name or model
        model, inputs = _zoo_model(model, batch)
    name = name or type(model).__name__
    if inputs is None:
        from mlcomp.base.errors import InputSpecError

        raise InputSpecError(f"bench --train of {name} needs example inputs", hint="pass inputs=(x,)")
    model = without_dropout(model).train()
    inputs = tuple(inputs)
    y = example_target(model, inputs, loss)
    loss_fn = loss_function(loss)
    spec = OptimizerSpec.parse(optimizer)
    eager = copy.deepcopy(model)
    graph = capture_joint(model, inputs, y, loss=loss, name=name)
    art = compile_training(graph, target=target, optimizer=spec, state_keys=list(model.state_dict()))
    device = art.device
    args = tuple(t.to(device) for t in inputs) + ((y.to(device),) if y is not None else ())
    check = verify_gradients(art, eager, loss_fn, args, tolerance=1e-4)
    eager = eager.to(device).train()
    opt = spec.build(p for p in eager.parameters() if p.requires_grad)

    def eager_step() -> None:
        opt.zero_grad(set_to_none=True)
        out = eager(*args[:-1]) if loss_fn is not None else eager(*args)
        from mlcomp.frontend.joint import model_output

        value = loss_fn(model_output(out), args[-1]) if loss_fn is not None else model_output(out)
        value.backward()
        opt.step()

    def compiled_step() -> None:
        art.step(*args)

    sync = synchronizer(device)
    timings = measure_interleaved({"eager": eager_step, "compiled": compiled_step}, policy, sync=sync)
    peaks = {}
    for key, fn in (("eager", eager_step), ("compiled", compiled_step)):
        fn()                            # optimizer state exists before the measured step
        sync()
        with PeakMemory(device) as mem:
            fn()
            sync()
        peaks[key] = mem.reading
    flops = phase_flops(graph)
    return TrainingBenchRow(
        name, batch, device, timings["eager"], timings["compiled"], peaks["eager"].growth,
        peaks["compiled"].growth, peaks["compiled"].method, predicted_peak(graph).transient,
        sum(s.nbytes for s in saved_activations(graph)), flops[Phase.FORWARD], flops[Phase.LOSS],
        flops[Phase.BACKWARD], check["worst_rel"])


def format_rows(rows: Sequence[TrainingBenchRow]) -> str:
    """The training table: step times, peaks (measured / predicted), saved bytes, FLOPs by phase."""
    columns = ("model", "batch", "eager step (med / p90)", "compiled step (med / p90)", "speedup",
               "peak eager", "peak compiled", "predicted", "saved acts", "fwd GFLOP", "bwd GFLOP", "bwd/fwd")
    cells = []
    for r in rows:
        cells.append((r.model, str(r.batch), f"{fmt_seconds(r.eager.median)} / {fmt_seconds(r.eager.p90)}",
                      f"{fmt_seconds(r.compiled.median)} / {fmt_seconds(r.compiled.p90)}",
                      f"{r.eager.median / r.compiled.median:.2f}x", fmt_bytes(r.eager_peak),
                      fmt_bytes(r.compiled_peak), fmt_bytes(r.predicted_transient), fmt_bytes(r.saved_bytes),
                      f"{(r.forward_flops + r.loss_flops) / 1e9:.3g}", f"{r.backward_flops / 1e9:.3g}",
                      f"{r.backward_flops / max(r.forward_flops + r.loss_flops, 1):.2f}"))
    table = Table(f"training step on {rows[0].device if rows else '?'}", columns, tuple(cells),
                  right=frozenset(range(1, len(columns))))
    methods = sorted({r.memory_method for r in rows})
    return table.format() + "\npeak memory: measured " + "; ".join(methods) + \
        ", above the state before the step; predicted = liveness over the joint graph (activations + gradients)"
