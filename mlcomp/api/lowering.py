"""One compile for one target: pipeline (adapted to the target), lowering, verification against eager.

::

    source = load_model("mlp"); graph = source.capture()
    result = compile_source(source, graph, target="onnxruntime", pipeline="-O2")
    result.artifact.target, result.check.passed
    ('onnxruntime', True)

``target`` is a name or a :class:`~mlcomp.targets.base.Target` instance (so the auto
target can try targets the registry does not hold, such as the tests' fake targets), and the
result carries the verification it did (``check``) for the caller to print.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from mlcomp.analysis.ranges import declared_tolerance
from mlcomp.analysis.selections import near_tie_reference, selection_nodes
from mlcomp.analysis.verify import flatten_outputs
from mlcomp.api.range_check import verify_ranges
from mlcomp.frontend.model_faults import eager_fault
from mlcomp.ir.interpreter import evaluate
from mlcomp.pipeline import Pipeline, run_pipeline
from mlcomp.pipeline.seeding import seeded
from mlcomp.pipeline.presets import adapt_preset
from mlcomp.targets import CompileOptions, Target, get_target

__all__ = ["CompileResult", "EagerOnce", "compile_source", "index_inputs", "verify_near_ties", "pass_decisions", "resolve_target", "adapted_pipeline", "eager_reference"]

Note = Callable[[str], None]


@dataclass
class CompileResult:
    """What a compile produced, for the CLI and :func:`mlcomp.compile` to report.

    ``check``: the verification against eager (None when not verified); ``cache``: a
    :class:`~mlcomp.api.cache.CacheOutcome` when a compile cache was used; ``auto``: the
    :class:`~mlcomp.api.auto.search.AutoReport` of ``target="auto"``.
    """

    artifact: Any
    pipeline_report: Any
    capture_seconds: float
    pipeline_seconds: float
    check: Any = None
    cache: Any = None
    auto: Any = None
    notes: list[str] = field(default_factory=list)


def resolve_target(target: str | Target | None, pipeline: Any = None) -> Target:
    """A target instance: the given one, the name's, the pipeline file's ``target``, else cpu."""
    if isinstance(target, Target):
        return target
    if target is None and pipeline is not None and pipeline != "":
        target = Pipeline.coerce(pipeline).target if not isinstance(pipeline, Pipeline) else pipeline.target
    return get_target(target or "cpu")


def adapted_pipeline(pipeline: Any, target: Target) -> tuple[Pipeline | None, Any]:
    """The pipeline as it runs for ``target`` (a preset adapted, anything else as written) and the adaptation."""
    if pipeline is None or pipeline == "":
        return None, None
    adapted = adapt_preset(pipeline, target.name, target.rewrites)
    return (Pipeline.parse(adapted.text) if adapted else Pipeline.coerce(pipeline)), adapted


def index_inputs(graph: Any, inputs: Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...] | None:
    """The example inputs for the target to build on when the graph takes integers (class targets, token
    ids: random ones may index out of range) and they fit its inputs exactly; else None (random ones)."""
    nodes = graph.input_nodes
    if not any(not n.tensor_meta.dtype.is_floating_point for n in nodes) or len(nodes) != len(inputs):
        return None
    fits = all(isinstance(x, torch.Tensor) and x.dtype == n.tensor_meta.dtype and not n.tensor_meta.is_dynamic
               and tuple(x.shape) == tuple(n.tensor_meta.concrete_shape(graph.symbols)) for n, x in zip(nodes, inputs))
    return tuple(inputs) if fits else None


class EagerOnce:
    """``source``'s eager outputs on its example inputs, computed at the first call and kept for every later
    one (a failure too): the candidates of one ``auto`` compile share one eager run.  ``runs`` counts them."""

    def __init__(self, source: Any) -> None:
        self.source, self.runs = source, 0
        self._outputs: Any = None
        self._failure: BaseException | None = None

    def __call__(self, *inputs: torch.Tensor) -> Any:
        if self._outputs is None and self._failure is None:
            self.runs += 1
            try:
                self._outputs = self.source.eager(*inputs)
            except Exception as exc:  # noqa: BLE001 - raised again, to every caller, as eager_reference reports it
                self._failure = exc
        if self._failure is not None:
            raise self._failure
        return self._outputs


def eager_reference(source: Any, inputs: Sequence[torch.Tensor], report: Any,
                    eager: Callable[..., Any] | None = None) -> tuple[tuple[Any, ...], str | None]:
    """What the artifact must compute on ``inputs``: eager (``eager``, default ``source.eager``), or the
    reference a pass declared (pruning); run from one seed (:func:`~mlcomp.pipeline.seeding.seeded`),
    as :meth:`Artifact.verify` runs the artifact, so random ops (dropout) draw the same numbers in both."""
    with torch.no_grad(), seeded():
        if report is not None and report.changes_function:
            # a pass changed the function on purpose (pruning) and declared what it must now compute (the masked
            # model); every later pass keeps that function, so the artifact is checked against it
            changed = report.function_changes()[-1]
            expected = evaluate(changed.declared_reference, *inputs)
            return tuple(flatten_outputs(expected)), \
                f"the reference declared by {changed.name} (it changes the function)"
        try:
            outputs = (eager or source.eager)(*inputs)
        except Exception as exc:  # noqa: BLE001 - eager PyTorch rejects the model on its own inputs
            raise eager_fault(exc, inputs, source.name) from None
        return tuple(flatten_outputs(outputs)), None


def pass_decisions(report: Any) -> list[dict[str, Any]]:
    """The ``decisions`` the passes of a pipeline report put in their stats, in run order, each with its pass."""
    out: list[dict[str, Any]] = []
    for record in (report.walk() if report is not None else ()):
        for decision in record.stats.get("decisions") or ():
            out.append(dict(decision, made_by=f"pass {record.spec}"))
    return out


def verify_near_ties(artifact: Any, captured: Any, lowered: Any, inputs: Sequence[torch.Tensor],
                     tolerance: float | None) -> Any:
    """The artifact verified against the captured graph taking the artifact's order at near-tie
    selections (:mod:`mlcomp.analysis.selections`), when that passes; else ``None`` (and the failed
    eager check stays the record, with the near-tie count beside it).  A pass makes these outputs
    the artifact's reference and says so in ``verified_against``."""
    if not selection_nodes(lowered) or declared_tolerance(lowered) is None:
        return None
    with torch.no_grad(), seeded():
        actual = flatten_outputs(artifact(*inputs))
    ties = near_tie_reference(captured, lowered, inputs, actual)
    if ties is None or not ties.ties:
        return None
    check = artifact.verify(inputs, ties.outputs, tolerance=tolerance, record=False, raise_on_failure=False)
    if not check.passed:
        artifact.manifest["verification"] = dict(artifact.manifest.get("verification") or {}, **ties.to_json())
        return None
    artifact.manifest["verification"] = dict(check.to_json(), **ties.to_json())
    artifact.manifest["verified_against"] = (
        f"the captured graph taking the artifact's order at {ties.ties} near-tie selection row(s) "
        f"({', '.join(f'%{n}: {k}' for n, k in ties.nodes.items())}): candidates closer than the precision's "
        "declared perturbation, which the rounding may order either way")
    artifact.set_reference(inputs, ties.outputs)
    return check


