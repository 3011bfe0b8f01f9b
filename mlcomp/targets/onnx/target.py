"""The ``onnxruntime`` target: IR → generated torch module → ONNX → ORT session.

    >>> import torch
    >>> from mlcomp.ir.builder import linear_relu_graph
    >>> graph = linear_relu_graph()              # relu(x @ W.T + b), x f32[2, 8]
    >>> x = torch.randn(2, 8)
    >>> from mlcomp.targets import get_target
    >>> art = get_target("onnxruntime").compile(graph, CompileOptions(threads=2))
    >>> y = art(x)                                   # torch in, torch out
    >>> art.save("out/mlp-ort")                      # out/mlp-ort/model.onnx
    PosixPath('out/mlp-ort')
    >>> import onnxruntime                           # plain ORT loads the payload
    >>> session = onnxruntime.InferenceSession("out/mlp-ort/model.onnx")
    >>> [tuple(o.shape) for o in session.run(None, {session.get_inputs()[0].name: x.numpy()})]
    [(2, 4)]

Before export the graph is rewritten into what ORT's own fusions match
(:func:`mlcomp.targets.onnx.patterns.ort_friendly`: unrolled GRU layers back to
one ONNX ``GRU``, broadcast-weight ``bmm`` back to ``Gemm``, the safe-softmax
guard as torch.onnx's ``IsNaN`` + ``Where``), checked against the graph on the example inputs;
``art.runtime.rewritten`` (saved in the manifest) says what changed.

Export: mlcomp's own emitter (:mod:`mlcomp.targets.onnx.emit`: ONNX nodes written
from the IR with ``onnx.helper``, no torch.onnx, no onnxscript) when it covers every
node; else torchlib (onnxscript) translates core ATen: by the direct path of
:mod:`mlcomp.targets.onnx.export` (an ``ExportedProgram`` built from the IR, no
re-tracing, a registry of the graph's ops only), or by ``torch.onnx.export(...,
dynamo=True)`` when that path cannot run; ``art.runtime.stats["onnx_export"]``
says which (``"mlcomp"``, ``"direct"``, ``"torch.onnx"``; ``--explain`` says why the
emitter declined).  Then ``onnx.checker``, then an
``InferenceSession`` with ``ORT_ENABLE_ALL`` graph optimisations on the CPU
execution provider (CUDA EP for ``device="cuda"`` when present).

The call path is kept minimal so the artifact costs no more than ORT used
directly: inputs are handed over as zero-copy numpy views, the session's C++
``run`` is called with the output names resolved once, and outputs become
torch tensors without copying (``torch.from_numpy``).

``supports(node)`` asks the emitter's table first, then the exporter's registries
by name (no torchlib function is parsed): an op is supported when the emitter or
torchlib translates it or when a core ATen decomposition exists for it.  A model the
emitter covers never imports onnxscript.

Mixed precision: a graph with bf16/fp16 values exports with ``Cast`` nodes and
low-precision initializers; nodes the execution provider has no kernel for in
that dtype run in fp32 instead (:mod:`mlcomp.targets.onnx.precision`, decided
from ORT's kernel registry and cached in the target), and the runtime's
``precision`` record (saved in the manifest) lists them::

    art = get_target("onnxruntime").compile(bf16_graph)
    art.runtime.precision["by_op"]
    {'Gemm': 2, 'Relu': 1}       # ORT 1.23's CPU EP: no bf16 Gemm/Relu kernels, kept fp32
"""
from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any, ClassVar

import torch
from mlcomp.runtime.artifact import RuntimeKind
from mlcomp.targets.backend_errors import first_error
from mlcomp.targets.base import CompileOptions, Target, TargetCompileError
from mlcomp.pipeline.target_facts import LowPrecision
from mlcomp.targets.capabilities import REAL_DTYPES, Capabilities, DeviceKind
from mlcomp.runtime.codegen import to_fx
from mlcomp.ir.quant import is_qdq
from mlcomp.targets.int8 import Int8Record
from mlcomp.targets.onnx.emit import emit_model, emittable
from mlcomp.targets.onnx.export import DEFAULT_OPSET, MLCOMP, ExportRecord, export_model
from mlcomp.targets.onnx.torchlib import translatable
from mlcomp.targets.onnx.patterns import ort_friendly
from mlcomp.targets.onnx.precision import KernelTable, keep_unsupported_fp32, summarize

from mlcomp.base.errors import MlcompError
from mlcomp.base.quiet import quiet_converter
from mlcomp.ir import Graph, tensor_metas
from mlcomp.ir.builder import rename
from mlcomp.ir.ops import PARAM, Namespace, Op
from mlcomp.pipeline.presets import Rewrite

