"""Values and nodes of the IR: references, tensor metadata, annotations, origins.

A node is frozen; a pass makes a changed copy and hands it to ``Graph.replace``::

    >>> from mlcomp.ir.ops import aten
    >>> n = Node("relu", aten("relu"), (Ref("x"),), meta=TensorMeta((2, 8), torch.float32))
    >>> n.format()
    '%relu: f32[2, 8] = aten.relu.default(%x)'
    >>> n.with_ann(stage=1).ann.stage
    1
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, replace
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Callable

import torch

from mlcomp.base.errors import IRError
from mlcomp.ir.dtypes import dtype_name, itemsize
from mlcomp.ir.ops import INPUT, PARAM, Op

__all__ = ["Ref", "map_refs", "refs_in", "Dim", "TensorMeta", "Precision", "Annotations", "Origin",
           "Node", "Mode", "Phase", "PrecisionReason", "format_meta", "format_value"]

# ---------------------------------------------------------------------------
# Values


@dataclass(frozen=True, order=True)
class Ref:
    """A use of another node's value inside ``Node.inputs`` / ``Node.attrs``."""

    name: str

    def __repr__(self) -> str:
        return f"%{self.name}"


def map_refs(value: Any, fn: Callable[[Ref], Any]) -> Any:
    """Rebuild a nested tuple/list/dict tree, replacing every :class:`Ref` with ``fn(ref)``."""
    if isinstance(value, Ref):
        return fn(value)
    if isinstance(value, (str, int, float, bool)) or value is None:     # the common leaves, before the ABC check
        return value
    if isinstance(value, tuple):
        return tuple(map_refs(v, fn) for v in value)
    if isinstance(value, list):
        return [map_refs(v, fn) for v in value]
    if isinstance(value, Mapping):
        return {k: map_refs(v, fn) for k, v in value.items()}
    return value


def refs_in(value: Any) -> list[Ref]:
    """Every :class:`Ref` in a nested tree, in order, with repeats."""
    found: list[Ref] = []
    map_refs(value, found.append)
    return found


Dim = int | str  # a size, or the name of a symbolic size ("s0", "batch")


@dataclass(frozen=True)
class TensorMeta:
    """Static facts about one tensor value."""

    shape: tuple[Dim, ...]
    dtype: torch.dtype
    device: str = "cpu"
    requires_grad: bool = False

    @classmethod
    def of(cls, t: torch.Tensor) -> "TensorMeta":
        shape = tuple(d if isinstance(d, int) else str(d) for d in t.shape)
        device = "cpu" if t.device.type in ("meta", "cpu") else str(t.device)
        return cls(shape, t.dtype, device, bool(t.requires_grad))

    @property
    def is_dynamic(self) -> bool:
        return any(isinstance(d, str) for d in self.shape)

    def concrete_shape(self, symbols: Mapping[str, int] | None = None) -> tuple[int, ...]:
        """Shape with symbolic sizes replaced by their example values."""
        out = []
        for d in self.shape:
            if isinstance(d, int):
                out.append(d)
            else:
                out.append(_eval_sym(d, symbols or {}))
        return tuple(out)

    def numel(self, symbols: Mapping[str, int] | None = None) -> int:
        return math.prod(self.concrete_shape(symbols))

    def nbytes(self, symbols: Mapping[str, int] | None = None) -> int:
        return self.numel(symbols) * itemsize(self.dtype)

    def __str__(self) -> str:
        return f"{dtype_name(self.dtype)}[{', '.join(str(d) for d in self.shape)}]"


def _eval_sym(expr: str, symbols: Mapping[str, int]) -> int:
    if expr in symbols:
        return symbols[expr]
    try:  # simple expressions such as "2*s0" or "s0 + 1" from symbolic shapes
        return int(eval(expr, {"__builtins__": {}}, dict(symbols)))  # noqa: S307 - names only
    except Exception as exc:  # pragma: no cover - defensive
        raise IRError(f"symbolic size {expr!r} has no example value",
                      hint="give example inputs so every symbolic size has a value") from exc


class Precision(enum.Enum):
    """The compute precision a mixed-precision pass assigns to a node."""

    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def dtype(self) -> torch.dtype:
        return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[self.value]


class Phase(enum.Enum):
    """Which part of a training step a node of a joint graph belongs to."""

    FORWARD = "forward"
    LOSS = "loss"
    BACKWARD = "backward"


class PrecisionReason(enum.Enum):
    """Why a mixed-precision pass gave a node its precision (mlcomp.passes.precision.mixed)."""

    POLICY = "policy"            # the per-op policy table
    DENIED = "denied"            # deny= matched the op or the module path
    ALLOWED = "allowed"          # allow= matched the op or the module path
    OVERFLOW = "overflow"        # range guard: calibrated values exceed the dtype's largest finite value
    UNDERFLOW = "underflow"      # range guard: calibrated values fall below the smallest normal (or to 0)
    TARGET = "target"            # the target computes this op in fp32 only (its low-precision support says so)
    SELECTION = "selection"      # it ranks the values a topk/sort/argmax selects by: a rounding would change the choice


