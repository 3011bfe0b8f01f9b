"""What every target shares: options, the support check and compilation.

    >>> import torch
    >>> from mlcomp.ir.builder import linear_relu_graph
    >>> graph = linear_relu_graph()              # relu(x @ W.T + b), x f32[2, 8]
    >>> x = torch.randn(2, 8)
    >>> from mlcomp.targets import get_target, CompileOptions
    >>> target = get_target("onnxruntime")
    >>> target.available() is None            # None, or why it cannot run here
    True
    >>> art = target.compile(graph, CompileOptions(threads=2))
    >>> art(x).shape
    torch.Size([2, 4])

A target declares what it compiles as a frozen ``capabilities`` ClassVar
(:mod:`mlcomp.targets.capabilities`: graph modes, dtypes, devices, placement,
symbolic sizes), implements ``explain(graph, node)`` (``None`` when it can run
the node, otherwise the reason) and ``build(graph, options, inputs) -> Runtime``.
``compile`` checks the capabilities before anything is exported or built and
raises one :class:`CapabilityError` listing every mismatch.  The
base class checks *every* node first and reports all unsupported ones at once
(:class:`UnsupportedOpError` with op, module path and source line); with
``fallback=Fallback.EAGER`` it splits the graph into supported regions and
regions that run in torch instead (:mod:`mlcomp.targets.fallback`).

Targets are found by name in :mod:`mlcomp.targets.registry` (``TARGETS``,
``get_target``, ``TargetName``); this module re-exports those names.
"""
from __future__ import annotations

import abc
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar, Mapping, Sequence

import torch

from mlcomp.base.errors import MlcompError, TargetUnavailableError, UnsupportedOpError
from mlcomp.base.spec import SpecItem
from mlcomp.frontend.loading import graph_random_inputs
from mlcomp.ir import Graph, Node, TensorMeta, map_refs, tensor_metas
from mlcomp.ir.ops import GETITEM, Namespace, Op
from mlcomp.pipeline.presets import ALL_REWRITES, Rewrite
from mlcomp.pipeline.target_facts import TargetFacts
from mlcomp.runtime.artifact import Artifact, Runtime, TensorSpec
from mlcomp.targets.capabilities import Capabilities, CapabilityError, Mismatch, MismatchKind, hint_for, mismatches
from mlcomp.targets.fallback import build_partitioned
from mlcomp.targets.options import CompileOptions, Fallback, LogLevel, OptionsError
# the registry lives in its own module (below this one and artifact); re-exported so
# ``from mlcomp.targets.base import get_target, TARGETS`` keeps working
from mlcomp.targets.registry import TARGETS, TargetName, available_targets, get_target, target_name

__all__ = ["Fallback", "CompileOptions", "LogLevel", "OptionsError", "TargetCompileError", "Target", "TargetName",
           "Capabilities", "CapabilityError", "get_target", "available_targets", "example_inputs",
           "UNSUPPORTED_EVERYWHERE", "TARGETS", "target_name"]


class TargetCompileError(MlcompError):
    """The backend's own compiler (exporter, TVM build) failed on a graph the target accepted."""

    exit_code = 3


# Ops no mlcomp target lowers: spectral ops work on complex tensors, which the
# artifacts' input/output contract, ONNX Runtime kernels and TVM do not cover.
UNSUPPORTED_EVERYWHERE: Mapping[str, str] = {
    name: "spectral (FFT) ops produce complex tensors, which mlcomp targets do not lower"
    for name in ("_fft_r2c", "_fft_c2r", "_fft_c2c", "fft_fft", "fft_rfft", "fft_irfft", "fft_ifft")
}


COMPLEX_REASON = "it reads or produces complex tensors, which mlcomp targets do not lower"




def _touches_complex(node: Node, graph: Graph | None) -> bool:
    metas = tensor_metas(node.meta)
    if graph is not None:
        for name in node.input_names():
            metas += tensor_metas(graph.node(name).meta)
    return any(m.dtype.is_complex for m in metas)


@dataclass(frozen=True)
class NoOptions:
    """The options of a target that takes none."""


