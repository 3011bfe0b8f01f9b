"""quantize: int8 Q/DQ pairs, ONNX Runtime's numerics in the interpreter, the int8 kernels ORT picks, bad inputs."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mlcomp.base.errors import PassFailure, PipelineSpecError
from mlcomp.frontend.loading import load_model
from mlcomp.ir.builder import GraphBuilder
from mlcomp.ir.interpreter import Interpreter
from mlcomp.ir.ops import aten
from mlcomp.ir.quant import DEQUANTIZE, QUANTIZE
from mlcomp.passes.quantize.quantize import Quantize
from mlcomp.pipeline import run_pipeline
from mlcomp.pipeline.target_facts import TargetFacts
from tests.helpers.captures import conv_linear


small = conv_linear
"""conv → relu → flatten → linear, captured once per process, with its example input (copies)."""


def _stats(report):
    return next(p["stats"] for p in report.to_json()["passes"] if p["name"] == "quantize")


GOLDEN_AFTER = """\
  %input_q: u8[2, 3, 8, 8] = mlcomp.quantize_linear(%input, %input.scale, %input.zero, 1)   # 0
  %input_dq: f32[2, 3, 8, 8] = mlcomp.dequantize_linear(%input_q, %input.scale, %input.zero, 1)   # 0
  %0.weight_dq: f32[4, 3, 3, 3] = mlcomp.dequantize_linear(%0.weight.int8, %0.weight.scale, %0.weight.zero, 0)   # 0
  %0.bias_dq: f32[4] = mlcomp.dequantize_linear(%0.bias.int32, %0.bias.scale, %0.bias.zero, 0)
  %convolution: f32[2, 4, 6, 6] = aten.convolution.default(%input_dq, %0.weight_dq, %0.bias_dq, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)   # 0
  %relu: f32[2, 4, 6, 6] = aten.relu.default(%convolution)   # 1
  %relu_q: u8[2, 4, 6, 6] = mlcomp.quantize_linear(%relu, %relu.scale, %relu.zero, 1)   # 1
  %relu_dq: f32[2, 4, 6, 6] = mlcomp.dequantize_linear(%relu_q, %relu.scale, %relu.zero, 1)   # 1
  %view: f32[2, 144] = aten.view.default(%relu_dq, [2, 144])   # 2
  %3.weight_dq: f32[5, 144] = mlcomp.dequantize_linear(%3.weight.int8, %3.weight.scale, %3.weight.zero, 0)   # 3
  %permute: f32[144, 5] = aten.permute.default(%3.weight_dq, [1, 0])   # 3
  %view_q: u8[2, 144] = mlcomp.quantize_linear(%view, %view.scale, %view.zero, 1)   # 3
  %view_dq: f32[2, 144] = mlcomp.dequantize_linear(%view_q, %view.scale, %view.zero, 1)   # 3
  %3.bias_dq: f32[5] = mlcomp.dequantize_linear(%3.bias.int32, %3.bias.scale, %3.bias.zero, 0)
  %addmm: f32[2, 5] = aten.addmm.default(%3.bias_dq, %view_dq, %permute)   # 3
  return (%addmm,)
}"""


def test_golden_ir_conv_linear():
    _, x, g = small()
    assert "quantize_linear" not in g.format()
    out, report = run_pipeline(g, "quantize", example_inputs=(x,), verify=True)
    text = out.format()
    assert text.endswith(GOLDEN_AFTER), text
    # the float weights are gone: only int8/int32 constants and their scales remain
    assert "%0.weight: f32" not in text and "%0.weight.int8: i8[4, 3, 3, 3] = param" in text
    assert out.constants["3.bias.int32"].dtype == torch.int32


def test_stats_per_layer_and_agreement():
    _, x, g = small()
    _, report = run_pipeline(g, "quantize{granularity=per-channel}", example_inputs=(x,))
    st = _stats(report)
    assert st["quantized"] == 2 and [l["node"] for l in st["layers"]] == ["convolution", "addmm"]
    conv = st["layers"][0]
    assert conv["module"] == "0" and conv["weight"]["axis"] == 0
    assert 0 <= conv["inputs"][0]["zero_point"] <= 255 and conv["inputs"][0]["scale"] > 0
    assert 0 < conv["rel_error"] < st["declared_tolerance"]
    assert st["top1_agreement"] == 1.0 and st["output_rel_error"] < st["declared_tolerance"]
    assert "uint8" in st["tolerance_why"]


class _Shared(nn.Module):
    """One linear applied twice (as a recurrent cell unrolled over two steps): one weight, two matmuls."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = nn.Linear(8, 8)

    def forward(self, x):
        return self.cell(torch.relu(self.cell(x)))


