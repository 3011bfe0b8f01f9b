"""A Dynamo graph that needs gradients as one mlcomp joint graph: forward, then backward from the tangents.

The lowered Dynamo graph (:func:`mlcomp.dynamo.lower.lower`: functional core ATen) is traced
again with ``make_fx`` around ``torch.autograd.grad``, with the joint decompositions of
:mod:`mlcomp.frontend.joint` (eager's fused backward kernels kept, so gradients round as
eager's do).  The traced function takes the *primals* (the Dynamo graph's tensor inputs:
parameters and user tensors) and one *tangent* per differentiable output (the gradient the
caller's ``backward`` brings), and returns the outputs, then one gradient per primal that
requires one.  Unlike :func:`mlcomp.frontend.joint.capture_joint` there is no loss in the
graph: the backward starts from the tangents, so any output structure trains::

    graph graph0_joint(%arg0_1: f32[16, 8], …, %arg2_1: f32[4, 8], …, %arg5_1: f32[4, 4]) {
      %addmm: f32[4, 16] = aten.addmm.default(%arg1_1, %arg2_1, %permute)     # {phase=forward}
      %relu: f32[4, 16] = aten.relu.default(%addmm)                           # {phase=forward}
      …
      %mm: f32[4, 16] = aten.mm.default(%arg5_1, %permute_2)                  # {phase=backward}
      %threshold_backward: f32[4, 16] = aten.threshold_backward.default(%mm, %relu, 0)   # {phase=backward}
      return (%addmm_1, %permute_8, %view_1, %permute_5, %view)
    }

Phases: a node is ``forward`` when an output of the Dynamo graph depends on it, else
``backward`` — what remat and mixed precision read (:mod:`mlcomp.passes.remat`).  A graph
with symbolic sizes is traced on Dynamo's own fake inputs (:func:`_symbolic`), so the joint
keeps each symbol where Dynamo made one and one build serves every size in its range.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch

from mlcomp.base.errors import MlcompError
from mlcomp.dynamo.lower import Lowered
from mlcomp.frontend.capture import from_fx
from mlcomp.frontend.joint import joint_decompositions
from mlcomp.frontend.joint_kernels import eager_autograd, restore_backward_kernels
from mlcomp.frontend.provenance import first_line
from mlcomp.ir import Graph
from mlcomp.ir.node import Phase
from mlcomp.ir.ops import GETITEM

__all__ = ["JointRefused", "JointTrace", "forward_closure", "trace_joint", "joint_graph"]

_ALIAS = (torch.ops.aten.alias.default, torch.ops.aten.detach.default)


class JointRefused(MlcompError):
    """This Dynamo graph cannot go through mlcomp's joint graph; the backend uses AOT autograd for it."""


@dataclass(frozen=True)
class JointTrace:
    """The traced joint: placeholders are the primals, then one tangent per differentiable output."""

    gm: torch.fx.GraphModule
    primals: int                     # how many placeholders are primals
    outputs: int                     # outputs of the Dynamo graph (the first outputs of ``gm``), new values
                                     # of the inputs it writes into last
    differentiable: tuple[int, ...]  # indices of the outputs that carry a gradient (one tangent each)
    grad_of: tuple[int, ...]         # primal index of each gradient output, in order
    example: tuple[torch.Tensor, ...]  # primals then tangents: real tensors the trace ran on
    written: tuple[int, ...] = ()    # primal index of each written input, in the order of the last outputs


