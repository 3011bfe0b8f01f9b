"""The ``openvino`` target: IR → generated torch module → OpenVINO PyTorch frontend → CPU plugin.

::

    art = get_target("openvino").compile(graph, CompileOptions(threads=2))
    art(x)                                       # torch in, torch out
    art.runtime.precision["hint"]                # what the CPU plugin was told
    'f32'
    art.save("out/mlp-ov")                       # out/mlp-ov/model.xml + model.bin (OpenVINO IR)
    openvino.Core().read_model("out/mlp-ov/model.xml")   # plain OpenVINO loads the payload

Lowering: :func:`~mlcomp.runtime.codegen.to_fx` generates the torch module
(composite ops are inlined to ATen by tracing it with ``make_fx``), shapes are
propagated once on the example inputs, and the module goes to OpenVINO's FX
decoder (the one its ``torch.export`` and ``torch.compile`` paths use) without
a second round of decompositions: the IR already is core ATen.  The model is
compiled for ``CPU`` with an explicit ``INFERENCE_PRECISION_HINT``,
``PERFORMANCE_HINT=LATENCY``, ``INFERENCE_NUM_THREADS`` from ``threads`` and thread pinning off
(pinned threads wait for their core when other processes use it).

Precision: the hint is f32 unless the graph computes in bf16/fp16 (a
mixed-precision pass ran: for this target it records each node's precision on an
fp32 graph, ``LowMode.HINT`` in the capabilities); then it is that dtype if the hardware probe finds
the CPU instructions for it (``avx512_bf16``/``amx_bf16``, ``avx512_fp16``/
``amx_fp16``), and f32 otherwise, with the reason in ``runtime.precision``
(saved in the manifest).  OpenVINO's own default on a bf16 CPU is bf16, so an
fp32 graph always sets f32 explicitly: never lower than the pipeline asked.
The choice is made again when an artifact is loaded on another machine.

An ``nn.GRU`` that capture unrolled goes over as one ``GRUSequence`` per layer (the CPU plugin's
``RNNSeq`` kernel) where its weights are still the module's parameters: :mod:`mlcomp.targets.openvino.gru`.

``supports(node)`` asks OpenVINO's own table of the ATen ops its FX decoder
translates (``torchdynamo.op_support.OperatorSupport``); an op outside it that
torch decomposes (``aten.reshape`` after cleanup) is lowered through ``make_fx``
with that decomposition, as OpenVINO's ``convert_model(ExportedProgram)`` would.  An
``aten.cat`` with torch's legacy 1-D empty operand (a ``transformers`` key/value cache
layer starts as ``torch.tensor([])``), which OpenVINO's Concat refuses (ranks differ), is
converted without that operand: torch skips it, so the value is the same::

    %cat = aten.cat.default([%layer.lifted_tensor_0, %k], -2)   →   %cat = aten.cat.default([%k], -2)
"""
from __future__ import annotations

import dataclasses
import importlib.util
from pathlib import Path
from typing import Any, ClassVar

import torch
from mlcomp.runtime.artifact import RuntimeKind
from mlcomp.targets.base import CompileOptions, Target, TargetCompileError
from mlcomp.targets.capabilities import Capabilities, DeviceKind
from mlcomp.runtime.codegen import to_fx
from mlcomp.targets.openvino.gru import gru_extension, gru_parts, whole_rnns
from mlcomp.targets.openvino.int8 import int8_layers, qdq_for_frontend
from mlcomp.targets.openvino.lower import (decomposition, frontend_name, lower_for_frontend,
                                           shared_weights_as_linear, translated, activations_before_views)

from mlcomp.base.errors import MlcompError
from mlcomp.base.quiet import quiet_converter
from mlcomp.hardware.probe import cpu_flags
from mlcomp.ir import Graph, Node, TensorMeta, tensor_metas
from mlcomp.ir.builder import remove_dead
from mlcomp.ir.dtypes import dtype_name, parse_dtype
from mlcomp.ir.ops import Namespace, Op
from mlcomp.ir.quant import is_qdq
from mlcomp.pipeline.presets import Rewrite
from mlcomp.pipeline.target_facts import LowMode, LowPrecision

__all__ = ["OpenVinoTarget", "OpenVinoRuntime", "requested_precision", "precision_hint", "cpu_config", "PACKAGE"]

PACKAGE = "openvino"
XML, BIN = "model.xml", "model.bin"
INSTALL_HINT = "pip install 'mlcomp[openvino]' (or pip install openvino)"