def test_a_weight_shared_by_two_ops_is_folded_once():
    torch.manual_seed(0)
    model, x = _Shared().eval(), torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    g = load_model(model, example_inputs=(x,)).capture()
    out, report = run_pipeline(g, "quantize", example_inputs=(x,), verify=True)
    st = _stats(report)
    assert st["quantized"] == 2 and {l["weight"]["param"] for l in st["layers"]} == {"cell.weight"}
    assert out.format().count("= param") and "%cell.weight: f32" not in out.format()
    assert sum(1 for n in out.call_nodes() if n.op == DEQUANTIZE and "cell.weight" in n.name) == 1
    with torch.no_grad():
        ref, got = model(x), Interpreter(out).run(x)[0]
    assert float((ref - got).abs().max() / ref.abs().max()) < st["declared_tolerance"]


def test_per_tensor_and_percentile():
    _, x, g = small()
    out, report = run_pipeline(g, "quantize{granularity=per-tensor method=percentile}", example_inputs=(x,),
                               verify=True)
    st = _stats(report)
    assert st["layers"][0]["weight"]["axis"] is None
    assert out.constants["0.weight.scale"].shape == ()
    assert st["layers"][0]["weight"]["scale_min"] == st["layers"][0]["weight"]["scale_max"]


def test_ort_numerics_round_half_even_and_saturate():
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper, numpy_helper
    x = torch.tensor([[0.25, 0.75, 1.25, -0.25, -0.75, 400.0, -400.0, 0.3]])
    scale, zero = torch.tensor(0.5), torch.tensor(3, dtype=torch.uint8)
    ours = QUANTIZE.resolve()(x, scale, zero, 1)
    back = DEQUANTIZE.resolve()(ours, scale, zero, 1)
    graph = helper.make_graph(
        [helper.make_node("QuantizeLinear", ["x", "s", "z"], ["q"]),
         helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 8])],
        [helper.make_tensor_value_info("q", TensorProto.UINT8, [1, 8]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 8])],
        initializer=[numpy_helper.from_array(scale.numpy(), "s"), numpy_helper.from_array(zero.numpy(), "z")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)], ir_version=10)
    q, y = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x.numpy()})
    assert ours.tolist() == q.tolist() == [[3, 5, 5, 3, 1, 255, 0, 4]]
    assert torch.equal(back, torch.from_numpy(y))


