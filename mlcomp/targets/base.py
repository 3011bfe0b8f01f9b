"""What every target shares: options, the support check, compilation and the registry.

    >>> from mlcomp.targets import get_target, CompileOptions
    >>> target = get_target("onnxruntime")
    >>> target.available()                    # None, or why it cannot run here
    >>> art = target.compile(graph, CompileOptions(threads=2))
    >>> art(x)

A target implements ``explain(graph, node)`` (``None`` when it can run the node,
otherwise the reason) and ``build(graph, options, inputs) -> Runtime``.  The
base class checks *every* node first and reports all unsupported ones at once
(:class:`UnsupportedOpError` with op, module path and source line); with
``fallback=Fallback.EAGER`` it splits the graph into supported regions and
regions that run in torch instead (:mod:`mlcomp.targets.fallback`).
"""
from __future__ import annotations

import abc
import dataclasses
import enum
import importlib
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING, Any, ClassVar, Mapping

import torch

from mlcomp.base.errors import MlcompError, TargetUnavailableError, UnsupportedOpError
from mlcomp.ir import Graph, Node, TensorMeta, map_refs
from mlcomp.ir.ops import GETITEM, Namespace, Op

if TYPE_CHECKING:
    from mlcomp.targets.artifact import Artifact, Runtime

__all__ = ["Fallback", "CompileOptions", "OptionsError", "TargetCompileError", "Target", "TargetName",
           "get_target", "available_targets", "example_inputs", "UNSUPPORTED_EVERYWHERE"]


class Fallback(enum.Enum):
    NONE = "none"      # an unsupported node is an error
    EAGER = "eager"    # unsupported regions run in torch


class OptionsError(MlcompError):
    """A compile option is unknown or has the wrong type."""


class TargetCompileError(MlcompError):
    """The backend's own compiler (exporter, TVM build) failed on a graph the target accepted."""

    exit_code = 3