__all__ = ["OnnxRuntimeTarget", "OrtRuntime", "export_onnx", "export_onnx_recorded", "graph_to_onnx", "make_session"]

PAYLOAD = "model.onnx"


def export_onnx(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], *, opset: int | None = None,
                dynamic_shapes: Any = None, name: str = "model") -> bytes:
    """:func:`export_onnx_recorded` without the record."""
    return export_onnx_recorded(module, inputs, opset=opset, dynamic_shapes=dynamic_shapes, name=name)[0]


def export_onnx_recorded(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], *,
                         opset: int | None = None, dynamic_shapes: Any = None, name: str = "model",
                         direct: bool = True) -> tuple[bytes, ExportRecord]:
    """The serialised, ``onnx.checker``-checked model of a :func:`to_fx` module, and which exporter made it
    (:func:`mlcomp.targets.onnx.export.export_model`: direct, or ``torch.onnx.export(dynamo=True)``)."""
    with quiet_converter():
        try:
            proto, record = export_model(module, inputs, opset=opset, dynamic_shapes=dynamic_shapes,
                                         direct=direct)
        except Exception as exc:  # noqa: BLE001 - turned into a user-facing error (first_error: the real cause)
            failure = first_error(exc, module)
            raise TargetCompileError(
                f"exporting {name} to ONNX failed: {failure.message}",
                where=failure.where() or "torch.onnx.export(dynamo=True)",
                hint="The cpu target (TorchScript) runs every op: use --target cpu, or --target tvm") from None
    return checked(proto, name), record


def checked(proto: Any, name: str) -> bytes:
    """``proto`` serialised, after ``onnx.checker`` accepted it (else a :class:`TargetCompileError`)."""
    import onnx

    model = proto.SerializeToString()
    try:
        onnx.checker.check_model(model)      # the bytes: check_model would serialise the proto again
    except onnx.checker.ValidationError as exc:
        raise TargetCompileError(f"the ONNX model exported from {name} is invalid: {str(exc).splitlines()[0]}",
                                 where="onnx.checker.check_model",
                                 hint="report this with the model; meanwhile use --target cpu") from None
    return model


