"""Standalone exports: files that plain torch, ONNX Runtime or TVM load without mlcomp.

    >>> import torch
    >>> from mlcomp.ir.builder import linear_relu_graph
    >>> graph = linear_relu_graph()              # relu(x @ W.T + b), x f32[2, 8]
    >>> x = torch.randn(2, 8)
    >>> from mlcomp.ir.interpreter import Interpreter
    >>> path, result = export_graph(graph, ExportFormat.ONNX, "mlp.onnx", (x,), Interpreter(graph).run(x))
    >>> path.name, result.passed        # reloaded with plain onnxruntime and compared with eager
    ('mlp.onnx', True)

=============  ==========================  ==========================================
format         written                     reloaded (and verified) with
=============  ==========================  ==========================================
``onnx``       ``model.onnx``              ``onnxruntime.InferenceSession(path)``
``torchscript`` frozen TorchScript ``.pt`` ``torch.jit.load(path)``
``pt2``        ExportedProgram ``.pt2``    ``torch.export.load(path).module()``
``tvm``        folder: ``model.so``,       ``tvm.runtime.load_module("model.so")`` +
               ``meta.json``               ``relax.VirtualMachine(lib, tvm.cpu())["main"]``
                                           (TVM alone: a pure TVM build, no torch)
=============  ==========================  ==========================================

The file is written under a temporary name, reloaded from there and compared
with eager; only when that passes is it renamed to ``path``, so a failed
export leaves nothing behind.  A TorchScript export embeds the input spec
(``mlcomp_inputs.json``), so ``mlcomp compile model.pt`` knows its shapes.
"""
from __future__ import annotations

import enum
import json
from pathlib import Path
from typing import Any, Callable, Sequence

import torch
from mlcomp.targets.tvm import build as tvm_backend
from mlcomp.runtime.codegen import to_fx
from mlcomp.targets.torch.cpu import trace_frozen
from mlcomp.targets.onnx.patterns import ort_friendly
from mlcomp.targets.onnx.target import graph_to_onnx
from mlcomp.targets.registry import get_target
from mlcomp.targets.tvm.target import lower_low_precision, quiet_native

from mlcomp.analysis.verify import VerifyResult, check_against
from mlcomp.base.errors import MlcompError
from mlcomp.base.files import atomic_dir, atomic_path
from mlcomp.base.quiet import quiet_torch
from mlcomp.frontend.loading import INPUT_SPEC_FILE, InputSpec
from mlcomp.ir import Graph, tensor_metas
from mlcomp.pipeline import Pipeline
from mlcomp.pipeline.presets import AdaptedPreset, adapt_preset

__all__ = ["ExportFormat", "export_graph", "export_pipeline"]


class ExportFormat(enum.Enum):
    ONNX = "onnx"
    TORCHSCRIPT = "torchscript"
    PT2 = "pt2"
    TVM = "tvm"

    @classmethod
    def parse(cls, text: str | "ExportFormat") -> "ExportFormat":
        if isinstance(text, ExportFormat):
            return text
        try:
            return cls(str(text).strip().lower())
        except ValueError:
            raise MlcompError(f"unknown export format {text!r}",
                              hint=f"choose one of: {', '.join(f.value for f in cls)}") from None


# the runtime that loads each format: a preset (-O2) adapts to it as compile adapts to a target
_RUNS_ON = {ExportFormat.ONNX: "onnxruntime", ExportFormat.TVM: "tvm",
            ExportFormat.TORCHSCRIPT: "cpu", ExportFormat.PT2: "cpu"}


def export_pipeline(fmt: ExportFormat | str, pipeline: Any) -> tuple[Pipeline, AdaptedPreset | None]:
    """The pipeline to run before exporting in ``fmt``, and how a preset was adapted (None if not a preset).

        >>> pipe, adapted = export_pipeline("onnx", "-O2")
        >>> pipe.spec       # onnxruntime fuses and folds itself; q/k/v apart measured faster there
        'cleanup{fold_params=false},split-projections,cleanup{fold_params=false}'
        >>> [d.spec for d in adapted.dropped]
        ['fuse', 'cleanup{fold_params=true}']
    """

    target = _RUNS_ON[ExportFormat.parse(fmt)]
    adapted = adapt_preset(pipeline, target, get_target(target).rewrites)
    return (Pipeline.parse(adapted.text) if adapted is not None else Pipeline.coerce(pipeline)), adapted


