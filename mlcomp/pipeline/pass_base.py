"""What a pass is, and the lazy registry that finds passes by name.

A pass is a small frozen dataclass: a ``name`` ClassVar, typed option fields
with defaults, and one method ``run(graph, ctx) -> PassResult``::

    @dataclass(frozen=True)
    class DeadCodeElimination(Pass):
        '''Remove nodes whose values nobody reads.'''
        name: ClassVar[str] = "dce"
        keep_params: bool = option(False, "keep unused parameters")

        def run(self, graph, ctx):
            ...
            return PassResult(graph, changed=True, stats={"nodes_removed": 3})

The registry maps pass names to ``"module:Class"`` references and imports a
module only when one of its passes is asked for, so parsing a pipeline costs
nothing and a pass family with heavy imports stays out of the way until used.
Issues that add passes (mixed precision, pruning, remat, placement) add one
line to :data:`BUILTIN_PASSES`; tests and plugins use
:meth:`PassRegistry.register` on their own registry.
"""
from __future__ import annotations

import dataclasses
import enum
import types
import typing
from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

from mlcomp.base.errors import PipelineSpecError
from mlcomp.base.registry import LazyRegistry, did_you_mean
from mlcomp.hardware.spec import DEFAULT_CPU
from mlcomp.ir.node import Mode

if typing.TYPE_CHECKING:
    from mlcomp.hardware.probe import PrecisionSpeeds
    from mlcomp.hardware.spec import HardwareSpec
    from mlcomp.ir import Graph
    from mlcomp.pipeline.target_facts import TargetFacts

__all__ = ["Pass", "PassResult", "PassContext", "Requirement", "option", "OptionInfo", "PassInfo", "PassRegistry",
           "REGISTRY", "BUILTIN_PASSES"]

# name -> "module:Class".  One line per pass; later issues append theirs here.
BUILTIN_PASSES: dict[str, str] = {
    "dce": "mlcomp.passes.cleanup:DeadCodeElimination",
    "cse": "mlcomp.passes.cleanup:CommonSubexpressionElimination",
    "simplify": "mlcomp.passes.cleanup:Simplify",
    "fold-constants": "mlcomp.passes.folding:FoldConstants",
    "cleanup": "mlcomp.passes.cleanup:Cleanup",
    "fold-batchnorm": "mlcomp.passes.fusion_patterns:FoldBatchNorm",
    "fold-bias": "mlcomp.passes.fusion_patterns:FoldBias",
    "fuse-epilogue": "mlcomp.passes.fusion:FuseEpilogue",
    "fuse-attention": "mlcomp.passes.attention:FuseAttention",
    "recompose": "mlcomp.passes.recompose:Recompose",
    "fuse-elementwise": "mlcomp.passes.fusion:FuseElementwise",
    "fuse": "mlcomp.passes.fusion:Fuse",
    "mixed-precision": "mlcomp.passes.mixed_precision:MixedPrecision",
    "remat": "mlcomp.passes.remat:Remat",
    "partition": "mlcomp.passes.partition:Partition",
    "place": "mlcomp.passes.place:Place",
    "prune": "mlcomp.passes.prune:Prune",
}


# ---------------------------------------------------------------------------
# The pass interface


class Requirement(enum.Enum):
    """Something a pass needs besides the graph; the manager checks them all before running anything."""

    EXAMPLE_INPUTS = "example inputs"            # ctx.example_inputs
    CALIBRATION_DATA = "calibration data"        # ctx.calibration_data
    HARDWARE_SPEC = "a hardware spec"            # ctx.hardware given (not the DEFAULT_CPU fallback)
    TRAINING_GRAPH = "a training graph"          # graph.mode is Mode.TRAINING


@dataclass(frozen=True)
class PassContext:
    """What a pass may depend on besides its options; passes never read globals."""

    hardware: "HardwareSpec | None" = None       # None: mlcomp.analysis.cost.DEFAULT_CPU
    example_inputs: tuple[Any, ...] | None = None
    calibration_data: tuple[Any, ...] | None = None
    target: "TargetFacts | None" = None              # what the target builds in low precision (None: torch's)
    host_precision: "PrecisionSpeeds | None" = None  # the host's measured matmul speed per dtype and CPU features
    cache: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)   # per-run memo (remat's profile)

    @property
    def hw(self) -> "HardwareSpec":
        return self.hardware or DEFAULT_CPU


@dataclass(frozen=True)
class PassResult:
    """A pass's output: the graph, whether anything changed, and numbers for the report.

    ``reference`` is set by a pass that changes the function on purpose (pruning):
    the graph its result must equal, which ``--verify`` checks instead of the input.
    """

    graph: "Graph"
    changed: bool
    stats: Mapping[str, Any] = field(default_factory=dict)
    reference: "Graph | None" = None


def option(default: Any, help: str, *, min: float | None = None,  # noqa: A002 - the natural names
           max: float | None = None) -> Any:
    """A pass option field: its default, its one-line help (shown by ``mlcomp passes``) and,
    for numbers, the closed range it must lie in (checked when a spec is parsed and when a
    pass is constructed in Python)::

        max_group_size: int = option(32, "most nodes in one group", min=1)
    """
    return field(default=default, metadata={"help": help, "min": min, "max": max})


