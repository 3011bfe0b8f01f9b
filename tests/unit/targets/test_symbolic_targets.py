"""Symbolic sizes on each target: one artifact for every size in range, numbers equal to eager."""
from __future__ import annotations

import re

import onnx
import pytest
import torch

import mlcomp
from mlcomp.frontend.loading import load_model
from mlcomp.targets.onnx.emit import emit_model
from tests.helpers.modules import Tokens


SIZES = ((1, 1), (3, 7), (6, 16))


def _like_eager_at_every_size(art, model) -> None:
    """The one artifact's outputs equal eager's at each (batch, seq) of :data:`SIZES`."""
    with torch.no_grad():
        for batch, seq in SIZES:
            x = torch.randn(batch, seq, 8)
            torch.testing.assert_close(art(x), model(x), rtol=1e-5, atol=1e-6)


def _dims(value_info):
    return [d.dim_param or d.dim_value for d in value_info.type.tensor_type.shape.dim]


@pytest.mark.ort
def test_onnx_emitter_writes_dim_params_and_computes_the_reshape_sizes():
    graph = load_model(Tokens().eval(), example_inputs=(torch.randn(2, 5, 8),)).capture(dynamic="batch,seq=1..16")
    emitted = emit_model(graph)
    assert emitted.declined is None
    model = emitted.model
    assert _dims(model.graph.input[0]) == ["batch", "seq", 8] and _dims(model.graph.output[0]) == ["batch", "seq", 8]
    ops = [n.op_type for n in model.graph.node]
    assert "Shape" in ops and "Mul" in ops and "Concat" in ops      # batch*seq computed, not a constant
    reshape_targets = {n.input[1] for n in model.graph.node if n.op_type == "Reshape"}
    assert not reshape_targets & {i.name for i in model.graph.initializer}
    onnx.checker.check_model(model)


@pytest.mark.ort
def test_one_onnxruntime_artifact_serves_three_sizes_like_eager():
    model = Tokens().eval()
    art = mlcomp.compile(model, torch.randn(2, 5, 8), target="onnxruntime", dynamic="batch=1..8,seq=1..16")
    assert art.runtime.stats["onnx_export"] == "mlcomp"      # mlcomp's emitter, no torch.onnx fallback
    assert [i.shape for i in art.inputs] == [("batch", "seq", 8)]
    session = art.runtime.session
    before = id(session)
    _like_eager_at_every_size(art, model)
    assert id(art.runtime.session) == before
    assert [s["sizes"] for s in art.verification["shapes"][1:]] == [
        {"batch": 1, "seq": 1}, {"batch": 4, "seq": 8}, {"batch": 8, "seq": 16}]


def test_cpu_target_serves_three_sizes_like_eager():
    model = Tokens().eval()
    art = mlcomp.compile(model, torch.randn(2, 5, 8), target="cpu", dynamic="batch,seq", pipeline="-O2")
    _like_eager_at_every_size(art, model)


@pytest.mark.openvino
def test_openvino_model_has_dynamic_dimensions_of_the_ranges_and_serves_three_sizes():
    model = Tokens().eval()
    art = mlcomp.compile(model, torch.randn(2, 5, 8), target="openvino", dynamic="batch=1..8,seq=1..16")
    (port,) = art.runtime.model.inputs
    batch, seq, width = port.get_partial_shape()
    assert (batch.min_length, batch.max_length, seq.min_length, seq.max_length) == (1, 8, 1, 16)
    assert width.is_static and width.get_length() == 8
    _like_eager_at_every_size(art, model)


@pytest.mark.tvm
def test_tvm_relax_signature_has_symbolic_vars_and_one_build_serves_three_sizes():
    from mlcomp.frontend.dynamic import graph_dims
    from mlcomp.runtime.codegen import to_fx
    from mlcomp.targets.tvm.lowering import to_relax

    model = Tokens().eval()
    graph = load_model(model, example_inputs=(torch.randn(2, 5, 8),)).capture(dynamic="batch=1..8,seq=1..16")
    relax_mod, _ = to_relax(to_fx(graph).eval(), (torch.randn(2, 5, 8),), graph_dims(graph))
    script = relax_mod["main"].script()
    batch, seq = re.search(r"def main\(x: R.Tensor\(\((\w+), (\w+), 8\)", script).groups()   # two tir vars
    bounds = {key: dict(re.findall(r'"(\w+)": (\d+)', text)) for key, text in
              re.findall(r'"tir_var_(lower|upper)_bound": \{([^}]*)\}', script)}
    assert bounds == {"lower": {batch: "1", seq: "1"}, "upper": {batch: "8", seq: "16"}}     # the ranges
    art = mlcomp.compile(model, torch.randn(2, 5, 8), target="tvm", dynamic="batch=1..8,seq=1..16")
    _like_eager_at_every_size(art, model)


@pytest.mark.tvm
def test_tvm_tuning_symbolic_sizes_is_refused_before_the_build():
    from mlcomp.base.errors import MlcompError

    with pytest.raises(MlcompError) as info:
        mlcomp.compile(Tokens().eval(), torch.randn(2, 5, 8), target="tvm", dynamic="batch", tune_trials=2)
    assert "its sizes batch are symbolic and MetaSchedule tunes each task for fixed sizes" in str(info.value)
