"""What a runtime actually executes: mlcomp's artifact against the runtime's own conversion of the same module.

Timings on a shared machine are noise; the executed graph is not.  For OpenVINO the
executed graph is ``compiled_model.get_runtime_model()``: one entry per layer the CPU
plugin runs, by kind and ``runtimePrecision`` (:func:`~mlcomp.targets.openvino.layers.layer_kind`:
``Attention`` for an attention fused into one snippet, ``Subgraph`` for a chain of element-wise
ops).  For ONNX Runtime it is the model the session writes after its own optimisations
(``SessionOptions.optimized_model_filepath``), counted by op type.  The anchors are
``ov.convert_model`` of ``torch.export.export(module)`` (of the module, where export
fails) and ``torch.onnx.export`` (dynamo; the TorchScript exporter where that fails)::

    model, inputs = build_held_out("mlp-mixer", batch=2)
    diff = compare("mlp-mixer", model, inputs, "openvino")
    diff.extra()       # layers mlcomp's artifact runs beyond OpenVINO's own, e.g. {'Reshape f32': 2}

Constants, inputs and outputs are left out of the counts: they are not kernels.
"""
from __future__ import annotations

import tempfile
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from mlcomp.targets.openvino.layers import executed_layers

__all__ = ["GraphDiff", "OV_WAYS", "compare", "ort_executed", "ov_executed", "ov_own", "ov_owns", "format_diffs"]

RUNTIMES = ("openvino", "onnxruntime")


def ov_executed(compiled: Any) -> Counter:
    """``Counter`` of ``"kind precision"`` over the kernels an OpenVINO ``CompiledModel`` runs (``layer_kind``)."""
    return Counter(f"{kind} {precision}" for kind, precision in executed_layers(compiled))


def ort_executed(model: bytes, threads: int = 1) -> Counter:
    """``Counter`` of op types in the graph ONNX Runtime runs after its optimisations (``domain.Op`` off ONNX)."""
    import onnx
    import onnxruntime as ort

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "optimized.onnx"
        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        options.intra_op_num_threads = threads
        options.log_severity_level = 3
        options.optimized_model_filepath = str(path)
        ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
        proto = onnx.load(str(path), load_external_data=False)
    return Counter(n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}.{n.op_type}" for n in proto.graph.node)


OV_WAYS = ("ov.convert_model(torch.export)", "ov.convert_model(module)")


def ov_own(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[Any, str]:
    """OpenVINO's own conversion of ``module`` and how it was made (``torch.export`` first, else the module)."""
    try:
        return _ov_convert(module, inputs, OV_WAYS[0]), OV_WAYS[0]
    except Exception:  # noqa: BLE001 - the module path is the other documented way in
        return _ov_convert(module, inputs, OV_WAYS[1]), OV_WAYS[1]


def ov_owns(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[list[tuple[Any, str]], list[str]]:
    """Every way OpenVINO's own converter takes ``module`` (:data:`OV_WAYS`): the conversions that succeed, and
    why each other one failed (one line each)."""
    done, failed = [], []
    for way in OV_WAYS:
        try:
            done.append((_ov_convert(module, inputs, way), way))
        except Exception as exc:  # noqa: BLE001 - a way that fails is reported, not raised
            failed.append(f"{way}: " + " ".join(f"{type(exc).__name__}: {exc}".split())[:160])
    return done, failed


def _ov_convert(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], way: str) -> Any:
    import openvino as ov

    from mlcomp.base.quiet import quiet_converter

    with torch.no_grad(), quiet_converter():
        if way == OV_WAYS[0]:
            return ov.convert_model(torch.export.export(module, inputs))
        return ov.convert_model(module, example_input=inputs)


def _ort_own(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...]) -> tuple[bytes, str]:
    import io

    from mlcomp.base.quiet import quiet_converter

    with torch.no_grad(), quiet_converter():
        try:
            return torch.onnx.export(module, inputs, dynamo=True).model_proto.SerializeToString(), "dynamo export"
        except Exception:  # noqa: BLE001 - the TorchScript exporter is the other one a user would try
            buffer = io.BytesIO()
            torch.onnx.export(module, inputs, buffer, dynamo=False)
            return buffer.getvalue(), "torchscript export"


