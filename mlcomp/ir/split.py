"""The generic splitter: a placement (node → stage) becomes one graph per stage with explicit boundaries.

Stages form a chain.  Stage ``s`` *receives* (its INPUT nodes) exactly what
stage ``s-1`` *sends* (its outputs): every value made at a stage ``<= s-1``
(or a graph input) that a stage ``>= s`` still reads, or that is a graph
output.  A value that skips a stage is relayed through it (the stage returns
its input unchanged), which is how a residual branch crosses several cuts.
Stage 0 receives the graph's inputs; the last stage returns the graph's outputs
in their original structure.  Parameters are copied into every stage that reads
them.  Names are kept, so stage ``s`` 's graph prints like the original::

    graph mlp (stage 0 of 2)                graph mlp (stage 1 of 2)
    graph mlp_stage0(%x: f32[2, 512]) {      graph mlp_stage1(%relu: f32[2, 256]) {
      ...                                      ...
      %relu = aten.relu.default(%addmm)        %addmm_2 = aten.addmm.default(...)
      return (%relu,)                          return (%addmm_2,)
    }                                        }

    >>> import torch
    >>> from mlcomp.ir.builder import GraphBuilder
    >>> from mlcomp.ir.ops import aten
    >>> b = GraphBuilder("mlp")
    >>> h = b.call(aten("relu"), b.call(aten("mm"), b.input("x", (2, 512)), b.param("w0", torch.ones(512, 256))))
    >>> graph = b.output(b.call(aten("mm"), h, b.param("w1", torch.ones(256, 2))))
    >>> stages = split_stages(graph, {"mm": 0, "relu": 0, "mm_1": 1})
    >>> stages[1].receives, stages[0].sends
    (('relu',), ('relu',))

This is mechanism only: which node goes where is decided elsewhere (the
``partition`` pass writes ``Node.ann.stage``; nodes without one take the
stage of their latest input).  O(n + edges) plus one sort of the boundary lists.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

from mlcomp.base.errors import IRError
from mlcomp.ir.graph import Graph
from mlcomp.ir.node import Node, Ref, TensorMeta
from mlcomp.ir.ops import GETITEM, INPUT, OUTPUT, PARAM

__all__ = ["Stage", "split_stages", "stage_of_nodes"]


@dataclass(frozen=True)
class Stage:
    """One stage: its graph, what it receives from the previous stage and what it sends on."""

    index: int
    graph: Graph
    receives: tuple[str, ...]
    sends: tuple[str, ...]


def stage_of_nodes(graph: Graph, placement: Mapping[str, int] | None = None) -> dict[str, int]:
    """Stage of every compute node: ``placement``, else ``ann.stage``, else the latest input's stage.

    A node may not sit on an earlier stage than a value it reads (stages form a chain).
    """
    stage: dict[str, int] = {}
    for node in graph.call_nodes():
        given = placement.get(node.name) if placement is not None else node.ann.stage
        inputs = [stage[n] for n in node.input_names() if n in stage]
        low = max(inputs, default=0)
        if given is None:
            given = low
        elif given < low:
            late = next(n for n in node.input_names() if stage.get(n) == low)
            raise IRError(f"node %{node.name} is placed on stage {given} but reads %{late} from stage {low}",
                          where=str(node.origin), hint="stages form a chain: a node goes on the stage of its "
                                                       "latest input or a later one")
        if node.op == GETITEM:
            given = low            # a projection stays with the tuple it picks from
        stage[node.name] = int(given)
    return stage


def split_stages(graph: Graph, placement: Mapping[str, int] | None = None, *,
                 num_stages: int | None = None) -> list[Stage]:
    """One :class:`Stage` per stage index (see the module docstring)."""
    stage = stage_of_nodes(graph, placement)
    count = num_stages if num_stages is not None else max(stage.values(), default=0) + 1
    if any(s < 0 or s >= count for s in stage.values()):
        raise IRError(f"graph {graph.name}: stage indices must lie in 0..{count - 1}")
    position = {name: i for i, name in enumerate(graph.order())}
    inputs = [n.name for n in graph.input_nodes]
    outputs = {r.name for r in graph.output_refs}
    last = count - 1
    # the last stage that needs each value (graph outputs: the last stage)
    need: dict[str, int] = {}
    for node in graph.nodes():
        if node.op in (PARAM, OUTPUT):
            continue
        readers = [stage[u.name] for u in graph.users(node.name) if u.name in stage]
        need[node.name] = max(readers, default=-1)
        if node.name in outputs:
            need[node.name] = last
    input_set = set(inputs)
    made = {name: (0 if name in input_set else stage[name]) for name in need}
    for name, s in made.items():
        if need[name] > s and not isinstance(graph.node(name).meta, TensorMeta):
            raise IRError(f"value %{name} ({graph.node(name).meta}) crosses from stage {s} to stage {need[name]}, "
                          "but only tensors can be sent between stages",
                          hint="run cleanup (fold-constants) first so sizes are literals, or move the cut")
    # values alive on the boundary after stage s: made at <= s, needed at > s
    sends: list[list[str]] = [[] for _ in range(count)]
    order_key = {name: (0, i) for i, name in enumerate(inputs)}
    ranked = sorted(need, key=lambda n: order_key.get(n, (1, position[n])))
    for name in ranked:
        for s in range(made[name], need[name]):
            sends[s].append(name)
    stages = []
    for s in range(count):
        receives = tuple(inputs) if s == 0 else tuple(sends[s - 1])
        out = tuple(sends[s]) if s < last else ()
        stages.append(Stage(s, _stage_graph(graph, s, count, stage, receives, out), receives, out))
    return stages


def _stage_graph(graph: Graph, s: int, count: int, stage: Mapping[str, int], receives: tuple[str, ...],
                 sends: tuple[str, ...]) -> Graph:
    sub = Graph(f"{graph.name}_stage{s}", mode=graph.mode)
    sub.symbols, sub.ranges = dict(graph.symbols), dict(graph.ranges)
    for name in receives:
        outer = graph.node(name)
        sub.add(Node(name, INPUT, meta=outer.meta, origin=outer.origin))
    for node in graph.nodes():
        if stage.get(node.name) != s:
            continue
        for src in node.input_names():
            if src not in sub and graph.node(src).op == PARAM:
                sub.add_constant(src, graph.constants[src], origin=graph.node(src).origin)
            elif src not in sub:
                raise IRError(f"stage {s} of {graph.name}: node %{node.name} reads %{src}, which does not "
                              "reach this stage", hint="this is a bug in the splitter")
        sub.add(node)
    if s == count - 1:
        out = graph.output_node
        for ref in graph.output_refs:
            if ref.name not in sub and graph.node(ref.name).op == PARAM:
                sub.add_constant(ref.name, graph.constants[ref.name], origin=graph.node(ref.name).origin)
            elif ref.name not in sub:
                raise IRError(f"graph output %{ref.name} does not reach the last stage")
        sub.add(Node("output", OUTPUT, inputs=out.inputs))
    else:
        sub.add(Node("output", OUTPUT, inputs=(tuple(Ref(n) for n in sends),)))
    return sub