class Target(abc.ABC):
    """One backend.  Subclasses set ``name``/``description`` and implement the abstract methods.

    ``Options``: the dataclass of the target's own spec options (``tvm{kernels=off}``, read by
    :func:`~mlcomp.targets.registry.get_target`); ``settings`` is this instance's.
    """

    name: ClassVar[str]
    description: ClassVar[str]
    default_device: ClassVar[str] = "cpu"
    runs_composites_in_torch: ClassVar[bool] = False   # True: composite impls run as torch code
    # what it compiles (modes, dtypes, devices…), checked by compile() before anything is built;
    # the default describes torch on the CPU
    capabilities: ClassVar[Capabilities] = Capabilities()
    # which kinds of rewrite help it: a preset (-O2…) drops the passes of other kinds for this target
    rewrites: ClassVar[frozenset[Rewrite]] = ALL_REWRITES
    Options: ClassVar[type] = NoOptions
    # what a process imports to load this target's artifacts, none of which starts a thread on import: a
    # group of timing processes imports them once, before its first process forks the others
    runtime_modules: ClassVar[tuple[str, ...]] = ()
    spec_item: SpecItem | None = None          # the options given after the name, set by get_target

    @property
    def settings(self) -> Any:
        """The target's own options (``Options``), as the spec gave them."""
        return self.Options(**dict(self.spec_item.options if self.spec_item else ()))

    @property
    def spec(self) -> str:
        """The canonical spec: ``tvm``, or ``tvm{kernels=off}`` with options that differ from the defaults."""
        return self.spec_item.text if self.spec_item else self.name

    # -- capability -------------------------------------------------------
    def available(self) -> str | None:
        """``None`` if this target can run here, else the reason (missing package, no device)."""
        return None

    def supports(self, node: Node, graph: Graph | None = None) -> bool:
        return self.explain(node, graph) is None

    def explain(self, node: Node, graph: Graph | None = None) -> str | None:
        """Why this target cannot run ``node`` (``None`` if it can)."""
        if node.op.is_structural or node.op == GETITEM:
            return None
        if node.op.namespace is Namespace.ATEN and node.op.name in UNSUPPORTED_EVERYWHERE:
            return UNSUPPORTED_EVERYWHERE[node.op.name]
        if _touches_complex(node, graph):
            return COMPLEX_REASON
        if node.op.is_composite:
            if graph is None or self.runs_composites_in_torch:
                return None
            try:
                inner_ops = composite_ops(graph, node)
            except Exception as exc:  # noqa: BLE001 - reported as the reason
                return f"its torch implementation could not be traced ({type(exc).__name__}: {exc})"
            for inner in inner_ops:
                reason = self._explain_op(inner)
                if reason:
                    return f"composite {node.op} expands to {inner}: {reason}"
            return None
        return self._explain_op(node.op)

    def _explain_op(self, op: Op) -> str | None:
        if op.is_structural or op == GETITEM:   # also met inside composite bodies (multi-output ops)
            return None
        if op.namespace in (Namespace.ATEN, Namespace.PRIMS) and op.name in UNSUPPORTED_EVERYWHERE:
            return UNSUPPORTED_EVERYWHERE[op.name]
        return self.explain_op(op)

    def explain_op(self, op: Op) -> str | None:
        """Target-specific check of one ATen/operator op; ``None`` = supported."""
        return None

    def unsupported(self, graph: Graph) -> dict[str, str]:
        """Every node this target cannot run → the reason, in graph order."""
        out: dict[str, str] = {}
        for node in graph.call_nodes():
            reason = self.explain(node, graph)
            if reason:
                out[node.name] = reason
        return out

    def check(self, graph: Graph) -> None:
        """Raise :class:`UnsupportedOpError` listing all unsupported nodes (op, module, source)."""
        bad = self.unsupported(graph)
        if bad:
            raise self._ops_error(graph, bad)

    def _describe_ops(self, graph: Graph, bad: Mapping[str, str]) -> str:
        groups: dict[tuple[str, str], list[str]] = {}
        for name, reason in bad.items():
            groups.setdefault((str(graph.node(name).op), reason), []).append(name)
        items = []
        for (op, reason), names in groups.items():
            shown = [f"%{n} ({op}) in {graph.node(n).origin}" for n in names[:3]]
            rest = f" and {len(names) - 3} more: " + ", ".join(f"%{n}" for n in names[3:]) \
                if len(names) > 3 else ""
            items.append("; ".join(shown) + rest + f": {reason}")
        return "; ".join(items)

    def _ops_error(self, graph: Graph, bad: Mapping[str, str]) -> UnsupportedOpError:
        err = UnsupportedOpError(
            f"target {self.name} cannot run {len(bad)} node(s) of {graph.name}: " + self._describe_ops(graph, bad),
            hint="run those regions in torch with --fallback eager (fallback='eager'), choose another "
                 "target (see `mlcomp targets`), or change the model to avoid the op")
        err.nodes = dict(bad)   # node name → reason, for programs
        return err

    def check_capabilities(self, graph: Graph, options: CompileOptions, bad: Mapping[str, str]) -> None:
        """Raise one :class:`CapabilityError` naming every way ``graph``/``options`` do not fit.

        ``bad``: the unsupported nodes, exempt from the dtype check: under ``fallback='eager'``
        they run in torch, otherwise they are listed as one problem, with their reasons (alone
        they raise the plain :class:`UnsupportedOpError` of :meth:`check`).
        """
        eager = options.fallback is Fallback.EAGER
        problems = mismatches(self.capabilities, self.name, graph, self.device(options), runs_elsewhere=bad)
        if bad and not eager:
            if not problems:
                raise self._ops_error(graph, bad)
            problems.append(Mismatch(MismatchKind.OPS, f"{len(bad)} node(s) use ops target {self.name} "
                                                       "cannot run: " + self._describe_ops(graph, bad)))
        if problems:
            err = CapabilityError(self.name, graph, problems, hint_for(problems))
            err.nodes = {} if eager else dict(bad)
            raise err

    # -- compilation ------------------------------------------------------
    def device(self, options: CompileOptions) -> str:
        return options.device or self.default_device

    def facts(self, options: CompileOptions | None = None) -> TargetFacts:
        """What passes are told about this target (``PassContext.target``): its low precisions, its device."""
        return self.capabilities.facts(self.name, self.device(options or CompileOptions()))

    def compile(self, graph: Graph, options: CompileOptions | None = None, *,
                inputs: Sequence[torch.Tensor] | None = None) -> Artifact:
        """Lower ``graph`` to an :class:`~mlcomp.runtime.artifact.Artifact` (not yet verified).

        ``inputs``: tensors fitting the graph's inputs to build on (a trace, a timed choice); default
        seeded random ones (:func:`example_inputs`), whose integers may not be valid indices."""
        options = options or CompileOptions()
        reason = self.available()
        if reason:
            raise TargetUnavailableError(f"target {self.name} is not available: {reason}",
                                         hint="see `mlcomp targets` for the targets this machine can use")
        start = time.perf_counter()
        bad = self.unsupported(graph)
        self.check_capabilities(graph, options, bad)   # before anything is exported or built
        regions: list[dict[str, Any]] = []
        inputs = tuple(inputs) if inputs is not None else example_inputs(graph)
        if bad:
            runtime, regions = build_partitioned(self, graph, options, set(bad), inputs)
        else:
            runtime = self.build(graph, options, inputs)
        seconds = time.perf_counter() - start
        art = Artifact.new(
            runtime, target=self.name, device=self.device(options), graph=graph,
            inputs=[TensorSpec.of_node(n) for n in graph.input_nodes],
            outputs=TensorSpec.of_outputs(graph), options=options.to_json(),
            compile_seconds=seconds, regions=regions)
        if self.spec != self.name:
            art.manifest["target_spec"] = self.spec
        return art

    @abc.abstractmethod
    def build(self, graph: Graph, options: CompileOptions, inputs: tuple[torch.Tensor, ...]) -> Runtime:
        """Lower a fully supported graph; ``inputs`` are random tensors fitting its inputs."""

    def __repr__(self) -> str:
        return f"<Target {self.spec}>"


