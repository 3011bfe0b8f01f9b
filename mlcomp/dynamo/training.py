"""Training under ``torch.compile(backend="mlcomp")``: mlcomp's joint graph, else AOT autograd, said so.

:func:`compile_training_graph` first tries mlcomp's own route
(:func:`mlcomp.dynamo.joint_step.compile_joint`: the joint graph through the pipeline, then
cut and lowered).  A graph it refuses (a backward the trace cannot spell
out, a verification failure …) gets a report row ``joint graph → aot-autograd`` with the
reason, printed by ``explain``, and goes the second way:

torch's AOT autograd traces the Dynamo graph's joint forward and backward, partitions it
into a forward graph (which also returns what the backward saves) and a backward graph, and
hands each to a compiler; here both compilers are closures over the ``torch.compile``
call's options and compile their graph region by region (:mod:`mlcomp.dynamo.partition`).
Parameters are inputs of these graphs, never frozen: the optimizer changes them every
step.  Passes that run on training graphs only (``remat``) are left out of the halves' pipeline
(:func:`for_halves`), and the report row names them.  Each graph is verified on example tensors drawn from its fake inputs (floats
uniform in [-1, 1), integers and booleans zero, so an index is always in range).
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Sequence

import torch

from mlcomp.base.errors import MlcompError
from mlcomp.dynamo.joint_step import compile_joint
from mlcomp.dynamo.lower import concrete
from mlcomp.dynamo.options import BackendOptions
from mlcomp.dynamo.partition import compile_regions, outside_dynamo
from mlcomp.dynamo.report import AOT, BackendReport, Partition
from mlcomp.frontend.provenance import first_line
from mlcomp.ir import Mode
from mlcomp.pipeline import Pipeline

__all__ = ["compile_split", "compile_training_graph", "example_of", "for_halves"]


def example_of(value: Any, generator: torch.Generator) -> Any:
    """A real example for a fake input: a tensor of its shape (sizes at their hints) and dtype, or an int."""
    if not isinstance(value, torch.Tensor):
        return concrete(value)
    shape = [concrete(d) for d in value.shape]
    if value.dtype.is_floating_point or value.dtype.is_complex:
        return (torch.rand(shape, generator=generator) * 2 - 1).to(value.dtype)
    return torch.zeros(shape, dtype=value.dtype)


def compile_training_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opts: BackendOptions,
                           report: BackendReport, name: str) -> Callable[..., Any]:
    """mlcomp's joint graph; where it is refused, AOT autograd (:func:`compile_split`) and a report row saying why."""
    try:
        with outside_dynamo():
            return compile_joint(gm, example_inputs, opts, report, name)
    except MlcompError as exc:
        reason = exc.what.split("\n")[0]
    except Exception as exc:  # noqa: BLE001 - a failure inside mlcomp costs the joint route, not the model
        reason = f"mlcomp failed: {type(exc).__name__}: {first_line(exc)[:200]}"
        warnings.warn(f"mlcomp backend: {name} trains through AOT autograd ({reason})", stacklevel=2)
    halves, dropped = for_halves(opts)
    if dropped:
        reason += f"; {', '.join(dropped)} need the joint graph and do not run on the halves"
    report.add(Partition(name, "joint graph", AOT, nodes=sum(1 for n in gm.graph.nodes if n.op == "call_function"),
                         reason=f"not through mlcomp's joint graph: {reason}"))
    return compile_split(gm, example_inputs, halves, report, name)


def for_halves(opts: BackendOptions) -> tuple[BackendOptions, list[str]]:
    """The options with the passes that run on training graphs only (remat) left out, and their names.

    AOT autograd's forward and backward are inference graphs; a pipeline file is kept as written.
    """
    spec = opts.pipeline_spec()
    if not isinstance(spec, str) or spec.endswith(".toml"):
        return opts, []
    pipe = Pipeline.parse(spec)
    kept = tuple(p for p in pipe.passes if Mode.INFERENCE in p.build().modes)
    if len(kept) == len(pipe.passes):
        return opts, []
    dropped = [p.text for p in pipe.passes if p not in kept]
    return dataclasses.replace(opts, pipeline=Pipeline(kept).spec, precision=None), dropped


def compile_split(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], opts: BackendOptions,
                  report: BackendReport, name: str) -> Callable[..., Any]:
    """AOT autograd with mlcomp compiling the forward and the backward graph."""
    from functorch.compile import make_boxed_func
    from torch._decomp import core_aten_decompositions
    from torch._dynamo.backends.common import aot_autograd

    def compiler(role: str) -> Callable[..., Any]:
        def compile_graph(fgm: torch.fx.GraphModule, fakes: Sequence[Any]) -> Callable[..., Any]:
            with outside_dynamo():        # AOT autograd calls the compilers inside its fake mode
                generator = torch.Generator().manual_seed(0)
                inputs = [example_of(f, generator) for f in fakes]
                compiled = compile_regions(fgm, inputs, constants={}, opts=opts, report=report,
                                           graph_name=f"{name}.{role}")
            return make_boxed_func(compiled)
        return compile_graph

    aot = aot_autograd(fw_compiler=compiler("forward"), bw_compiler=compiler("backward"),
                       inference_compiler=compiler("inference"), decompositions=core_aten_decompositions())
    return aot(gm, example_inputs)
