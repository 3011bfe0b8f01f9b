"""The Python API: ``mlcomp.compile``, ``mlcomp.load``, ``mlcomp.export``, and the compile the CLI runs.

::

    import mlcomp, torch
    art = mlcomp.compile("resnet18", target="onnxruntime", pipeline="-O2", threads=2)
    art.verification["passed"]           # compared with eager on the example inputs
    True
    art = mlcomp.compile("mlp", target="auto", cache=True)   # fastest verified target, cached
    art.manifest["auto"]["picked"], art.manifest["cache"]["status"]
    ('onnxruntime', 'stored')                # a second call: 'hit', no passes and no lowering
    art.save("out/mlp"); again = mlcomp.load("out/mlp", verify=True)

``model_or_path`` is an ``nn.Module`` (with ``example_inputs``) or anything
:func:`mlcomp.frontend.loading.load_model` accepts (zoo name, ``.pt``, ``.pt2``,
``file.py:fn``).  Remaining keyword arguments are
:class:`~mlcomp.targets.base.CompileOptions` (``threads``, ``tune_trials``,
``work_dir``, ``device``, ``tolerance``…) or loading options (``input_shapes``,
``batch``, ``capture``, ``dynamic`` (``"batch,seq=8..512"``), ``dynamic_batch``, ``trust_pickle``).

:func:`compile_model` (what both ``mlcomp.compile`` and ``mlcomp compile`` run)
consults an optional :class:`~mlcomp.api.cache.CompileCache` first (opt-in here:
``cache=True`` or a folder; the CLI's default is on) and handles ``target="auto"``
(:mod:`mlcomp.api.auto.search`).
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import time
import warnings
from pathlib import Path
from typing import Any, Sequence

import torch

from mlcomp.api.auto.record import RECORDS_DIR, RecordStore
from mlcomp.api.auto.search import AUTO, DEFAULT_AUTO_TIMING, auto_candidates, compile_auto, timing_pool
from mlcomp.api.cache import CacheOutcome, CacheStatus, CompileCache, default_cache_dir
from mlcomp.api.cache_key import CacheKey, UncacheableGraph, cache_key
from mlcomp.api.inputs import LOAD_KEYS, TRAIN_KEYS, check_options, load_source
from mlcomp.api.lowering import (CompileResult, Note, adapted_pipeline, compile_source, eager_reference,
                                 resolve_target)
from mlcomp.base.errors import MlcompError, OptionError
from mlcomp.base.files import Kind, check_destination
from mlcomp.frontend.loading import kept_modes
from mlcomp.frontend.stochastic import randomness_off
from mlcomp.hardware.timing import TimingPolicy
from mlcomp.pipeline import Pipeline, run_pipeline
from mlcomp.pipeline.presets import preset_key
from mlcomp.pipeline.seeding import DETERMINISTIC_SEED, seed_everything
from mlcomp.targets import CompileOptions, Target
from mlcomp.runtime.artifact import Artifact
from mlcomp.training.host_memory import before_capture
from mlcomp.training.loss_scaling import LossScaleSpec
from mlcomp.runtime.optim import OptimizerSpec
from mlcomp.training.step import (
    TRAINING_FORMAT,
    TrainingArtifact,
    check_training_target,
    compile_training,
    verify_gradients,
)

__all__ = ["check_pipeline_target", "compile", "compile_model", "open_cache", "is_auto", "load", "export",
           "compile_training_source", "early_pool"]


def is_auto(target: Any) -> bool:
    return isinstance(target, str) and target.strip().lower() == AUTO


def check_pipeline_target(target: Any, pipeline: Any, *, device: str | None = None) -> None:
    """Refuse, before anything is captured, a pipeline the target cannot run (checked against the target's
    facts: the dtypes it builds, the device).  No pipeline, or ``target="auto"`` (each candidate is checked
    as it compiles): nothing to check."""
    if pipeline is None or pipeline == "" or is_auto(target):
        return
    chosen = resolve_target(target, pipeline)
    Pipeline.coerce(pipeline).check_target(chosen.name, facts=chosen.facts(CompileOptions.make(device=device)))


def open_cache(cache: Any) -> CompileCache | None:
    """``None``/``False``: no cache; ``True``: the user's (:func:`default_cache_dir`); a folder or a cache."""
    if cache is None or cache is False:
        return None
    if cache is True:
        return CompileCache(default_cache_dir())
    if isinstance(cache, CompileCache):
        return cache
    if isinstance(cache, (str, os.PathLike)):
        return CompileCache(cache)
    raise OptionError(f"cache={cache!r} is not a cache", hint="give cache=True (the user's cache folder), a "
                      "folder path, or a mlcomp.api.CompileCache")


