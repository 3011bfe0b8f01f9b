"""The ``loss-scale`` pass: the seed rewrite on joint graphs, its numbers against eager, its stats, its refusals."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mlcomp.base.errors import LossScaleError, PassFailure, PipelineMismatchError
from mlcomp.frontend.joint import GRAD, output_names
from mlcomp.ir.builder import GraphBuilder
from mlcomp.ir.interpreter import evaluate
from mlcomp.ir.ops import aten
from mlcomp.passes.precision.loss_scale import LOSS_SCALE_INPUT, LossScale, find_backward_seed, is_loss_scaled
from mlcomp.pipeline import REGISTRY, PassContext, run_pipeline
from mlcomp.training.step import compile_training


def test_registered_for_training_graphs_only():
    info = REGISTRY.get("loss-scale")
    assert info.cls is LossScale and [o.name for o in info.options] == ["loss"]
    assert {m.value for m in LossScale.modes} == {"training"}
    assert REGISTRY.get("loss-scale").make({"loss": "loss"}) == LossScale(loss="loss")


def test_ir_before_after(mlp_joint):
    _, _, _, graph = mlp_joint
    seed = find_backward_seed(graph, "loss")
    readers = [u.name for u in graph.users(seed.name)]
    scaled, report = run_pipeline(graph, "loss-scale")
    assert [n.name for n in scaled.input_nodes] == ["args_0", "target", LOSS_SCALE_INPUT]
    lines = [ln.strip() for ln in scaled.format().splitlines()]
    assert lines[0] == "graph Sequential(%args_0: f32[2, 4], %target: i64[2], %loss_scale: f32[]) {"
    assert "%loss_scale" not in graph.format() and not is_loss_scaled(graph)     # the input graph is untouched
    assert "%scaled_seed: f32[] = aten.mul.Tensor(%full_like, %loss_scale)   # {phase=backward}" in lines
    assert [u.name for u in scaled.users("scaled_seed")] == readers            # every reader now reads the product
    assert [u.name for u in scaled.users(seed.name)] == ["scaled_seed"]
    assert len(scaled) == len(graph) + 2 and is_loss_scaled(scaled)
    scaled.verify()
    assert report.records[0].stats == {"seed": seed.name, "input": LOSS_SCALE_INPUT, "scaled_seed": "scaled_seed",
                                       "readers_rewired": len(readers)}


def test_scaled_gradients_over_scale_equal_eager(mlp_joint):
    model, x, y, graph = mlp_joint
    scaled, _ = run_pipeline(graph, "loss-scale")
    scale = 1024.0
    outs = evaluate(scaled, x, y, torch.tensor(scale))
    names = output_names(scaled)
    got = {n[len(GRAD):]: outs[i] / scale for i, n in enumerate(names) if n.startswith(GRAD)}
    model.zero_grad()
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    torch.testing.assert_close(outs[0], loss.detach())                      # the loss itself is not scaled
    assert set(got) == {k for k, _ in model.named_parameters()}
    for name, p in model.named_parameters():
        torch.testing.assert_close(got[name], p.grad, rtol=1e-6, atol=1e-7)
        assert not torch.allclose(outs[names.index(GRAD + name)], p.grad)   # the raw outputs are scaled


def test_inference_graph_is_refused_before_running():
    b = GraphBuilder("infer")
    graph = b.output(b.call(aten("relu"), b.input("x", (2, 3))))
    with pytest.raises(PipelineMismatchError) as info:
        run_pipeline(graph, "loss-scale")
    assert "pass 'loss-scale' (pass 1 of 1) runs on training graphs only, and graph infer is a inference graph" \
        in str(info.value)
    with pytest.raises(LossScaleError, match="no backward seed"):              # run directly: its own message
        LossScale().run(graph.copy(), PassContext())


def test_twice_and_unknown_loss_are_refused(mlp_joint):
    _, _, _, graph = mlp_joint
    with pytest.raises(PassFailure, match="already has a node named %loss_scale"):
        run_pipeline(graph, "loss-scale,loss-scale")
    with pytest.raises(PassFailure, match=r"no backward seed \(full_like\(%nope, 1\)\)"):
        run_pipeline(graph, "loss-scale{loss=nope}")


def test_pipeline_pass_and_training_compile_agree(mlp_joint):
    _, x, y, graph = mlp_joint
    by_pipeline, _ = run_pipeline(graph, "loss-scale")
    art = compile_training(by_pipeline, optimizer="sgd{lr=0.1}")          # not scaled a second time
    assert art.loss_scaler is not None and art.loss_scaler.spec.mode.value == "dynamic"
    assert [n.name for n in art.graph.input_nodes].count(LOSS_SCALE_INPUT) == 1
    plain = compile_training(graph, optimizer="sgd{lr=0.1}", loss_scale="none")
    _, g_scaled = art.gradients(x, y)
    _, g_plain = plain.gradients(x, y)
    for name, g in g_plain.items():
        torch.testing.assert_close(g_scaled[name], g, rtol=1e-6, atol=0)
    with pytest.raises(LossScaleError, match="loss-scaled by the pipeline's loss-scale pass"):
        compile_training(by_pipeline, loss_scale="none")
