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

import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch

from mlcomp.base.errors import InputSpecError, MlcompError, ModelLoadError, OptionError
from mlcomp.ir.interpreter import evaluate
from mlcomp.pipeline import Pipeline, run_pipeline
from mlcomp.pipeline.presets import adapt_preset

__all__ = ["compile", "load", "export", "CompileResult", "check_model_inputs"]

_LOAD_KEYS = ("input_shapes", "batch", "capture", "dynamic_batch", "trust_pickle")
_TRAIN_KEYS = ("loss", "optimizer", "y", "instruments", "pipeline_verify", "loss_scale")   # mode="train" only


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


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def _check_size(what: str, shape: tuple[int, ...], itemsize: int, option: str) -> None:
    if any(d < 1 for d in shape):
        raise InputSpecError(f"{option} {what}: every size must be a positive integer",
                             hint="give sizes of at least 1, e.g. --input-shape 1x3x32x32")
    need, have = math.prod(shape) * itemsize, _memory_bytes()
    if need > have:
        raise InputSpecError(f"{option} {what} needs {need / 2**30:.3g} GiB for one input, more than this "
                             f"machine's {have / 2**30:.3g} GiB of memory", hint="give a smaller shape or batch")


def check_model_inputs(model: Any, input_shapes: Sequence[Any], batch: int | None,
                       capture_method: str = "export") -> None:
    """Shapes and batch checked before anything is loaded or allocated (non-positive, absurd, inapplicable).

    Before: ``--input-shape 100000x100000x1000`` died in the allocator asking for 40 TB;
    after: "--input-shape 100000x100000x1000 needs 3.73e+04 GiB for one input, more than …".
    """
    from mlcomp.ir.dtypes import parse_dtype

    if isinstance(model, str) and not model.strip():
        raise ModelLoadError("the MODEL argument is empty", hint="give a zoo name (see `mlcomp models list`), "
                             "a .pt/.pt2 file or a factory path/to/file.py:fn")
    if input_shapes and isinstance(model, str) and model.endswith(".pt2"):
        raise InputSpecError(f"--input-shape was given with {model}, an ExportedProgram that carries its own "
                             f"input shapes", hint="drop --input-shape; export the model again for other shapes")
    if batch is not None and isinstance(model, str) and model.endswith(".pt2"):
        raise InputSpecError(f"--batch {batch} was given with {model}, an ExportedProgram that carries its own "
                             f"input shapes (its batch is fixed when it is exported)",
                             hint="drop --batch; export the model again (`mlcomp models save NAME --format pt2 "
                                  "--batch N`) for another batch")
    if capture_method == "fx" and isinstance(model, str) and model.endswith(".pt2"):
        raise InputSpecError(f"--capture fx does not apply to {model}: an ExportedProgram is already captured "
                             f"by torch.export", hint="drop --capture fx (the default, export, reads the file as is)")
    for text in input_shapes:
        if not isinstance(text, str):
            continue                      # an InputSpec object: checked by whoever built it
        dims, _, dtype_text = text.partition(":")
        try:
            shape = tuple(int(d) for d in dims.lower().split("x"))
            itemsize = parse_dtype(dtype_text).itemsize if dtype_text else 4
        except (ValueError, MlcompError):
            continue                      # malformed: the loader explains the syntax
        _check_size(text, shape, itemsize, "--input-shape")
    if isinstance(batch, int) and not input_shapes:
        from mlcomp import models

        if isinstance(model, str) and model in models.ZOO:
            _check_size(str(batch), (batch, *models.ZOO[model].input_shape), 4, "--batch")


def _check_options(model: Any, load_opts: dict[str, Any], tolerance: Any) -> None:
    """Values checked before anything is loaded: batch, tolerance."""
    from mlcomp.analysis.verify import check_tolerance

    batch = load_opts.get("batch")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise OptionError(f"batch={batch!r} is not a positive integer", hint="give batch=1 or more")
    check_tolerance(tolerance, option="tolerance")
    if isinstance(model, str):
        check_model_inputs(model, load_opts.get("input_shapes") or (), batch, load_opts.get("capture", "export"))


