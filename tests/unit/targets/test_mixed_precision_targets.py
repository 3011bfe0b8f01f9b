"""Mixed-precision graphs on onnxruntime and tvm, per-node precision errors, the report's section.

Graphs are made by capturing small models that cast by hand (bf16/fp16 weights, a cast of
the input, a cast back to fp32 before softmax): the IR a mixed-precision pass produces.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mlcomp.analysis.precision_error import by_op, precision_errors
from mlcomp.frontend.loading import load_model
from mlcomp.ir import TensorMeta
from mlcomp.ir.builder import GraphBuilder
from mlcomp.ir.ops import aten
from mlcomp.targets import CompileOptions, get_target
from mlcomp.targets.capabilities import CapabilityError, MismatchKind


class Mixed(nn.Module):
    """Linear-ReLU-Linear in ``dtype`` between an input cast and an fp32 softmax."""

    def __init__(self, dtype: torch.dtype, conv: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.dtype = dtype
        self.conv = nn.Conv2d(2, 4, 3, padding=1).to(dtype) if conv else None
        self.l1 = nn.Linear(16 if conv else 8, 16).to(dtype)
        self.l2 = nn.Linear(16, 4).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.to(self.dtype)
        if self.conv is not None:
            h = torch.relu(self.conv(h)).mean(dim=(2, 3)).repeat(1, 4)
        h = torch.relu(self.l1(h))
        return torch.softmax(self.l2(h).float(), -1)


def _graph(model: nn.Module, x: torch.Tensor):
    return load_model(model, example_inputs=(x,)).capture()


def _fp32_twin(model: Mixed) -> Mixed:
    twin = copy.deepcopy(model).float()
    twin.dtype = torch.float32
    return twin


X = torch.linspace(-2, 2, 16).reshape(2, 8)


@pytest.fixture(scope="module")
def graphs():
    """dtype -> (model, captured graph), captured once for the module; fp32 is the bf16 model's twin."""
    model = Mixed(torch.bfloat16)
    out = {torch.bfloat16: (model, _graph(model, X))}
    twin = _fp32_twin(model)
    out[torch.float32] = (twin, _graph(twin, X))
    return out


@pytest.fixture(scope="module")
def ort_built(graphs):
    model, graph = graphs[torch.bfloat16]
    return model, graph, get_target("onnxruntime").compile(graph, CompileOptions(threads=1))


@pytest.mark.ort
def test_ort_keeps_ops_without_low_precision_kernels_fp32(ort_built):
    import onnx

    model, _, art = ort_built
    record = art.runtime.precision
    assert record["provider"] == "CPUExecutionProvider"
    assert record["by_op"] == {"Gemm": 2, "Relu": 1}        # ORT 1.23's CPU EP: no low-precision Gemm/Relu
    assert all(n["dtype"] == "bf16" and "registers no" in n["reason"] for n in record["nodes"])
    proto = onnx.load_from_string(art.runtime.model)
    # golden (mlcomp's emitter writes the bf16 graph): fp32 Gemm/Relu read the fp32 input and fp32
    # weights made once; one cast pair remains where the graph itself rounds the logits to low
    # precision before its fp32 softmax
    assert art.runtime.stats == {"onnx_export": "mlcomp"}
    assert [(n.op_type, list(n.input), list(n.output)) for n in proto.graph.node] == [
        ("Gemm", ["x", "l1.weight__f32", "l1.bias__f32"], ["addmm__f32"]),
        ("Relu", ["addmm__f32"], ["relu__f32"]),
        ("Gemm", ["relu__f32", "l2.weight__f32", "l2.bias__f32"], ["addmm_1__f32"]),
        ("Cast", ["addmm_1__f32"], ["addmm_1"]), ("Cast", ["addmm_1"], ["addmm_1/f32"]),
        ("Softmax", ["addmm_1/f32"], ["_softmax"])]
    assert {t.data_type for t in proto.graph.initializer} == {onnx.TensorProto.FLOAT}   # no per-call weight casts
    with torch.no_grad():
        expected, low_eager = _fp32_twin(model)(X), model(X)
    out = art(X)
    assert (out - expected).abs().max() < 2e-2 and (out - low_eager).abs().max() < 2e-2