def compile_source(source: Any, graph: Any, *, target: str | Target | None = None, pipeline: Any = None,
                   verify: bool = True, capture_seconds: float = 0.0,
                   instruments: Sequence[Any] | None = None, raise_on_failure: bool = True,
                   calibration_data: Any = None, eager: Callable[..., Any] | None = None,
                   **options: Any) -> CompileResult:
    """Pipeline + lowering + verification for an already captured model.

    ``target`` None: the pipeline file's ``target``, else ``cpu``.  ``instruments`` go to
    :func:`mlcomp.pipeline.run_pipeline` (None: its defaults, IR check and timing).  With
    ``verify`` the artifact is compared with eager on the example inputs (``result.check``), and
    for a graph with symbolic sizes at each range's ends and middle (:mod:`mlcomp.api.range_check`);
    a mismatch raises unless ``raise_on_failure`` is False.  ``eager``: runs the model eagerly on the example
    inputs (default ``source.eager``; an :class:`EagerOnce` shares that run between compiles).
    """
    chosen = resolve_target(target, pipeline)
    opts = CompileOptions.make(**options)            # unknown or ill-typed options: refused before any pass
    report, pipeline_seconds, spec = None, 0.0, None
    inputs, captured = source.inputs(), graph
    pipe, adapted = adapted_pipeline(pipeline, chosen)
    if pipe is not None:
        t0 = time.perf_counter()
        graph, report = run_pipeline(graph, pipe, example_inputs=inputs, instruments=instruments,
                                     target=chosen.facts(opts), deterministic=opts.deterministic,
                                     calibration_data=calibration_data)
        if adapted is not None and report is not None:
            report.target = report.target or adapted.target
            report.dropped = [str(d) for d in adapted.dropped]
        pipeline_seconds = time.perf_counter() - t0
        spec = pipe.spec
    expected, against = eager_reference(source, inputs, report, eager)   # before the build: eager's own faults first
    artifact = chosen.compile(graph, opts, inputs=index_inputs(graph, inputs))
    artifact.manifest["pipeline"] = spec
    to_json = getattr(report, "to_json", None)
    artifact.manifest["pipeline_report"] = to_json() if callable(to_json) else None
    # the passes' decisions first (they ran first), then the target's
    artifact.manifest["decisions"] = pass_decisions(report) + list(artifact.manifest.get("decisions") or [])
    artifact.manifest["capture_seconds"] = round(capture_seconds, 4)
    if getattr(source, "notes", None):
        artifact.manifest["capture_notes"] = list(source.notes)
    artifact.manifest["pipeline_seconds"] = round(pipeline_seconds, 4)
    if against:
        artifact.manifest["verified_against"] = against
    artifact.set_reference(inputs, expected)
    check = None
    if verify:
        check = artifact.verify(tolerance=opts.tolerance, raise_on_failure=False)
        if not check.passed and graph is not captured and not against:
            check = verify_near_ties(artifact, captured, graph, inputs, opts.tolerance) or check
        if graph.ranges:          # symbolic sizes: also at each range's ends and middle
            check = verify_ranges(artifact, source, graph, report, check, tolerance=opts.tolerance,
                                  reference=eager_reference)
        if raise_on_failure:
            check.raise_if_failed(where=f"target {artifact.target}, model {artifact.manifest['model']}")
    return CompileResult(artifact, report, capture_seconds, pipeline_seconds, check=check)
