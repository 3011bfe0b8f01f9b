"""int8 lowering per target: what the runtime's executed graph runs in int8, numbers against fp32, refusals."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import mlcomp
from mlcomp.base.errors import PipelineSpecError
from mlcomp.ir.interpreter import Interpreter
from mlcomp.pipeline import run_pipeline
from mlcomp.runtime.artifact import Artifact
from mlcomp.targets.int8 import Int8Record
from tests.helpers.captures import conv_linear


small = conv_linear
"""conv → relu → flatten → linear, captured once per process, with its example input (copies)."""


def _rel(got, ref):
    got = got[0] if isinstance(got, tuple) else got
    return float((got - ref).abs().max() / ref.abs().max())


@pytest.mark.openvino
def test_qdq_for_frontend_rewrites_pairs_and_keeps_the_numbers():
    from mlcomp.runtime.codegen import to_fx
    from mlcomp.targets.openvino.int8 import qdq_for_frontend
    _, x, g = small()
    out, _ = run_pipeline(g, "quantize", example_inputs=(x,))
    module = qdq_for_frontend(to_fx(out).eval())
    targets = [str(n.target) for n in module.graph.nodes if n.op == "call_function"]
    assert targets.count("quantized_decomposed.quantize_per_tensor.default") == 3     # input, relu, view (addmm: float)
    assert targets.count("quantized_decomposed.quantize_per_channel.default") == 2    # the two weights
    assert targets.count("quantized_decomposed.dequantize_per_channel.default") == 2
    assert not any("quant.quantize_linear" in t or "dequantize_linear" in t for t in targets)
    assert module.p_0_bias_dq_f32.dtype == torch.float32                   # the int32 bias folded to float
    assert torch.equal(module(x)[0], Interpreter(out).run(x)[0])           # same arithmetic, op for op


@pytest.mark.openvino
def test_openvino_runs_convolution_and_fully_connected_in_int8(tmp_path):
    model, x, _ = small()
    art = mlcomp.compile(model, (x,), target="openvino", pipeline="quantize")
    rt = art.runtime.compiled.get_runtime_model()
    ran = {(op.get_rt_info()["layerType"].astype(str), op.get_rt_info()["runtimePrecision"].astype(str))
           for op in rt.get_ops()}
    assert ("Convolution", "u8") in ran and ("FullyConnected", "u8") in ran, ran
    assert art.runtime.int8.int8 == {"Convolution": 1, "FullyConnected": 1} and art.runtime.int8.floating == {}
    ver = art.manifest["verification"]
    assert ver["passed"] and ver["max_rel"] <= art.manifest["declared_tolerance"]
    with torch.no_grad():
        assert _rel(art(x), model(x)) <= art.manifest["declared_tolerance"]
    art.save(tmp_path / "ov", force=True)
    again = Artifact.load(tmp_path / "ov")
    assert again.manifest["runtime_info"]["int8"]["fraction"] == 1.0
    assert torch.equal(again(x), art(x))
    assert any(line.startswith("int8: 2 of 2 compute ops") for line in art.runtime.explain_lines())


@pytest.mark.ort
def test_onnxruntime_records_its_int8_kernels():
    model, x, _ = small()
    art = mlcomp.compile(model, (x,), target="onnxruntime", pipeline="quantize")
    assert art.runtime.int8.int8 == {"MatMulIntegerToFloat": 1, "QLinearConv": 1}, art.runtime.int8
    assert art.runtime.int8.floating == {} and art.runtime.int8.to_json()["fraction"] == 1.0
    fp32 = mlcomp.compile(model, (x,), target="onnxruntime")
    assert fp32.runtime.int8 is None and "int8" not in " ".join(fp32.runtime.explain_lines())


def test_int8_record_counts_float_compute_left_over():
    rec = Int8Record.from_op_types({"com.microsoft.QLinearConv": 3, "Conv": 1, "Relu": 4, "MaxPool": 1})
    assert rec.int8 == {"QLinearConv": 3} and rec.floating == {"Conv": 1}
    assert rec.fraction() == 0.75 and "float: Conv 1" in rec.line()
    assert Int8Record.from_json(rec.to_json()) == rec
    assert Int8Record.from_op_types({"Relu": 1}).fraction() is None


@pytest.mark.parametrize("target", ["cpu", "tvm"])
def test_cpu_and_tvm_refuse_naming_the_int8_targets(target):
    model, x, _ = small()
    with pytest.raises(PipelineSpecError) as err:
        mlcomp.compile(model, (x,), target=target, pipeline="quantize")
    text = str(err.value)
    assert f"target {target} would run them as float arithmetic" in text
    assert "--target onnxruntime or --target openvino" in text and "int8-lowering" in text


@pytest.mark.openvino
def test_a_pair_whose_scale_is_not_a_constant_is_refused_by_node():
    from torch import fx
    from mlcomp.ir.quant import quantize_linear
    from mlcomp.targets.base import TargetCompileError
    from mlcomp.targets.openvino.int8 import qdq_for_frontend
    root = nn.Module()
    root.register_buffer("zero", torch.tensor(0, dtype=torch.uint8))
    g = fx.Graph()
    x, s = g.placeholder("x"), g.placeholder("s")
    g.output(g.call_function(quantize_linear, (x, s, g.get_attr("zero"), 1), name="x_q"))
    with pytest.raises(TargetCompileError, match="x_q: the scale and zero point") as err:
        qdq_for_frontend(fx.GraphModule(root, g))
    assert "node x_q" in str(err.value.where)


@pytest.mark.slow
@pytest.mark.openvino
def test_zoo_resnet18_runs_every_convolution_in_int8_on_openvino(zoo):
    model = zoo["resnet18"].build().eval()
    xs = [torch.randn(1, 3, 32, 32, generator=torch.Generator().manual_seed(s)) for s in range(3)]
    art = mlcomp.compile(model, (xs[0],), target="openvino", pipeline="fold-batchnorm,fold-constants,cleanup,quantize")
    assert art.runtime.int8.int8 == {"Convolution": 20, "FullyConnected": 1} and art.runtime.int8.floating == {}
    with torch.no_grad():
        ref, got = model(xs[2]), art(xs[2])          # a held-back input, not the calibration one
    assert got.argmax(-1).tolist() == ref.argmax(-1).tolist()
    assert _rel(got, ref) <= art.manifest["declared_tolerance"]


@pytest.mark.slow
@pytest.mark.openvino
def test_third_party_vit_on_openvino_within_its_declared_tolerance():
    pytest.importorskip("transformers")
    from mlcomp.models.third_party import build_third_party
    model, inputs = build_third_party("vit", batch=2)
    art = mlcomp.compile(model, inputs, target="openvino", pipeline="fold-constants,quantize")
    ver = art.manifest["verification"]
    assert ver["passed"] and 0 < ver["max_rel"] <= art.manifest["declared_tolerance"]
    rec = art.runtime.int8
    assert rec.int8.get("FullyConnected", 0) >= 8 and rec.int8.get("Convolution") == 1   # patch embedding


def test_the_cpu_refusal_says_why_torchs_kernels_are_not_used():
    from mlcomp.passes.quantize.quantize import Quantize
    with pytest.raises(PipelineSpecError, match="quantized tensor types torch deprecates") as err:
        Quantize().check_target("cpu")
    assert "docs/decisions/0019-int8-lowering.md" in str(err.value)


@pytest.mark.openvino
def test_cli_compile_says_what_ran_in_int8(tmp_path):
    import json
    from click.testing import CliRunner
    from mlcomp.cli.main import main
    out = CliRunner().invoke(main, ["compile", "lenet", "-t", "openvino", "-p", "fold-constants,cleanup,quantize",
                                    "--no-cache", "-o", str(tmp_path / "art"), "--json"])
    assert out.exit_code == 0, out.output
    facts = json.loads(out.stdout)
    assert facts["int8"]["int8"] == {"Convolution": 2, "FullyConnected": 3} and facts["int8"]["fraction"] == 1.0


def _ran(art) -> set[tuple[str, str]]:
    """(layer type, runtime precision) of every matrix product in OpenVINO's executed graph."""
    rt = art.runtime.compiled.get_runtime_model()
    infos = [op.get_rt_info() for op in rt.get_ops()]
    return {(i["layerType"].astype(str), i["runtimePrecision"].astype(str)) for i in infos
            if i["layerType"].astype(str) in ("MatMul", "FullyConnected")}