def _key(graph: Any, target: Any, candidates: Any, pipeline: Any, options: CompileOptions,
         policy: TimingPolicy) -> tuple[CacheKey | None, str | None]:
    """The cache key of this compile, or why it has none."""
    try:
        if is_auto(target):
            names = [t.name for t in auto_candidates(candidates)]
            key = preset_key(pipeline)
            spec = f"-{key}" if key else (Pipeline.coerce(pipeline).spec if pipeline else "")
            return cache_key(graph, pipeline=spec, target=AUTO, options=options, device=options.device or "cpu",
                             extra={"candidates": names, "auto_timing": [policy.warmup, policy.budget_s,
                                                                         policy.min_repeats]}), None
        chosen = resolve_target(target, pipeline)
        pipe, _ = adapted_pipeline(pipeline, chosen)
        files = [f for p in (pipe.build() if pipe is not None else ()) for f in p.files_read()]
        return cache_key(graph, pipeline=pipe.spec if pipe is not None else "", target=chosen.spec,
                         options=options, device=chosen.device(options),
                         extra={"files": {f: file_digest(f) for f in files}} if files else None), None
    except UncacheableGraph as exc:
        return None, f"the graph cannot be hashed ({exc})"
    except OSError as exc:
        return None, f"a file the pipeline reads cannot be hashed ({exc.strerror or exc})"


def file_digest(path: str) -> str:
    """The sha256 of a file a pass reads (what makes a changed calibration dataset a cache miss)."""
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def _reuse(source: Any, art: Any, *, verify: bool, tolerance: float | None, capture_seconds: float) -> CompileResult:
    """A cached artifact made current: eager outputs on this run's example inputs, verified unless asked not to."""
    if not art.manifest.get("verified_against"):        # a declared reference (pruning) stays the stored one
        inputs = source.inputs()
        expected, _ = eager_reference(source, inputs, None)
        art.set_reference(inputs, expected)
    art.manifest["capture_seconds"] = round(capture_seconds, 4)
    check = art.verify(tolerance=tolerance, raise_on_failure=False) if verify else None
    return CompileResult(art, None, capture_seconds, 0.0, check=check)