def _reload_onnx(path: str) -> Callable[..., Any]:
    import onnxruntime as ort

    session = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]

    def run(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        outs = session.run(None, {n: t.detach().cpu().numpy() for n, t in zip(names, inputs)})
        return tuple(torch.from_numpy(o) for o in outs)
    return run


def name_onnx_outputs(model: bytes, names: Sequence[str]) -> bytes:
    """The ONNX model with its graph outputs called ``names`` (the names ``mlcomp run`` prints: ``output``,
    ``output_1`` or the model's own keys) instead of internal values (``addmm``, ``getitem_12``)::

        before: Gemm(...) -> addmm_2; graph output addmm_2
        after:  Gemm(...) -> addmm_2; Identity(addmm_2) -> output; graph output output

    An internal value that already has one of the new names is renamed first (``output__internal``)."""
    import onnx

    proto = onnx.load_from_string(model)
    graph = proto.graph
    old = [o.name for o in graph.output]
    wanted = {n for n, o in zip(names, old) if n != o}
    values = {v for node in graph.node for v in (*node.input, *node.output)} | {i.name for i in graph.input}
    for clash in wanted & values:                 # free the public name inside the graph
        fresh = f"{clash}__internal"
        for node in graph.node:
            node.input[:] = [fresh if v == clash else v for v in node.input]
            node.output[:] = [fresh if v == clash else v for v in node.output]
        old = [fresh if v == clash else v for v in old]
    for out, before, name in zip(graph.output, old, names):
        if name != out.name or before != out.name:
            graph.node.append(onnx.helper.make_node("Identity", [before], [name], name=f"{name}__named"))
            out.name = name
    return proto.SerializeToString()


def _write_onnx(graph: Graph, inputs: tuple[torch.Tensor, ...], tmp: str,
                names: Sequence[str] | None = None) -> Callable[..., Any]:
    """The graph the ``onnxruntime`` target exports (:func:`mlcomp.targets.onnx.patterns.ort_friendly`:
    RNN layers as ONNX RNN ops, linears as ``Gemm``).  Casts of a mixed-precision graph become ONNX
    ``Cast`` nodes; ops the ORT CPU provider has no bf16/fp16 kernel for are kept fp32 in the file
    (see :mod:`mlcomp.targets.onnx.precision`), so the file runs on plain ``onnxruntime``."""

    friendly, _ = ort_friendly(graph, inputs)
    model, _ = graph_to_onnx(friendly, inputs)       # mlcomp's emitter, else torch.onnx
    if any(m.dtype in (torch.bfloat16, torch.float16) for n in graph.nodes() for m in tensor_metas(n.meta)):
        model, _ = get_target("onnxruntime").lower_precision(model)
    if names is not None:
        model = name_onnx_outputs(model, names)
    Path(tmp).write_bytes(model)
    return _reload_onnx(tmp)


def _write_torchscript(graph: Graph, inputs: tuple[torch.Tensor, ...], tmp: str) -> Callable[..., Any]:

    module = trace_frozen(graph, inputs)
    extra = {INPUT_SPEC_FILE: json.dumps([InputSpec.of(t).to_json() for t in inputs])}
    torch.jit.save(module, tmp, _extra_files=extra)
    return torch.jit.load(tmp)


def _write_pt2(graph: Graph, inputs: tuple[torch.Tensor, ...], tmp: str) -> Callable[..., Any]:

    with quiet_torch():
        program = torch.export.export(to_fx(graph).eval(), inputs)
        torch.export.save(program, tmp)
        return torch.export.load(tmp).module()


def _reload_tvm(directory: str) -> Callable[..., Any]:
    """The exported ``model.so`` as plain TVM runs it: ``tvm.runtime.load_module`` and a Relax VM, numpy in and out."""
    import tvm
    from tvm import relax

    vm = relax.VirtualMachine(tvm.runtime.load_module(str(Path(directory) / "model.so")), tvm.cpu())

    def leaves(out: Any) -> list[Any]:
        return [out] if hasattr(out, "numpy") else [x for o in out for x in leaves(o)]

    def run(*inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = vm["main"](*[tvm.runtime.tensor(t.detach().cpu().contiguous().numpy()) for t in inputs])
        return tuple(torch.from_numpy(o.numpy()) for o in leaves(out))
    return run


def _write_tvm(graph: Graph, inputs: tuple[torch.Tensor, ...], tmp: str) -> Callable[..., Any]:
    """A pure TVM build (``kernels=False``: no torch kernel calls), so ``model.so`` loads with TVM alone;
    reloaded for the check the same way, without mlcomp's loader."""
    from mlcomp.targets.tvm.config import BuildConfig

    with quiet_native():
        built = tvm_backend.build(to_fx(lower_low_precision(graph)).eval(), inputs,
                                  BuildConfig(device="cpu", kernels=False))
        built.save(tmp)
        return _reload_tvm(tmp)


_WRITERS = {ExportFormat.ONNX: _write_onnx, ExportFormat.TORCHSCRIPT: _write_torchscript,
            ExportFormat.PT2: _write_pt2, ExportFormat.TVM: _write_tvm}


def export_graph(graph: Graph, fmt: ExportFormat, path: str | Path, inputs: Sequence[torch.Tensor],
                 expected: Any, *, tolerance: float | None = None,
                 names: Sequence[str] | None = None) -> tuple[Path, VerifyResult]:
    """Write ``graph`` in ``fmt`` to ``path``, reload it with the plain tool and verify it.

    ``names``: the model's output names, for the verification report and as an ONNX file's output names
    (default: the graph's).
    """

    fmt = ExportFormat.parse(fmt)
    needs = {ExportFormat.ONNX: "onnxruntime", ExportFormat.TVM: "tvm"}.get(fmt)
    if needs:
        target = get_target(needs)
        reason = target.available()
        if reason:
            raise MlcompError(f"cannot export {fmt.value}: {reason}")
        target.check(graph)
    else:
        get_target("cpu").check(graph)
    path = Path(path)
    inputs = tuple(inputs)
    names = list(names) if names is not None else [r.name for r in graph.output_refs]
    where = f"{fmt.value} export of {graph.name}, reloaded from disk"
    if fmt is ExportFormat.TVM:
        with atomic_dir(path) as tmp:
            reloaded = _WRITERS[fmt](graph, inputs, str(tmp))
            result = check_against(reloaded, expected, inputs, tolerance=tolerance, names=names, where=where)
    else:
        with atomic_path(path, fmt.value) as tmp:          # marked: mlcomp.base.marks
            reloaded = _write_onnx(graph, inputs, tmp, names) if fmt is ExportFormat.ONNX else \
                _WRITERS[fmt](graph, inputs, tmp)
            result = check_against(reloaded, expected, inputs, tolerance=tolerance, names=names, where=where)
    return path, result