def _out_of_range(value: Any, low: float | None, high: float | None) -> str | None:
    """Why ``value`` is outside ``[low, high]``, or ``None`` when it is inside (or not a number)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if low is not None and not value >= low:
        return f"must be at least {low}"
    if high is not None and not value <= high:
        return f"must be at most {high}"
    return None


class Pass:
    """Base of every pass; subclasses are ``@dataclass(frozen=True)``.

    ``modes`` are the graph modes (``Mode.INFERENCE``/``Mode.TRAINING``) the pass
    is correct on and ``requires`` what it needs from the context; the pass
    manager checks both for the whole pipeline before running anything.
    """

    name: ClassVar[str] = ""
    modes: ClassVar[frozenset[Mode]] = frozenset(Mode)
    requires: ClassVar[frozenset[Requirement]] = frozenset()
    uses_host_precision: ClassVar[bool] = False   # run_pipeline measures ctx.host_precision when none is given

    def __post_init__(self) -> None:
        """Options constructed in Python obey the same declared ranges as parsed specs."""
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            problem = _out_of_range(getattr(self, f.name), f.metadata.get("min"), f.metadata.get("max"))
            if problem:
                raise PipelineSpecError(f"option {f.name!r} of pass {self.name!r} {problem}, "
                                        f"got {getattr(self, f.name)!r}",
                                        hint=f"run `mlcomp passes` to see the options of {self.name!r}")

    def run(self, graph: "Graph", ctx: PassContext) -> PassResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def check_target(self, target: str) -> None:
        """Refuse (``PipelineSpecError``) a target whose runtime cannot use what this pass writes.

        Called with the canonical target name before any model is loaded; passes that
        do not care about the target keep this no-op.
        """

    def check_target_facts(self, facts: "TargetFacts") -> None:
        """Like :meth:`check_target`, from what the target declares it builds (its low precisions)."""

    @classmethod
    def summary(cls) -> str:
        doc = (cls.__doc__ or "").strip()
        return doc.splitlines()[0].rstrip(".") if doc else ""


# ---------------------------------------------------------------------------
# Options


_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}


@dataclass(frozen=True)
class OptionInfo:
    """One typed option of a pass."""

    name: str
    type: Any
    default: Any
    help: str = ""
    min: float | None = None
    max: float | None = None

    # -- describing ---------------------------------------------------------
    def type_text(self) -> str:
        text = _type_text(self.type)
        if self.min is not None and self.max is not None:
            return f"{text} in [{self.min}, {self.max}]"
        if self.min is not None:
            return f"{text} >= {self.min}"
        if self.max is not None:
            return f"{text} <= {self.max}"
        return text

    def format_value(self, value: Any) -> str:
        """Canonical spec text for a value of this option."""
        return _format_value(value)

    # -- converting ---------------------------------------------------------
    def convert(self, value: Any, *, pass_name: str) -> Any:
        """``value`` (spec text, TOML value or Python value) as this option's type."""
        try:
            converted = _convert(self.type, value)
        except (TypeError, ValueError) as exc:
            raise PipelineSpecError(
                f"option {self.name!r} of pass {pass_name!r} expects {self.type_text()}, "
                f"got {value!r}" + (f" ({exc})" if str(exc) else ""),
                hint=f"for example {pass_name}{{{self.name}={self.format_value(self.default)}}}") from None
        problem = _out_of_range(converted, self.min, self.max)
        if problem:
            raise PipelineSpecError(f"option {self.name!r} of pass {pass_name!r} {problem}, got {value!r}",
                                    hint=f"for example {pass_name}{{{self.name}={self.format_value(self.default)}}}")
        return converted


def _optional_inner(tp: Any) -> Any | None:
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) == 1 and len(typing.get_args(tp)) == 2:
            return args[0]
    return None


def _type_text(tp: Any) -> str:
    inner = _optional_inner(tp)
    if inner is not None:
        return f"{_type_text(inner)} or none"
    if typing.get_origin(tp) is typing.Literal:
        return "one of " + "|".join(str(a) for a in typing.get_args(tp))
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        return "one of " + "|".join(str(m.value) for m in tp)
    if typing.get_origin(tp) is tuple:
        return f"list of {_type_text(typing.get_args(tp)[0])}"
    return {bool: "bool", int: "int", float: "float", str: "string"}.get(tp, getattr(tp, "__name__", str(tp)))