def compile_source(source: Any, graph: Any, *, target: str | None = None, pipeline: Any = None,
                   verify: bool = True, capture_seconds: float = 0.0,
                   instruments: Sequence[Any] | None = None, **options: Any) -> CompileResult:
    """Pipeline + lowering + verification for an already captured model (used by the CLI).

    ``target`` None: the pipeline file's ``target``, else ``cpu``.  ``instruments`` go to
    :func:`mlcomp.pipeline.run_pipeline` (None: its defaults, IR check and timing).
    """
    from mlcomp.targets import CompileOptions, get_target

    report, pipeline_seconds, spec = None, 0.0, None
    inputs = source.inputs()
    if pipeline is not None and pipeline != "":
        t0 = time.perf_counter()
        adapted = adapt_preset(pipeline, target or "cpu", get_target(target or "cpu").rewrites)
        pipe = Pipeline.parse(adapted.text) if adapted else Pipeline.coerce(pipeline)   # only presets adapt
        graph, report = run_pipeline(graph, pipe, example_inputs=inputs, instruments=instruments)
        if adapted is not None and report is not None:
            report.target = report.target or adapted.target
            report.dropped = [str(d) for d in adapted.dropped]
        pipeline_seconds = time.perf_counter() - t0
        spec = pipe.spec
        if target is None:
            target = pipe.target
    opts = CompileOptions.make(**options)
    artifact = get_target(target or "cpu").compile(graph, opts)
    artifact.manifest["pipeline"] = spec
    to_json = getattr(report, "to_json", None)
    artifact.manifest["pipeline_report"] = to_json() if callable(to_json) else None
    artifact.manifest["capture_seconds"] = round(capture_seconds, 4)
    artifact.manifest["pipeline_seconds"] = round(pipeline_seconds, 4)
    with torch.no_grad():
        if report is not None and report.changes_function:
            # a pass changed the function on purpose (pruning) and declared what it must now compute (the masked
            # model); every later pass keeps that function, so the artifact is checked against it
            changed = report.function_changes()[-1]
            expected = evaluate(changed.declared_reference, *inputs)
            artifact.manifest["verified_against"] = f"the reference declared by {changed.name} (it changes the function)"
        else:
            expected = source.eager(*inputs)
    from mlcomp.analysis.verify import flatten_outputs

    artifact.set_reference(inputs, tuple(flatten_outputs(expected)))
    if verify:
        artifact.verify(tolerance=opts.tolerance)
    return CompileResult(artifact, report, capture_seconds, pipeline_seconds)


def compile(model_or_path: Any, example_inputs: Sequence[torch.Tensor] | torch.Tensor | None = None,
            target: str | None = None, pipeline: Any = None, verify: bool = True, fallback: str = "none",
            **options: Any):
    """Capture, run ``pipeline`` (inline text, preset, ``.toml`` path or Pipeline), lower, verify.

    ``target`` None: the pipeline file's ``target = "..."`` if it names one, else ``cpu``.

    Returns an :class:`~mlcomp.targets.artifact.Artifact`; raises
    :class:`~mlcomp.base.errors.VerificationError` if ``verify`` and the outputs differ
    from eager beyond the tolerance.
    """
    load_opts = {k: options.pop(k) for k in _LOAD_KEYS if k in options}
    _check_options(model_or_path, load_opts, options.get("tolerance"))
    mode = str(options.pop("mode", "inference")).lower()
    train_opts = {k: options.pop(k) for k in _TRAIN_KEYS if k in options}
    if mode in ("train", "training"):   # joint forward+backward graph → TrainingArtifact
        source = _source(model_or_path, example_inputs, load_opts)
        return compile_training_source(source, target=target, pipeline=pipeline, verify=verify,
                                       **train_opts, **options)
    if train_opts or mode not in ("inference", "eval"):
        raise MlcompError(f"mode={mode!r} with {', '.join(train_opts) or 'no training options'}",
                          hint="use mode='train' with loss/optimizer/y, or mode='inference' without them")
    source = _source(model_or_path, example_inputs, load_opts)
    t0 = time.perf_counter()
    graph = source.capture(method=load_opts.get("capture", "export"),
                           dynamic_batch=bool(load_opts.get("dynamic_batch")))
    seconds = time.perf_counter() - t0
    result = compile_source(source, graph, target=target, pipeline=pipeline, verify=verify,
                            capture_seconds=seconds, fallback=fallback, **options)
    return result.artifact


