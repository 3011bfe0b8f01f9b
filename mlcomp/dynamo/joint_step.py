"""Training through mlcomp's joint graph: the pipeline sees forward and backward together.

For a Dynamo graph that needs gradients, :func:`compile_joint` traces the joint graph
(:mod:`mlcomp.dynamo.joint`), runs the ``torch.compile`` call's pipeline over it (adapted to
the target as any preset is; ``remat`` and ``mixed-precision`` act on the joint here, as in
``compile_training``), verifies each pass on the trace's example, cuts the result into a
forward and a backward (:mod:`mlcomp.dynamo.joint_split`), and compiles both through
:func:`~mlcomp.api.compiler.compile_model` (the target, the compile cache, verification against
its IR from one seed, so dropout draws the same masks, and over its symbolic ranges).  The
callable it returns runs a ``torch.autograd.Function``: its forward runs the compiled forward
and saves exactly the values of the cut, its backward runs the compiled backward, so
``loss.backward()`` and the user's optimizer work as with eager::

    fast = torch.compile(model, backend="mlcomp", options={"pipeline": "remat{budget=0.5}"})
    loss_fn(fast(x), y).backward()          # gradients from mlcomp's backward
    opt.step()

The joint's record (:class:`~mlcomp.dynamo.report.JointRecord`) says what crossed the cut
before and after the pipeline, what remat recomputed and the tolerance mixed precision
declared.  Anything this route cannot take raises :class:`~mlcomp.dynamo.joint.JointRefused`
(or another :class:`~mlcomp.base.errors.MlcompError`); the backend then compiles the graph
through torch's AOT autograd and says so (:mod:`mlcomp.dynamo.training`).
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import torch
from torch.autograd.function import once_differentiable

from mlcomp.api.compiler import compile_model, open_cache
from mlcomp.api.lowering import adapted_pipeline, resolve_target
from mlcomp.dynamo.joint import JointRefused, JointTrace, joint_graph, trace_joint
from mlcomp.dynamo.joint_split import Parts, cut, split_joint
from mlcomp.dynamo.lower import concrete, lower, parameter_slots
from mlcomp.dynamo.options import BackendOptions
from mlcomp.dynamo.report import BackendReport, JointRecord, Partition
from mlcomp.frontend.joint import joint_decompositions
from mlcomp.frontend.source import ModelSource
from mlcomp.ir.interpreter import evaluate
from mlcomp.pipeline import run_pipeline
from mlcomp.targets.options import CompileOptions

__all__ = ["compile_joint", "JointStep"]


def compile_joint(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opts: BackendOptions,
                  report: BackendReport, name: str) -> Callable[..., Any]:
    """The Dynamo graph trained through mlcomp's joint graph (module doc); raises MlcompError where it cannot."""
    start = time.perf_counter()
    if opts.target == "auto":
        raise JointRefused("target 'auto' chooses per graph by timing inference; the joint graph needs a named "
                           "target", hint="give options={'target': 'cpu'} to train through mlcomp's joint graph")
    low = lower(gm, example_inputs, writes=True, table=joint_decompositions())    # eager's fused kernels kept
    primals = [concrete(example_inputs[i]) for i in low.tensor_indices]
    needs = [isinstance(p, torch.Tensor) and p.requires_grad for p in primals]
    trace = trace_joint(low, primals, needs, torch.Generator().manual_seed(0))
    slots = parameter_slots(gm)
    params = {j: slots[i] for j, i in enumerate(low.tensor_indices) if i in slots}
    graph = joint_graph(trace, f"{name}_joint", params)
    inputs = iter(n.name for n in graph.input_nodes)
    prim_names = [params[j] if j in params else next(inputs) for j in range(trace.primals)]
    tangent_names = list(inputs)
    before = cut(graph, prim_names, trace.outputs)
    copts = CompileOptions.make(**opts.compile_options)
    chosen = resolve_target(opts.target, None)
    pipe, _ = adapted_pipeline(opts.pipeline_spec(), chosen)
    record = JointRecord(name, saved_before=before.activations, saved_before_bytes=before.activation_bytes)
    if pipe is not None:
        examples = [x for j, x in enumerate(trace.example) if j not in params]    # the joint IR's inputs
        graph, prep = run_pipeline(graph, pipe, example_inputs=examples, verify=opts.verify,
                                   target=chosen.facts(copts), deterministic=copts.deterministic)
        record.pipeline = pipe.spec
        record.note_passes(prep)
    parts = split_joint(graph, prim_names, tangent_names, trace.outputs)
    record.saved, record.saved_bytes = parts.cut.activations, parts.cut.activation_bytes
    step = JointStep(_lower_parts(parts, trace, opts, chosen.name, record), trace)
    part = Partition(name, "joint", f"mlcomp:{record.target}", nodes=len(graph.call_nodes()),
                     seconds=time.perf_counter() - start, pipeline=record.pipeline, cache=record.cache_status())
    report.add(part)
    report.joints.append(record)
    indices = low.tensor_indices

    def run(*args: Any) -> Any:
        if not low.holds(args):
            return gm(*args)           # a scalar baked into the joint (BatchNorm's momentum) changed: torch runs it
        return step(*[args[i] for i in indices])
    return run