@pytest.mark.openvino
def test_openvino_runs_attention_as_one_int8_kernel():
    """On openvino quantize recovers attention as one op and quantizes its q and k (no zero point): the plugin
    runs Q·Kᵀ, softmax and P·V as one int8 attention subgraph, no MatMul or Softmax layer of their own (where
    the plugin fuses int8 attention; elsewhere Q·Kᵀ runs as an int8 MatMul: ``_attention_in_int8``)."""
    torch.manual_seed(0)
    model = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True).eval()
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(7))
    art = mlcomp.compile(model, (x,), target="openvino", pipeline="fold-constants,cleanup,quantize")
    # q, k, v (split from the packed in-projection, decision 43), out, the two feed-forward linears
    _attention_in_int8(art.runtime.int8, attentions=1, linears=6)
    kinds = {i["layerType"].astype(str) for i in (op.get_rt_info() for op in
             art.runtime.compiled.get_runtime_model().get_ops())}
    assert not kinds & {"MatMul", "Softmax"} or "Attention" not in art.runtime.int8.int8, kinds
    st = _quantize_stats(art)
    assert st["attention_fused"] == 1
    sdpa = next(r for r in st["layers"] if "scaled_dot_product_attention" in r["op"])
    assert [i["zero_point"] for i in sdpa["inputs"]] == [0, 0] and [i["grid"] for i in sdpa["inputs"]] == \
        ["zero-free", "signed"]
    ver = art.manifest["verification"]
    assert ver["passed"] and ver["max_rel"] <= art.manifest["declared_tolerance"]