def example_inputs(graph: Graph, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random tensors fitting the graph's inputs (symbolic sizes take their example values)."""
    return graph_random_inputs(graph, seed)


def composite_ops(graph: Graph, node: Node) -> list[Op]:
    """The ATen ops a composite node's torch implementation runs (traced on meta tensors)."""
    def fake(ref: Any) -> Any:
        meta = graph.node(ref.name).meta
        if isinstance(meta, TensorMeta):
            return torch.empty(meta.concrete_shape(graph.symbols), dtype=meta.dtype, device="meta")
        return tuple(torch.empty(m.concrete_shape(graph.symbols), dtype=m.dtype, device="meta")
                     for m in meta or ())
    args = map_refs(node.inputs, fake)
    kwargs = map_refs(dict(node.attrs), fake)
    return list(_trace_ops(node.op, _freeze(args), _freeze(kwargs)))


def _freeze(value: Any) -> Any:
    return _Hashable(value)


class _Hashable:
    """Wraps fake arguments so :func:`_trace_ops` can cache by op and shapes."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.key = _describe(value)

    def __hash__(self) -> int:
        return hash(self.key)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Hashable) and self.key == other.key


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"T{tuple(value.shape)}{value.dtype}"
    if isinstance(value, (list, tuple)):
        return "(" + ",".join(_describe(v) for v in value) + ")"
    if isinstance(value, dict):
        return "{" + ",".join(f"{k}:{_describe(v)}" for k, v in value.items()) + "}"
    return repr(value)


@lru_cache(maxsize=256)
def _trace_ops(op: Op, args: _Hashable, kwargs: _Hashable) -> tuple[Op, ...]:
    from torch.fx.experimental.proxy_tensor import make_fx

    impl = op.resolve()
    # functionalised like torch.export does, so in-place ops inside the impl appear in their
    # out-of-place form, which is what the backends import
    fn = torch.func.functionalize(lambda *a: impl(*a, **kwargs.value))
    gm = make_fx(fn, tracing_mode="fake")(*args.value)
    found: dict[Op, None] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function":
            try:
                found.setdefault(Op.from_torch(n.target), None)
            except KeyError:
                found.setdefault(Op(Namespace.MLCOMP, f"<{getattr(n.target, '__name__', n.target)}>"), None)
    return tuple(found)
