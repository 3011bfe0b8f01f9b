"""Every pass, alone and in the presets, keeps every zoo model numerically equal to eager PyTorch.

``run_pipeline(..., verify=True)`` checks the IR and compares every value with
the interpreter after each pass; the final graph is also compared with the
eager module itself.
"""
from __future__ import annotations

import pytest
import torch
from mlcomp.models import ZOO

from mlcomp.analysis.verify import compare
from mlcomp.ir.interpreter import Interpreter
from mlcomp.pipeline import run_pipeline

PASSES = ["dce", "cse", "simplify", "fold-constants", "cleanup", "fold-batchnorm", "fold-bias", "fuse-attention",
          "recompose", "fuse-epilogue", "fuse-elementwise", "fuse"]
PRESETS = ["-O1", "-O2", "-O3"]

# what each pass must at least do on each model (a pass that silently stops matching fails here)
EXPECTED = {
    ("resnet18", "fold-batchnorm"): {"batchnorms_folded": 20},
    ("transformer", "fuse-attention"): {"attention_fused": 4},
    ("transformer", "fold-bias"): {"bmm_linearized": 4},
    ("mlp", "fold-constants"): {"constants_created": 3},
    ("gru", "cse"): {"nodes_merged": 30},
    ("transformer", "simplify"): {"copies_removed": 20},
}


def _check(module, inputs, graph, spec):
    out, report = run_pipeline(graph, spec, example_inputs=inputs, verify=True)
    with torch.no_grad():
        expected = module(*inputs)
    result = compare(expected, Interpreter(out).run(*inputs))
    assert result.passed, result.format()
    return out, report


@pytest.mark.parametrize("spec", PASSES)
@pytest.mark.parametrize("model", list(ZOO))
def test_pass_keeps_zoo_model_numerics(captured, model, spec):
    module, inputs, graph = captured(model)
    out, report = _check(module, inputs, graph, spec)
    stats = report.records[0].stats
    for key, at_least in EXPECTED.get((model, spec), {}).items():
        assert stats.get(key, 0) >= at_least, (key, stats)


@pytest.mark.parametrize("spec", PRESETS)
@pytest.mark.parametrize("model", list(ZOO))
def test_presets_keep_zoo_model_numerics_and_shrink_graphs(captured, model, spec):
    module, inputs, graph = captured(model)
    out, report = _check(module, inputs, graph, spec)
    assert len(out) < len(graph)
    if spec != "-O1":
        assert report.stats("fuse").get("groups_formed", 0) >= 1


@pytest.mark.parametrize("model", ["resnet18", "transformer"])
def test_dynamic_batch_graphs_stay_dynamic(model):
    from mlcomp.frontend.loading import load_model

    z = ZOO[model]
    module, inputs = z.build(), z.example_inputs(2)
    graph = load_model(module, example_inputs=inputs).capture(dynamic_batch=True)
    out, _ = run_pipeline(graph, "-O2", example_inputs=inputs, verify=True)
    assert out.input_nodes[0].tensor_meta.is_dynamic and out.output_node is not None
    five = (torch.randn(5, *inputs[0].shape[1:]),)          # another batch size than the capture's
    with torch.no_grad():
        result = compare(module(*five), Interpreter(out).run(*five))
    assert result.passed, result.format()