def _convert(tp: Any, value: Any) -> Any:
    inner = _optional_inner(tp)
    if inner is not None:
        if value is None or (isinstance(value, str) and value.lower() in ("none", "null")):
            return None
        return _convert(inner, value)
    if typing.get_origin(tp) is typing.Literal:
        choices = typing.get_args(tp)
        for c in choices:
            if value == c or (isinstance(value, str) and str(c) == value):
                return c
        raise ValueError("")
    if isinstance(tp, type) and issubclass(tp, enum.Enum):
        if isinstance(value, tp):
            return value
        for m in tp:
            if isinstance(value, str) and value.lower() in (str(m.value).lower(), m.name.lower()):
                return m
        raise ValueError("")
    if typing.get_origin(tp) is tuple:
        item = typing.get_args(tp)[0]
        values = value if isinstance(value, (list, tuple)) else [value]
        return tuple(_convert(item, v) for v in values)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ValueError("")
    if tp is int:
        if isinstance(value, bool):
            raise ValueError("")
        if isinstance(value, int):
            return value
        if isinstance(value, str):
            return int(value.replace("_", ""))
        raise ValueError("")
    if tp is float:
        if isinstance(value, bool):
            raise ValueError("")
        if isinstance(value, (int, float)):
            return float(value)
        if isinstance(value, str):
            return float(value)
        raise ValueError("")
    if tp is str:
        if isinstance(value, str):
            return value
        raise ValueError("")
    raise TypeError(f"unsupported option type {tp!r}")


def _format_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "none"
    if isinstance(value, enum.Enum):
        return str(value.value)
    if isinstance(value, tuple):
        return "[" + ",".join(_format_value(v) for v in value) + "]"
    if isinstance(value, float):
        return repr(value)
    text = str(value)
    if text and all(c.isalnum() or c in "._-+/:" for c in text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


# ---------------------------------------------------------------------------
# Registry


@dataclass(frozen=True)
class PassInfo:
    """A registered pass: its class, one-line help and typed options."""

    name: str
    cls: type
    summary: str
    options: tuple[OptionInfo, ...]

    def option(self, key: str) -> OptionInfo:
        wanted = key.replace("-", "_")
        for opt in self.options:
            if opt.name == wanted:
                return opt
        known = [o.name for o in self.options]
        close = did_you_mean(wanted, known)
        listing = ", ".join(f"{o.name} ({o.type_text()}, default {o.format_value(o.default)})"
                            for o in self.options) or "none"
        raise PipelineSpecError(
            f"pass {self.name!r} has no option {key!r}"
            + (f"; did you mean {close!r}?" if close else ".")
            + f" Its options are: {listing}",
            hint="run `mlcomp passes` to list every pass with its options")

    def make(self, options: Mapping[str, Any]) -> Pass:
        """An instance of the pass with ``options`` (already converted) applied."""
        return self.cls(**dict(options))


class PassRegistry:
    """Pass name → pass class, imported on first use (a :class:`LazyRegistry` of classes)."""

    def __init__(self, refs: Mapping[str, str | type] | None = None) -> None:
        self._classes: LazyRegistry[type] = LazyRegistry("pass", refs, on_unknown=self._unknown, cutoff=0.5)
        self._infos: dict[str, PassInfo] = {}

    def register(self, cls_or_ref: str | type, *, name: str | None = None, replace: bool = False) -> None:
        """Add a pass (a class, or ``"module:Class"`` with ``name``)."""
        if isinstance(cls_or_ref, str):
            if name is None:
                raise ValueError("a 'module:Class' reference needs name=")
        else:
            name = name or cls_or_ref.name
        if not name:
            raise ValueError(f"{cls_or_ref!r} has no pass name")
        self._classes.register(name, cls_or_ref, replace=replace)
        self._infos.pop(name, None)

    def names(self) -> list[str]:
        return self._classes.names()

    def copy(self) -> "PassRegistry":
        """A registry with the same entries, to extend without touching this one (tests, plugins)."""
        return PassRegistry({n: self._classes.ref(n) for n in self.names()})

    def __contains__(self, name: object) -> bool:
        return name in self._classes

    def get(self, name: str) -> PassInfo:
        """The pass called ``name``; :class:`PipelineSpecError` with the closest match if unknown."""
        if name not in self._infos:
            self._infos[name] = _describe(name, self._classes.get(name))
        return self._infos[name]

    def infos(self) -> list[PassInfo]:
        return [self.get(n) for n in self.names()]

    def _unknown(self, name: str, close: str | None) -> PipelineSpecError:
        return PipelineSpecError(
            f"unknown pass {name!r}" + (f"; did you mean {close!r}?" if close else ".")
            + f" Known passes: {', '.join(self.names())}",
            hint="run `mlcomp passes` to see what each pass does")


def _describe(name: str, cls: type) -> PassInfo:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"pass {name!r} ({cls.__qualname__}) must be a frozen dataclass")
    hints = typing.get_type_hints(cls)
    opts = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        default = f.default if f.default is not dataclasses.MISSING else (
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None)  # type: ignore[misc]
        opts.append(OptionInfo(f.name, hints.get(f.name, type(default)), default, f.metadata.get("help", ""),
                               f.metadata.get("min"), f.metadata.get("max")))
    summary = cls.summary() if hasattr(cls, "summary") else ""
    return PassInfo(name, cls, summary, tuple(opts))


REGISTRY = PassRegistry(BUILTIN_PASSES)