def compile_model(source: Any, graph: Any, *, target: str | Target | None = None,
                  candidates: Sequence[str | Target] | None = None, pipeline: Any = None, verify: bool = True,
                  cache: CompileCache | None = None, capture_seconds: float = 0.0,
                  instruments: Any = None, auto_timing: TimingPolicy = DEFAULT_AUTO_TIMING,
                  note: Note | None = None, calibration_data: Any = None, isolate: bool = True,
                  pool: Any = None, **options: Any) -> CompileResult:
    """Cache lookup, then the auto target or one target, verification, and storing a verified miss.

    Nothing raises on a verification failure: ``result.check`` says (the CLI prints it first).
    ``result.cache`` is the :class:`CacheOutcome` when ``cache`` is given.  ``instruments``:
    a list, or for ``target="auto"`` a callable giving one list per candidate name.
    ``calibration_data``: batches for the passes that calibrate (quantize, mixed-precision); a compile
    given them bypasses the cache (the batches are not part of its key).  ``isolate=False``: the auto
    target times its candidates in this process (:func:`~mlcomp.api.auto.search.compile_auto`); ``pool``: its
    timing processes, started before the capture (:func:`~mlcomp.api.auto.search.timing_pool`).
    """
    say = note or (lambda text: None)
    auto = is_auto(target)
    if candidates is not None and not auto:
        raise OptionError(f"candidate targets were given for target {target!r}",
                          hint="candidates apply to target='auto' (--target auto) only")
    if calibration_data is not None and auto:
        raise OptionError("calibration_data was given for target='auto'", hint="name the target (for quantize: "
                          "target='onnxruntime'); calibration data goes to one target's pipeline")
    opts = CompileOptions.make(**options)
    if opts.deterministic:
        seed_everything(DETERMINISTIC_SEED)
    key, outcome, removed = None, None, []
    if cache is not None:
        key, why = _key(graph, target, candidates, pipeline, opts, auto_timing) if calibration_data is None else \
            (None, "calibration data was given (it is not part of the cache key)")
        if key is None:
            outcome = CacheOutcome(CacheStatus.BYPASSED, reason=why)
        else:
            say(f"cache lookup {key.short}")
            art, problem = cache.lookup(key)
            removed += [problem] if problem else []
            if art is not None:
                say("verify the cached artifact against eager" if verify else "cached artifact")
                hit = _reuse(source, art, verify=verify, tolerance=opts.tolerance, capture_seconds=capture_seconds)
                if hit.check is None or hit.check.passed:
                    hit.cache = CacheOutcome(CacheStatus.HIT, key, removed=removed)
                    art.manifest["cache"] = hit.cache.to_json()
                    return hit
                cache.remove(cache.path(key))
                cache.corrupt += 1
                removed.append(f"cache entry {key.short} differs from eager ({hit.check.summary()}); "
                               f"removed, compiling again")
    if auto:
        records = RecordStore(cache.root / RECORDS_DIR) if cache is not None else None
        result = compile_auto(source, graph, candidates=candidates, pipeline=pipeline,
                              capture_seconds=capture_seconds, instruments=instruments, policy=auto_timing,
                              note=say, records=records, isolate=isolate, pool=pool, **options)
    else:
        result = compile_source(source, graph, target=target, pipeline=pipeline, verify=verify,
                                capture_seconds=capture_seconds, instruments=instruments,
                                raise_on_failure=False, calibration_data=calibration_data, **options)
    if key is not None and cache is not None:
        if not verify:
            outcome = CacheOutcome(CacheStatus.NOT_STORED, key, "it was not verified (--no-verify)")
        elif not result.check.passed:
            outcome = CacheOutcome(CacheStatus.NOT_STORED, key, "it failed verification")
        else:
            result.artifact.manifest["cache"] = {"status": CacheStatus.STORED.value, "key": key.digest}
            why = cache.store(key, result.artifact)
            outcome = CacheOutcome(CacheStatus.STORED if why is None else CacheStatus.NOT_STORED, key, why)
        outcome.removed = removed
    if outcome is not None:
        result.cache = outcome
        result.artifact.manifest["cache"] = outcome.to_json()
    return result


def compile(model_or_path: Any, example_inputs: Sequence[torch.Tensor] | torch.Tensor | None = None,
            target: str | Target | None = None, pipeline: Any = None, verify: bool = True, fallback: str = "none",
            cache: Any = None, candidates: Sequence[str | Target] | None = None, **options: Any):
    """Capture, run ``pipeline`` (inline text, preset, ``.toml`` path or Pipeline), lower, verify.

    ``target`` None: the pipeline file's ``target = "..."`` if it names one, else ``cpu``;
    ``"auto"``: the fastest of ``candidates`` (default: every target available here) that
    verifies (:mod:`mlcomp.api.auto.search`).  ``calibration_data=``: an iterable of example
    batches for the passes that calibrate (``quantize``'s ranges).  ``cache``: None (default, no cache), True (the user's
    cache folder), a folder, or a :class:`~mlcomp.api.cache.CompileCache`; the outcome is in
    ``art.manifest["cache"]``.

    Returns an :class:`~mlcomp.runtime.artifact.Artifact`; raises
    :class:`~mlcomp.base.errors.VerificationError` if ``verify`` and the outputs differ
    from eager beyond the tolerance.  A module passed in keeps its train/eval mode.
    """
    with kept_modes(model_or_path):
        return _compile(model_or_path, example_inputs, target, pipeline, verify, fallback, cache, candidates,
                        **options)


