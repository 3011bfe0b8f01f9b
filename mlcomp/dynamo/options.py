"""What ``torch.compile(model, backend="mlcomp", options={...})`` accepts, checked once per call.

    >>> opts = BackendOptions.parse({"target": "cpu", "pipeline": "-O1", "threads": 1})
    >>> opts.target, opts.pipeline, opts.compile_options["threads"]
    ('cpu', '-O1', 1)
    >>> BackendOptions.parse({"precision": "bf16"}).pipeline_spec()
    '-O2,mixed-precision{dtype=bf16}'
    >>> BackendOptions.parse({"treads": 2})
    Traceback (most recent call last):
    mlcomp.base.errors.OptionError: torch.compile(backend="mlcomp") got unknown option(s) treads...

The options are those of :func:`mlcomp.compile` (``target``, ``pipeline``, ``verify``,
``cache``, ``dynamic`` and every :class:`~mlcomp.targets.options.CompileOptions` field such
as ``threads`` and ``tolerance``), plus ``precision`` (a mixed-precision pass appended to the
pipeline), ``report`` (a :class:`~mlcomp.dynamo.report.BackendReport` the backend fills:
which partition ran where) and ``explain`` (print that report as each graph compiles).
An inference graph goes to the ``target`` the call names; with none, to the one a rule on the
graph's FLOPs picks (:mod:`mlcomp.dynamo.target_rule`: one compile).  ``target="auto"`` compiles it
for each of :data:`INFERENCE_CANDIDATES`, verifies each and keeps the one timed fastest on the
graph's example inputs in this process.  Training compiles for ``cpu`` unless a target is named.
``dynamic`` (``"batch,seq=8..512"``) names the sizes Dynamo made symbolic and bounds their
ranges (:mod:`mlcomp.dynamo.symbols`); which sizes are symbolic is Dynamo's choice.
Each ``torch.compile`` call carries its own dict to the backend, so two compiled models in
one process never share options.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Mapping

from mlcomp.base.errors import OptionError
from mlcomp.frontend.dynamic import DynamicDim, parse_dynamic
from mlcomp.hardware.timing import TimingPolicy
from mlcomp.targets.options import CompileOptions

__all__ = ["BY_RULE", "BackendOptions", "DEFAULT_PIPELINE", "INFERENCE_CANDIDATES", "INFERENCE_TIMING", "PRECISIONS"]

DEFAULT_PIPELINE = "-O2"
BY_RULE = "by-rule"     # an inference graph's target when the call names none: mlcomp.dynamo.target_rule
# target="auto" under the backend: these are compiled, and the one timed fastest on the graph's example wins
INFERENCE_CANDIDATES = ("cpu", "onnxruntime", "openvino")
INFERENCE_TIMING = TimingPolicy(warmup=3, budget_s=0.2, min_repeats=5)
PRECISIONS = ("fp32", "bf16", "fp16", "auto")
OWN_KEYS = ("target", "pipeline", "precision", "verify", "cache", "report", "explain", "train_pipeline", "dynamic")
COMPILE_KEYS = tuple(f.name for f in dataclasses.fields(CompileOptions))


@dataclass(frozen=True)
class BackendOptions:
    """One ``torch.compile`` call's options for the mlcomp backend (validated, immutable)."""

    target: str = "cpu"                  # what training compiles for unless the call names a target
    target_given: bool = False           # the call named the target: it applies to inference too
    pipeline: Any = DEFAULT_PIPELINE
    precision: str | None = None
    verify: bool = True
    cache: Any = None
    report: Any = None
    explain: bool = False
    train_pipeline: Any = None
    dynamic: tuple[DynamicDim, ...] = ()
    compile_options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def parse(cls, options: Mapping[str, Any] | None) -> "BackendOptions":
        values = dict(options or {})
        unknown = sorted(k for k in values if k not in OWN_KEYS and k not in COMPILE_KEYS)
        if unknown:
            raise OptionError(f'torch.compile(backend="mlcomp") got unknown option(s) {", ".join(unknown)}',
                              hint=f"the options are {', '.join(OWN_KEYS + COMPILE_KEYS)}")
        precision = values.get("precision")
        if precision is not None and str(precision).lower() not in PRECISIONS:
            raise OptionError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}",
                              hint='give options={"precision": "bf16"} (or fp16, fp32, auto)')
        compile_options = {k: values[k] for k in COMPILE_KEYS if k in values}
        compile_options.setdefault("fallback", "eager")       # torch.compile must run whatever it is given
        CompileOptions.make(**compile_options)                # ill-typed values: refused before any graph
        own = {k: values[k] for k in OWN_KEYS if k in values}
        if "target" in own and not isinstance(own["target"], str):
            raise OptionError(f"target={own['target']!r} is not a target name",
                              hint="give a name from `mlcomp targets`, or 'auto'")
        own["dynamic"] = parse_dynamic(own.get("dynamic"))
        return cls(**own, target_given="target" in own, compile_options=compile_options)

    def for_inference(self) -> "BackendOptions":
        """These options for an inference graph: the named target, else :data:`BY_RULE`."""
        return self if self.target_given else dataclasses.replace(self, target=BY_RULE)

    def target_args(self) -> dict[str, Any]:
        """``compile_model``'s target arguments for a named target: ``auto`` picks among
        :data:`INFERENCE_CANDIDATES`, timed in this process (:data:`INFERENCE_TIMING`)."""
        if self.target != "auto":
            return {"target": self.target}
        return {"target": "auto", "candidates": INFERENCE_CANDIDATES, "isolate": False,
                "auto_timing": INFERENCE_TIMING}

    def pipeline_spec(self) -> Any:
        """The pipeline with the precision pass appended (``precision`` absent or fp32: the pipeline as given)."""
        if self.precision is None or str(self.precision).lower() == "fp32":
            return self.pipeline
        step = f"mixed-precision{{dtype={str(self.precision).lower()}}}"
        if not isinstance(self.pipeline, str) or self.pipeline.endswith(".toml"):
            raise OptionError("precision= applies to an inline or preset pipeline",
                              hint=f"add {step} to the pipeline itself")
        return f"{self.pipeline},{step}" if self.pipeline else step
