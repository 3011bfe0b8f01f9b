"""quantize on ONNX Runtime: the kernels ORT's optimizer picks for mlcomp's Q/DQ graph, against the kernels it
picks for its own ``quantize_static`` (QDQ) model of the same module.  Asserted on op types, never on time."""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch import nn

from mlcomp.frontend.loading import load_model
from mlcomp.pipeline import run_pipeline

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

pytestmark = pytest.mark.ort

INT8 = ("QLinearConv", "QLinearMatMul", "QGemm", "MatMulIntegerToFloat", "QLinearAdd", "QLinearMul", "QLinearSoftmax",
        "QLinearGlobalAveragePool", "MatMulInteger")


def _optimized(model_bytes: bytes, path) -> Counter:
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(path)
    ort.InferenceSession(model_bytes, so, providers=["CPUExecutionProvider"])
    return Counter(n.op_type for n in onnx.load(str(path)).graph.node)


def ours(module, x, pipeline, tmp_path) -> Counter:
    """The op types of ORT's optimized model of mlcomp's graph (a preset adapted to onnxruntime, as compile does)."""
    from mlcomp.pipeline.presets import adapt_preset
    from mlcomp.targets.onnx.emit import emit_model
    from mlcomp.targets.registry import get_target
    adapted = adapt_preset(pipeline, "onnxruntime", get_target("onnxruntime").rewrites)
    g = load_model(module, example_inputs=(x,)).capture()
    out, _ = run_pipeline(g, adapted.text if adapted else pipeline, example_inputs=(x,))
    emitted = emit_model(out)
    assert emitted.declined is None, emitted.declined
    return _optimized(emitted.model.SerializeToString(), tmp_path / "ours.opt.onnx")