# CPU instructions OpenVINO's CPU plugin needs to compute in each low precision (names as in /proc/cpuinfo)
_NEEDS = {torch.bfloat16: ("avx512_bf16", "amx_bf16"), torch.float16: ("avx512_fp16", "amx_fp16")}
_OV_NAME = {torch.float32: "f32", torch.bfloat16: "bf16", torch.float16: "f16"}


def requested_precision(graph: Graph) -> torch.dtype:
    """The lowest float precision ``graph`` computes in: bf16/fp16 after a mixed-precision pass, else f32."""
    found: set[torch.dtype] = set()
    for node in graph.nodes():
        if node.ann.precision is not None:
            found.add(node.ann.precision.dtype)
        found.update(m.dtype for m in tensor_metas(node.meta))
    for low in (torch.float16, torch.bfloat16):     # fp16 first: it has the fewer exponent bits
        if low in found:
            return low
    return torch.float32


def precision_hint(requested: torch.dtype, flags: tuple[str, ...]) -> tuple[torch.dtype, str]:
    """``(hint, why)``: the requested precision where ``flags`` (the probe's CPU flags) allow it, else f32."""
    if requested not in _NEEDS:
        return torch.float32, "the graph computes in f32; set explicitly (OpenVINO's default on bf16 CPUs is bf16)"
    have = [f for f in _NEEDS[requested] if f in flags]
    if have:
        return requested, f"the graph asks for {dtype_name(requested)} and the CPU has {', '.join(have)}"
    return torch.float32, (f"the graph asks for {dtype_name(requested)} but this CPU has none of "
                           f"{', '.join(_NEEDS[requested])} (hardware probe): OpenVINO computes in f32")


def cpu_config(hint: torch.dtype | str, threads: int | None) -> dict[Any, Any]:
    """The CPU plugin's properties every mlcomp compile uses (the target, the executed-graph comparisons, the
    benchmarks' anchors): ``hint`` (a dtype or OpenVINO's name, ``"bf16"``), latency, ``threads``, no pinning."""
    import openvino as ov
    from openvino import properties as props

    config: dict[Any, Any] = {
        props.hint.inference_precision: getattr(ov.Type, hint if isinstance(hint, str) else _OV_NAME[hint]),
        props.hint.performance_mode: props.hint.PerformanceMode.LATENCY,
        # pinned threads wait for their own core, which a shared machine may not give them
        props.hint.enable_cpu_pinning: False,
    }
    if threads:
        config[props.inference_num_threads] = threads
    return config


class OpenVinoRuntime:
    """An OpenVINO ``CompiledModel`` and one infer request; inputs shared zero-copy, outputs copied."""

    kind: ClassVar[RuntimeKind] = RuntimeKind.OPENVINO
    # no ``checks_inputs``: OpenVINO converts an input of the wrong dtype silently, so the artifact
    # checks shape and dtype before every call

    def __init__(self, model: Any, *, requested: torch.dtype = torch.float32, threads: int | None = None,
                 flags: tuple[str, ...] | None = None) -> None:
        import openvino as ov

        self.model = model
        self.threads = threads
        self.requested = requested
        hint, why = precision_hint(requested, cpu_flags() if flags is None else flags)
        self.compiled = ov.Core().compile_model(model, "CPU", cpu_config(hint, threads))
        effective = self.compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
        self.precision = {"requested": dtype_name(requested), "hint": _OV_NAME[hint],
                          "effective": effective, "reason": why}
        quantized = any(op.get_type_name() == "FakeQuantize" for op in model.get_ops())
        self.int8 = int8_layers(self.compiled) if quantized else None
        self.request = self.compiled.create_infer_request()
        self._n_out = len(self.compiled.outputs)

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        arrays = [t.numpy() if not t.requires_grad and t.is_contiguous() else t.detach().contiguous().numpy()
                  for t in inputs]
        self.request.infer(arrays, share_inputs=True)
        # the request reuses its output buffers on the next call: hand out copies
        return tuple(torch.from_numpy(self.request.get_output_tensor(i).data.copy()) for i in range(self._n_out))

    def with_state(self, state: dict[int, int], outputs: list[tuple[tuple[int, ...], Any]]) -> Any:
        """A call that copies each state output into the input it updates (``output index -> input index``;
        :class:`~mlcomp.targets.openvino.state.StateCopy`): no allocation per call."""
        from mlcomp.targets.openvino.state import StateCopy

        return StateCopy(self, state, outputs)

    def save(self, directory: Path) -> dict[str, Any]:
        import openvino as ov

        # compress_to_fp16 defaults to True: weights would silently become fp16 on disk
        ov.save_model(self.model, str(directory / XML), compress_to_fp16=False)
        return {"xml": XML, "bin": BIN, "threads": self.threads, "requested": dtype_name(self.requested),
                "precision": self.precision, "int8": self.int8.to_json() if self.int8 else None}

    def explain_lines(self) -> list[str]:
        """The precision the plugin was told, and which layers ran in int8 (``--explain``)."""
        lines = [f"precision hint {self.precision['hint']} (effective {self.precision['effective']}): "
                 f"{self.precision['reason']}"]
        return lines + ([self.int8.line()] if self.int8 else [])

    @classmethod
    def load(cls, directory: Path, info: dict[str, Any]) -> "OpenVinoRuntime":
        import openvino as ov

        model = ov.Core().read_model(str(directory / info.get("xml", XML)), str(directory / info.get("bin", BIN)))
        return cls(model, requested=parse_dtype(info.get("requested", "f32")), threads=info.get("threads"))