@pytest.mark.slow
@pytest.mark.openvino
def test_zoo_transformer_runs_every_product_in_int8_on_openvino(zoo):
    """Every product: 25 linears (q, k and v apart: decision 43) and 4 attentions, each one int8 kernel; on a
    held-back batch within quantize's declared tolerance."""
    model = zoo["transformer"].build().eval()
    xs = [torch.randn(2, 128, 256, generator=torch.Generator().manual_seed(s)) for s in range(5)]
    art = mlcomp.compile(model, (xs[0],), target="openvino", calibration_data=xs,
                         pipeline="fold-batchnorm,fold-constants,cleanup,quantize{held_back=1}")
    _attention_in_int8(art.runtime.int8, attentions=4, linears=25)
    assert {p for _, p in _ran(art)} <= {"u8", "i8"}
    st = next(p for p in art.manifest["pipeline_report"]["passes"] if p["name"] == "quantize")["stats"]
    assert st["held_back"]["samples"] == 1 and st["held_back"]["max_rel"] <= st["declared_tolerance"], st["held_back"]
    with torch.no_grad():
        assert _rel(art(xs[4]), model(xs[4])) <= art.manifest["declared_tolerance"]

def _attention_in_int8(record, *, attentions: int, linears: int) -> None:
    """Every linear one int8 ``FullyConnected``; each attention one int8 kernel where the CPU plugin fuses it
    (on AVX-512 VNNI and AMX hosts), else its Q·Kᵀ an int8 ``MatMul`` and P·V (``v`` stays float) a float one."""
    fused = ({"Attention": attentions, "FullyConnected": linears}, {})
    apart = ({"FullyConnected": linears, "MatMul": attentions}, {"MatMul": attentions})
    assert (record.int8, record.floating) in (fused, apart), (record.int8, record.floating)