@dataclass
class GraphDiff:
    """Executed-graph counts of one model on one runtime: the runtime's own conversion and mlcomp's."""

    model: str
    runtime: str
    own: Counter
    ours: Counter
    anchor: str
    hint: str = "f32"
    effective: dict[str, str] = field(default_factory=dict)   # side → the precision the plugin settled on

    def extra(self) -> dict[str, int]:
        """Kernels mlcomp's artifact runs more of than the runtime's own conversion (positive counts)."""
        return {k: self.ours[k] - self.own[k] for k in sorted(self.ours) if self.ours[k] > self.own[k]}

    def missing(self) -> dict[str, int]:
        """Kernels the runtime's own conversion runs more of."""
        return {k: self.own[k] - self.ours[k] for k in sorted(self.own) if self.own[k] > self.ours[k]}

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "runtime": self.runtime, "hint": self.hint, "anchor": self.anchor,
                "own": dict(self.own), "ours": dict(self.ours), "effective": self.effective}


def compare(name: str, module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], runtime: str, *,
            pipeline: str = "-O2", hint: str = "f32", threads: int = 1, own: tuple[Any, str] | None = None
            ) -> GraphDiff:
    """Build ``module`` with mlcomp (``pipeline``, verified) and with the runtime's own converter; count kernels.

    ``hint`` (OpenVINO only) is the ``INFERENCE_PRECISION_HINT`` both sides are compiled with: ``bf16``
    shows which kernels the plugin picks for a bf16 run, on any CPU.  ``own`` (OpenVINO only): the runtime's own
    conversion and how it was made, when the caller has it already (:func:`ov_own`'s answer).
    """
    import mlcomp

    if runtime not in RUNTIMES:
        raise ValueError(f"runtime {runtime!r}: one of {', '.join(RUNTIMES)}")
    art = mlcomp.compile(module, inputs, target=runtime, pipeline=pipeline, threads=threads)
    if runtime == "onnxruntime":
        own, anchor = _ort_own(module, inputs)
        return GraphDiff(name, runtime, ort_executed(own, threads), ort_executed(art.runtime.model, threads), anchor)
    import openvino as ov

    from mlcomp.targets.openvino.target import cpu_config

    model, anchor = own or ov_own(module, inputs)
    core = ov.Core()
    sides = {"own": core.compile_model(model, "CPU", cpu_config(hint, threads)),
             "ours": core.compile_model(art.runtime.model, "CPU", cpu_config(hint, threads))}
    effective = {k: c.get_property("INFERENCE_PRECISION_HINT").get_type_name() for k, c in sides.items()}
    return GraphDiff(name, runtime, ov_executed(sides["own"]), ov_executed(sides["ours"]), anchor, hint, effective)


def format_diffs(diffs: list[GraphDiff]) -> str:
    """A markdown table per runtime: every kernel kind whose counts differ, own vs mlcomp, per model."""
    lines = ["| model | runtime | hint | kernel | own | mlcomp |", "|---|---|---|---|--:|--:|"]
    for d in diffs:
        kinds = sorted(k for k in set(d.own) | set(d.ours) if d.own[k] != d.ours[k])
        total = f"{sum(d.own.values())} vs {sum(d.ours.values())} kernels"
        if not kinds:
            lines.append(f"| {d.model} | {d.runtime} | {d.hint} | same kernels ({total}) | | |")
        for i, k in enumerate(kinds):
            label = total if i == 0 else ""
            lines.append(f"| {d.model} | {d.runtime} | {d.hint} | {k} {('(' + label + ')') if label else ''} "
                         f"| {d.own[k]} | {d.ours[k]} |")
    return "\n".join(lines)