def make_session(model: bytes | str, *, threads: int | None = None, device: str = "cpu",
                 optimized: Path | None = None):
    """An ``InferenceSession`` with ``ORT_ENABLE_ALL`` (CUDA EP first for ``device="cuda"``); ``optimized``:
    where the session writes the model it runs after its graph optimisations."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if optimized is not None:
        so.optimized_model_filepath = str(optimized)
        so.log_severity_level = 3           # its warning that the file is specific to this CPU: we only read it
    if threads:
        so.intra_op_num_threads = threads
    providers = ["CPUExecutionProvider"]
    if device.startswith("cuda"):
        if "CUDAExecutionProvider" not in ort.get_available_providers():
            raise MlcompError("onnxruntime here has no CUDA execution provider",
                              hint="install onnxruntime-gpu, or compile with --device cpu")
        providers.insert(0, "CUDAExecutionProvider")
    return ort.InferenceSession(model, so, providers=providers)


class OrtRuntime:
    """An ORT session called through its C++ ``run`` with zero-copy numpy views."""

    kind: ClassVar[RuntimeKind] = RuntimeKind.ONNXRUNTIME
    checks_inputs: ClassVar[bool] = True     # ORT rejects wrong shapes/dtypes (static dims) itself

    def __init__(self, model: bytes, *, threads: int | None = None, device: str = "cpu",
                 precision: dict[str, Any] | None = None, rewritten: dict[str, Any] | None = None,
                 stats: dict[str, Any] | None = None, int8: dict[str, Any] | None = None) -> None:
        self.model = model
        self.int8 = Int8Record.from_json(int8) if int8 else None   # what ran in int8 (a quantized graph)
        self.stats = dict(stats or {})  # onnx_export: "mlcomp" | "direct" | "torch.onnx"; why
        self.precision = precision      # nodes kept fp32 for lack of a low-precision kernel
        self.rewritten = rewritten      # what onnx_patterns.ort_friendly rewrote before export
        self.threads = threads
        self.device = device
        self.session = make_session(model, threads=threads, device=device)
        self.input_names = [i.name for i in self.session.get_inputs()]
        self.output_names = [o.name for o in self.session.get_outputs()]
        # the session's C++ run: the Python wrapper re-validates the feed on every call
        raw = getattr(self.session, "_sess", None)
        self._run = raw.run if raw is not None else \
            (lambda names, feed, _options: self.session.run(names, feed))
        self._single = len(self.input_names) == 1 and len(self.output_names) == 1
        self._only = self.input_names[0] if self.input_names else None

    def __call__(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        if self._single:          # the common case, kept to one Python frame
            try:
                array = inputs[0].numpy()   # a view: no copy for CPU tensors without grad
            except RuntimeError:
                array = _as_numpy(inputs[0])
            return (torch.from_numpy(self._run(self.output_names, {self._only: array}, None)[0]),)
        feed = {n: _as_numpy(t) for n, t in zip(self.input_names, inputs)}
        return tuple(map(torch.from_numpy, self._run(self.output_names, feed, None)))

    def with_state(self, state: dict[int, int], outputs: list[tuple[tuple[int, ...], Any]]) -> Any:
        """A call that writes each state output into the input it updates (``output index -> input index``;
        :class:`~mlcomp.targets.onnx.binding.StateBinding`), or None where this session cannot."""
        from mlcomp.targets.onnx.binding import StateBinding

        ok = StateBinding.supports(self, [dtype for _, dtype in outputs])
        return StateBinding(self, state, outputs) if ok else None

    def save(self, directory: Path) -> dict[str, Any]:
        (directory / PAYLOAD).write_bytes(self.model)
        return {"file": PAYLOAD, "threads": self.threads, "device": self.device,
                "onnx_inputs": self.input_names, "onnx_outputs": self.output_names, "precision": self.precision,
                "rewritten": self.rewritten, "stats": self.stats, "int8": self.int8.to_json() if self.int8 else None}

    def explain_lines(self) -> list[str]:
        """Which exporter made the model and why (``--explain``)."""
        path = self.stats.get("onnx_export")
        lines = [] if path is None else [ExportRecord(path, self.stats.get("onnx_export_reason"),
                                                      self.stats.get("onnx_emitter_declined")).line()]
        return lines + ([self.int8.line()] if self.int8 else [])

    @classmethod
    def load(cls, directory: Path, info: dict[str, Any]) -> "OrtRuntime":
        model = (directory / info.get("file", PAYLOAD)).read_bytes()
        return cls(model, threads=info.get("threads"), device=info.get("device", "cpu"),
                   precision=info.get("precision"), rewritten=info.get("rewritten"), stats=info.get("stats"),
                   int8=info.get("int8"))


def _as_numpy(t: torch.Tensor) -> Any:
    if t.requires_grad or t.device.type != "cpu" or not t.is_contiguous():
        t = t.detach().cpu().contiguous()
    return t.numpy()


class OnnxRuntimeTarget(Target):
    name = "onnxruntime"
    description = "ONNX (mlcomp's emitter, else torch.onnx) → ONNX Runtime, ORT_ENABLE_ALL, CPU EP (CUDA EP if any)"
    runtime_modules = ("mlcomp.targets.onnx.target",)    # not onnxruntime: its import starts a thread
    # fuses and folds weights on its own: presets skip both; q/k/v apart measured faster (decision 43)
    rewrites = frozenset({Rewrite.CLEANUP, Rewrite.PROJECTIONS})
    # inputs and outputs cross as numpy arrays, and numpy has no bfloat16
    capabilities = Capabilities(io_dtypes=REAL_DTYPES - {torch.bfloat16},
                                devices=frozenset({DeviceKind.CPU, DeviceKind.CUDA}),
                                # the CPU provider's bf16/fp16 kernels are native only with these instructions
                                low_precision=(LowPrecision(torch.bfloat16, needs=("avx512_bf16", "amx_bf16")),
                                               LowPrecision(torch.float16, needs=("avx512_fp16", "amx_fp16"))))

    def __init__(self, *, emit: bool = True) -> None:
        self._kernels: dict[str, KernelTable] = {}    # provider -> what it runs in bf16/fp16 (cached)
        self.emit = emit      # False: always export through torchlib (tests and benchmarks compare the two)

    def lower_precision(self, model: bytes, device: str = "cpu") -> tuple[bytes, dict[str, Any] | None]:
        """``model`` with the nodes ORT cannot run in bf16/fp16 kept in fp32; ``None`` record if none are low."""
        import onnx

        proto = onnx.load_from_string(model)
        provider = "CUDAExecutionProvider" if device.startswith("cuda") else "CPUExecutionProvider"
        table = self._kernels.setdefault(provider, KernelTable(provider))
        lowered, kept = keep_unsupported_fp32(proto, table)
        record = dict(summarize(kept), provider=provider)
        return (lowered.SerializeToString() if kept else model), record

    def available(self) -> str | None:
        import importlib.util

        for pkg in ("onnxruntime", "onnx", "onnxscript"):
            if importlib.util.find_spec(pkg) is None:
                return f"the {pkg} package is not installed (pip install {pkg})"
        return None

    def explain_op(self, op: Op) -> str | None:
        if op.namespace is Namespace.OPERATOR:
            return None  # symbolic size arithmetic is traced away by the exporter
        if op.namespace not in (Namespace.ATEN, Namespace.PRIMS):
            return f"{op} has no ONNX translation"
        if emittable(op):              # mlcomp's emitter: answered without importing torchlib
            return None
        overload = op.resolve()
        if translatable(overload):     # by name: building torchlib's registry parses ~1000 functions
            return None
        from torch._decomp import decomposition_table

        if overload in decomposition_table:
            return None
        return f"torchlib (onnxscript) has no ONNX translation for {op} and torch has no decomposition of it"

    def build(self, graph: Graph, options: CompileOptions, inputs: tuple[torch.Tensor, ...]) -> OrtRuntime:
        # mode, dtypes (numpy ones at the boundary) and device were checked by compile()
        graph, rewritten = ort_friendly(graph, inputs)     # what ORT's fusions match (onnx_patterns)
        model, record = graph_to_onnx(graph, inputs, opset=options.opset, emit=self.emit)
        precision = None
        if _has_low_precision(graph):
            model, precision = self.lower_precision(model, self.device(options))
        device = self.device(options)
        int8 = executed_int8(model, threads=options.threads, device=device).to_json() \
            if any(is_qdq(n.op) for n in graph.call_nodes()) else None
        return OrtRuntime(model, threads=options.threads, device=device, precision=precision,
                          rewritten=rewritten.to_json(), stats=record.to_stats(), int8=int8)


def executed_int8(model: bytes, *, threads: int | None = None, device: str = "cpu") -> Int8Record:
    """Which compute ops ORT runs in int8: the op types of the model a session writes after optimising."""
    import tempfile

    import onnx

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "optimized.onnx"
        make_session(model, threads=threads, device=device, optimized=path)
        proto = onnx.load(str(path), load_external_data=False)
    return Int8Record.from_op_types(Counter(n.op_type for n in proto.graph.node))


def graph_to_onnx(graph: Graph, inputs: tuple[torch.Tensor, ...], *, opset: int | None = None,
                  emit: bool = True) -> tuple[bytes, ExportRecord]:
    """The checked ONNX model of ``graph`` (already :func:`ort_friendly`) and which exporter wrote it:
    mlcomp's emitter, else (it declined, or ``emit=False``) :func:`export_onnx_recorded`."""
    emitted = emit_model(graph, opset=opset or DEFAULT_OPSET) if emit else None
    if emitted is not None and emitted.model is not None:
        return checked(emitted.model, graph.name), ExportRecord(MLCOMP)
    if emitted is not None and any(is_qdq(n.op) for n in graph.call_nodes()):
        raise TargetCompileError(
            f"graph {graph.name} carries int8 quantize/dequantize pairs, which only mlcomp's ONNX emitter "
            f"writes (torch.onnx does not know them), and the emitter declined the graph: {emitted.declined}",
            where=f"graph {graph.name}",
            hint="compile with -p \"-O2,quantize\" (for onnxruntime its cleanup folds constant index "
                 "arithmetic and batch norm before quantize), or without quantize")
    dynamic = None
    if any(n.tensor_meta.is_dynamic for n in graph.input_nodes):
        dynamic = tuple({i: torch.export.Dim.DYNAMIC for i, d in enumerate(n.tensor_meta.shape)
                         if isinstance(d, str)} for n in graph.input_nodes)
    model, record = export_onnx_recorded(to_fx(distinct_constant_names(graph)).eval(), inputs, opset=opset,
                                         dynamic_shapes=dynamic, name=graph.name)
    declined = emitted.declined if emitted is not None else "it was turned off (emit=False)"
    return model, ExportRecord(record.path, record.reason, declined)


def distinct_constant_names(graph: Graph) -> Graph:
    """``graph``, or a copy whose constants named like values (``%scalar_tensor``: what folding names after
    the op it folded) are ``%const_<name>``.  torch.onnx names initializers by their constant's name and the
    values its decompositions add by their op, so a folded ``%scalar_tensor`` beside a new ``scalar_tensor``
    value made ONNX's constant folder stop ("Initializer 'scalar_tensor' is already registered");
    module weights (``fc.weight``: dotted) cannot clash."""
    plain = [n.name for n in graph.nodes(PARAM) if "." not in n.name]
    if not plain:
        return graph
    graph = graph.copy()
    for name in plain:
        new = f"const_{name}"
        if new not in graph:
            rename(graph, name, new)
    return graph


def _has_low_precision(graph: Graph) -> bool:
    return any(m.dtype in (torch.bfloat16, torch.float16) for n in graph.nodes() for m in tensor_metas(n.meta))