def _quantize_stats(art):
    return next(p for p in art.manifest["pipeline_report"]["passes"] if p["name"] == "quantize")["stats"]


@pytest.mark.openvino
def test_openvino_bert_computes_what_quantize_measured():
    """A ``transformers`` BERT on openvino: every linear and attention in int8 (attention whole, its q and k
    scalings folded into its scale), the word table looked up in int8, and its output the quantized graph's
    own (the error the pass measured running it, bias corrections included)."""
    pytest.importorskip("transformers")
    from mlcomp.models.third_party import build_third_party
    model, inputs = build_third_party("bert", batch=32)   # 32 examples: biases corrected
    art = mlcomp.compile(model, inputs, target="openvino", pipeline="fold-batchnorm,fold-constants,cleanup,quantize")
    _attention_in_int8(art.runtime.int8, attentions=2, linears=12)
    st = _quantize_stats(art)
    assert st["attention_fused"] == 2 and st["scalar_muls_absorbed"] == 0, st["kept_float"]
    assert st["kept_float"]["add"].startswith("no operand comes from an int8")
    assert st["biases_corrected"] == 12                  # every linear's bias holds its measured shift
    infos = [op.get_rt_info() for op in art.runtime.compiled.get_runtime_model().get_ops()]
    gathers = {i["runtimePrecision"].astype(str) for i in infos if i["layerType"].astype(str) == "Gather"}
    assert "i8" in gathers, gathers                      # the word table's rows looked up in int8
    # each FFN's first linear runs its GELU and the quantize of the second's input as post-ops: writes u8
    fused = [i["outputPrecisions"].astype(str) for i in infos if i["layerType"].astype(str) == "FullyConnected"
             and "gelu" in i["originalLayersNames"].astype(str)]
    assert fused == ["u8", "u8"], fused
    with torch.no_grad():
        ref = model(*inputs)
    simulated = st["calibration"]["max_rel"]
    assert 0 < simulated and abs(_rel(art(*inputs), ref) - simulated) <= 0.05 * simulated, (_rel(art(*inputs), ref),
                                                                                          simulated)


class CausalSelfAttention(nn.Module):
    """GPT-2's attention block, tiny: one projection to q, k, v, causal attention (``is_causal``), a residual."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads, self.c_attn, self.c_proj = heads, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in self.c_attn(x).split(d, -1))
        a = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x + self.c_proj(a.transpose(1, 2).reshape(b, s, d))


@pytest.mark.openvino
def test_openvino_runs_a_causal_attention_in_int8_and_keeps_it_causal():
    """A captured causal attention through quantize: one int8 attention kernel and both linears in int8, within
    the declared tolerance, and causal still (a later token changes no earlier output)."""
    torch.manual_seed(0)
    model = CausalSelfAttention().eval()
    x = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(7))
    art = mlcomp.compile(model, (x,), target="openvino", pipeline="fold-constants,cleanup,quantize")
    # c_attn split into q, k, v (decision 43) and c_proj
    _attention_in_int8(art.runtime.int8, attentions=1, linears=4)
    sdpa = next(r for r in _quantize_stats(art)["layers"] if "scaled_dot_product_attention" in r["op"])
    assert [(i["grid"], i["zero_point"]) for i in sdpa["inputs"]] == [("zero-free", 0), ("signed", 0)]
    with torch.no_grad():
        assert _rel(art(x), model(x)) <= art.manifest["declared_tolerance"]
        later = x.clone()
        later[:, -1] += 1.0                                     # only the last token changes
        assert torch.equal(art(later)[:, :-1], art(x)[:, :-1]) and not torch.equal(art(later), art(x))
