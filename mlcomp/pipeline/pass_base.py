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
import typing
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any, ClassVar, Mapping

from mlcomp.base.errors import MlcompError, PipelineSpecError
from mlcomp.base.registry import LazyRegistry
from mlcomp.base.spec import Grammar, SpecEntry
from mlcomp.base.spec_options import OptionInfo, check_fields, option
from mlcomp.hardware.decide import Decision, measure_times
from mlcomp.hardware.spec import DEFAULT_CPU
from mlcomp.ir.node import Mode

if typing.TYPE_CHECKING:
    from mlcomp.hardware.probe import PrecisionSpeeds
    from mlcomp.hardware.spec import HardwareSpec
    from mlcomp.ir import Graph
    from mlcomp.pipeline.target_facts import TargetFacts

__all__ = ["Pass", "PassResult", "PassContext", "Requirement", "option", "OptionInfo", "PassInfo", "PassRegistry",
           "PIPELINE_GRAMMAR", "REGISTRY", "BUILTIN_PASSES"]

# name -> "module:Class".  One line per pass; later issues append theirs here.
BUILTIN_PASSES: dict[str, str] = {
    "dce": "mlcomp.passes.cleanup.cleanup:DeadCodeElimination",
    "cse": "mlcomp.passes.cleanup.cleanup:CommonSubexpressionElimination",
    "simplify": "mlcomp.passes.cleanup.cleanup:Simplify",
    "fold-constants": "mlcomp.passes.cleanup.folding:FoldConstants",
    "cleanup": "mlcomp.passes.cleanup.cleanup:Cleanup",
    "fold-batchnorm": "mlcomp.passes.fusion.folds:FoldBatchNorm",
    "fold-bias": "mlcomp.passes.fusion.folds:FoldBias",
    "fuse-epilogue": "mlcomp.passes.fusion.fusion:FuseEpilogue",
    "fuse-attention": "mlcomp.passes.attention:FuseAttention",
    "split-projections": "mlcomp.passes.projections:SplitProjections",
    "recompose": "mlcomp.passes.fusion.recompose:Recompose",
    "fuse-elementwise": "mlcomp.passes.fusion.fusion:FuseElementwise",
    "fuse": "mlcomp.passes.fusion.fusion:Fuse",
    "mixed-precision": "mlcomp.passes.precision.mixed:MixedPrecision",
    "loss-scale": "mlcomp.passes.precision.loss_scale:LossScale",
    "remat": "mlcomp.passes.remat.remat:Remat",
    "schedule": "mlcomp.passes.remat.schedule:Schedule",
    "partition": "mlcomp.passes.placement.partition:Partition",
    "place": "mlcomp.passes.placement.place:Place",
    "prune": "mlcomp.passes.prune.prune:Prune",
    "quantize": "mlcomp.passes.quantize.quantize:Quantize",
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
    # True: every choice a pass would make by measuring takes its fixed rule (recorded as a Decision)
    deterministic: bool = False
    optimizer: Any = None      # a training step's optimizer (mlcomp.runtime.optim.OptimizerSpec): its update's scratch

    @property
    def hw(self) -> "HardwareSpec":
        return self.hardware or DEFAULT_CPU

    def measure(self, question: str, fns: Mapping[str, Callable[[], Any]], *,
                rule: str) -> tuple[dict[str, float] | None, Decision]:
        """Median seconds of each of ``fns`` and the :class:`Decision` recording it (a pass puts it in its
        stats' ``decisions``, the manifest's); in a deterministic run nothing is timed (``None``) and the pass
        takes its fixed ``rule``.  Every timing a pass makes goes through here
        (:func:`mlcomp.hardware.decide.measure_times`)."""
        return measure_times(question, fns, deterministic=self.deterministic, rule=rule)


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
    enum_options: ClassVar[Mapping[str, type[enum.Enum]]] = {}   # option -> enum its text names a member of

    def __post_init__(self) -> None:
        """Options constructed in Python obey the same declared ranges as parsed specs; options named in
        ``enum_options`` given as text (``MixedPrecision(dtype="bf16")``) become their enum members."""
        check_fields(self, owner=self.name, noun="pass", error=PipelineSpecError,
                     hint=f"run `mlcomp passes` to see the options of {self.name!r}")
        for key, kind in self.enum_options.items():
            value = getattr(self, key)
            if isinstance(value, str):
                try:
                    object.__setattr__(self, key, kind(value.lower()))
                except ValueError:
                    raise PipelineSpecError(
                        f"option {key!r} of pass {self.name!r} expects one of "
                        f"{'|'.join(m.value for m in kind)}, got {value!r}",
                        hint=f"for example {self.name}{{{key}={next(iter(kind)).value}}}") from None

    def run(self, graph: "Graph", ctx: PassContext) -> PassResult:  # pragma: no cover - abstract
        raise NotImplementedError

    def check_target(self, target: str) -> None:
        """Refuse (``PipelineSpecError``) a target whose runtime cannot use what this pass writes.

        Called with the canonical target name before any model is loaded; passes that
        do not care about the target keep this no-op.
        """

    def check_target_facts(self, facts: "TargetFacts") -> None:
        """Like :meth:`check_target`, from what the target declares it builds (its low precisions)."""

    def files_read(self) -> tuple[str, ...]:
        """Files the pass reads besides the graph (a calibration dataset): their bytes belong in a compile's
        cache key, since the pipeline's text names them but not their contents."""
        return ()

    @classmethod
    def summary(cls) -> str:
        doc = (cls.__doc__ or "").strip()
        return doc.splitlines()[0].rstrip(".") if doc else ""


# ---------------------------------------------------------------------------
# Registry


PassInfo = SpecEntry
"""A registered pass: its class, one-line help and typed options (a :class:`SpecEntry` of the pipeline grammar)."""

PIPELINE_GRAMMAR = Grammar("pass", PipelineSpecError, whole="pipeline", cutoff=0.5,
                           hint="write passes as name or name{key=value,...}, separated by commas "
                                "(see `mlcomp passes`)")


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

    def _unknown(self, name: str, close: str | None) -> MlcompError:
        return PIPELINE_GRAMMAR.unknown(name, self.names(), hint="run `mlcomp passes` to see what each pass does")


def _describe(name: str, cls: type) -> PassInfo:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"pass {name!r} ({cls.__qualname__}) must be a frozen dataclass")
    return SpecEntry.of(name, cls, PIPELINE_GRAMMAR)


REGISTRY = PassRegistry(BUILTIN_PASSES)

