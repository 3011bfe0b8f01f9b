"""quantize's bias correction and smoothing: biases take the mean shift; activation spread moves into weights."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mlcomp.frontend.loading import load_model
from mlcomp.ir.interpreter import Interpreter
from mlcomp.ir.ops import aten
from mlcomp.passes.quantize.bias import MIN_ROWS
from mlcomp.pipeline import run_pipeline
from tests.helpers.captures import captured_once


def _mlp():
    """linear → relu → linear on inputs far from 0 (weight rounding then shifts the outputs' means)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8)).eval()


@pytest.fixture(scope="module")
def quantized():
    """The same float graph through quantize with and without bias correction, on a calibration batch and
    a held-back one."""
    model = _mlp()
    x, held = (torch.randn(256, 16, generator=torch.Generator().manual_seed(s)) + 3.0 for s in (1, 2))
    g = load_model(model, example_inputs=(x,)).capture()
    runs = {on: run_pipeline(g, f"quantize{{bias_correction={on} held_back=1}}", example_inputs=(x,),
                             calibration_data=[(x,), (held,)]) for on in ("true", "false")}
    return model, x, held, runs


def _shift(model, graph, x):
    """max over output channels of |mean over rows (int8 − fp32)|, relative to max |fp32|."""
    with torch.no_grad():
        ref, got = model(x), Interpreter(graph).run(x)[0]
    return float((got - ref).mean(0).abs().max() / ref.abs().max())


def test_the_graph_is_the_same_only_the_int32_biases_change(quantized):
    _, _, _, runs = quantized
    (on, _), (off, _) = runs["true"], runs["false"]
    assert on.format() == off.format()          # golden IR: the same nodes, constants and shapes
    changed = sorted(k for k in on.constants if not torch.equal(on.constants[k], off.constants[k]))
    assert changed == ["0.bias.int32", "2.bias.int32"], changed


def test_the_mean_shift_is_taken_out_on_calibration_and_held_back_data(quantized):
    model, x, held, runs = quantized
    (on, rep_on), (off, rep_off) = runs["true"], runs["false"]
    for data in (x, held):
        assert _shift(model, on, data) < 0.3 * _shift(model, off, data), (_shift(model, on, data),
                                                                          _shift(model, off, data))
    st_on, st_off = rep_on.stats("quantize"), rep_off.stats("quantize")
    assert st_on["biases_corrected"] == 2 and st_off["biases_corrected"] == 0
    assert st_on["held_back"]["mean_rel"] < st_off["held_back"]["mean_rel"]
    assert all(r["bias_shift"] > 0 for r in st_on["layers"])           # per-layer stats: the correction made


def test_one_interpreter_per_graph_corrects_over_every_sample_each_against_its_own_float_values(monkeypatch):
    """Three calibration samples run through one interpreter of each graph (float, int8); each sample's shift
    is measured against that sample's float values: the biases do not depend on the samples' order, and a
    sample given twice counts as once (the same numbers, to the bit)."""
    from mlcomp.passes.quantize import bias

    built = []

    class Counted(Interpreter):
        def __init__(self, *args, **kwargs):
            built.append(1)
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(bias, "Interpreter", Counted)
    model = _mlp()
    a, b, c = (torch.randn(32, 16, generator=torch.Generator().manual_seed(s)) + 3.0 for s in (1, 2, 3))
    g = load_model(model, example_inputs=(a,)).capture()

    def biases(*samples):
        out, report = run_pipeline(g, "quantize", example_inputs=(a,), calibration_data=[(x,) for x in samples])
        assert report.stats("quantize")["biases_corrected"] == 2
        return [out.constants[k] for k in ("0.bias.int32", "2.bias.int32")]

    built.clear()
    abc = biases(a, b, c)
    assert len(built) == 2
    for got, want in zip(biases(c, a, b), abc):
        assert (got - want).abs().max() <= 1                 # the mean's float rounding may move one int32 step
    for got, want in zip(biases(a, a), biases(a, a, a, a)):
        assert torch.equal(got, want)


def test_too_few_rows_keep_the_bias_with_the_reason():
    model = _mlp()
    x = torch.randn(2, 16, generator=torch.Generator().manual_seed(1)) + 3.0
    g = load_model(model, example_inputs=(x,)).capture()
    out, report = run_pipeline(g, "quantize", example_inputs=(x,))
    st = report.stats("quantize")
    assert st["biases_corrected"] == 0
    assert {r["bias_kept"] for r in st["layers"]} == {f"fewer than {MIN_ROWS} rows per channel to measure a shift on"}


def test_a_symbolic_channel_axis_keeps_the_bias_with_its_own_reason(quantized):
    """One shift per channel needs a fixed channel count: a layer whose output channels are symbolic keeps its
    bias, and says so (not "too few rows": it may have many)."""
    from mlcomp.ir import TensorMeta
    from mlcomp.passes.quantize.bias import correct_biases

    _, x, _, runs = quantized
    graph = runs["false"][0].copy()
    layer = graph.nodes(aten("addmm"))[0]
    before = {k: v.clone() for k, v in graph.constants.items()}
    graph.replace(layer.with_(meta=TensorMeta((layer.tensor_meta.shape[0], "channels"), layer.tensor_meta.dtype)))
    records = [{"node": layer.name}]
    assert correct_biases(graph, graph.copy(), [(x,)] * 4, {layer.name: -1}, records) == 0
    assert records[0]["bias_kept"] == "its channel axis has no fixed size to hold one shift per channel"
    assert all(torch.equal(graph.constants[k], v) for k, v in before.items())


# -- smoothing ----------------------------------------------------------------------------------------------

class Shared(nn.Module):
    """A layer norm read by two linears and, through a slice, by a residual add; then a linear on a GELU."""

    def __init__(self) -> None:
        super().__init__()
        self.norm, self.a, self.b, self.c = nn.LayerNorm(16), nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 8)
        with torch.no_grad():
            self.norm.weight.copy_(torch.linspace(0.1, 4.0, 16))      # channels of very different spread

    def forward(self, x):
        h = self.norm(x)
        return self.c(torch.nn.functional.gelu(self.a(h) + self.b(h))) + h[:, :8]