def _lower_parts(parts: Parts, trace: JointTrace, opts: BackendOptions, target: str,
                 record: JointRecord) -> tuple[Any, Any]:
    """Forward and backward through the target (and the compile cache), each verified against its own IR.

    The backward's example inputs are the forward's saved values from the forward's reference run."""
    primals, tangents = trace.example[:trace.primals], trace.example[trace.primals:]
    built = []
    for graph in (parts.forward, parts.backward):
        inputs = tuple(primals) if not built else (*built[0].reference[1][trace.outputs:], *tangents)
        source = ModelSource(graph.name, _reference(graph), inputs)
        result = compile_model(source, graph, target=target, pipeline="", verify=opts.verify,
                               cache=open_cache(opts.cache), **opts.compile_options)
        if result.check is not None and not result.check.passed:
            raise JointRefused(f"{graph.name} as built by {target} differs from its IR on the example: "
                               f"{result.check.summary()}", hint="its forward and backward are compiled "
                                                                 "separately (AOT autograd)")
        record.target = result.artifact.target
        record.regions += list(result.artifact.manifest.get("fallback_regions") or [])
        record.cache.append(result.cache.status.value if result.cache is not None else None)
        built.append(result.artifact)
    return built[0], built[1]


def _reference(graph: Graph) -> Callable[..., Any]:
    return lambda *xs: evaluate(graph, *xs)


def _tuple(out: Any) -> tuple[Any, ...]:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


class JointStep:
    """The compiled forward and backward behind one ``torch.autograd.Function``."""

    def __init__(self, parts: tuple[Any, Any], trace: JointTrace) -> None:
        self.forward, self.backward = parts
        self.outputs, self.primals = trace.outputs, trace.primals
        self.differentiable, self.grad_of = trace.differentiable, trace.grad_of
        self.constant = tuple(i for i in range(trace.outputs) if i not in set(trace.differentiable))
        self.written = trace.written

    def __call__(self, *primals: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The outputs; each input the Dynamo graph writes into (a running statistic) gets its new value."""
        out = _Function.apply(self, *primals)
        if not self.written:
            return out
        user = len(out) - len(self.written)
        with torch.no_grad():
            for i, new in zip(self.written, out[user:]):
                primals[i].copy_(new)
        return out[:user]


class _Function(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, step: JointStep, *primals: torch.Tensor) -> tuple[torch.Tensor, ...]:  # type: ignore[override]
        out = _tuple(step.forward(*primals))
        ctx.step = step
        written = {id(primals[i]) for i in step.written}      # its new value is copied in after this call
        ctx.save_for_backward(*[t.clone() if id(t) in written else t for t in out[step.outputs:]])
        results = out[:step.outputs]
        ctx.mark_non_differentiable(*[results[i] for i in step.constant])
        return results

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        step: JointStep = ctx.step
        tangents = [grads[i].contiguous() for i in step.differentiable]
        computed = _tuple(step.backward(*ctx.saved_tensors, *tangents))
        out: list[torch.Tensor | None] = [None] * step.primals
        for i, g in zip(step.grad_of, computed):
            out[i] = g
        return (None, *out)
