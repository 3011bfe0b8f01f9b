"""Pipelines as data and the pass manager that runs them.

``pass_base`` (what a pass is, its typed options, the pass registry), ``spec``
(inline/TOML/preset parsing), ``manager`` (running passes with instruments),
``instruments`` and ``report``.
"""
from mlcomp.pipeline.instruments import PassRecord, PipelineReport
from mlcomp.pipeline.pass_base import REGISTRY, Pass, PassContext, PassRegistry, PassResult, option
from mlcomp.pipeline.spec import PRESETS, PassSpec, Pipeline, run_pipeline

__all__ = ["Pass", "PassContext", "PassResult", "PassRegistry", "REGISTRY", "option", "PassSpec", "Pipeline",
           "PRESETS", "run_pipeline", "PipelineReport", "PassRecord"]