def _legacy_empty_cat(node: Node, graph: Graph) -> list[str]:
    """Operands of an ``aten.cat`` that are 1-D and empty beside higher-rank ones (torch skips them)."""
    if node.op.namespace is not Namespace.ATEN or node.op.name != "cat":
        return []
    out = node.meta if isinstance(node.meta, TensorMeta) else None
    operands = node.inputs[0] if node.inputs and isinstance(node.inputs[0], (list, tuple)) else ()
    found = []
    for ref in operands:
        meta = graph.node(ref.name).meta if hasattr(ref, "name") else None
        if isinstance(meta, TensorMeta) and out is not None and len(out.shape) > 1 \
                and tuple(meta.shape) == (0,):
            found.append(ref.name)
    return found


def without_legacy_empties(graph: Graph) -> Graph:
    """``graph`` (a copy, if anything changes) with every ``aten.cat``'s legacy 1-D empty operands left out."""
    found = [(n, empty) for n in graph.call_nodes() if (empty := _legacy_empty_cat(n, graph))]
    if not found:
        return graph
    out = graph.copy()
    for node, empty in found:
        kept = [r for r in node.inputs[0] if getattr(r, "name", None) not in empty]
        out.replace(dataclasses.replace(node, inputs=(type(node.inputs[0])(kept), *node.inputs[1:])))
    remove_dead(out, {name for _, empty in found for name in empty})
    return out


def _conversion_message(exc: BaseException) -> str:
    """The frontend's summary line (``Conversion is failed for: …``) or the first line of the error."""
    text = str(exc)
    summary = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("-- Conversion is failed for")]
    if summary:
        return summary[-1][3:]
    first = next((ln.strip() for ln in text.splitlines() if ln.strip()), type(exc).__name__)
    return f"{type(exc).__name__}: {first}"


class OpenVinoTarget(Target):
    name = "openvino"
    description = "OpenVINO PyTorch (FX) frontend → CPU plugin, explicit precision hint (f32 unless asked)"
    runtime_modules = ("mlcomp.targets.openvino.target",)    # not openvino: its import starts a thread
    # OpenVINO fuses on its own, from whole ops: attention as ScaledDotProductAttention, layer norm as MVN
    rewrites = frozenset({Rewrite.CLEANUP, Rewrite.WEIGHT_FOLDING, Rewrite.RECOMPOSE})
    # inputs/outputs cross as numpy arrays (no bfloat16); f64 is left out because the CPU plugin
    # computes it in f32, which would be lower than the graph asks
    capabilities = Capabilities(
        dtypes=frozenset({torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int8,
                          torch.uint8, torch.bool}),
        io_dtypes=frozenset({torch.float32, torch.float16, torch.int64, torch.int32, torch.int8, torch.uint8,
                             torch.bool}),
        devices=frozenset({DeviceKind.CPU}), dynamic_shapes=True,
        # the CPU plugin lowers an fp32 graph itself (INFERENCE_PRECISION_HINT); bf16/f16 casts in the
        # graph stop its converter on transformers (OpConversionFailure), so the graph stays fp32
        low_precision=tuple(LowPrecision(dtype, LowMode.HINT, needs=needs) for dtype, needs in _NEEDS.items()),
        whole_modules=frozenset({"GRU"}))            # converted to GRUSequence from its own weights
    package: ClassVar[str] = PACKAGE

    def available(self) -> str | None:
        if importlib.util.find_spec(self.package) is None:
            return f"the {self.package} package is not installed ({INSTALL_HINT})"
        return None

    def explain_op(self, op: Op) -> str | None:
        try:
            table = translated()
        except ImportError:
            return self.available() or f"the {self.package} package cannot be imported ({INSTALL_HINT})"

        name = frontend_name(op)
        if name is None:
            return f"{op} has no OpenVINO translation"
        if name in table:
            return None
        if op.namespace is not Namespace.OPERATOR and decomposition(op) is not None:
            return None       # lowered to the ops torch decomposes it into (aten.reshape → view)
        return f"OpenVINO's PyTorch frontend has no translation for {op} and torch has no decomposition of it"

    def build(self, graph: Graph, options: CompileOptions, inputs: tuple[torch.Tensor, ...]) -> OpenVinoRuntime:
        # mode, dtypes and device were checked by compile() against the capabilities
        if self.device(options) != "cpu":
            raise MlcompError(f"target openvino compiles for the CPU, not {options.device!r}",
                              hint="use --target cuda or --target onnxruntime --device cuda for GPUs")
        model = convert(graph, inputs)
        return OpenVinoRuntime(model, requested=requested_precision(graph), threads=options.threads)


