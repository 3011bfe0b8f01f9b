"""The pipeline is checked against the target, with the target's facts, before anything is captured."""
from __future__ import annotations

import copy
from dataclasses import replace

import pytest

from mlcomp.api.compiler import check_pipeline_target
from mlcomp.base.errors import PipelineSpecError
from mlcomp.targets import get_target


def test_a_pipeline_the_target_cannot_run_is_refused_and_auto_is_left_to_its_candidates():
    with pytest.raises(PipelineSpecError, match="target onnxruntime cannot run them"):
        check_pipeline_target("onnxruntime", "prune{method=2:4}")
    check_pipeline_target("auto", "prune{method=2:4}")          # each candidate is checked as it compiles
    check_pipeline_target("onnxruntime", None)
    check_pipeline_target("onnxruntime", "")


def test_the_targets_facts_decide_a_precision():
    bare = copy.copy(get_target("cpu"))                                 # the registry's own stays as it is
    bare.capabilities = replace(bare.capabilities, low_precision=())     # builds no bf16 or fp16
    check_pipeline_target(get_target("cpu"), "mixed-precision{dtype=bf16}")
    with pytest.raises(PipelineSpecError, match="target cpu cannot build bf16 graphs"):
        check_pipeline_target(bare, "mixed-precision{dtype=bf16}")