def compile_training_source(source: Any, *, target: str | None = "cpu", pipeline: Any = None,
                            verify: bool = True, loss: Any = None, optimizer: Any = "sgd",
                            y: torch.Tensor | None = None, instruments: Sequence[Any] | None = None,
                            pipeline_verify: bool = False, loss_scale: Any = None, **options: Any):
    """``mode="train"``: joint capture, pipeline, a :class:`~mlcomp.targets.training.TrainingArtifact`.

    Checks the target and the optimizer spec before capturing; with ``verify`` the
    gradients of one batch are compared with eager autograd (``art.verification``);
    ``pipeline_verify`` checks every pass on the joint graph (first diverging node).
    ``loss_scale``: ``dynamic``, ``none``, a number, ``dynamic{init=… interval=…}``
    (:mod:`mlcomp.targets.loss_scaling`); ``None``: dynamic when the graph computes in fp16.
    """
    from mlcomp.frontend.joint import (
        capture_joint,
        example_target,
        loss_function,
        resolve_loss,
    )
    from mlcomp.targets import CompileOptions
    from mlcomp.targets.loss_scaling import LossScaleSpec
    from mlcomp.targets.optim import OptimizerSpec
    from mlcomp.targets.training import (
        check_training_target,
        compile_training,
        verify_gradients,
    )

    spec = OptimizerSpec.parse(optimizer)
    loss = resolve_loss(source, loss)
    if loss_scale is not None:
        loss_scale = LossScaleSpec.parse(loss_scale)   # malformed: refused before capture
    check_training_target(target or "cpu")
    opts = CompileOptions.make(**options)
    model, inputs = source.eager, source.inputs()
    if not isinstance(model, torch.nn.Module):
        raise MlcompError(f"{source.name} is a {type(model).__name__}; training needs an nn.Module with "
                          "parameters", hint="give the Python module or a factory file.py:fn")
    if y is None:
        y = example_target(model, inputs, loss)
    state = model.state_dict()
    graph = capture_joint(model, inputs, y, loss=loss, name=source.name)
    args = tuple(inputs) + ((y,) if y is not None and loss_function(loss) is not None else ())
    if pipeline is not None and pipeline != "":   # Verify runs the joint graph: forward and backward
        graph, _ = run_pipeline(graph, Pipeline.coerce(pipeline), example_inputs=args, instruments=instruments,
                                verify=pipeline_verify)
    art = compile_training(graph, target=target or "cpu", optimizer=spec, options=opts,
                           state_keys=list(state),
                           extra_state={k: v for k, v in state.items() if k not in graph.constants},
                           loss_scale=loss_scale)
    if verify:
        verify_gradients(art, model, loss_function(loss), args, tolerance=opts.tolerance or 1e-5)
    return art


def load(directory: str | Path, *, verify: bool = False):
    """Load an artifact folder; ``verify=True`` re-runs its stored reference inputs and compares.

    A training artifact (``mlcomp compile --train -o DIR``) comes back as a
    :class:`~mlcomp.targets.training.TrainingArtifact` that has already checked itself:
    one step on the stored batch repeats the step the original took.
    """
    from mlcomp.targets.artifact import Artifact
    from mlcomp.targets.training import TRAINING_FORMAT, TrainingArtifact

    if _folder_format(Path(directory)) == TRAINING_FORMAT:
        return TrainingArtifact.load(directory)
    artifact = Artifact.load(directory)
    if verify:
        artifact.verify(record=False)
    return artifact


def _folder_format(directory: Path) -> str | None:
    import json

    try:
        manifest = json.loads((directory / "manifest.json").read_text())
    except (OSError, ValueError):
        return None
    return manifest.get("format") if isinstance(manifest, dict) else None


def export(model_or_path: Any, path: str | Path, format: str = "onnx",
           example_inputs: Sequence[torch.Tensor] | torch.Tensor | None = None, pipeline: Any = None,
           tolerance: float | None = None, force: bool = True, **options: Any):
    """Write a standalone file for plain torch / ONNX Runtime / TVM and verify it after reloading.

    Returns ``(path, VerifyResult)``; see :mod:`mlcomp.targets.export` for the formats.  ``path``
    is checked before capture: a tvm folder may replace only an earlier mlcomp output (and only
    with ``force``), never a file or a folder of anything else.
    """
    from mlcomp.base.files import Kind, check_destination
    from mlcomp.targets.export import ExportFormat, export_graph

    load_opts = {k: options.pop(k) for k in _LOAD_KEYS if k in options}
    if options:
        raise MlcompError(f"unknown export option(s) {', '.join(sorted(options))}",
                          hint=f"export takes example_inputs, pipeline, tolerance, force and "
                               f"{', '.join(_LOAD_KEYS)}")
    fmt = ExportFormat.parse(format)
    check_destination(path, Kind.DIR if fmt is ExportFormat.TVM else Kind.FILE, force=force, option="path")
    _check_options(model_or_path, load_opts, tolerance)
    source = _source(model_or_path, example_inputs, load_opts)
    graph = source.capture(method=load_opts.get("capture", "export"),
                           dynamic_batch=bool(load_opts.get("dynamic_batch")))
    inputs = source.inputs()
    if pipeline:
        graph, _ = run_pipeline(graph, Pipeline.coerce(pipeline), example_inputs=inputs)
    with torch.no_grad():
        expected = source.eager(*inputs)
    return export_graph(graph, fmt, path, inputs, expected, tolerance=tolerance)