def _compile(model_or_path: Any, example_inputs: Any, target: Any, pipeline: Any, verify: bool, fallback: str,
             cache: Any, candidates: Any, **options: Any):
    load_opts = {k: options.pop(k) for k in LOAD_KEYS if k in options}
    check_options(model_or_path, load_opts, options.get("tolerance"))
    mode = str(options.pop("mode", "inference")).lower()
    train_opts = {k: options.pop(k) for k in TRAIN_KEYS if k in options}
    store = open_cache(cache)
    if mode in ("train", "training"):   # joint forward+backward graph → TrainingArtifact
        if store is not None or candidates is not None or is_auto(target):
            raise OptionError("cache, candidates and target='auto' apply to inference compiles only",
                              hint="drop them for mode='train'")
        source = load_source(model_or_path, example_inputs, load_opts)
        return compile_training_source(source, target=target, pipeline=pipeline, verify=verify,
                                       **train_opts, **options)
    if train_opts or mode not in ("inference", "eval"):
        raise MlcompError(f"mode={mode!r} with {', '.join(train_opts) or 'no training options'}",
                          hint="use mode='train' with loss/optimizer/y, or mode='inference' without them")
    check_pipeline_target(target, pipeline, device=options.get("device"))
    if options.get("deterministic"):
        seed_everything(DETERMINISTIC_SEED)      # before the model is built and its inputs drawn
    source = load_source(model_or_path, example_inputs, load_opts)
    for note in source.notes:                  # e.g. a model given in train() mode, compiled in eval() mode
        warnings.warn(note, stacklevel=2)
    with early_pool(source, target, candidates, options) as pool:
        t0 = time.perf_counter()
        graph = source.capture(method=load_opts.get("capture", "export"),
                               dynamic=load_opts.get("dynamic"), dynamic_batch=bool(load_opts.get("dynamic_batch")))
        seconds = time.perf_counter() - t0
        result = compile_model(source, graph, target=target, candidates=candidates, pipeline=pipeline, verify=verify,
                               cache=store, capture_seconds=seconds, fallback=fallback, pool=pool, **options)
    if result.check is not None:
        result.check.raise_if_failed(where=f"target {result.artifact.target}, model {graph.name}")
    return result.artifact


def early_pool(source: Any, target: Any, candidates: Any, options: dict[str, Any]) -> Any:
    """For ``target="auto"`` timed in processes: its timing processes, started now, so that their one start-up
    (a zygote importing torch, mlcomp and the runtimes) runs on the core the capture leaves; else nothing.
    Unused ones (a cache hit, a record, a failed capture) are killed when the block ends."""
    if not is_auto(target) or not options.get("isolate", True) or options.get("deterministic"):
        return contextlib.nullcontext()
    pool = timing_pool(source.inputs(), auto_candidates(candidates), options.get("auto_timing", DEFAULT_AUTO_TIMING))
    try:
        pool.start()
    except BaseException:           # an OSError saving the inputs, Ctrl-C: nothing started is left behind
        pool.__exit__(None, None, None)
        raise
    return pool


