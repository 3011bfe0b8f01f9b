"""``torch.compile(model, backend="mlcomp", options={...})``: each Dynamo graph through mlcomp.

::

    import torch, mlcomp.dynamo.backend as mb
    mb.register()                      # in-process; `pip install mlcomp` registers it by entry point
    fast = torch.compile(model, backend="mlcomp", options={"target": "cpu", "pipeline": "-O2", "threads": 2})
    with torch.no_grad():
        fast(x)                        # Dynamo graph → ATen → mlcomp IR → pipeline → target, verified

    report = mb.BackendReport()        # which partition ran where, and why
    torch.compile(model, backend="mlcomp", options={"report": report})(x)
    print(report.table())

Inference (grad mode off, or no input needing a gradient): parameters and buffers are frozen
into the IR as constants, so passes fold them; each call checks that the same tensors come
back unchanged (``_version``), and runs the Dynamo graph in torch when a weight was edited
in place since the compile.  Training (an input needs a gradient): mlcomp traces the joint
forward and backward graph, runs the pipeline over it (remat, mixed precision), cuts it
into a forward and a backward, lowers both and runs them in a ``torch.autograd.Function``
(:mod:`mlcomp.dynamo.joint_step`); a graph that route refuses goes through torch's AOT
autograd instead, which splits it before mlcomp compiles each half, and the report says
so (:mod:`mlcomp.dynamo.training`).

Options travel with the ``torch.compile`` call (``options=`` reaches the backend as a keyword
argument, and everything downstream receives it as an argument or a closure), so nothing is process-wide.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from mlcomp.base.errors import MlcompError, OptionError
from mlcomp.dynamo.lower import concrete, lower, parameter_slots
from mlcomp.dynamo.options import BackendOptions
from mlcomp.dynamo.partition import compile_regions, direct_call
from mlcomp.dynamo.report import TORCH, BackendReport, Partition

__all__ = ["BACKEND_NAME", "BackendReport", "mlcomp_backend", "register", "compile_inference"]

BACKEND_NAME = "mlcomp"


def mlcomp_backend(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *,
                   options: dict[str, Any] | None = None, mode: str | None = None) -> Callable[..., Any]:
    """The Dynamo backend: ``(gm, example_inputs, options=...) -> callable`` with ``gm``'s signature."""
    if mode is not None:
        raise OptionError(f"torch.compile(mode={mode!r}) applies to inductor, not to the mlcomp backend",
                          hint='drop mode=; give mlcomp\'s own options, e.g. options={"pipeline": "-O3"}')
    opts = BackendOptions.parse(options)
    report = opts.report if opts.report is not None else BackendReport()
    name = f"graph{report.graphs}"
    report.graphs += 1
    needs_grad = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in example_inputs)
    if needs_grad:
        from mlcomp.dynamo.training import compile_training_graph

        compiled = compile_training_graph(gm, example_inputs, opts, report, name)
    else:
        compiled = compile_inference(gm, example_inputs, opts, report, name)
    if opts.explain:
        print(_explained(report, name))
    return compiled


def _explained(report: BackendReport, name: str) -> str:
    return f"mlcomp backend, {name}:\n{report.only(name).table()}"


def compile_inference(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opts: BackendOptions,
                      report: BackendReport, name: str) -> Callable[..., Any]:
    """Parameters frozen, the graph lowered to ATen, each region compiled; the rest of ``gm`` stays torch."""
    params = parameter_slots(gm)
    try:
        low = lower(gm, example_inputs)
    except MlcompError as exc:
        report.add(Partition(name, "whole graph", TORCH, nodes=len(gm.graph.nodes), reason=exc.message))
        return gm.forward
    inputs = [concrete(example_inputs[i]) for i in low.tensor_indices]
    constants = {j: params[i] for j, i in enumerate(low.tensor_indices) if i in params}
    compiled = direct_call(compile_regions(low.gm, inputs, constants=constants, opts=opts, report=report,
                                           graph_name=name))
    frozen = [(i, example_inputs[i], example_inputs[i]._version) for i in params]
    indices = low.tensor_indices

    def run(*args: Any) -> Any:
        if not low.holds(args):
            return gm(*args)               # a scalar baked into the IR changed: torch computes it
        for i, tensor, version in frozen:
            if args[i] is not tensor or tensor._version != version:
                return gm(*args)           # a weight changed since the compile: torch computes it
        return compiled(*[args[i] for i in indices])

    return run


def register() -> None:
    """Make ``backend="mlcomp"`` resolve in this process (the installed entry point does it for new ones)."""
    from torch._dynamo.backends import registry

    if BACKEND_NAME not in registry._COMPILER_FNS:
        registry.register_backend(mlcomp_backend, name=BACKEND_NAME)
