"""A joint graph cut into the forward and the backward a ``torch.autograd.Function`` runs.

The forward takes the primals and returns the Dynamo graph's outputs followed by the
*saved* values: every forward value (a primal included, a parameter constant excepted)
that a backward node reads or that is itself a gradient.  The backward takes the saved
values, then the tangents, and returns the gradients (a size the backward reads, such as a
symbolic batch's ``sym_size``, is computed there again from a saved tensor: sizes are no
tensors to save).  Forward means a node an output of
the Dynamo graph depends on, or one a pass marked ``forward``; everything else (remat's
recomputations among them) runs in the backward.  The cut follows what the pipeline left,
so after ``remat`` fewer, cheaper values cross it::

    joint (budget 1.0)                        joint after remat{budget=0.5}
    forward saves  addmm, relu, x, …          forward saves  addmm, x, …
    backward       threshold_backward(relu)   backward       relu.remat = relu(addmm)
                                                             threshold_backward(relu.remat)

O(nodes + edges).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

from mlcomp.dynamo.joint import JointRefused, forward_closure
from mlcomp.analysis.liveness import buffers
from mlcomp.ir import Graph, Node, Ref
from mlcomp.ir.node import Phase, TensorMeta
from mlcomp.ir.ops import GETITEM, INPUT, OUTPUT, PARAM

__all__ = ["Cut", "cut", "split_joint", "Parts"]

_FORWARD = (Phase.FORWARD, Phase.LOSS)
_HINT = "its forward and backward are compiled separately (AOT autograd)"


@dataclass(frozen=True)
class Cut:
    """Which nodes run in the forward, and what the forward saves for the backward."""

    forward: frozenset[str]
    saved: tuple[str, ...]          # every value the backward receives from the forward, primals included
    activations: int                # the tensors they hold besides parameters (views counted as their base)
    activation_bytes: int
    again: tuple[str, ...] = ()     # forward sizes the backward computes again (from saved tensors)


@dataclass(frozen=True)
class Parts:
    forward: Graph        # primals → outputs, saved
    backward: Graph       # saved, tangents → gradients
    cut: Cut


def cut(graph: Graph, primals: Sequence[str], outputs: int) -> Cut:
    """The forward side of ``graph`` (its first ``outputs`` outputs are the Dynamo graph's) and the saved values.

    ``primals``: the names of the forward's inputs (``PARAM`` nodes for parameters, which are
    inputs of the compiled parts all the same; other ``PARAM`` nodes are constants)."""
    refs = graph.output_refs
    marked = [n.name for n in graph.call_nodes() if n.ann.phase in _FORWARD]
    forward = forward_closure(graph, outputs, extra=[*primals, *marked])
    given = set(primals)
    again = _sizes_again(graph, forward)
    saved: dict[str, None] = {}
    for node in graph.call_nodes():
        reads = [s for s in node.input_names() if s in given or graph.node(s).op != PARAM]
        if node.name in forward and node.name not in again:
            late = [s for s in reads if s not in forward]
            if late:
                raise JointRefused(f"forward node %{node.name} of {graph.name} reads %{late[0]}, which the forward "
                                   "does not compute", hint=_HINT)
        else:
            saved.update((s, None) for s in reads if s in forward and s not in again)
    saved.update((r.name, None) for r in refs[outputs:] if r.name in forward)
    order = {name: i for i, name in enumerate(graph.order())}
    names = tuple(sorted(saved, key=order.__getitem__))
    for name in names:
        if not isinstance(graph.node(name).meta, TensorMeta):
            raise JointRefused(f"the backward of {graph.name} reads %{name}, which is not a tensor "
                               f"({graph.node(name).meta})", hint=_HINT)
    bufs = buffers(graph)
    bases = {bufs.storage[n] for n in names} - {n for n in given if graph.node(n).op == PARAM}
    acts = [b for b in bases if graph.node(b).op != PARAM]        # views of a parameter cost nothing
    return Cut(frozenset(forward), names, len(acts), sum(bufs.size[b] for b in acts),
               tuple(sorted(again, key=order.__getitem__)))


def _sizes_again(graph: Graph, forward: set[str]) -> set[str]:
    """Forward nodes holding a size (``sym_size``, arithmetic on sizes) that the backward reads: the backward
    computes them again from the tensors they read instead of receiving them (they are no tensors)."""
    scalar = {n.name for n in graph.call_nodes() if n.name in forward and not isinstance(n.meta, TensorMeta)
              and n.op != GETITEM and not isinstance(n.meta, tuple)}
    stack = [s for n in graph.call_nodes() if n.name not in forward for s in n.input_names() if s in scalar]
    again: set[str] = set()
    while stack:
        name = stack.pop()
        if name not in again:
            again.add(name)
            stack.extend(s for s in graph.node(name).input_names() if s in scalar)
    return again


def split_joint(graph: Graph, primals: Sequence[str], tangents: Sequence[str], outputs: int) -> Parts:
    """The forward and backward graphs of ``graph`` (see the module doc)."""
    the_cut = cut(graph, primals, outputs)
    refs = graph.output_refs
    given = set(primals)
    for ref in refs[:outputs]:
        if ref.name in given or graph.node(ref.name).op == PARAM:
            raise JointRefused(f"output {refs.index(ref)} of {graph.name} is an input or a parameter itself, not a "
                               "value the graph computes", hint=_HINT)
    fw = _part(graph, f"{graph.name}_forward", [_as_input(graph, p) for p in primals],
               [n for n in graph.call_nodes() if n.name in the_cut.forward],
               list(refs[:outputs]) + [Ref(s) for s in the_cut.saved])
    saved_inputs = [_as_input(graph, s) for s in the_cut.saved]
    again = set(the_cut.again)
    bw = _part(graph, f"{graph.name}_backward", saved_inputs + [graph.node(t) for t in tangents],
               [n for n in graph.call_nodes() if n.name not in the_cut.forward or n.name in again],
               list(refs[outputs:]))
    return Parts(fw, bw, the_cut)


def _as_input(graph: Graph, name: str) -> Node:
    node = graph.node(name)
    return Node(name, INPUT, meta=node.meta, origin=node.origin)


def _part(graph: Graph, name: str, inputs: Sequence[Node], body: Sequence[Node], outs: Sequence[Ref]) -> Graph:
    """A graph of ``inputs`` (INPUT nodes), ``body`` in order and ``outs``; constants copied where read."""
    part = Graph(name)
    part.symbols, part.ranges = dict(graph.symbols), dict(graph.ranges)
    for item in inputs:
        part.add(item)

    def need(src: str) -> None:
        if src not in part and graph.node(src).op == PARAM:
            part.add_constant(src, graph.constants[src], origin=graph.node(src).origin)
        elif src not in part:
            raise JointRefused(f"{name} reads %{src}, which neither it nor its inputs hold", hint=_HINT)

    for node in body:
        for src in node.input_names():
            need(src)
        part.add(node)
    for ref in outs:
        need(ref.name)
    part.add(Node("output", OUTPUT, inputs=(tuple(outs),)))
    return part