@dataclass(frozen=True)
class CompileOptions:
    """Options every target understands (each uses those that apply to it).

    ``device``: ``None`` = the target's default (``cpu``; ``cuda`` for the CUDA
    target).  ``threads``: intra-op threads (``None`` = the runtime's default).
    ``tune_trials``/``work_dir``: TVM MetaSchedule budget and its tuning database
    folder (reused across runs).  ``tolerance``: relative tolerance for
    verification (``None`` = by dtype).  ``optimize``: TorchScript
    ``optimize_for_inference`` (``None`` = measure both, keep the faster).
    ``cuda_graphs``: replay static-shape CUDA models as one CUDA graph.
    """

    device: str | None = None
    threads: int | None = None
    tune_trials: int = 0
    work_dir: str | None = None
    fallback: Fallback = Fallback.NONE
    tolerance: float | None = None
    optimize: bool | None = None
    cuda_graphs: bool = True
    opset: int | None = None

    @classmethod
    def make(cls, **values: Any) -> "CompileOptions":
        """Build from loose values (``fallback="eager"``), naming any unknown or ill-typed option.

        ``None`` means "the default" for every option.
        """
        fields = {f.name: f for f in dataclasses.fields(cls)}
        unknown = sorted(set(values) - set(fields))
        if unknown:
            raise OptionsError(f"unknown compile option(s) {', '.join(unknown)}",
                               hint=f"the options are: {', '.join(fields)}")
        clean = {key: _check_option(key, value) for key, value in values.items() if value is not None}
        return cls(**clean)

    def to_json(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["fallback"] = self.fallback.value
        return out


def _check_option(key: str, value: Any) -> Any:
    """``value`` converted to the option's type; :class:`OptionsError` naming it otherwise."""
    if key == "fallback":
        try:
            return value if isinstance(value, Fallback) else Fallback(str(value).lower())
        except ValueError:
            raise OptionsError(f"fallback={value!r} is not valid",
                               hint="use 'none' (unsupported ops are an error) or 'eager'") from None
    if key in ("threads", "tune_trials", "opset"):
        low = 0 if key == "tune_trials" else 1
        if isinstance(value, bool) or not isinstance(value, int) or value < low:
            raise OptionsError(f"{key}={value!r} must be an integer >= {low}")
        return value
    if key == "tolerance":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise OptionsError(f"tolerance={value!r} must be a positive number such as 1e-3")
        return float(value)
    if key in ("optimize", "cuda_graphs"):
        if not isinstance(value, bool):
            raise OptionsError(f"{key}={value!r} must be True or False")
        return value
    if key in ("device", "work_dir"):
        return str(value)
    return value


# Ops no mlcomp target lowers: spectral ops work on complex tensors, which the
# artifacts' input/output contract, ONNX Runtime kernels and TVM do not cover.
UNSUPPORTED_EVERYWHERE: Mapping[str, str] = {
    name: "spectral (FFT) ops produce complex tensors, which mlcomp targets do not lower"
    for name in ("_fft_r2c", "_fft_c2r", "_fft_c2c", "fft_fft", "fft_rfft", "fft_irfft", "fft_ifft")
}


COMPLEX_REASON = "it reads or produces complex tensors, which mlcomp targets do not lower"


def _metas(meta: Any) -> list[TensorMeta]:
    if isinstance(meta, TensorMeta):
        return [meta]
    if isinstance(meta, tuple):
        return [m for m in meta if isinstance(m, TensorMeta)]
    return []


def _touches_complex(node: Node, graph: Graph | None) -> bool:
    metas = _metas(node.meta)
    if graph is not None:
        for name in node.input_names():
            metas += _metas(graph.node(name).meta)
    return any(m.dtype.is_complex for m in metas)


class Target(abc.ABC):
    """One backend.  Subclasses set ``name``/``description`` and implement the abstract methods."""

    name: ClassVar[str]
    description: ClassVar[str]
    default_device: ClassVar[str] = "cpu"
    runs_composites_in_torch: ClassVar[bool] = False   # True: composite impls run as torch code

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
        if not bad:
            return
        groups: dict[tuple[str, str], list[str]] = {}
        for name, reason in bad.items():
            groups.setdefault((str(graph.node(name).op), reason), []).append(name)
        items = []
        for (op, reason), names in groups.items():
            shown = [f"%{n} ({op}) in {graph.node(n).origin}" for n in names[:3]]
            rest = f" and {len(names) - 3} more: " + ", ".join(f"%{n}" for n in names[3:]) \
                if len(names) > 3 else ""
            items.append("; ".join(shown) + rest + f": {reason}")
        err = UnsupportedOpError(
            f"target {self.name} cannot run {len(bad)} node(s) of {graph.name}: " + "; ".join(items),
            hint="run those regions in torch with --fallback eager (fallback='eager'), choose another "
                 "target (see `mlcomp targets`), or change the model to avoid the op")
        err.nodes = dict(bad)   # node name → reason, for programs
        raise err

    # -- compilation ------------------------------------------------------
    def device(self, options: CompileOptions) -> str:
        return options.device or self.default_device

    def compile(self, graph: Graph, options: CompileOptions | None = None) -> "Artifact":
        """Lower ``graph`` to an :class:`~mlcomp.targets.artifact.Artifact` (not yet verified)."""
        from mlcomp.targets.artifact import Artifact, TensorSpec

        options = options or CompileOptions()
        reason = self.available()
        if reason:
            raise TargetUnavailableError(f"target {self.name} is not available: {reason}",
                                         hint="see `mlcomp targets` for the targets this machine can use")
        start = time.perf_counter()
        bad = self.unsupported(graph)
        regions: list[dict[str, Any]] = []
        if bad and options.fallback is Fallback.NONE:
            self.check(graph)
        inputs = example_inputs(graph)
        if bad:
            from mlcomp.targets.fallback import build_partitioned

            runtime, regions = build_partitioned(self, graph, options, set(bad), inputs)
        else:
            runtime = self.build(graph, options, inputs)
        seconds = time.perf_counter() - start
        return Artifact.new(
            runtime, target=self.name, device=self.device(options), graph=graph,
            inputs=[TensorSpec.of_node(n) for n in graph.input_nodes],
            outputs=TensorSpec.of_outputs(graph), options=options.to_json(),
            compile_seconds=seconds, regions=regions)

    @abc.abstractmethod
    def build(self, graph: Graph, options: CompileOptions, inputs: tuple[torch.Tensor, ...]) -> "Runtime":
        """Lower a fully supported graph; ``inputs`` are random tensors fitting its inputs."""

    def __repr__(self) -> str:
        return f"<Target {self.name}>"


def example_inputs(graph: Graph, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Random tensors fitting the graph's inputs (symbolic sizes take their example values)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for node in graph.input_nodes:
        meta: TensorMeta = node.tensor_meta
        shape = meta.concrete_shape(graph.symbols)
        if meta.dtype.is_floating_point:
            out.append(torch.randn(shape, generator=gen).to(meta.dtype))
        elif meta.dtype == torch.bool:
            out.append(torch.randint(0, 2, shape, generator=gen).bool())
        else:
            out.append(torch.randint(0, 10, shape, generator=gen).to(meta.dtype))
    return tuple(out)


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


# ---------------------------------------------------------------------------
# Registry


class TargetName(enum.Enum):
    CPU = "cpu"
    CUDA = "cuda"
    ONNXRUNTIME = "onnxruntime"
    TVM = "tvm"

    @property
    def implementation(self) -> str:
        return {"cpu": "mlcomp.targets.cpu:CpuTarget", "cuda": "mlcomp.targets.cuda:CudaTarget",
                "onnxruntime": "mlcomp.targets.onnxruntime:OnnxRuntimeTarget",
                "tvm": "mlcomp.targets.tvm:TvmTarget"}[self.value]


_ALIASES = {"ort": TargetName.ONNXRUNTIME, "onnx": TargetName.ONNXRUNTIME, "torchscript": TargetName.CPU}


def target_name(name: str | TargetName) -> TargetName:
    if isinstance(name, TargetName):
        return name
    key = str(name).strip().lower()
    if key in _ALIASES:
        return _ALIASES[key]
    try:
        return TargetName(key)
    except ValueError:
        import difflib

        known = [t.value for t in TargetName]
        close = difflib.get_close_matches(key, known, n=1)
        raise TargetUnavailableError(
            f"there is no target named {name!r}" + (f" (did you mean {close[0]!r}?)" if close else ""),
            hint=f"choose one of: {', '.join(known)}") from None


def get_target(name: str | TargetName) -> Target:
    """The target called ``name`` (``cpu``, ``cuda``, ``onnxruntime``/``ort``, ``tvm``)."""
    return _instance(target_name(name))


@lru_cache(maxsize=None)
def _instance(name: TargetName) -> Target:
    module, _, cls = name.implementation.partition(":")
    return getattr(importlib.import_module(module), cls)()


def available_targets() -> dict[str, str | None]:
    """Every target → ``None`` if usable here, else the reason it is not."""
    return {t.value: get_target(t).available() for t in TargetName}