def theirs(module, x, tmp_path) -> Counter:
    """ORT's own int8: torch.onnx export, quantize_static (QDQ, per-channel, uint8 activations)."""
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    fp32, int8 = tmp_path / "fp32.onnx", tmp_path / "int8.onnx"
    torch.onnx.export(module, (x,), str(fp32), input_names=["x"], dynamo=False)

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter([{"x": x.numpy()}])

        def get_next(self):
            return next(self.items, None)

    quantize_static(str(fp32), str(int8), Reader(), quant_format=QuantFormat.QDQ, per_channel=True,
                    activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    return _optimized(int8.read_bytes(), tmp_path / "theirs.opt.onnx")


def _int8(ops: Counter) -> dict[str, int]:
    return {k: v for k, v in ops.items() if k in INT8}


class Net(nn.Module):
    """conv/BN/relu, a residual block, global average pool, linear: resnet's int8 ops in small."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU())
        self.conv1, self.conv2 = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 3, padding=1)
        self.pool, self.fc = nn.AdaptiveAvgPool2d(1), nn.Linear(8, 5)

    def forward(self, x):
        x = self.stem(x)
        x = torch.relu(self.conv2(torch.relu(self.conv1(x))) + x)
        return self.fc(torch.flatten(self.pool(x), 1))


def test_residual_net_runs_the_same_int8_kernels_as_orts_own_quantizer(tmp_path):
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    mine = ours(model, x, "-O2,quantize", tmp_path)
    own = theirs(model, x, tmp_path)
    same = {"QLinearConv": 3, "QLinearAdd": 1, "QLinearGlobalAveragePool": 1}
    # the linear: ORT's QGemm for quantize_static's Gemm, MatMulIntegerToFloat as mlcomp writes it
    assert _int8(mine) == {**same, "MatMulIntegerToFloat": 1} and _int8(own) == {**same, "QGemm": 1}, (mine, own)
    assert not {"Conv", "Add", "Relu", "ReduceMean", "GlobalAveragePool"} & set(mine), mine
    assert mine["QuantizeLinear"] <= own["QuantizeLinear"] + 1 and mine["DequantizeLinear"] <= own["DequantizeLinear"] + 1


@pytest.mark.slow
def test_attention_softmax_and_products_run_in_int8(tmp_path):
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(7))
    mine = ours(model, x, "fold-constants,quantize", tmp_path)
    assert mine["QLinearMatMul"] == 2, mine          # scores and the weighted sum
    assert mine["Softmax"] == 1 and "QLinearSoftmax" not in mine, mine   # float softmax of the int8 scores
    assert mine["MatMulIntegerToFloat"] == 6, mine   # q, k, v (split: decision 43), out, both feed-forward linears
    assert not {"IsNaN", "Where", "MatMul", "Gemm"} & set(mine), mine
    assert mine["LayerNormalization"] == 2 and "SkipLayerNormalization" not in mine   # float sums on the rows


@pytest.mark.slow
def test_sequence_first_attention_projections_and_scalings_in_int8(tmp_path):
    """Sequence-first attention: the input projection is an addmm (MatMulIntegerToFloat; split into q, k, v by
    decision 43), and q and k's scalar multiplies become dequantize scales (the one float Mul left scales the
    int8 scores into the softmax)."""
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0).eval()
    x = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(7))
    mine = ours(model, x, "-O2,quantize", tmp_path)
    assert mine["MatMulIntegerToFloat"] == 6 and mine["QLinearMatMul"] == 2 and mine["Softmax"] == 1, mine
    assert mine["Mul"] == 1 and not {"QLinearSoftmax", "MatMul", "Gemm"} & set(mine), mine
    with_mul = ours(model, x, "-O2,quantize{fold_scalars=false}", tmp_path)
    assert with_mul["Mul"] == 3, with_mul


def test_compile_o2_quantize_with_calibration_iterable():
    import mlcomp
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    batches = (torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(s)) for s in range(4))
    art = mlcomp.compile(model, (x,), target="onnxruntime", pipeline="-O2,quantize{held_back=1}",
                         calibration_data=batches)
    ver = art.manifest["verification"]
    assert ver["passed"] and ver["max_rel"] <= art.manifest["declared_tolerance"]
    st = next(p for p in art.manifest["pipeline_report"]["passes"] if p["name"] == "quantize")["stats"]
    assert st["calibration_samples"] == 3 and st["held_back"]["samples"] == 1 and st["quantized"] == 6


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert", "vit"])
def test_third_party_within_the_declared_metric(name):
    pytest.importorskip("transformers")
    import mlcomp
    from mlcomp.models.third_party import build_third_party, token_ids
    model, inputs = build_third_party(name, batch=2)
    batches = [token_ids(2, seed=s) if name == "bert" else
               (torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(s)),) for s in (5, 6, 7)]
    art = mlcomp.compile(model, inputs, target="onnxruntime", pipeline="-O2,quantize{held_back=1}",
                         calibration_data=batches)
    ver = art.manifest["verification"]
    tol = art.manifest["declared_tolerance"]
    assert ver["passed"] and 0 < ver["max_rel"] <= tol
    st = next(p for p in art.manifest["pipeline_report"]["passes"] if p["name"] == "quantize")["stats"]
    assert st["quantized"] >= 8 and st["calibration"]["max_rel"] <= tol
    assert st["held_back"]["samples"] == 1 and st["held_back"]["mean_rel"] < tol
    assert st["sensitivity"] and st["sensitivity"][0]["added"] >= st["sensitivity"][-1]["added"]


def test_bert_int8_runs_orts_int8_kernels_without_skip_layer_norm(tmp_path):
    """A ``transformers`` BERT (2 layers) in a plain ``InferenceSession`` of the saved ``model.onnx`` (ORT's
    defaults: every optimizer on): per layer six MatMulIntegerToFloat (bias inside; no QGemm), two
    QLinearMatMul and a float Softmax of the int8 scores (``Cast``, ``Mul``: no QLinearSoftmax); the residual
    adds a float Add and LayerNormalization on ``[rows, width]`` (no SkipLayerNormalization); per layer seven
    quantize (three inputs of linears; q, k, v and the probabilities for the int8 products) and no
    dequantize; the embedding sum float."""
    pytest.importorskip("transformers")
    import mlcomp
    from mlcomp.models.third_party import build_third_party
    model, inputs = build_third_party("bert", batch=2)
    art = mlcomp.compile(model, inputs, target="onnxruntime",
                         pipeline="fold-batchnorm,fold-constants,cleanup,quantize")
    saved = art.save(tmp_path / "bert-int8") / "model.onnx"
    so = ort.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "opt.onnx")
    plain = ort.InferenceSession(str(saved), so, providers=["CPUExecutionProvider"])
    ops = Counter(n.op_type for n in onnx.load(str(tmp_path / "opt.onnx")).graph.node)
    layers = 2
    assert (ops["MatMulIntegerToFloat"], ops["QLinearMatMul"], ops["Softmax"]) == (6 * layers, 2 * layers, layers), ops
    assert not {"QGemm", "QLinearSoftmax", "SkipLayerNormalization", "MatMul", "Gemm"} & set(ops), ops
    assert ops["LayerNormalization"] == 2 * layers + 1 and ops["Add"] == 2 * layers + 2, ops   # + embeddings
    assert ops["QuantizeLinear"] == 7 * layers and "DequantizeLinear" not in ops, ops
    got = plain.run(None, {plain.get_inputs()[0].name: inputs[0].numpy()})[0]
    assert torch.equal(torch.from_numpy(got), art(*inputs))       # the file is what the artifact runs
    assert ops["Gather"] == 2 and ops["Cast"] == ops["Mul"] == 1 + layers, ops   # + the int8 word rows, their scales
    st = next(p for p in art.manifest["pipeline_report"]["passes"] if p["name"] == "quantize")["stats"]
    assert st["ranges_shared"] == layers and "add" in st["kept_float"]


def test_dynamic_activations_run_orts_dynamic_quantize_matmul(tmp_path):
    from mlcomp.ir.interpreter import Interpreter
    from mlcomp.targets.onnx.emit import emit_model
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    x = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))
    g = load_model(model, example_inputs=(x,)).capture()
    out, _ = run_pipeline(g, "quantize{activations=dynamic}", example_inputs=(x,), verify=True)
    emitted = emit_model(out)
    assert emitted.declined is None
    ran = _optimized(emitted.model.SerializeToString(), tmp_path / "dyn.opt.onnx")
    assert ran["DynamicQuantizeMatMul"] == 2 and not {"Gemm", "MatMul", "MatMulInteger"} & set(ran), ran
    sess = ort.InferenceSession(emitted.model.SerializeToString(), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0])
    ref = Interpreter(out).run(x)[0]
    assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max())   # the interpreter computes ORT's numbers


def test_compile_refuses_a_missed_declared_tolerance_with_numbers():
    import mlcomp
    from mlcomp.base.errors import VerificationError
    torch.manual_seed(0)
    model, x = Net().eval(), torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(1))
    with pytest.raises(VerificationError) as err:
        mlcomp.compile(model, (x,), target="onnxruntime", pipeline="-O2,quantize{tolerance=1e-9 agreement=1}")
    text = str(err.value)
    assert "exceeds tolerance=1e-09" in text and "The layers that lose most:" in text
    assert err.value.exit_code == 4 and "report the model" not in text


def _initializer_bytes(path) -> int:
    from onnx import numpy_helper
    return sum(numpy_helper.to_array(i).nbytes for i in onnx.load(str(path)).graph.initializer)


@pytest.mark.slow
def test_zoo_transformer_int8_file_is_as_small_as_orts_own(zoo, tmp_path):
    """Every weight int8 once, no float copy beside it, no weight broadcast over the batch: the initializers
    weigh what ORT's own quantize_static makes of mlcomp's fp32 model of the same module (within 10%)."""
    import mlcomp
    from onnxruntime.quantization import CalibrationDataReader, QuantFormat, QuantType, quantize_static
    model = zoo["transformer"].build().eval()
    x = torch.randn(2, 128, 256, generator=torch.Generator().manual_seed(0))
    mlcomp.compile(model, (x,), target="onnxruntime").save(tmp_path / "fp32")
    mlcomp.compile(model, (x,), target="onnxruntime",
                   pipeline="fold-batchnorm,fold-constants,cleanup,quantize").save(tmp_path / "int8")
    fp32 = tmp_path / "fp32" / "model.onnx"
    name = onnx.load(str(fp32)).graph.input[0].name

    class Reader(CalibrationDataReader):
        def __init__(self):
            self.items = iter([{name: x.numpy()}])

        def get_next(self):
            return next(self.items, None)

    quantize_static(str(fp32), str(tmp_path / "theirs.onnx"), Reader(), quant_format=QuantFormat.QDQ,
                    per_channel=True, activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8)
    mine, theirs = _initializer_bytes(tmp_path / "int8" / "model.onnx"), _initializer_bytes(tmp_path / "theirs.onnx")
    assert mine <= 1.1 * theirs, (mine, theirs)
    assert mine < _initializer_bytes(fp32) / 3.5