def input_shapes(graph: Graph) -> list[Any] | None:
    """The inputs' ``openvino.PartialShape`` s when some size is symbolic (else None): each symbol an
    ``ov.Dimension(min, max)`` of its range (``max`` -1: unbounded), an expression an unknown size."""
    if not any(n.tensor_meta.is_dynamic for n in graph.input_nodes):
        return None
    import openvino as ov

    def dim(d: Any) -> Any:
        if isinstance(d, int):
            return ov.Dimension(d)
        r = graph.ranges.get(d)
        return ov.Dimension(r.lo, -1 if r.hi is None else r.hi) if r is not None else ov.Dimension()
    return [ov.PartialShape([dim(d) for d in n.tensor_meta.shape]) for n in graph.input_nodes]


def convert(graph: Graph, inputs: tuple[torch.Tensor, ...]) -> Any:
    """``graph`` as an ``openvino.Model``: static shapes of ``inputs``, or dynamic dimensions where the graph's
    inputs have symbolic sizes (:func:`input_shapes`); TargetCompileError on failure."""
    import openvino as ov
    from openvino.frontend.pytorch.fx_decoder import TorchFXPythonDecoder
    from torch.fx.passes.shape_prop import ShapeProp

    graph = activations_before_views(shared_weights_as_linear(without_legacy_empties(graph)))
    if input_shapes(graph) is None:                     # nn.GRU as one op: OpenVINO's GRUSequence
        graph, _ = whole_rnns(graph, inputs)
    module = gru_parts(qdq_for_frontend(to_fx(graph).eval()))   # int8 pairs → the ops OpenVINO makes FakeQuantize of
    with torch.no_grad(), quiet_converter():
        table = translated() | {"torch.ops.aten.gru.input"}      # written as mlcomp.gru_part, converted below
        # ops OpenVINO lacks → torch's decomposition, node by node; composite impls → the ATen ops they run
        lowered = {n.op.resolve(): decomposition(n.op) for n in graph.call_nodes()
                   if n.op.namespace in (Namespace.ATEN, Namespace.PRIMS) and frontend_name(n.op) not in table}
        dynamic = input_shapes(graph)
        module = lower_for_frontend(module, inputs, lowered, symbolic=dynamic is not None,
                                    whole=any(n.op.is_composite and not is_qdq(n.op) for n in graph.call_nodes()))
        ShapeProp(module).propagate(*inputs)        # the decoder reads shapes and dtypes from node meta
        try:
            if dynamic is not None:     # sizes stay ShapeOf arithmetic in the model, inputs take the ranges
                return ov.convert_model(TorchFXPythonDecoder(module, input_shapes=dynamic, dynamic_shapes=True),
                                        extension=[gru_extension()])
            return ov.convert_model(TorchFXPythonDecoder(module), extension=[gru_extension()])
        except Exception as exc:  # noqa: BLE001 - turned into a user-facing error
            raise TargetCompileError(
                f"OpenVINO could not convert {graph.name}: {_conversion_message(exc)}",
                where="openvino.convert_model (PyTorch FX frontend)",
                hint="compile with --fallback eager to run the unconverted ops in torch, or use "
                     "--target onnxruntime / --target cpu") from None
