"""What a target can compile, declared as data, and the up-front check of a graph against it.

Every :class:`~mlcomp.targets.base.Target` carries a frozen :class:`Capabilities`
(graph modes, dtypes, dtypes at the graph boundary, device kinds, per-node
placement on several devices, symbolic sizes).  ``Target.compile`` compares the
graph and the options with it *before* anything is exported or built, and
reports every mismatch in one :class:`CapabilityError`::

    >>> from mlcomp.targets import get_target
    >>> get_target("onnxruntime").capabilities.describe()
    'modes inference; dtypes f32, f16, bf16, f64, i64, i32, i16, i8, u8, bool (inputs/outputs
     without bf16); devices cpu, cuda; single device; symbolic sizes; mixed precision bf16 (casts in the
     graph, pays with avx512_bf16 or amx_bf16), f16 (casts in the graph, pays with avx512_fp16 or amx_fp16)'
    >>> from mlcomp.ir.builder import GraphBuilder
    >>> from mlcomp.ir.ops import aten
    >>> from mlcomp.targets import CompileOptions
    >>> b = GraphBuilder("fp8mlp", mode=Mode.TRAINING)
    >>> fp8_training_graph = b.output(b.call(aten("relu"), b.input("x", (2, 4), torch.float8_e4m3fn)))
    >>> get_target("onnxruntime").compile(fp8_training_graph, CompileOptions(device="mps"))
    Traceback (most recent call last):
    mlcomp.targets.capabilities.CapabilityError: target onnxruntime cannot compile fp8mlp: (1) mode: fp8mlp
    is a training graph; target onnxruntime compiles inference graphs; (2) dtype: float8_e4m3fn is not a
    dtype target onnxruntime handles (f32, f16, bf16, ...) (used by %x, %relu); (3) device: device 'mps' is
    not one target onnxruntime runs on (cpu, cuda). capture without --training; cast the model ... to a
    listed dtype; pass --device ...

The graph never reaches the backend's exporter: every problem is found first, not only the
one the exporter would stop at.

Nodes with unsupported ops are exempt from the dtype check: under
``fallback='eager'`` they run in torch, otherwise the error lists them once, as
ops, with the reason (a complex FFT is one problem, not two).  The check is one
pass over the graph (O(n)).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

import torch

from mlcomp.base.errors import UnsupportedOpError
from mlcomp.ir import Graph, Mode, Node, tensor_metas
from mlcomp.ir.dtypes import DTYPE_NAMES, dtype_name
from mlcomp.ir.ops import OUTPUT
from mlcomp.pipeline.target_facts import TORCH_LOW_PRECISION, LowPrecision, TargetFacts

__all__ = ["DeviceKind", "Capabilities", "MismatchKind", "Mismatch", "CapabilityError", "REAL_DTYPES",
           "TORCH_CPU", "TORCH_CUDA", "mismatches"]

# every real dtype of the one dtype table; no target lowers complex tensors
REAL_DTYPES: frozenset[torch.dtype] = frozenset(d for d in DTYPE_NAMES if not d.is_complex)
_SHOWN_NODES = 4


class DeviceKind(enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"

    @classmethod
    def of(cls, device: str) -> "DeviceKind | None":
        """``"cuda:1"`` → ``CUDA``; ``None`` for a device no target knows (``mps``, typos)."""
        try:
            return cls(torch.device(device).type)
        except (RuntimeError, ValueError):
            return None


@dataclass(frozen=True)
class Capabilities:
    """What one target compiles.  The defaults describe torch running on the CPU."""

    modes: frozenset[Mode] = frozenset({Mode.INFERENCE})
    dtypes: frozenset[torch.dtype] = REAL_DTYPES              # any tensor inside the graph
    io_dtypes: frozenset[torch.dtype] | None = None           # graph inputs/outputs (None = ``dtypes``)
    devices: frozenset[DeviceKind] = frozenset({DeviceKind.CPU})
    multi_device: bool = False        # honours ``ann.device`` placement over several devices
    dynamic_shapes: bool = True       # inputs with symbolic sizes
    # kinds of device a node may be placed on (``ann.device``) when ``multi_device``; None: ``devices``.
    # The cuda target runs where its GPU is and places nodes on that GPU or the host's CPU.
    placement_devices: frozenset[DeviceKind] | None = None
    # the low precisions a mixed-precision pass may target here: how each is built and what makes it
    # pay (handed to passes as PassContext.target; an explicit dtype not listed is refused before capture)
    low_precision: tuple[LowPrecision, ...] = TORCH_LOW_PRECISION
    # module types the target converts whole from their parameters (PassContext.target.whole_modules)
    whole_modules: frozenset[str] = frozenset()

    @property
    def placeable(self) -> frozenset[DeviceKind]:
        return self.devices | (self.placement_devices or frozenset()) if self.multi_device else self.devices

    @property
    def boundary_dtypes(self) -> frozenset[torch.dtype]:
        return self.dtypes if self.io_dtypes is None else self.io_dtypes & self.dtypes

    def describe(self) -> str:
        """One line for ``mlcomp targets``."""
        def names(dtypes: frozenset[torch.dtype]) -> str:
            return ", ".join(dtype_name(d) for d in _ordered(dtypes))
        io = ""
        if self.boundary_dtypes != self.dtypes:
            io = f" (inputs/outputs without {names(self.dtypes - self.boundary_dtypes)})"
        return "; ".join([
            "modes " + ", ".join(m.value for m in Mode if m in self.modes),
            f"dtypes {names(self.dtypes)}{io}",
            "devices " + ", ".join(d.value for d in DeviceKind if d in self.devices),
            ("nodes placed on " + ", ".join(d.value for d in DeviceKind if d in self.placeable))
            if self.multi_device else "single device",
            "symbolic sizes" if self.dynamic_shapes else "static shapes only",
            "mixed precision " + (", ".join(lp.describe() for lp in self.low_precision) or "none")])

    def facts(self, target: str, device: str = "cpu") -> TargetFacts:
        """What passes are told about this target (``PassContext.target``)."""
        return TargetFacts(target, self.low_precision, device, self.whole_modules)

    def to_json(self) -> dict[str, Any]:
        return {"modes": [m.value for m in Mode if m in self.modes],
                "dtypes": [dtype_name(d) for d in _ordered(self.dtypes)],
                "io_dtypes": [dtype_name(d) for d in _ordered(self.boundary_dtypes)],
                "devices": [d.value for d in DeviceKind if d in self.devices],
                "multi_device": self.multi_device, "dynamic_shapes": self.dynamic_shapes,
                "placement_devices": [d.value for d in DeviceKind if d in self.placeable],
                "low_precision": [{"dtype": dtype_name(lp.dtype), "mode": lp.mode.value, "needs": list(lp.needs),
                                   "fp32_ops": sorted(lp.fp32_ops)} for lp in self.low_precision]}


# Targets that run generated torch code also run joint training graphs: the training step
# (mlcomp.training.step.TrainingArtifact) is that code plus a torch.optim optimizer.
TORCH_CPU = Capabilities(modes=frozenset({Mode.INFERENCE, Mode.TRAINING}))
TORCH_CUDA = Capabilities(modes=frozenset({Mode.INFERENCE, Mode.TRAINING}), devices=frozenset({DeviceKind.CUDA}),
                          multi_device=True, placement_devices=frozenset({DeviceKind.CUDA, DeviceKind.CPU}))


def _ordered(dtypes: frozenset[torch.dtype]) -> list[torch.dtype]:
    table = list(DTYPE_NAMES)
    return sorted(dtypes, key=lambda d: (table.index(d) if d in table else len(table), str(d)))


class MismatchKind(enum.Enum):
    MODE = "mode"
    DTYPE = "dtype"
    IO_DTYPE = "input/output dtype"
    DEVICE = "device"
    MULTI_DEVICE = "placement"
    DYNAMIC_SHAPES = "symbolic sizes"
    OPS = "ops"


@dataclass(frozen=True)
class Mismatch:
    """One way a graph does not fit a target; ``nodes`` are every node concerned, in graph order."""

    kind: MismatchKind
    detail: str
    nodes: tuple[str, ...] = field(default=())

    def format(self) -> str:
        if not self.nodes:
            return f"{self.kind.value}: {self.detail}"
        shown = ", ".join(f"%{n}" for n in self.nodes[:_SHOWN_NODES])
        more = f" and {len(self.nodes) - _SHOWN_NODES} more" if len(self.nodes) > _SHOWN_NODES else ""
        return f"{self.kind.value}: {self.detail} (used by {shown}{more})"


class CapabilityError(UnsupportedOpError):
    """The graph or the options do not fit what a target declares it can compile.

    ``problems`` lists every :class:`Mismatch`; ``nodes`` (node → reason) the
    unsupported ops among them, as :class:`UnsupportedOpError` does.
    """

    def __init__(self, target: str, graph: Graph, problems: list[Mismatch], hint: str) -> None:
        items = "; ".join(f"({i}) {p.format()}" for i, p in enumerate(problems, 1))
        super().__init__(f"target {target} cannot compile {graph.name}: {items}", hint=hint)
        self.problems = list(problems)
        self.nodes: dict[str, str] = {}




def _node_dtypes(node: Node) -> list[torch.dtype]:
    out = [m.dtype for m in tensor_metas(node.meta)]
    if node.ann.precision is not None:
        out.append(node.ann.precision.dtype)
    return out


def mismatches(caps: Capabilities, target: str, graph: Graph, device: str,
               runs_elsewhere: Mapping[str, str] | Iterable[str] = ()) -> list[Mismatch]:
    """Every way ``graph`` compiled for ``device`` does not fit ``caps``, in a fixed order.

    ``runs_elsewhere``: nodes with unsupported ops (exempt from the dtype check).
    """
    skip = set(runs_elsewhere)
    found: list[Mismatch] = []
    if graph.mode not in caps.modes:
        allowed = " or ".join(m.value for m in Mode if m in caps.modes)
        found.append(Mismatch(MismatchKind.MODE, f"{graph.name} is a {graph.mode.value} graph; target "
                                                 f"{target} compiles {allowed} graphs"))

    inner: dict[torch.dtype, list[str]] = {}
    boundary: dict[torch.dtype, list[str]] = {}
    edge = {n.name for n in graph.input_nodes} | {r.name for r in graph.output_refs}
    for node in graph.nodes():
        if node.op == OUTPUT or node.name in skip:
            continue
        crossing = {m.dtype for m in tensor_metas(node.meta)}    # what crosses the boundary: the values,
        for dtype in dict.fromkeys(_node_dtypes(node)):          # not the precision they were computed in
            if dtype not in caps.dtypes:
                inner.setdefault(dtype, []).append(node.name)
            elif node.name in edge and dtype in crossing and dtype not in caps.boundary_dtypes:
                boundary.setdefault(dtype, []).append(node.name)
    handled = ", ".join(dtype_name(d) for d in _ordered(caps.dtypes))
    for dtype, names in inner.items():
        found.append(Mismatch(MismatchKind.DTYPE, f"{dtype_name(dtype)} is not a dtype target {target} "
                                                  f"handles ({handled})", tuple(names)))
    for dtype, names in boundary.items():
        found.append(Mismatch(MismatchKind.IO_DTYPE, f"target {target} cannot take or return "
                                                     f"{dtype_name(dtype)} tensors at the graph boundary",
                              tuple(names)))

    kinds = ", ".join(d.value for d in DeviceKind if d in caps.devices)
    if DeviceKind.of(device) not in caps.devices:
        found.append(Mismatch(MismatchKind.DEVICE, f"device {device!r} is not one target {target} "
                                                   f"runs on ({kinds})"))
    placed: dict[str, list[str]] = {}
    calls = graph.call_nodes()
    for node in calls:
        if node.ann.device:
            placed.setdefault(_norm(node.ann.device), []).append(node.name)
    placeable = ", ".join(d.value for d in DeviceKind if d in caps.placeable)
    for where, names in placed.items():
        if DeviceKind.of(where) not in caps.placeable:
            found.append(Mismatch(MismatchKind.DEVICE, f"nodes are placed on {where!r}, not a device "
                                                       f"target {target} places nodes on ({placeable})", tuple(names)))
    unplaced = len(calls) - sum(len(names) for names in placed.values())
    devices = set(placed) | ({_norm(device)} if unplaced else set())
    if len(devices) > 1 and not caps.multi_device:
        found.append(Mismatch(MismatchKind.MULTI_DEVICE, f"the graph is placed on {len(devices)} devices "
                                                         f"({', '.join(sorted(devices))}); target {target} "
                                                         "runs a graph on one device",
                              tuple(n for names in placed.values() for n in names)))

    dynamic = [n.name for n in graph.input_nodes if n.tensor_meta.is_dynamic]
    if dynamic and not caps.dynamic_shapes:
        found.append(Mismatch(MismatchKind.DYNAMIC_SHAPES, f"target {target} compiles static shapes "
                                                           "(one compile per input shape)", tuple(dynamic)))
    return found


def _norm(device: str) -> str:
    """``"cuda"`` and ``"cuda:0"`` are one device; text no torch device parses stays as it is."""
    try:
        d = torch.device(device)
    except (RuntimeError, ValueError):
        return device
    return f"{d.type}:0" if d.type == "cuda" and d.index is None else str(d)


HINTS: Mapping[MismatchKind, str] = {
    MismatchKind.MODE: "capture without --training",
    MismatchKind.DTYPE: "cast the model (or drop the mixed-precision pass) to a listed dtype",
    MismatchKind.IO_DTYPE: "keep model inputs and outputs float32; mixed precision casts inside the graph",
    MismatchKind.DEVICE: "pass --device with one of the listed devices, or choose another target",
    MismatchKind.MULTI_DEVICE: "compile without the placement pass, or for a target that honours placement",
    MismatchKind.DYNAMIC_SHAPES: "capture without --dynamic / --dynamic-batch",
    MismatchKind.OPS: "run those regions in torch with --fallback eager",
}


def hint_for(problems: list[Mismatch]) -> str:
    kinds = list(dict.fromkeys(p.kind for p in problems))
    return "; ".join(HINTS[k] for k in kinds) + "; `mlcomp targets` lists what each target compiles"
