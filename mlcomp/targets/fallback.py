"""``--fallback eager``: run what a target supports on it, and the rest in torch.

The graph is split into regions, each either wholly supported by the target or
wholly not, with as few switches as a greedy two-colour topological order
gives (ready nodes of the current colour are taken before switching).  Each
region becomes a subgraph (:meth:`Graph.subgraph`); supported ones are built by
the target, the others run the generated torch code (:class:`EagerRuntime`)::

    runtime, regions = build_partitioned(get_target("tvm"), graph, options, {"fft_r2c"}, inputs)
    [r["runs_on"] for r in regions]
    ['tvm', 'torch (eager)', 'tvm']

A saved partitioned artifact holds one sub-folder per region (``part0/``…),
each with its own payload; eager regions are saved as ExportedPrograms
(``model.pt2``), loadable with ``torch.export.load``.
"""
from __future__ import annotations

from typing import Any, Protocol

import torch

from mlcomp.ir import Graph
from mlcomp.ir.ops import GETITEM, PARAM, Namespace
from mlcomp.ir.opsets import SYM_SIZE
from mlcomp.runtime.artifact import Runtime
from mlcomp.runtime.eager import EagerRuntime, PartitionedRuntime
from mlcomp.targets.options import CompileOptions

__all__ = ["split_regions", "build_partitioned", "EagerRuntime", "PartitionedRuntime"]

EAGER_LABEL = "torch (eager)"


def split_regions(graph: Graph, unsupported: set[str]) -> list[tuple[bool, list[str]]]:
    """Compute nodes grouped into ``(supported, names)`` regions in a valid execution order."""
    calls = graph.call_nodes()
    rank = {n.name: i for i, n in enumerate(calls)}
    ok: dict[str, bool] = {}
    for node in calls:  # a getitem goes with the node whose tuple it reads
        ok[node.name] = ok[node.inputs[0].name] if node.op == GETITEM and node.inputs[0].name in ok \
            else node.name not in unsupported
    preds = {n.name: {p for p in n.input_names() if p in rank} for n in calls}
    succs: dict[str, list[str]] = {n.name: [] for n in calls}
    for name, ps in preds.items():
        for p in ps:
            succs[p].append(name)
    missing = {name: len(ps) for name, ps in preds.items()}
    ready = sorted((n for n, c in missing.items() if c == 0), key=rank.__getitem__)
    regions: list[tuple[bool, list[str]]] = []
    colour = ok[ready[0]] if ready else True
    while ready:
        take = [n for n in ready if ok[n] == colour]
        if not take:
            colour = not colour
            continue
        ready = [n for n in ready if ok[n] != colour]
        region: list[str] = []
        while take:
            take.sort(key=rank.__getitem__)
            name = take.pop(0)
            region.append(name)
            for s in succs[name]:
                missing[s] -= 1
                if missing[s] == 0:
                    (take if ok[s] == colour else ready).append(s)
        regions.append((colour, region))
        ready.sort(key=rank.__getitem__)
        colour = not colour
    return _sink_constants(graph, regions, rank)


def _sink_constants(graph: Graph, regions: list[tuple[bool, list[str]]],
                    rank: dict[str, int]) -> list[tuple[bool, list[str]]]:
    """Move nodes computed from parameters only (weight transposes…) next to their readers.

    Otherwise the greedy order computes them in the first region and passes
    them between regions as extra values.
    """
    const: set[str] = set()
    for name in sorted(rank, key=rank.__getitem__):
        srcs = graph.node(name).input_names()
        if srcs and all(graph.node(s).op == PARAM or s in const for s in srcs):
            const.add(name)
    where = {n: i for i, (_, names) in enumerate(regions) for n in names}
    members = [list(names) for _, names in regions]
    for name in sorted(const, key=rank.__getitem__, reverse=True):
        readers = {where[u.name] for u in graph.users(name) if u.name in where}
        if len(readers) != 1:
            continue
        dest = readers.pop()
        src = where[name]
        if dest != src and regions[dest][0] == regions[src][0]:
            members[src].remove(name)
            members[dest].insert(0, name)
            where[name] = dest
    out = [(ok, names) for (ok, _), names in zip(regions, members) if names]
    merged: list[tuple[bool, list[str]]] = []
    for ok, names in out:
        if merged and merged[-1][0] == ok:
            merged[-1][1].extend(names)
        else:
            merged.append((ok, names))
    return merged


def _is_size(node: Any) -> bool:
    """A symbolic size computation (``aten.sym_size.int``, ``operator.mul``…): an int, not a tensor."""
    return node.meta is None and (node.op == SYM_SIZE or node.op.namespace is Namespace.OPERATOR)


def _with_sizes(graph: Graph, names: list[str], sizes: set[str]) -> list[str]:
    """``names`` and the size computations they read, recomputed in the region rather than passed into it
    (a region's inputs are tensors; a size is read from a tensor it has)."""
    have = set(names)
    stack = [s for n in names for s in graph.node(n).input_names() if s in sizes]
    while stack:
        name = stack.pop()
        if name not in have:
            have.add(name)
            names.append(name)
            stack.extend(s for s in graph.node(name).input_names() if s in sizes)
    return names


class RegionBuilder(Protocol):
    """What :func:`build_partitioned` needs of a target (:class:`mlcomp.targets.base.Target` is one).

    A protocol rather than ``Target`` itself: ``base`` imports this module to split graphs,
    so naming ``Target`` here would make the two import each other.
    """

    name: str

    def build(self, graph: Graph, options: CompileOptions, inputs: tuple[torch.Tensor, ...]) -> Runtime: ...


def build_partitioned(target: RegionBuilder, graph: Graph, options: CompileOptions, unsupported: set[str],
                      inputs: tuple[torch.Tensor, ...]) -> tuple[PartitionedRuntime, list[dict[str, Any]]]:
    """Build each region (target or eager); returns the runtime and a description of the regions."""
    env: dict[str, Any] = {n.name: t for n, t in zip(graph.input_nodes, inputs)}
    for ref in graph.output_refs:  # outputs that are parameters come straight from the graph
        if graph.node(ref.name).op == PARAM:
            env[ref.name] = graph.constants[ref.name]
    parts, described = [], []
    sizes = {n.name for n in graph.call_nodes() if _is_size(n)} - {r.name for r in graph.output_refs}
    for i, (supported, names) in enumerate(split_regions(graph, unsupported)):
        names = _with_sizes(graph, [n for n in names if n not in sizes], sizes)
        if not names:
            continue
        sub = graph.subgraph(names, name=f"{graph.name}_part{i}")
        outs = [r.name for r in sub.output_refs]
        if not outs:
            continue  # dead region: nothing downstream reads it
        ins = [n.name for n in sub.input_nodes]
        sub_inputs = tuple(env[n] for n in ins)
        runtime = target.build(sub, options, sub_inputs) if supported else EagerRuntime.of_graph(sub, sub_inputs)
        env.update(zip(outs, runtime(*sub_inputs)))
        runs_on = target.name if supported else EAGER_LABEL
        parts.append({"runtime": runtime, "inputs": ins, "outputs": outs, "runs_on": runs_on})
        ops = sorted({str(graph.node(n).op) for n in names if graph.node(n).op != GETITEM})
        described.append({"region": len(described), "runs_on": runs_on, "nodes": len(names),
                          "ops": ops[:12], "first": names[0], "last": names[-1],
                          "unsupported": sorted(n for n in names if n in unsupported)})
    runtime = PartitionedRuntime([n.name for n in graph.input_nodes],
                                 [r.name for r in graph.output_refs], parts)
    return runtime, described
