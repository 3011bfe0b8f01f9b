"""Heterogeneous placement in one process: ``place{devices=cuda:0,cpu policy=cost|memory}``.

Writes ``Node.ann.device`` on every compute node; code generation
(:func:`mlcomp.runtime.codegen.to_fx`) then copies a value once to each other
device that reads it and stores a weight where all its readers are::

    before                                    after place{devices=cuda:0,cpu}
    %addmm = aten.addmm.default(...)          %addmm = aten.addmm.default(...)   {device=cuda:0}
    %relu = aten.relu.default(%addmm)         %relu = aten.relu.default(%addmm)  {device=cuda:0}

* ``cost``: nodes in topological order, each on the device where it finishes
  first: its roofline time there plus moving every input that lives elsewhere
  (``bytes / link bandwidth + latency``, :mod:`mlcomp.analysis.parallel.placement_cost`;
  a value is moved to a device once).  O(n · devices).
* ``memory``: fill the devices in the order given, each up to its memory
  (parameters + activations the nodes produce), then spill to the next.

An op a device cannot run (no kernel registered for it there) goes to the next
device that can.  A device that does not exist on this machine is refused
before anything is placed.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, ClassVar, Sequence

import psutil
import torch

from mlcomp.analysis.cost import node_cost
from mlcomp.analysis.liveness import value_bytes
from mlcomp.analysis.parallel.placement_cost import LINKS, Link
from mlcomp.base.errors import MlcompError, PipelineSpecError
from mlcomp.hardware.spec import DEFAULT_CPU, SPEC_SHEETS, HardwareSpec
from mlcomp.ir import Graph, Node, TensorMeta
from mlcomp.ir.graph_tools import annotate
from mlcomp.ir.ops import PARAM, Namespace
from mlcomp.pipeline.pass_base import Pass, PassContext, PassResult, option

__all__ = ["Place", "Policy", "Device", "PlacementError", "assign_devices", "devices_here"]


class PlacementError(MlcompError):
    """A device asked for does not exist, or no device can run a node."""


class Policy(enum.Enum):
    COST = "cost"
    MEMORY = "memory"


@dataclass(frozen=True)
class Device:
    """One device as placement sees it."""

    name: str                                   # "cpu", "cuda:0"
    spec: HardwareSpec
    memory: int                                 # bytes
    runs: Callable[[Node], bool] = lambda node: True


def _kernel_on(kind: str) -> Callable[[Node], bool]:
    key = "CUDA" if kind == "cuda" else "CPU"

    def runs(node: Node) -> bool:
        if node.op.namespace not in (Namespace.ATEN, Namespace.PRIMS):
            return True                         # composites are torch code; getitem/sizes run anywhere
        qual = f"{node.op.namespace.value}::{node.op.name}"
        if node.op.overload != "default":
            qual += f".{node.op.overload}"
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        return any(has(qual, k) for k in (key, "CompositeImplicitAutograd", "CompositeExplicitAutograd"))

    return runs


def devices_here(names: Sequence[str], cpu_spec: HardwareSpec | None = None) -> list[Device]:
    """:class:`Device` s for ``names``; :class:`PlacementError` for one this machine does not have."""
    out = []
    for text in names:
        try:
            dev = torch.device(text)
        except RuntimeError:
            raise PlacementError(f"place: {text!r} is not a device name",
                                 hint="write devices like cpu, cuda:0 (comma separated)") from None
        if dev.type == "cpu":
            out.append(Device("cpu", cpu_spec or DEFAULT_CPU, psutil.virtual_memory().total, _kernel_on("cpu")))
            continue
        count = torch.cuda.device_count() if dev.type == "cuda" else 0
        index = dev.index or 0
        if dev.type != "cuda" or index >= count:
            raise PlacementError(f"place: device {text} does not exist on this machine (torch sees {count} CUDA "
                                 "device(s))", hint="list devices this machine has, e.g. devices=cpu, or "
                                                    "devices=cuda:0,cpu on a machine with a GPU")
        props = torch.cuda.get_device_properties(index)
        spec = next((s for key, s in SPEC_SHEETS.items() if key in props.name), SPEC_SHEETS["A100"])
        out.append(Device(f"cuda:{index}", spec, int(props.total_memory), _kernel_on("cuda")))
    return out


def assign_devices(graph: Graph, devices: Sequence[Device], policy: Policy = Policy.COST,
                   link: Link | None = None) -> dict[str, str]:
    """Compute node → device name (see the module docstring)."""
    link = link or LINKS["pcie4-x16"]
    where: dict[str, str] = {n.name: devices[0].name for n in graph.input_nodes}
    copies: set[tuple[str, str]] = set()
    used = {d.name: 0 for d in devices}
    param_home: dict[str, str] = {}
    current = 0
    for node in graph.call_nodes():
        able = [d for d in devices if d.runs(node)]
        if not able:
            raise PlacementError(f"place: no device among {', '.join(d.name for d in devices)} can run "
                                 f"%{node.name} ({node.op})", where=str(node.origin),
                                 hint="add a device that can (cpu runs every ATen op)")
        params = [p for p in node.input_names() if graph.node(p).op == PARAM and p not in param_home]
        weight = sum(value_bytes(graph, graph.node(p)) for p in params)
        size = weight + value_bytes(graph, node)
        if policy is Policy.MEMORY:
            while current < len(devices) - 1 and (used[devices[current].name] + size > devices[current].memory
                                                  or devices[current] not in able):
                current += 1
            choice = devices[current] if devices[current] in able else able[0]
        else:
            cost = node_cost(graph, node)

            def finish(d: Device) -> float:
                moves = [v for v in node.input_names() if v in where and where[v] != d.name
                         and (v, d.name) not in copies and isinstance(graph.node(v).meta, (TensorMeta, tuple))]
                nbytes = sum(value_bytes(graph, graph.node(v)) for v in moves)
                return d.spec.time(cost) + (link.seconds(nbytes, len(moves)) if moves else 0.0)

            choice = min(able, key=finish)
        for v in node.input_names():
            if v in where and where[v] != choice.name:
                copies.add((v, choice.name))
        for p in params:
            param_home[p] = choice.name
        used[choice.name] += size
        where[node.name] = choice.name
    return {name: dev for name, dev in where.items() if graph.node(name).op.namespace is not Namespace.GRAPH
            or graph.node(name).op.name == "getitem"}


@dataclass(frozen=True)
class Place(Pass):
    """Place compute nodes on the devices of one process by cost or memory; writes ann.device."""

    name: ClassVar[str] = "place"
    devices: tuple[str, ...] = option(("cpu",), "devices to use, first = where inputs arrive (cuda:0,cpu)")
    policy: Policy = option(Policy.COST, "cost: fastest finish incl. copies; memory: fill devices in order")

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.devices:
            raise PipelineSpecError("option 'devices' of pass 'place' is empty", hint="for example "
                                    "place{devices=[cuda:0,cpu]}")
        try:
            devices_here(self.devices)          # refuse a device this machine lacks before anything runs
        except PlacementError as err:
            raise PipelineSpecError(err.what, hint=err.hint) from None

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        devices = devices_here(self.devices, ctx.hardware)
        placement = assign_devices(graph, devices, self.policy)
        changed = annotate(graph, "device", placement)
        counts = {d.name: 0 for d in devices}
        for dev in placement.values():
            counts[dev] += 1
        crossings = sum(1 for n in graph.call_nodes() for v in n.input_names()
                        if v in placement and placement[v] != placement.get(n.name))
        return PassResult(graph, changed, {"nodes_per_device": counts, "cross_device_reads": crossings})
