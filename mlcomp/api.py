"""The Python API: ``mlcomp.compile`` and ``mlcomp.load``.

    >>> import mlcomp, torch
    >>> art = mlcomp.compile("resnet18", target="onnxruntime", pipeline="-O2", threads=2)
    >>> art.verification["passed"]           # compared with eager on the example inputs
    True
    >>> art(torch.randn(1, 3, 32, 32))
    >>> art.save("out/resnet18-ort")
    >>> again = mlcomp.load("out/resnet18-ort", verify=True)   # re-checks the stored reference

``model_or_path`` is an ``nn.Module`` (with ``example_inputs``) or anything
:func:`mlcomp.frontend.loading.load_model` accepts (zoo name, ``.pt``, ``.pt2``,
``file.py:fn``).  Remaining keyword arguments are
:class:`~mlcomp.targets.base.CompileOptions` (``threads``, ``tune_trials``,
``work_dir``, ``device``, ``tolerance``…) or loading options (``input_shapes``,
``batch``, ``capture``, ``dynamic_batch``, ``trust_pickle``).
"""
from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from mlcomp.base.errors import MlcompError

__all__ = ["compile", "load", "export", "CompileResult"]

_LOAD_KEYS = ("input_shapes", "batch", "capture", "dynamic_batch", "trust_pickle")


@dataclass(frozen=True)
class CompileResult:
    """What :func:`compile_source` produced, for the CLI to print."""

    artifact: Any
    pipeline_report: Any
    capture_seconds: float
    pipeline_seconds: float


def _source(model_or_path: Any, example_inputs: Sequence[torch.Tensor] | torch.Tensor | None,
            load_opts: dict[str, Any]):
    from mlcomp.frontend.loading import load_model

    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    return load_model(model_or_path, example_inputs=example_inputs,
                      input_shapes=load_opts.get("input_shapes") or (),
                      trust_pickle=bool(load_opts.get("trust_pickle")), batch=load_opts.get("batch"))


def _pipeline_module():
    if importlib.util.find_spec("mlcomp.pipeline") is None:
        return None
    return importlib.import_module("mlcomp.pipeline")


def compile_source(source: Any, graph: Any, *, target: str = "cpu", pipeline: Any = None,
                   verify: bool = True, capture_seconds: float = 0.0,
                   pipeline_kwargs: dict[str, Any] | None = None, **options: Any) -> CompileResult:
    """Pipeline + lowering + verification for an already captured model (used by the CLI).

    ``pipeline_kwargs`` go to :func:`mlcomp.pipeline.spec.run_pipeline` (the instruments:
    ``verify``, ``dump_after``, ``dump_dir``, ``explain``).
    """
    from mlcomp.targets import CompileOptions, get_target

    report, pipeline_seconds, spec = None, 0.0, None
    inputs = source.inputs()
    if pipeline is not None and pipeline != "":
        module = _pipeline_module()
        if module is not None:
            t0 = time.perf_counter()
            pipe = module.Pipeline.coerce(pipeline)
            graph, report = module.run_pipeline(graph, pipe, example_inputs=inputs, **(pipeline_kwargs or {}))
            pipeline_seconds = time.perf_counter() - t0
            spec = pipe.spec
            if getattr(pipe, "target", None) and target is None:
                target = pipe.target
    opts = CompileOptions.make(**options)
    artifact = get_target(target or "cpu").compile(graph, opts)
    artifact.manifest["pipeline"] = spec
    to_json = getattr(report, "to_json", None)
    artifact.manifest["pipeline_report"] = to_json() if callable(to_json) else None
    artifact.manifest["capture_seconds"] = round(capture_seconds, 4)
    artifact.manifest["pipeline_seconds"] = round(pipeline_seconds, 4)
    with torch.no_grad():
        expected = source.eager(*inputs)
    from mlcomp.analysis.verify import flatten_outputs

    artifact.set_reference(inputs, tuple(flatten_outputs(expected)))
    if verify:
        artifact.verify(tolerance=opts.tolerance)
    return CompileResult(artifact, report, capture_seconds, pipeline_seconds)


def compile(model_or_path: Any, example_inputs: Sequence[torch.Tensor] | torch.Tensor | None = None,
            target: str = "cpu", pipeline: Any = None, verify: bool = True, fallback: str = "none",
            **options: Any):
    """Capture, run ``pipeline`` (inline text, preset, ``.toml`` path or Pipeline), lower, verify.

    Returns an :class:`~mlcomp.targets.artifact.Artifact`; raises
    :class:`~mlcomp.base.errors.VerificationError` if ``verify`` and the outputs differ
    from eager beyond the tolerance.
    """
    load_opts = {k: options.pop(k) for k in _LOAD_KEYS if k in options}
    source = _source(model_or_path, example_inputs, load_opts)
    t0 = time.perf_counter()
    graph = source.capture(method=load_opts.get("capture", "export"),
                           dynamic_batch=bool(load_opts.get("dynamic_batch")))
    seconds = time.perf_counter() - t0
    result = compile_source(source, graph, target=target, pipeline=pipeline, verify=verify,
                            capture_seconds=seconds, fallback=fallback, **options)
    return result.artifact


def load(directory: str | Path, *, verify: bool = False):
    """Load an artifact folder; ``verify=True`` re-runs its stored reference inputs and compares."""
    from mlcomp.targets.artifact import Artifact

    artifact = Artifact.load(directory)
    if verify:
        artifact.verify(record=False)
    return artifact


def export(model_or_path: Any, path: str | Path, format: str = "onnx",
           example_inputs: Sequence[torch.Tensor] | torch.Tensor | None = None, pipeline: Any = None,
           tolerance: float | None = None, **options: Any):
    """Write a standalone file for plain torch / ONNX Runtime / TVM and verify it after reloading.

    Returns ``(path, VerifyResult)``; see :mod:`mlcomp.targets.export` for the formats.
    """
    from mlcomp.targets.export import ExportFormat, export_graph

    load_opts = {k: options.pop(k) for k in _LOAD_KEYS if k in options}
    if options:
        raise MlcompError(f"unknown export option(s) {', '.join(sorted(options))}",
                          hint=f"export takes example_inputs, pipeline, tolerance and {', '.join(_LOAD_KEYS)}")
    source = _source(model_or_path, example_inputs, load_opts)
    graph = source.capture(method=load_opts.get("capture", "export"),
                           dynamic_batch=bool(load_opts.get("dynamic_batch")))
    inputs = source.inputs()
    if pipeline:
        module = _pipeline_module()
        if module is not None:
            graph, _ = module.run_pipeline(graph, module.Pipeline.coerce(pipeline), example_inputs=inputs)
    with torch.no_grad():
        expected = source.eager(*inputs)
    return export_graph(graph, ExportFormat.parse(format), path, inputs, expected, tolerance=tolerance)