@pytest.mark.ort
def test_ort_kernel_table_asks_ort_and_caches():
    import onnx
    from onnx import helper

    from mlcomp.targets.onnx.precision import KernelTable

    table = KernelTable()
    gemm = helper.make_node("Gemm", ["a", "b"], ["y"])
    cast = helper.make_node("Cast", ["a"], ["y"], to=onnx.TensorProto.BFLOAT16)
    bf16, f16, f32 = onnx.TensorProto.BFLOAT16, onnx.TensorProto.FLOAT16, onnx.TensorProto.FLOAT
    assert "no Gemm(opset 20) kernel with bf16 for T" in table.reason(gemm, 20, {"a": bf16, "b": bf16, "y": bf16})
    assert "kernel with f16 for T" in table.reason(gemm, 20, {"a": f16, "b": f16, "y": f16})
    assert table.reason(gemm, 20, {"a": f32, "b": f32, "y": f32}) is None
    assert table.reason(cast, 20, {"a": f32, "y": bf16}) is None
    cached = len(table._cache)
    table.reason(gemm, 20, {"a": bf16, "b": bf16, "y": bf16})
    assert len(table._cache) == cached == 3


@pytest.mark.ort
def test_ort_record_survives_save_and_load_and_export(ort_built, tmp_path):
    import onnxruntime as ort

    from mlcomp.runtime.artifact import Artifact
    from mlcomp.targets.export import ExportFormat, export_graph

    model, graph, art = ort_built
    art.save(tmp_path / "a")
    again = Artifact.load(tmp_path / "a")
    assert again.runtime.precision == art.runtime.precision
    torch.testing.assert_close(again(X), art(X))
    with torch.no_grad():
        expected = model(X)
    path, result = export_graph(graph, ExportFormat.ONNX, tmp_path / "m.onnx", (X,), expected, tolerance=2e-2)
    assert result.passed
    plain = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])   # plain ORT runs it
    assert plain.run(None, {"x": X.numpy()})[0].shape == (2, 4)


def test_tvm_lowering_golden_ir(graphs):
    from mlcomp.targets.tvm.target import lower_low_precision

    graph = _graph(Mixed(torch.bfloat16, conv=True), torch.randn(2, 2, 4, 4))
    lowered = lower_low_precision(graph)
    text = [ln.strip() for ln in lowered.format().splitlines()]
    assert ("%convolution_nobias: bf16[2, 4, 4, 4] = aten.convolution.default(%_to_copy, %conv.weight, None, "
            "[1, 1], [1, 1], [1, 1], False, [0, 0], 1)   # conv") in text
    assert "%convolution_cast: bf16[2, 4, 4, 4] = aten._to_copy.default(%convolution_nobias, dtype=bf16)   # conv" \
        in text
    assert "%convolution_bias: bf16[1, 4, 1, 1] = aten.view.default(%conv.bias, [1, -1, 1, 1])   # conv" in text
    assert "%convolution: bf16[2, 4, 4, 4] = aten.add.Tensor(%convolution_cast, %convolution_bias)   # conv" in text
    assert "%addmm_mm: bf16[2, 16] = aten.mm.default(%repeat, %permute)   # l1" in text
    assert "%addmm: bf16[2, 16] = aten.add.Tensor(%addmm_mm, %l1.bias)   # l1" in text
    assert not lowered.nodes(aten("addmm"))
    lowered.verify()
    x = torch.randn(2, 2, 4, 4)
    from mlcomp.ir.interpreter import evaluate
    torch.testing.assert_close(evaluate(lowered, x)[0], evaluate(graph, x)[0], rtol=2e-2, atol=2e-3)
    fp32 = graphs[torch.float32][1]
    assert lower_low_precision(fp32) is fp32                        # fp32 graphs are left alone
    assert graphs[torch.bfloat16][1].node("l1.weight").meta == TensorMeta((16, 8), torch.bfloat16)