def trace_joint(low: Lowered, primals: Sequence[torch.Tensor], needs_grad: Sequence[bool],
                generator: torch.Generator) -> JointTrace:
    """Trace forward and backward of ``low.gm`` on ``primals`` (real tensors); see the module doc."""
    primals = [p.detach() for p in primals]
    with torch.no_grad():
        outs = low.gm(*primals)
    if not isinstance(outs, (tuple, list)) or not all(isinstance(o, torch.Tensor) for o in outs):
        raise JointRefused("the graph returns something other than a tuple of tensors",
                           hint="its forward and backward are compiled separately (AOT autograd)")
    grad_of = tuple(i for i, g in enumerate(needs_grad) if g)
    with torch.enable_grad():
        probe = low.gm(*[p.requires_grad_(g) if g else p for p, g in zip([p.clone() for p in primals], needs_grad)])
    user = len(outs) - len(low.written)          # a written input's new value carries no gradient
    differentiable = tuple(i for i, o in enumerate(probe[:user]) if o.requires_grad)
    if not differentiable or not grad_of:
        raise JointRefused("no output of the graph depends on an input that needs a gradient",
                           hint="its forward and backward are compiled separately (AOT autograd)")
    tangents = [(torch.rand(outs[i].shape, generator=generator) * 2 - 1).to(outs[i].dtype) for i in differentiable]
    n = len(primals)

    def joint(*args: torch.Tensor) -> tuple[torch.Tensor, ...]:
        prim = [a.detach().requires_grad_(g) if g else a for a, g in zip(args[:n], needs_grad)]
        with torch.enable_grad():
            out = low.gm(*prim)
        grads = torch.autograd.grad([out[i] for i in differentiable], [prim[i] for i in grad_of],
                                    list(args[n:]), allow_unused=True, materialize_grads=True)
        return (*[o.detach() for o in out], *grads)

    from torch.fx.experimental.proxy_tensor import make_fx
    try:
        args, mode = _symbolic(low, differentiable) if low.dynamic else ((*primals, *tangents), "real")
        with eager_autograd():
            gm = make_fx(joint, decomposition_table=joint_decompositions(), tracing_mode=mode)(*args)
    except Exception as exc:  # noqa: BLE001 - a backward the trace cannot spell out goes to AOT autograd
        raise JointRefused(f"the backward cannot be traced: {type(exc).__name__}: {first_line(exc)[:200]}",
                           hint="its forward and backward are compiled separately (AOT autograd)") from None
    _tidy(gm)
    return JointTrace(gm, n, len(outs), differentiable, grad_of, (*primals, *tangents), low.written)


def _symbolic(low: Lowered, differentiable: Sequence[int]) -> tuple[tuple[torch.Tensor, ...], str]:
    """Fake primals and tangents with Dynamo's symbols: the joint keeps each size symbolic where Dynamo's graph does.

    The primals are ``low.gm``'s own fake inputs (Dynamo's fake mode and shape environment);
    each tangent is a fake tensor of its output's symbolic shape.
    """
    from torch._guards import detect_fake_mode

    fakes = [n.meta["val"] for n in low.gm.graph.nodes if n.op == "placeholder"]
    mode = detect_fake_mode(fakes)
    if mode is None:
        raise JointRefused("the graph's symbolic inputs carry no fake mode",
                           hint="its forward and backward are compiled separately (AOT autograd)")
    with mode:
        outs = low.gm(*fakes)
        tangents = [torch.empty(outs[i].shape, dtype=outs[i].dtype) for i in differentiable]
    return (*fakes, *tangents), "symbolic"


def _tidy(gm: torch.fx.GraphModule) -> None:
    """Aliases and detaches (autograd's bookkeeping) dropped, ``view`` as ``reshape``, eager's kernels restored."""
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _ALIAS:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
        elif node.op == "call_function" and node.target is torch.ops.aten.view.default:
            node.target = torch.ops.aten.reshape.default
    restore_backward_kernels(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()


def joint_graph(trace: JointTrace, name: str, params: Mapping[int, str]) -> Graph:
    """The traced joint as mlcomp IR (``Mode.TRAINING``), each compute node marked forward or backward.

    ``params``: primal index → module path of the primals that are parameters or buffers; they
    become ``PARAM`` nodes under that path, as in :func:`mlcomp.frontend.joint.capture_joint`,
    so remat does not count them as activations and mixed precision keeps them fp32 masters.
    They stay inputs of the compiled forward and backward (:mod:`mlcomp.dynamo.joint_split`).
    """
    holders = [n.name for n in trace.gm.graph.nodes if n.op == "placeholder"]
    constant_of = {holders[i]: path for i, path in params.items()}
    tensors = {path: trace.example[i] for i, path in params.items()}
    try:
        graph = from_fx(trace.gm.graph, name=name, training=True, constant_of=constant_of, tensors=tensors)
    except MlcompError as exc:
        raise JointRefused(f"the joint graph is outside mlcomp's IR: {exc.message.splitlines()[0]}",
                           hint="its forward and backward are compiled separately (AOT autograd)") from None
    forward = forward_closure(graph, trace.outputs)
    for node in graph.call_nodes():
        graph.replace(node.with_ann(phase=Phase.FORWARD if node.name in forward else Phase.BACKWARD))
    return graph


def forward_closure(graph: Graph, outputs: int, extra: Iterable[str] = ()) -> set[str]:
    """The nodes the first ``outputs`` outputs of ``graph`` depend on, ``extra``, and each projection
    (``getitem``) of a tuple among them: a projection stays with the tuple it picks from (dropout's
    mask, a norm's saved statistics).  O(nodes + edges)."""
    forward: set[str] = set()
    stack = [r.name for r in graph.output_refs[:outputs]]
    while stack:
        name = stack.pop()
        if name not in forward:
            forward.add(name)
            stack.extend(graph.node(name).input_names())
    forward.update(extra)
    forward |= {n.name for n in graph.nodes(GETITEM) if n.input_names()[0] in forward}
    return forward