@dataclass(frozen=True)
class Annotations:
    """Decisions passes record on a node; targets and reports read them."""

    precision: Precision | None = None   # mixed precision: compute dtype of this node
    precision_reason: PrecisionReason | None = None   # mixed precision: why that precision
    fusion_group: int | None = None      # fusion: id of the group the node belongs to
    stage: int | None = None             # placement/partition: pipeline stage
    device: str | None = None            # placement: "cpu", "cuda:0"…
    checkpoint: bool = False             # remat: recompute in backward instead of storing
    sparsity: float | None = None        # pruning: fraction of zeros in this parameter
    phase: Phase | None = None           # joint training graphs: forward, loss or backward

    def __str__(self) -> str:
        parts = [f"{k}={v.value if isinstance(v, enum.Enum) else v}"
                 for k, v in self.__dict__.items() if v is not None and v is not False]
        return ", ".join(parts)


@dataclass(frozen=True)
class Origin:
    """Where in the user's code a node came from."""

    module_path: str = ""   # "layer1.0.conv1" ("" = the root module)
    module_type: str = ""   # "Conv2d"
    source: str = ""        # "model.py:42"

    def __str__(self) -> str:
        where = self.module_path or "<root>"
        if self.module_type:
            where += f" ({self.module_type})"
        if self.source:
            where += f" at {self.source}"
        return where




@dataclass(frozen=True)
class Node:
    """One operation.  ``inputs`` is a tuple tree of :class:`Ref` and literals."""

    name: str
    op: Op
    inputs: tuple[Any, ...] = ()
    attrs: Mapping[str, Any] = field(default_factory=dict)
    meta: TensorMeta | tuple[TensorMeta | None, ...] | None = None
    ann: Annotations = field(default_factory=Annotations)
    origin: Origin = field(default_factory=Origin)

    def __post_init__(self) -> None:
        if not isinstance(self.attrs, MappingProxyType):
            object.__setattr__(self, "attrs", MappingProxyType(dict(self.attrs)))
        if not isinstance(self.inputs, tuple):
            object.__setattr__(self, "inputs", tuple(self.inputs))

    def __reduce__(self) -> tuple[Any, ...]:
        # attrs is a read-only mappingproxy, which pickle and deepcopy cannot copy: rebuild from a dict
        return (Node, (self.name, self.op, self.inputs, dict(self.attrs), self.meta, self.ann, self.origin))

    def input_names(self) -> list[str]:
        """Names of the nodes this one reads, in order, without repeats (found once per node: a node is
        frozen, so the names are kept on it; every analysis reads them several times per pass)."""
        names = self.__dict__.get("_input_names")
        if names is None:
            seen: dict[str, None] = {}
            for r in refs_in(self.inputs) + refs_in(self.attrs):
                seen.setdefault(r.name, None)
            names = tuple(seen)
            object.__setattr__(self, "_input_names", names)
        return list(names)

    @property
    def tensor_meta(self) -> TensorMeta:
        """The meta of a single-tensor node (raises for tuple/None meta)."""
        if not isinstance(self.meta, TensorMeta):
            raise IRError(f"node %{self.name} ({self.op}) has no single tensor value")
        return self.meta

    def with_(self, **changes: Any) -> "Node":
        return replace(self, **changes)

    def with_ann(self, **changes: Any) -> "Node":
        return replace(self, ann=replace(self.ann, **changes))

    def format(self) -> str:
        meta = format_meta(self.meta)
        lhs = f"%{self.name}" + (f": {meta}" if meta else "")
        if self.op == PARAM:
            rhs = "param"
        elif self.op == INPUT:
            rhs = "input"
        else:
            args = [format_value(v) for v in self.inputs]
            args += [f"{k}={format_value(v)}" for k, v in self.attrs.items() if k != "body"]
            rhs = f"{self.op}({', '.join(args)})"
        notes = []
        if self.origin.module_path or self.origin.module_type:
            notes.append(self.origin.module_path or "<root>")
        ann = str(self.ann)
        if ann:
            notes.append("{" + ann + "}")
        text = f"{lhs} = {rhs}"
        return text + ("   # " + " ".join(notes) if notes else "")


def format_meta(meta: Any) -> str:
    if meta is None:
        return ""
    if isinstance(meta, tuple):
        return "(" + ", ".join(format_meta(m) or "_" for m in meta) + ")"
    return str(meta)


def format_value(v: Any) -> str:
    if isinstance(v, Ref):
        return repr(v)
    if isinstance(v, (list, tuple)):
        inner = ", ".join(format_value(x) for x in v)
        return f"[{inner}]" if isinstance(v, list) else f"({inner}{',' if len(v) == 1 else ''})"
    if isinstance(v, torch.dtype):
        return dtype_name(v)
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, torch.Tensor):
        return f"tensor({TensorMeta.of(v)})"
    if hasattr(v, "ir_summary"):  # a nested Graph (fused bodies)
        return v.ir_summary()
    return repr(v) if isinstance(v, str) else str(v)


class Mode(enum.Enum):
    INFERENCE = "inference"
    TRAINING = "training"


def tensor_metas(meta: Any) -> list[TensorMeta]:
    """Every :class:`TensorMeta` in a node's meta (one, a tuple of them, nested, or none)."""
    if isinstance(meta, TensorMeta):
        return [meta]
    if isinstance(meta, tuple):
        return [m for part in meta for m in tensor_metas(part)]
    return []