@pytest.mark.ort
def test_onnxruntime_runs_int8_kernels(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    import onnx
    from mlcomp.targets.onnx.emit import emit_model
    _, x, g = small()
    out, _ = run_pipeline(g, "quantize", example_inputs=(x,))
    emitted = emit_model(out)
    assert emitted.declined is None
    types = [n.op_type for n in emitted.model.graph.node]
    assert "QuantizeLinear" in types and "DequantizeLinear" in types
    per_axis = [n for n in emitted.model.graph.node if n.op_type == "DequantizeLinear"
                and any(a.name == "axis" for a in n.attribute)]
    assert per_axis, "per-channel weights carry an axis"
    opts = ort.SessionOptions()
    opts.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    sess = ort.InferenceSession(emitted.model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
    ran = {n.op_type for n in onnx.load(str(tmp_path / "optimized.onnx")).graph.node}
    assert "QLinearConv" in ran and ran & {"QGemm", "QLinearMatMul", "MatMulIntegerToFloat"}, ran
    assert "Conv" not in ran
    got = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])
    # the interpreter computes what ORT's kernels do; the last linear writes float (its integer sum scaled
    # once), the interpreter sums dequantized floats: equal to float rounding
    torch.testing.assert_close(got, Interpreter(out).run(x)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.ort
def test_compile_onnxruntime_end_to_end():
    import mlcomp
    model, x, _ = small()
    art = mlcomp.compile(model, (x,), target="onnxruntime", pipeline="quantize")
    ver = art.manifest["verification"]
    assert ver["passed"] and ver["max_rel"] <= art.manifest["declared_tolerance"]
    assert art.manifest["declared_tolerance"] > 1e-2           # int8's looser tolerance, not fp32's


@pytest.mark.slow
def test_zoo_resnet18_small_input(zoo):
    model = zoo["resnet18"].build()
    xs = [torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    g = load_model(model, example_inputs=(xs[0],)).capture()
    out, report = run_pipeline(g, "fold-batchnorm,quantize{calibration=2}", example_inputs=(xs[0],),
                               calibration_data=[(t,) for t in xs[:2]], verify=True)
    st = _stats(report)
    assert st["quantized"] >= 20 and st["calibration_samples"] == 2
    assert st["top1_agreement"] == 1.0
    held_out = [torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(s)) for s in range(2, 8)]
    held = torch.cat([Interpreter(out).run(x)[0] for x in held_out])
    with torch.no_grad():
        ref = torch.cat([model(x) for x in held_out])
    error = (held - ref).abs().amax(-1)
    assert float(error.max() / ref.abs().max()) < st["declared_tolerance"]
    # the class is the reference's wherever its lead over the runner-up exceeds twice the error (random weights leave
    # near ties: with 7-bit weights, on a CPU without VNNI, seed 2's lead is 0.0016 and its error 0.004)
    top2 = ref.topk(2, dim=-1).values
    decided = (top2[:, 0] - top2[:, 1]) > 2 * error
    assert decided.any() and held.argmax(-1)[decided].tolist() == ref.argmax(-1)[decided].tolist()


def test_no_quantizable_op_is_refused():
    b = GraphBuilder("act")
    g = b.output(b.call(aten("relu"), b.input("x", (2, 3))))
    with pytest.raises(PassFailure, match="no op it computes in int8") as err:
        run_pipeline(g, "quantize")
    assert "aten.convolution.default" in str(err.value) and "drop quantize" in str(err.value)
    assert "report the model" not in str(err.value)          # the model is not at fault, nor mlcomp
    assert "scaled_dot_product_attention" not in str(err.value)
    with pytest.raises(PassFailure) as on_openvino:           # a target's own rows are named on that target
        run_pipeline(g, "quantize", target=TargetFacts("openvino"))
    assert "aten.scaled_dot_product_attention.default" in str(on_openvino.value)


@pytest.mark.parametrize("spec, words", [
    ("quantize{calibration=0}", "calibration"),
    ("quantize{granularity=per-row}", "per-channel"),
    ("quantize{method=kl}", "minmax"),
    ("quantize{held_back=-1}", "held_back"),
    ("quantize{agreement=1.5}", "agreement"),
])
def test_bad_options_are_refused(spec, words):
    _, x, g = small()
    with pytest.raises(PipelineSpecError, match=words):
        run_pipeline(g, spec, example_inputs=(x,))


@pytest.mark.parametrize("target", ["cpu", "tvm"])
def test_targets_without_int8_lowering_refuse(target):
    with pytest.raises(PipelineSpecError, match="only the onnxruntime and openvino targets lower") as err:
        Quantize().check_target(target)
    assert f"target {target}" in str(err.value) and "--target onnxruntime" in str(err.value)
    Quantize().check_target("openvino")              # lowers them: no refusal


@pytest.mark.slow
@pytest.mark.ort
def test_third_party_bert_on_onnxruntime():
    pytest.importorskip("transformers")
    import mlcomp
    from mlcomp.models.third_party import build_third_party
    model, inputs = build_third_party("bert", batch=2)
    art = mlcomp.compile(model, inputs, target="onnxruntime", pipeline="fold-constants,quantize")
    ver = art.manifest["verification"]
    assert ver["passed"] and 0 < ver["max_rel"] <= art.manifest["declared_tolerance"]
    # without fold-constants too: the emitter writes BERT's arange (position ids) itself, pairs and all
    bare = mlcomp.compile(model, inputs, target="onnxruntime", pipeline="quantize")
    assert bare.manifest["verification"]["passed"]
    assert dict(bare.runtime.int8.int8) == dict(art.runtime.int8.int8) and not bare.runtime.int8.floating


def test_compile_for_cpu_is_refused_before_capture():
    import mlcomp
    model, x, _ = small()
    with pytest.raises(PipelineSpecError, match="target cpu would run them as float arithmetic"):
        mlcomp.compile(model, (x,), target="cpu", pipeline="quantize")


class _Masked(nn.Module):
    """Attention scores plus a padding mask, softmax, the weighted sum, a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.out = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        scores = self.q(x) @ x.transpose(-1, -2)
        return self.out(torch.softmax(scores + mask, dim=-1) @ x)


@pytest.mark.parametrize("fill", [torch.finfo(torch.float32).min, -1e4])
def test_a_padding_mask_add_keeps_float_and_the_scores_survive(fill):
    from mlcomp.frontend.loading import load_model
    from mlcomp.passes.quantize.selection import SPAN_RATIO

    torch.manual_seed(0)
    model = _Masked().eval()
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(3))
    mask = torch.zeros(2, 1, 6)
    mask[:, :, 4:] = fill                                    # the last two tokens are padding
    g = load_model(model, example_inputs=(x, mask)).capture()
    out, report = run_pipeline(g, "quantize", example_inputs=(x, mask))
    kept = _stats(report)["kept_float"]
    masked = [n for n, why in kept.items() if "spans differ" in why]
    assert len(masked) == 1 and f"fewer than {256 / SPAN_RATIO:.0f} steps" in kept[masked[0]]
    assert masked[0] not in [l["node"] for l in _stats(report)["layers"]]
    ref, got = model(x, mask), Interpreter(out).run(x, mask)[0]
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 0.05
