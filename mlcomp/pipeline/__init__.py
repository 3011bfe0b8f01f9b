"""Pipelines as data and the pass manager that runs them.

``pass_base`` (what a pass is, its typed options, modes and requirements, the
pass registry), ``composite`` (``Sequential``/``FixedPoint`` composites the
manager walks), ``spec`` (inline/TOML/preset parsing), ``manager`` (checking and
running passes), ``instruments`` (hooks around every pass) and ``report``.
"""
from mlcomp.pipeline.composite import CompositePass, FixedPoint, Sequential, Step
from mlcomp.pipeline.instruments import (Dump, Explain, Instrument, IRCheck, Memory, Timing, Verify,
                                         standard_instruments)
from mlcomp.pipeline.manager import PassManager, run_pipeline
from mlcomp.pipeline.pass_base import REGISTRY, Pass, PassContext, PassRegistry, PassResult, Requirement, option
from mlcomp.pipeline.pass_records import PassRecord, PipelineReport
from mlcomp.pipeline.spec import PRESETS, PassSpec, Pipeline

__all__ = ["Pass", "PassContext", "PassResult", "PassRegistry", "REGISTRY", "Requirement", "option", "PassSpec",
           "Pipeline", "PRESETS", "PassManager", "run_pipeline", "PipelineReport", "PassRecord", "CompositePass",
           "Sequential", "FixedPoint", "Step", "Instrument", "Timing", "IRCheck", "Verify", "Dump", "Explain",
           "Memory", "standard_instruments"]