@pytest.mark.tvm
def test_tvm_runs_bf16_conv_and_linear_layers():
    model = Mixed(torch.bfloat16, conv=True)
    x = torch.randn(2, 2, 4, 4)
    art = get_target("tvm").compile(_graph(model, x), CompileOptions())
    with torch.no_grad():
        expected = _fp32_twin(model)(x)
    assert (art(x) - expected).abs().max() < 2e-2


@pytest.mark.tvm
def test_tvm_refuses_a_precision_it_cannot_run_before_building():
    b = GraphBuilder("lowlinear")
    x = b.call(aten("_to_copy"), b.input("x", (2, 8)), dtype=torch.float16)
    w, bias = b.param("fc.weight", torch.randn(4, 8).half()), b.param("fc.bias", torch.randn(4).half())
    y = b.call(aten("linear"), x, w, bias, origin="fc")
    graph = b.output(b.call(aten("_to_copy"), y, dtype=torch.float32))
    with pytest.raises(CapabilityError) as info:
        get_target("tvm").compile(graph, CompileOptions())
    err = info.value
    assert [p.kind for p in err.problems] == [MismatchKind.DTYPE]
    assert err.problems[0].nodes == ("linear",) and "cannot run aten.linear.default in f16" in str(err)
    assert "mixed-precision{deny=" in str(err) and "out_dtype='float32'" in str(err)


def test_precision_errors_per_node_and_per_op(graphs):
    (model, mixed), (_, reference) = graphs[torch.bfloat16], graphs[torch.float32]
    rows = {r.name: r for r in precision_errors(reference, mixed, (X,))}
    assert rows["_to_copy"].precision == "bf16" and rows["_to_copy"].introduced > 0   # rounding x to bf16
    assert rows["addmm"].precision == "bf16" and 0 < rows["addmm"].introduced < 5e-2
    assert rows["_softmax"].precision == "f32" and rows["_softmax"].introduced == 0.0
    assert rows["_softmax"].error > 0                                   # drift from upstream
    with torch.no_grad():
        assert rows["_softmax"].error == pytest.approx(float((model(X) - _fp32_twin(model)(X)).abs().max()))
    ops = by_op(rows.values())
    assert ops["aten.addmm.default"]["nodes"] == 2 and ops["aten.addmm.default"]["precisions"] == ["bf16"]
    assert ops["aten._softmax.default"]["introduced"] == 0.0


def test_report_section_lists_precision_per_op(tmp_path):
    from mlcomp.hardware.timing import TimingPolicy
    from mlcomp.measure.bench import BenchConfig
    from mlcomp.html_report import ReportConfig, build_report

    def compiler(model, inputs, target, pipeline, options):
        return torch.jit.trace(model, inputs)

    cfg = ReportConfig(BenchConfig(targets=("traced",), batches=(1,), pipeline="mixed-precision{dtype=bf16}",
                                   policy=TimingPolicy(warmup=1, budget_s=0.005, min_repeats=1, max_repeats=5)),
                       bench_options={"compiler": compiler, "availability": lambda: {"traced": None}})
    rep = build_report("mlp", tmp_path / "rep", cfg)
    page = (tmp_path / "rep" / "index.html").read_text()
    assert "Mixed precision: per op, the precision chosen and the error it introduced" in page
    assert "precision.json" in rep.files
    import json
    data = json.loads((tmp_path / "rep" / "precision.json").read_text())
    assert data["decision"]["dtype"] == "bf16"
    addmm = [n for n in data["nodes"] if n["op"] == "aten.addmm.default"]
    assert len(addmm) == 3 and all(n["precision"] == "bf16" and n["introduced"] > 0 for n in addmm)