def compile_training_source(source: Any, *, target: str | None = "cpu", pipeline: Any = None,
                            verify: bool = True, loss: Any = None, optimizer: Any = "sgd",
                            y: torch.Tensor | None = None, instruments: Sequence[Any] | None = None,
                            pipeline_verify: bool = False, loss_scale: Any = None, randomness: str = "refuse",
                            update_in_backward: bool = False, host_memory: str = "auto", **options: Any):
    """``mode="train"``: joint capture, pipeline, a :class:`~mlcomp.training.step.TrainingArtifact`.

    Checks the target and the optimizer spec before capturing; with ``verify`` the
    gradients of one batch are compared with eager autograd (``art.verification``);
    ``pipeline_verify`` checks every pass on the joint graph (first diverging node).
    ``loss_scale``: ``dynamic``, ``none``, a number, ``dynamic{init=… interval=…}``
    (:mod:`mlcomp.training.loss_scaling`); ``None``: dynamic when the graph computes in fp16.
    ``randomness``: ``"refuse"`` a model whose training mode draws randomness outside the graph (LayerDrop,
    SpecAugment: :mod:`mlcomp.frontend.stochastic`), or ``"off"``: capture and verify the step with those
    settings at 0 for the compile only (listed in ``art.verification["randomness_off"]``).
    ``update_in_backward``: the optimizer in the backward (:mod:`mlcomp.training.fused`);
    ``host_memory``: the allocator policy, applied before capture (:mod:`mlcomp.training.host_memory`).
    """
    # here, not at the top: the joint capture's imports (torch._dynamo, torch._inductor) are an inference
    # compile's capture's, after auto's timing processes have started
    from mlcomp.frontend.joint import capture_joint, example_target, loss_function, resolve_loss

    spec = OptimizerSpec.parse(optimizer)
    loss = resolve_loss(source, loss)
    if loss_scale is not None:
        loss_scale = LossScaleSpec.parse(loss_scale)   # malformed: refused before capture
    check_training_target(target or "cpu")
    opts = CompileOptions.make(**options)
    model, inputs = source.trainable(), source.inputs()
    if not isinstance(model, torch.nn.Module):
        raise MlcompError(f"{source.name} is a {type(model).__name__}; training needs an nn.Module with "
                          "parameters", hint="give the Python module or a factory file.py:fn")
    with randomness_off(model, source.name, randomness) as off:
        if y is None:
            y = example_target(model, inputs, loss)
        state = model.state_dict()
        before_capture(host_memory, pipeline, fused=update_in_backward)
        graph = capture_joint(model, inputs, y, loss=loss, name=source.name)
        args = tuple(inputs) + ((y,) if y is not None and loss_function(loss) is not None else ())
        if pipeline is not None and pipeline != "":   # Verify runs the joint graph: forward and backward
            graph, _ = run_pipeline(graph, Pipeline.coerce(pipeline), example_inputs=args, instruments=instruments,
                                    verify=pipeline_verify, optimizer=spec)
        art = compile_training(graph, target=target or "cpu", optimizer=spec, options=opts,
                               state_keys=list(state),
                               extra_state={k: v for k, v in state.items() if k not in graph.constants},
                               loss_scale=loss_scale, update_in_backward=update_in_backward,
                               host_memory=host_memory)
        if verify:
            verify_gradients(art, model, loss_function(loss), args, tolerance=opts.tolerance or 1e-5)
    if off and art.verification is not None:
        art.verification["randomness_off"] = off
    return art


def load(directory: str | Path, *, verify: bool = False):
    """Load an artifact folder; ``verify=True`` re-runs its stored reference inputs and compares (from the
    seed eager ran from, as :meth:`Artifact.verify` always does).

    A training artifact (``mlcomp compile --train -o DIR``) comes back as a
    :class:`~mlcomp.training.step.TrainingArtifact` that has already checked itself:
    one step on the stored batch repeats the step the original took.
    """
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
    with ``force``), never a file or a folder of anything else.  A module passed in keeps its mode.
    """
    with kept_modes(model_or_path):
        return _export(model_or_path, path, format, example_inputs, pipeline, tolerance, force, **options)


def _export(model_or_path: Any, path: str | Path, format: str, example_inputs: Any, pipeline: Any,
            tolerance: float | None, force: bool, **options: Any):
    # lazy: the exporters import every target module (cpu, onnxruntime, tvm), which `mlcomp.compile` does not need
    from mlcomp.targets.export import ExportFormat, export_graph

    load_opts = {k: options.pop(k) for k in LOAD_KEYS if k in options}
    if options:
        raise MlcompError(f"unknown export option(s) {', '.join(sorted(options))}",
                          hint=f"export takes example_inputs, pipeline, tolerance, force and "
                               f"{', '.join(LOAD_KEYS)}")
    fmt = ExportFormat.parse(format)
    tvm = fmt is ExportFormat.TVM
    check_destination(path, Kind.DIR if tvm else Kind.FILE, force=force, option="path",
                      fmt=None if tvm else fmt.value,
                      inputs=(model_or_path,) if isinstance(model_or_path, (str, os.PathLike)) else ())
    check_options(model_or_path, load_opts, tolerance)
    source = load_source(model_or_path, example_inputs, load_opts)
    graph = source.capture(method=load_opts.get("capture", "export"),
                           dynamic=load_opts.get("dynamic"), dynamic_batch=bool(load_opts.get("dynamic_batch")))
    inputs = source.inputs()
    if pipeline:
        graph, _ = run_pipeline(graph, Pipeline.coerce(pipeline), example_inputs=inputs)
    with torch.no_grad():
        expected = source.eager(*inputs)
    return export_graph(graph, fmt, path, inputs, expected, tolerance=tolerance)
