"""mixed-precision on joint (training) graphs: fused backward kernels, dropout, the declared tolerance.

Two bugs this file pins (issue 10):

* a normalisation's parameters were cast to bf16 with its input; the CPU kernels then return
  bf16 statistics (mean, rstd) that the meta kernels, and so the IR, call fp32, and the fp32
  ``native_layer_norm_backward`` failed at run time ("expected scalar type Float but found
  BFloat16") on HF BERT and ViT.  Now the parameters stay fp32 (the mixed-type kernel eager
  autocast runs), the statistics are fp32 as the IR says, and the backward reads fp32 only::

      before: %1.weight_bf16 = _to_copy(%1.weight, bf16); native_layer_norm(%addmm, [4], %1.weight_bf16, …)
      after:  native_layer_norm(%addmm, [4], %1.weight, %1.bias, 1e-05) -> (bf16, f32, f32)

* the compiled step and the eager reference drew different dropout masks (0.47 relative on the
  zoo transformer, fp32 and bf16 alike); both sides now draw from the same seed.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mlcomp.frontend.joint import (
    capture_joint,
    example_target,
    loss_function,
    without_dropout,
)
from mlcomp.ir import TensorMeta, map_refs
from mlcomp.ir.interpreter import Interpreter
from mlcomp.ir.ops import INPUT, OUTPUT, PARAM, aten
from mlcomp.pipeline import run_pipeline
from mlcomp.targets.training import compile_training, verify_gradients
from tests.test_training import MODELS

BF16 = "mixed-precision{dtype=bf16}"


def runtime_dtype_mismatches(graph, *inputs) -> list[str]:
    """Nodes whose computed tensors have another dtype than their IR meta says (the root of the bug)."""
    env, bad = {}, []
    feed = dict(zip((n.name for n in graph.input_nodes), inputs))
    for node, fn in Interpreter(graph)._plan:
        if node.op == INPUT:
            env[node.name] = feed[node.name]
        elif node.op == PARAM:
            env[node.name] = graph.constants[node.name]
        elif node.op != OUTPUT:
            value = fn(*map_refs(node.inputs, lambda r: env[r.name]), **map_refs(dict(node.attrs),
                                                                                  lambda r: env[r.name]))
            env[node.name] = value
            metas = node.meta if isinstance(node.meta, tuple) else (node.meta,)
            values = value if isinstance(value, (tuple, list)) else (value,)
            bad += [f"{node.name}: {v.dtype} vs {m.dtype}" for v, m in zip(values, metas)
                    if isinstance(v, torch.Tensor) and isinstance(m, TensorMeta) and v.dtype != m.dtype]
    return bad


@pytest.fixture(scope="module")
def layer_norm_joint():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4), nn.Linear(4, 2))
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1])
    graph = capture_joint(model, (x,), y, name="ln")
    out, report = run_pipeline(graph, BF16, example_inputs=(x, y), instruments=[])
    return model, x, y, out, report.records[0].stats


LN_LINES = [   # the golden lines that matter (the whole text: /tmp golden run, checked in the assertions below)
    "  %native_layer_norm: (bf16[2, 4], f32[2, 1], f32[2, 1]) = aten.native_layer_norm.default(%addmm, [4], "
    "%1.weight, %1.bias, 1e-05)   # 1 {precision=bf16, precision_reason=policy, phase=forward}",
    "  %getitem_1: f32[2, 1] = graph.getitem(%native_layer_norm, 1)   # 1 {precision=fp32, precision_reason=policy, "
    "phase=backward}",
    "  %mm_f32: f32[2, 4] = aten._to_copy.default(%mm, dtype=f32)   # 2 {precision=fp32}",
    "  %addmm_f32: f32[2, 4] = aten._to_copy.default(%addmm, dtype=f32)   # 0 {precision=fp32}",
    "  %native_layer_norm_backward: (f32[2, 4], f32[4], f32[4]) = aten.native_layer_norm_backward.default(%mm_f32, "
    "%addmm_f32, [4], %getitem_1, %getitem_2, %1.weight, %1.bias, [True, True, True])   # 1 {precision=fp32, "
    "precision_reason=policy, phase=backward}",
    "  return (%loss, %grad:0.weight_f32, %grad:0.bias, %grad:1.weight, %grad:1.bias, %grad:2.weight_f32, "
    "%grad:2.bias)",
]


def test_layer_norm_keeps_fp32_parameters_and_statistics(layer_norm_joint):
    model, x, y, graph, stats = layer_norm_joint
    lines = graph.format().splitlines()
    for line in LN_LINES:
        assert line in lines, line
    casts = {n.inputs[0].name for n in graph.nodes(aten("_to_copy"))}
    assert not casts & {"1.weight", "1.bias"} and {"0.weight", "2.weight"} <= casts
    assert stats["weight_casts"] == 4               # both Linear layers' weight and bias, once each
    assert runtime_dtype_mismatches(graph, x, y) == []
    art = compile_training(graph, optimizer="sgd", state_keys=list(model.state_dict()))
    check = verify_gradients(art, model, loss_function("cross_entropy"), (x, y))
    assert check["passed"] and check["tolerance"] == stats["declared_tolerance"]


@pytest.fixture(scope="module")
def bf16_training():
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            model, inputs = MODELS[name]()
            model = without_dropout(model).train()
            y = example_target(model, inputs, "cross_entropy")
            graph = capture_joint(model, inputs, y, name=name)
            out, report = run_pipeline(graph, BF16, example_inputs=(*inputs, y), instruments=[])
            cache[name] = model, (*inputs, y), out, report.records[0].stats
        return cache[name]

    return get


# ResNet-18 at batch 4: eager autocast's gradients themselves differ from fp32's by 0.68 relative
# (stem.1.bias; BatchNorm batch statistics over few values, ReLU masks flipping on rounded values),
# ours from fp32's by 0.59 and from autocast's by 0.47 (layer4.0.conv1.weight): the forward-rounding
# tolerance (0.07) does not bound gradients through batch statistics, so this case is expected to fail
RESNET_GAP = "bf16 gradients through BatchNorm batch statistics: autocast itself is 0.68 from fp32"


@pytest.mark.parametrize("name", ["mlp", "lenet", "bert",            # BERT: failed at run time before
                                  *(pytest.param(n, marks=pytest.mark.slow) for n in ("gru", "transformer", "vit")),
                                  pytest.param("resnet18", marks=[pytest.mark.slow, pytest.mark.xfail(
                                      strict=True, reason=RESNET_GAP)])])
def test_bf16_training_within_declared_tolerance(bf16_training, name):
    """Every zoo model (small), HF BERT and ViT: the bf16 step runs and its gradients agree with eager
    autocast within the tolerance the pass declares (BERT and ViT failed at run time before)."""
    model, args, graph, stats = bf16_training(name)
    art = compile_training(graph, optimizer="sgd", state_keys=list(model.state_dict()))
    check = verify_gradients(art, model, loss_function("cross_entropy"), args)
    assert check["passed"] and check["tolerance"] == stats["declared_tolerance"]
    assert check["worst_rel"] < stats["declared_tolerance"], (check["worst"], check["worst_rel"])


def test_norm_backward_reads_one_precision(bf16_training):
    """Every kept fused normalisation backward kernel reads fp32 values only, and what runs has the dtypes
    the IR declares (BERT: five layer norms, attention, embeddings)."""
    _, args, graph, _ = bf16_training("bert")
    backward = [n for n in graph.call_nodes() if n.op.name == "native_layer_norm_backward"]
    assert len(backward) == 5
    for node in backward:
        dtypes = {graph.node(r).tensor_meta.dtype for r in node.input_names()}
        assert dtypes == {torch.float32}, node.name
    assert runtime_dtype_mismatches(graph, *args) == []


def test_dropout_masks_agree_between_compiled_and_eager():
    """A model with active dropout verifies exactly in fp32: both sides draw the same masks (the zoo
    transformer differed by 0.47 relative before), and the global generator is left as it was."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3)).train()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    y = torch.tensor([0, 1, 2, 0])
    art = compile_training(capture_joint(model, (x,), y), optimizer="sgd", state_keys=list(model.state_dict()))
    state = torch.get_rng_state()
    check = verify_gradients(art, model, loss_function("cross_entropy"), (x, y))
    assert check["worst_rel"] == 0.0 and check["loss_rel"] == 0.0
    assert torch.equal(torch.get_rng_state(), state)