@captured_once
def _shared():
    torch.manual_seed(0)
    model = Shared().eval()
    x = torch.randn(64, 16, generator=torch.Generator().manual_seed(1))
    return model, x, load_model(model, example_inputs=(x,)).capture()


def test_smoothing_keeps_the_function_and_scales_the_shared_weights():
    from mlcomp.passes.quantize.selection import choose
    from mlcomp.passes.quantize.smooth import smooth
    _, x, g = _shared()
    before = g.copy()
    records = smooth(g, choose(g, ())[0], [(x,)], 0.95)
    assert [len(r["layers"]) for r in records] == [2, 1]          # the norm's two linears share one factor; c
    assert records[0]["factor_max"] > 5 * records[0]["factor_min"]
    muls = [n for n in g.call_nodes() if n.op == aten("mul.Tensor") and n.name.endswith("_s")]
    assert len(muls) == 2 and {u.op for u in g.users(muls[0].name)} == {aten("addmm")}
    with torch.no_grad():
        ref, got = Interpreter(before).run(x)[0], Interpreter(g).run(x)[0]
    assert float((got - ref).abs().max() / ref.abs().max()) < 1e-5   # the same function in float


def test_smoothing_is_openvinos_default_and_an_option_elsewhere():
    from mlcomp.pipeline.target_facts import TargetFacts
    _, x, g = _shared()
    runs = {(t, s): run_pipeline(g, "quantize" + s, example_inputs=(x,), target=TargetFacts(t))[1].stats("quantize")
            for t, s in (("openvino", "{smooth=0}"), ("onnxruntime", ""), ("openvino", ""),
                         ("onnxruntime", "{smooth=0.95}"))}
    assert [len(st["smoothed"]) for st in runs.values()] == [0, 0, 2, 2]
    assert runs["openvino", ""]["calibration"]["mean_rel"] < runs["openvino", "{smooth=0}"]["calibration"]["mean_rel"]
