"""quantize's options: exclude, method, calibration data (file, iterable), held-back metric, declared targets,
fused graphs (-O2,quantize), and the bad calibration inputs."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mlcomp.base.errors import InputSpecError, VerificationError
from mlcomp.frontend.loading import load_model
from mlcomp.ir.composites import is_fused
from mlcomp.ir.interpreter import Interpreter
from mlcomp.ir.ops import aten
from mlcomp.ir.quant import DEQUANTIZE, QUANTIZE
from mlcomp.pipeline import run_pipeline
from tests.helpers.captures import captured_once, conv_linear


def _gen(seed):
    return torch.Generator().manual_seed(seed)


small = conv_linear
"""conv → relu → flatten → linear, captured once per process, with its example input (copies)."""


class Block(nn.Module):
    """A residual block: conv → BN → relu → conv → BN, plus the input, → relu."""

    def __init__(self, c: int = 4) -> None:
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)
        self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1), nn.BatchNorm2d(c)

    def forward(self, x):
        y = self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x)))))
        return torch.relu(y + x)


@captured_once
def block():
    torch.manual_seed(0)
    model = Block().eval()
    x = torch.randn(2, 4, 6, 6, generator=_gen(3))
    return model, x, load_model(model, example_inputs=(x,)).capture()


def _stats(report):
    return report.stats("quantize")


def _quantized_ops(graph):
    """The ops that read a dequantized activation (what the int8 runtime fuses into its kernels)."""
    dq = {n.name for n in graph.call_nodes() if n.op == DEQUANTIZE}
    return sorted({str(n.op) for n in graph.call_nodes() if n.op not in (QUANTIZE, DEQUANTIZE)
                   and any(r in dq for r in n.input_names())})


# -- exclude ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pattern", ["3", "addmm", "aten.addmm", "aten.addmm.default"])
def test_exclude_by_module_node_or_op_keeps_the_linear_float(pattern):
    _, x, g = small()
    out, report = run_pipeline(g, f"quantize{{exclude=[{pattern}]}}", example_inputs=(x,), verify=True)
    st = _stats(report)
    assert [r["node"] for r in st["layers"]] == ["convolution"]
    assert st["kept_float"] == {"addmm": f"excluded by {pattern}"}
    text = out.format()
    assert "%3.weight: f32[5, 144] = param" in text and "3.weight.int8" not in text   # float weight kept
    assert "aten.addmm.default(%3.bias, %view, %permute)" in text                   # reads the float view
    assert "%relu_q" in text                                                       # the conv stays int8


def test_exclude_matching_nothing_warns():
    _, x, g = small()
    with pytest.warns(UserWarning, match="exclude pattern 'layer9' matched no node"):
        _, report = run_pipeline(g, "quantize{exclude=[layer9]}", example_inputs=(x,))
    assert _stats(report)["quantized"] == 2


def test_excluding_everything_is_refused_with_the_reasons():
    from mlcomp.base.errors import PassFailure
    _, x, g = small()
    with pytest.raises(PassFailure, match="kept float: %convolution: excluded by 0; %addmm: excluded by 3"):
        run_pipeline(g, "quantize{exclude=[0,3]}", example_inputs=(x,))


# -- residual add, softmax ---------------------------------------------------------------------------------

def test_residual_add_takes_int8_inputs_and_its_relu_is_dropped():
    _, x, g = block()
    out, report = run_pipeline(g, "fold-batchnorm,quantize", example_inputs=(x,), verify=True)
    st = _stats(report)
    assert [r["op"] for r in st["layers"]] == ["aten.convolution.default"] * 2 + ["aten.add.Tensor"]
    add = st["layers"][2]
    assert len(add["inputs"]) == 2 and add["inputs"][1]["value"] == "x"          # the skip connection
    assert add["output"]["value"] == "relu_1" and add["output"]["zero_point"] == 0   # after the ReLU
    assert _quantized_ops(out) == ["aten.add.Tensor", "aten.convolution.default"]


def test_add_read_only_by_layer_norm_keeps_float():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8)).eval()

    class Res(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc, self.norm = nn.Linear(8, 8), nn.LayerNorm(8)

        def forward(self, x):
            return self.norm(x + self.fc(x))
    model = Res().eval()
    x = torch.randn(4, 8, generator=_gen(5))
    g = load_model(model, example_inputs=(x,)).capture()
    _, report = run_pipeline(g, "quantize", example_inputs=(x,))
    st = _stats(report)
    assert [r["op"] for r in st["layers"]] == ["aten.addmm.default"]
    assert "read only by a layer norm" in next(iter(st["kept_float"].values()))


def _attention():
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 6, 16, generator=_gen(7))
    return model, x


def test_softmax_is_quantized_and_its_guard_dropped():
    model, x = _attention()
    g = load_model(model, example_inputs=(x,)).capture()
    assert any(n.op == aten("where.self") for n in g.call_nodes())           # the safe softmax's guard
    out, report = run_pipeline(g, "fold-constants,quantize", example_inputs=(x,), verify=True)
    ops = {str(n.op) for n in out.call_nodes()}
    assert "aten.where.self" not in ops and "aten.eq.Scalar" not in ops
    assert "aten._softmax.default" in _quantized_ops(out) and "aten.bmm.default" in _quantized_ops(out)
    soft = next(r for r in _stats(report)["layers"] if r["op"] == "aten._softmax.default")
    assert soft["output"]["scale"] == pytest.approx(1 / 255) and soft["output"]["zero_point"] == 0


# -- methods -----------------------------------------------------------------------------------------------

def _input_scale(method, x, g):
    _, report = run_pipeline(g, f"quantize{{method={method}}}", example_inputs=(x,))
    return _stats(report)["layers"][0]["inputs"][0]["scale"]


def test_entropy_clips_an_outlier_minmax_keeps():
    _, x, g = small()
    x = torch.randn(2, 3, 8, 8, generator=_gen(4))
    x[0, 0, 0, 0] = 60.0                                    # one far outlier (1 of 384: above the 99.99% quantile)
    minmax, pct, ent = (_input_scale(m, x, g) for m in ("minmax", "percentile", "entropy"))
    assert minmax > 0.2 and ent < minmax / 4, (minmax, ent)
    assert pct < minmax


def test_percentile_ignores_rare_outliers():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 4)).eval()
    x = torch.randn(512, 64, generator=_gen(6))
    x[0, :2] = 80.0                                         # 2 of 32768 elements: below the 0.01% tail
    g = load_model(model, example_inputs=(x,)).capture()
    minmax, pct = (_input_scale(m, x, g) for m in ("minmax", "percentile"))
    assert minmax > 0.3 and pct < minmax / 4, (minmax, pct)


# -- calibration data --------------------------------------------------------------------------------------

def test_calibration_file_list_and_stack(tmp_path):
    _, x, g = small()
    batches = [torch.randn(2, 3, 8, 8, generator=_gen(10 + i)) for i in range(3)]
    torch.save(batches, tmp_path / "cal.pt")
    torch.save(torch.stack(batches), tmp_path / "stack.pt")
    for name in ("cal.pt", "stack.pt"):
        _, report = run_pipeline(g, f"quantize{{calibration=\"{tmp_path / name}\"}}", example_inputs=(x,))
        assert _stats(report)["calibration_samples"] == 3
    one = tmp_path / "one.pt"
    torch.save(batches[0], one)                               # one batch, shaped like the input
    _, report = run_pipeline(g, f"quantize{{calibration=\"{one}\"}}", example_inputs=(x,))
    assert _stats(report)["calibration_samples"] == 1


def test_calibration_iterable_and_held_back_metric():
    model, x, g = small()
    batches = (torch.randn(2, 3, 8, 8, generator=_gen(20 + i)) for i in range(5))     # a generator
    _, report = run_pipeline(g, "quantize{held_back=2}", example_inputs=(x,), calibration_data=batches)
    st = _stats(report)
    assert st["calibration_samples"] == 3 and st["held_back_samples"] == 2
    held = st["held_back"]
    assert held["samples"] == 2 and 0 < held["mean_rel"] <= held["max_rel"] < 0.2
    assert held["top1"] is not None and st["calibration"]["samples"] == 3
    assert st["calibration"]["max_rel"] < st["declared_tolerance"]


@pytest.mark.parametrize("given, words", [
    ([torch.zeros(2, 3, 9, 9)], r"batch 0 of calibration_data=, input 0, is float32\[2, 3, 9, 9\] and the model "
                                r"was captured with float32\[2, 3, 8, 8\]"),
    ([torch.zeros(2, 3, 8, 8, dtype=torch.int64)], r"is int64\[2, 3, 8, 8\]"),
    ([], "holds 0 batches"),
    ([(torch.zeros(2, 3, 8, 8), torch.zeros(2))], "has 2 tensors and the model takes 1 inputs"),
    (["x"], "batch 0 of calibration_data= is a str"),
])
def test_bad_calibration_data_is_refused(given, words):
    _, x, g = small()
    with pytest.raises(InputSpecError, match=words) as err:
        run_pipeline(g, "quantize", example_inputs=(x,), calibration_data=given)
    assert "bug in mlcomp" not in str(err.value) and err.value.exit_code == 2


def test_bad_calibration_file_is_refused(tmp_path):
    _, x, g = small()
    with pytest.raises(InputSpecError, match="does not exist"):
        run_pipeline(g, f"quantize{{calibration=\"{tmp_path / 'none.pt'}\"}}", example_inputs=(x,))
    (tmp_path / "bad.pt").write_text("not a tensor file")
    with pytest.raises(InputSpecError, match="cannot be read as tensors"):
        run_pipeline(g, f"quantize{{calibration=\"{tmp_path / 'bad.pt'}\"}}", example_inputs=(x,))
    torch.save({"x": torch.zeros(2, 3, 8, 8)}, tmp_path / "dict.pt")
    with pytest.raises(InputSpecError, match="is a dict; it needs batches in order"):
        run_pipeline(g, f"quantize{{calibration=\"{tmp_path / 'dict.pt'}\"}}", example_inputs=(x,))
    torch.save([torch.zeros(1, 3, 8, 8)], tmp_path / "wrong.pt")
    with pytest.raises(InputSpecError, match=r"batch 0 of calibration=.*wrong.pt, input 0, is float32\[1, 3, 8, 8\]"):
        run_pipeline(g, f"quantize{{calibration=\"{tmp_path / 'wrong.pt'}\"}}", example_inputs=(x,))


# -- accuracy: sensitivity, explain, declared targets ------------------------------------------------------

def test_sensitivity_explain_and_suggestion():
    _, x, g = block()
    _, report = run_pipeline(g, "fold-batchnorm,quantize", example_inputs=(x,))
    st = _stats(report)
    added = [r["added"] for r in st["sensitivity"]]
    assert added == sorted(added, reverse=True) and len(added) == 3 and added[0] > 0
    assert all(r["rel_error"] >= r["added"] for r in st["sensitivity"])
    assert st["suggest_exclude"] and st["suggest_exclude"][0] in {"conv1", "conv2", ""} | {r["node"] for r in
                                                                                        st["layers"]}
    text = report.format(nested=True)
    assert "calibration set (1 sample): max rel error" in text and "loses" in text
    assert "quantize{exclude=[" in text
    assert "loses" not in report.format(nested=False)               # only under --explain


def test_declared_tolerance_missed_is_refused_with_numbers():
    _, x, g = block()
    with pytest.raises(VerificationError) as err:
        run_pipeline(g, "fold-batchnorm,quantize{tolerance=1e-6}", example_inputs=(x,))
    text = str(err.value)
    assert "max relative error" in text and "exceeds tolerance=1e-06" in text
    assert "The layers that lose most:" in text and "quantize{exclude=[" in text
    _, report = run_pipeline(g, "fold-batchnorm,quantize{tolerance=0.5 agreement=0.5}", example_inputs=(x,))
    assert _stats(report)["quantized"] == 3


GOLDEN_BLOCK = """\
  %x_q: u8[2, 4, 6, 6] = mlcomp.quantize_linear(%x, %x.scale, %x.zero, 1)   # conv1
  %x_dq: f32[2, 4, 6, 6] = mlcomp.dequantize_linear(%x_q, %x.scale, %x.zero, 1)   # conv1
  %conv1.weight_bnfold_dq: f32[4, 4, 3, 3] = mlcomp.dequantize_linear(%conv1.weight_bnfold.int8, %conv1.weight_bnfold.scale, %conv1.weight_bnfold.zero, 0)   # conv1
  %conv1.bias_bnfold_dq: f32[4] = mlcomp.dequantize_linear(%conv1.bias_bnfold.int32, %conv1.bias_bnfold.scale, %conv1.bias_bnfold.zero, 0)
  %convolution: f32[2, 4, 6, 6] = aten.convolution.default(%x_dq, %conv1.weight_bnfold_dq, %conv1.bias_bnfold_dq, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)   # conv1
  %relu: f32[2, 4, 6, 6] = aten.relu.default(%convolution)   # conv1
  %relu_q: u8[2, 4, 6, 6] = mlcomp.quantize_linear(%relu, %relu.scale, %relu.zero, 1)   # conv1
  %relu_dq: f32[2, 4, 6, 6] = mlcomp.dequantize_linear(%relu_q, %relu.scale, %relu.zero, 1)   # conv1
  %conv2.weight_bnfold_dq: f32[4, 4, 3, 3] = mlcomp.dequantize_linear(%conv2.weight_bnfold.int8, %conv2.weight_bnfold.scale, %conv2.weight_bnfold.zero, 0)   # conv2
  %conv2.bias_bnfold_dq: f32[4] = mlcomp.dequantize_linear(%conv2.bias_bnfold.int32, %conv2.bias_bnfold.scale, %conv2.bias_bnfold.zero, 0)
  %convolution_1: f32[2, 4, 6, 6] = aten.convolution.default(%relu_dq, %conv2.weight_bnfold_dq, %conv2.bias_bnfold_dq, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)   # conv2
  %convolution_1_q: u8[2, 4, 6, 6] = mlcomp.quantize_linear(%convolution_1, %convolution_1.scale, %convolution_1.zero, 1)   # conv2
  %convolution_1_dq: f32[2, 4, 6, 6] = mlcomp.dequantize_linear(%convolution_1_q, %convolution_1.scale, %convolution_1.zero, 1)   # conv2
  %add: f32[2, 4, 6, 6] = aten.add.Tensor(%convolution_1_dq, %x_dq)   # conv2
  %relu_1: f32[2, 4, 6, 6] = aten.relu.default(%add)   # conv2
  %relu_1_q: u8[2, 4, 6, 6] = mlcomp.quantize_linear(%relu_1, %relu_1.scale, %relu_1.zero, 1)   # conv2
  %relu_1_dq: f32[2, 4, 6, 6] = mlcomp.dequantize_linear(%relu_1_q, %relu_1.scale, %relu_1.zero, 1)   # conv2
  return (%relu_1_dq,)
}
"""


def test_golden_ir_residual_block_after_o2_quantize():
    """-O2's fused groups put back; the add reads both dequantized operands; the pair after the block's ReLU."""
    _, x, g = block()
    out, _ = run_pipeline(g, "-O2,quantize", example_inputs=(x,), verify=True)
    text = out.format()
    assert text[text.index("  %x_q"):].rstrip() == GOLDEN_BLOCK.rstrip(), text


# -- fused graphs ------------------------------------------------------------------------------------------

def test_o2_then_quantize_puts_fused_groups_back():
    model, x, g = block()
    out, report = run_pipeline(g, "-O2,quantize", example_inputs=(x,), verify=True)
    st = _stats(report)
    assert st["unfused_groups"] >= 1 and st["quantized"] == 3
    assert not any(is_fused(n.op) for n in out.call_nodes())
    assert "aten.add.Tensor" in _quantized_ops(out)
    with torch.no_grad():
        ref, got = model(x), Interpreter(out).run(x)[0]
    assert float((ref - got).abs().max() / ref.abs().max()) < st["declared_tolerance"]


def test_a_changed_calibration_file_changes_the_cache_key(tmp_path):
    from mlcomp.api.auto.search import DEFAULT_AUTO_TIMING
    from mlcomp.api.compiler import _key
    from mlcomp.targets import CompileOptions
    _, x, g = small()
    path = tmp_path / "cal.pt"
    spec = f"quantize{{calibration=\"{path}\"}}"

    def key():
        return _key(g, "onnxruntime", None, spec, CompileOptions.make(), DEFAULT_AUTO_TIMING)
    missing, why = key()
    assert missing is None and "cannot be hashed" in why              # the pass itself then names the file
    torch.save([x], path)
    first = key()[0]
    torch.save([x * 2], path)
    assert key()[0].digest != first.digest


def test_dynamic_activations_golden_and_what_keeps_float():
    _, x, g = small()
    out, report = run_pipeline(g, "quantize{activations=dynamic}", example_inputs=(x,), verify=True)
    text = out.format()
    assert text.endswith("""\
  %3.weight_dq: f32[5, 144] = mlcomp.dequantize_linear(%3.weight.int8, %3.weight.scale, %3.weight.zero, 0)   # 3
  %permute: f32[144, 5] = aten.permute.default(%3.weight_dq, [1, 0])   # 3
  %view_dyn: f32[2, 144] = mlcomp.dynamic_quantize_linear(%view)   # 3
  %addmm: f32[2, 5] = aten.addmm.default(%3.bias, %view_dyn, %permute)   # 3
  return (%addmm,)
}"""), text
    st = _stats(report)
    assert st["quantized"] == 1 and "constant weight" in st["kept_float"]["convolution"]
    assert "%0.weight: f32" in text and "%3.bias: f32[5] = param" in text      # conv and bias stay float
    assert 0 < st["calibration"]["max_rel"] < st["declared_tolerance"]


def test_dynamic_activations_on_openvino_are_refused_up_front():
    from mlcomp.base.errors import PipelineSpecError
    from mlcomp.passes.quantize.quantize import Quantize
    with pytest.raises(PipelineSpecError, match="only the onnxruntime target lowers to integer kernels"):
        Quantize(activations="dynamic").check_target("openvino")
    Quantize(activations="dynamic").check_target("onnxruntime")
    Quantize().check_target("openvino")
