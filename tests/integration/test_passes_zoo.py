"""Every pass, alone and in the presets, keeps every zoo model numerically equal to eager PyTorch.

Each model's captured graph is compared with the eager module once; a pass's graph is then
run and compared with eager's outputs when it differs from the captured one (its text or a
constant), and needs no run when it is the same graph.  The presets run with
``run_pipeline(..., verify=True)``, which checks the IR and compares every value with the
interpreter after each pass, and their final graph is compared with eager too.
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


@pytest.fixture(scope="module")
def eager(captured):
    """Eager outputs per zoo model (computed once), after checking the captured graph against them."""
    outputs: dict[str, object] = {}

    def get(model: str):
        if model not in outputs:
            module, inputs, graph = captured(model)
            with torch.no_grad():
                outputs[model] = module(*inputs)
            result = compare(outputs[model], Interpreter(graph).run(*inputs))
            assert result.passed, f"the captured {model} graph: {result.format()}"
        return outputs[model]

    return get


def _same_graph(a, b) -> bool:
    """The same text and the same constants (shared tensors, or equal ones)."""
    return a.format() == b.format() and a.constants.keys() == b.constants.keys() and all(
        t is b.constants[k] or torch.equal(t, b.constants[k]) for k, t in a.constants.items())


def _check(captured, eager, model, spec, verify):
    module, inputs, graph = captured(model)
    expected = eager(model)
    out, report = run_pipeline(graph, spec, example_inputs=inputs, verify=verify)
    if verify or not _same_graph(graph, out):
        result = compare(expected, Interpreter(out).run(*inputs))
        assert result.passed, result.format()
    return graph, out, report


@pytest.mark.parametrize("spec", PASSES)
@pytest.mark.parametrize("model", list(ZOO))
def test_pass_keeps_zoo_model_numerics(captured, eager, model, spec):
    _, out, report = _check(captured, eager, model, spec, verify=False)
    stats = report.records[0].stats
    for key, at_least in EXPECTED.get((model, spec), {}).items():
        assert stats.get(key, 0) >= at_least, (key, stats)


@pytest.mark.parametrize("spec", PRESETS)
@pytest.mark.parametrize("model", list(ZOO))
def test_presets_keep_zoo_model_numerics_and_shrink_graphs(captured, eager, model, spec):
    graph, out, report = _check(captured, eager, model, spec, verify=True)
    assert len(out) < len(graph)
    if spec != "-O1":
        assert report.stats("fuse").get("groups_formed", 0) >= 1


def _small(model: str):
    """The zoo class at a reduced size (the same ops and structure): ResNet-18 at widths 8/16
    (``tests.helpers.modules.small_resnet``), the transformer with 2 layers of d_model 64 over 16 tokens."""
    from tests.helpers.modules import small_resnet, small_transformer

    module, inputs = (small_resnet if model == "resnet18" else small_transformer)(2)
    return module.eval(), inputs


# the zoo-size models (~5-12 CPU-s each) are slow; the fast suite runs the same classes at a reduced size
@pytest.mark.parametrize("model, size", [("resnet18", "small"), ("transformer", "small"),
                                         pytest.param("resnet18", "zoo", marks=pytest.mark.slow),
                                         pytest.param("transformer", "zoo", marks=pytest.mark.slow)])
def test_dynamic_batch_graphs_stay_dynamic(model, size):
    from mlcomp.frontend.loading import load_model

    module, inputs = (ZOO[model].build(), ZOO[model].example_inputs(2)) if size == "zoo" else _small(model)
    graph = load_model(module, example_inputs=inputs).capture(dynamic_batch=True)
    out, _ = run_pipeline(graph, "-O2", example_inputs=inputs, verify=True)
    assert out.input_nodes[0].tensor_meta.is_dynamic and out.output_node is not None
    five = (torch.randn(5, *inputs[0].shape[1:]),)          # another batch size than the capture's
    with torch.no_grad():
        result = compare(module(*five), Interpreter(out).run(*five))
    assert result.passed, result.format()
