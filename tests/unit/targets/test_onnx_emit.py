"""mlcomp's own ONNX emitter (issue 14 part 6): numbers per op, graph text, records, fallbacks, no onnxscript.

Per op: a tiny IR graph, emitted and run in ORT, against the IR interpreter (≤ 1e-5 relative).
Per model: the zoo through the target, against eager and (mlp, lenet) against torchlib's export.
The emitted graph text of mlp and a small conv net is pinned; a declined graph takes the torchlib
path and says why; a covered compile in a fresh process never imports onnxscript.
"""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from mlcomp.ir import Graph, Mode
from mlcomp.ir.builder import GraphBuilder
from mlcomp.ir.interpreter import Interpreter
from mlcomp.ir.ops import GETITEM, aten
from mlcomp.targets import CompileOptions
from mlcomp.runtime.artifact import Artifact
from mlcomp.targets.onnx.emit import RULES, emit_model
from mlcomp.targets.onnx.export import DIRECT, MLCOMP, ExportRecord
from mlcomp.targets.onnx.target import OnnxRuntimeTarget

pytestmark = pytest.mark.ort
A = aten
INT64_MAX = 2 ** 63 - 1


def _run(proto, inputs):
    import onnxruntime as ort

    session = ort.InferenceSession(proto.SerializeToString(), providers=["CPUExecutionProvider"])
    feed = {i.name: t.numpy() for i, t in zip(session.get_inputs(), inputs)}
    return [torch.from_numpy(o) for o in session.run(None, feed)]


def _data(shape, dtype, gen):
    if dtype == torch.int64:
        return torch.randint(0, 3, shape, generator=gen)
    if dtype == torch.bool:
        return torch.rand(shape, generator=gen) > 0.5
    return torch.randn(shape, generator=gen, dtype=dtype)


def _build(spec):
    """``spec = (inputs, body)``: inputs as (shape, dtype) pairs, ``body(b, *refs)`` the graph's output(s)."""
    ins, body = spec
    b = GraphBuilder("case")
    refs = [b.input(f"x{i}", shape, dtype) for i, (shape, dtype) in enumerate(ins)]
    out = body(b, *refs)
    graph = b.output(*(out if isinstance(out, tuple) else (out,)))
    gen = torch.Generator().manual_seed(0)
    return graph, tuple(_data(shape, dtype, gen) for shape, dtype in ins)


F, I64, BOOL = torch.float32, torch.int64, torch.bool
W = torch.Generator().manual_seed(1)


def _w(*shape):
    return torch.randn(*shape, generator=W)


def _linear(b, x):
    weight = b.call(A("permute"), b.param("fc.weight", _w(5, 4)), [1, 0])
    return b.call(A("addmm"), b.param("fc.bias", _w(5)), x, weight)


def _gru(batch_first, layers, bidirectional):
    def body(b, x, h):
        dirs, params = 2 if bidirectional else 1, []
        for layer in range(layers):
            for d in range(dirs):
                size = 4 if layer == 0 else 3 * dirs
                sfx = f"l{layer}" + ("_reverse" if d else "")
                params += [b.param(f"gru.weight_ih_{sfx}", _w(9, size)), b.param(f"gru.weight_hh_{sfx}", _w(9, 3)),
                           b.param(f"gru.bias_ih_{sfx}", _w(9)), b.param(f"gru.bias_hh_{sfx}", _w(9))]
        g = b.call(A("gru.input"), x, h, params, True, layers, 0.0, False, bidirectional, batch_first)
        return b.call(GETITEM, g, 0), b.call(GETITEM, g, 1)
    dirs = 2 if bidirectional else 1
    x_shape = (2, 5, 4) if batch_first else (5, 2, 4)
    return [(x_shape, F), ((layers * dirs, 2, 3), F)], body


def _items(b, tup, indices):
    return tuple(b.call(GETITEM, tup, i) for i in indices)


def _aliases(b, x, y):
    """No-op views as outputs: of an input, and of one value three times (once as itself)."""
    twice = b.call(A("permute"), b.call(A("permute"), y, [1, 0]), [1, 0])
    return b.call(A("expand"), x, [1, 4]), b.call(A("view"), y, [1, 4]), twice, y


def _unary(name, *args):
    return [((2, 3, 4), F)], lambda b, x: b.call(A(name), x, *args)


CASES = {
    **{name: _unary(name) for name in ("relu", "sigmoid", "tanh", "exp", "neg", "abs", "erf", "reciprocal", "silu",
                                       "hardswish", "hardsigmoid", "rsqrt", "sqrt", "log")},
    "gelu": _unary("gelu"), "gelu_tanh": ([((2, 8), F)], lambda b, x: b.call(A("gelu"), x, approximate="tanh")),
    "leaky_relu": _unary("leaky_relu", 0.2), "hardtanh": _unary("hardtanh", -0.5, 0.25),
    "clamp": _unary("clamp", -0.3), "clamp_max": _unary("clamp_max", 0.1),
    "isnan_not": ([((2, 3), F)], lambda b, x: b.call(A("logical_not"), b.call(A("isnan"), b.call(A("log"), x)))),
    "add_broadcast_alpha": ([((2, 3, 4), F), ((4,), F)], lambda b, x, y: b.call(A("add.Tensor"), x, y, alpha=2)),
    "rsub_scalar_first": ([((3,), F)], lambda b, x: b.call(A("sub.Tensor"), 1, x)),
    "mul_scalar": ([((2, 3), F)], lambda b, x: b.call(A("mul.Scalar"), x, 0.3535533905932738)),
    "mul_div": ([((2, 3), F), ((2, 1), F)], lambda b, x, y: b.call(A("div.Tensor"), b.call(A("mul.Tensor"), x, y), y)),
    "int_true_div": ([((2, 3), I64)], lambda b, x: b.call(A("div.Tensor"), x, 2)),
    "int_plus_float": ([((2, 3), I64)], lambda b, x: b.call(A("add.Tensor"), x, 1.5)),
    "pow": ([((2, 3), F)], lambda b, x: b.call(A("pow.Tensor_Scalar"), x, 2)),
    "compare": ([((2, 3), I64), ((2, 3), F)], lambda b, x, y: (
        b.call(A("eq.Scalar"), x, 2), b.call(A("lt.Tensor"), x, y), b.call(A("ne.Scalar"), y, 0.0))),
    "where_scalar_tensor": ([((2, 3), BOOL), ((2, 3), F)],
                            lambda b, c, x: b.call(A("where.self"), c, b.call(A("scalar_tensor"), 0.0, dtype=F), x)),
    "any_all": ([((2, 3, 4), BOOL), ((2, 3), F)], lambda b, m, x: (
        b.call(A("any.dim"), m, -1), b.call(A("any.dims"), m, [0, 2], True), b.call(A("all.dim"), x, 1),
        b.call(A("any"), b.call(A("relu"), x)))),
    "softmax": ([((2, 3, 4), F)], lambda b, x: b.call(A("_softmax"), x, -1, False)),
    "log_softmax": ([((2, 3, 4), F)], lambda b, x: b.call(A("_log_softmax"), x, 1, False)),
    "reductions": ([((2, 3, 4), F)], lambda b, x: (b.call(A("mean.dim"), x, [-1], True),
                                                   b.call(A("sum.dim_IntList"), x, [0, 2]), b.call(A("amax"), x, [1]))),
    "views": ([((2, 3, 4), F)], lambda b, x: b.call(A("view"), b.call(A("reshape"), x, [6, -1]), [2, 12])),
    "expand": ([((1, 4), F)], lambda b, x: b.call(A("expand"), x, [3, -1])),
    "outputs_alias": ([((1, 4), F)], lambda b, x: _aliases(b, x, b.call(A("relu"), x))),
    "permutes": ([((2, 3, 4), F)], lambda b, x: b.call(A("permute"), b.call(A("permute"), x, [2, 0, 1]), [0, 2, 1])),
    "transpose_t": ([((2, 3, 4), F)], lambda b, x: b.call(
        A("t"), b.call(A("select.int"), b.call(A("transpose.int"), x, 0, -1), 1, -1))),
    "squeeze_unsqueeze": ([((2, 1, 4, 1), F)], lambda b, x: b.call(
        A("unsqueeze"), b.call(A("squeeze.dims"), x, [-1, 0]), -1)),
    "slices": ([((2, 6), F)], lambda b, x: (b.call(A("slice.Tensor"), x, 1, 1, INT64_MAX),
                                            b.call(A("slice.Tensor"), x, -1, -4, None, 2),
                                            b.call(A("slice.Tensor"), x, 0, 0, INT64_MAX))),
    "split": ([((2, 6), F)], lambda b, x: _items(b, b.call(A("split_with_sizes"), x, [1, 2, 3], -1), (2, 0))),
    "split_tensor": ([((5, 2), F)], lambda b, x: b.call(GETITEM, b.call(A("split.Tensor"), x, 2), 2)),
    "cat": ([((2, 3), F), ((2, 1), F), ((2, 0), F), ((0,), F)],
            lambda b, x, y, e, legacy: (b.call(A("cat"), [x, y, e, legacy, x], 1),
                                        b.call(A("cat"), [e, y, legacy], -1))),
    "gather": ([((3, 4), F), ((3, 2), I64)], lambda b, x, i: b.call(A("gather"), x, 1, i)),
    "index_select": ([((3, 4), F), ((2,), I64)], lambda b, x, i: b.call(A("index_select"), x, -1, i)),
    "embedding": ([((2, 5), I64)], lambda b, i: b.call(A("embedding"), b.param("emb.weight", _w(3, 4)), i)),
    "fills": ([((2, 3), F)], lambda b, x: (b.call(A("full_like"), x, 3.0), b.call(A("zeros_like"), x))),
    "arange": ([((2, 5), I64)], lambda b, x: b.call(A("add.Tensor"), x, b.call(A("arange.start_step"), 2, 12, 2,
                                                                                dtype=I64))),
    "residual_layer_norm_on_rows": ([((2, 3, 4), F), ((2, 3, 4), F)], lambda b, x, y: b.call(GETITEM, b.call(
        A("native_layer_norm"), b.call(A("add.Tensor"), x, y), [4], b.param("ln.weight", _w(4)), None, 1e-5), 0)),
    "pad": ([((2, 3, 4), F)], lambda b, x: b.call(A("constant_pad_nd"), x, [1, 2, 0, 1], 0.5)),
    "to_copy": ([((2, 3), I64)], lambda b, x: b.call(A("_to_copy"), b.call(A("clone"), x), dtype=F)),
    "addmm_folded": ([((3, 4), F)], _linear),
    "addmm_beta_alpha": ([((3, 4), F), ((4, 5), F), ((5,), F)],
                         lambda b, x, y, c: b.call(A("addmm"), c, x, y, beta=0.5, alpha=2.0)),
    "mm_t": ([((3, 4), F)], lambda b, x: b.call(A("mm"), x, b.call(A("t"), b.param("w", _w(5, 4))))),
    "mm_bmm": ([((3, 4), F), ((4, 2), F), ((2, 3, 4), F), ((2, 4, 5), F)],
               lambda b, x, y, p, q: (b.call(A("mm"), x, y), b.call(A("bmm"), p, q))),
    "conv2d": ([((1, 4, 9, 9), F)], lambda b, x: b.call(
        A("convolution"), x, b.param("c.weight", _w(6, 2, 3, 3)), b.param("c.bias", _w(6)),
        [2, 1], [1, 2], [2, 1], False, [0, 0], 2)),
    "conv1d_no_bias": ([((2, 3, 8), F)], lambda b, x: b.call(A("convolution"), x, b.param("c.weight", _w(4, 3, 3)),
                                                            None, [1], [0], [1], False, [0], 1)),
    "conv_transposed": ([((1, 4, 5, 5), F)], lambda b, x: b.call(
        A("convolution"), x, b.param("c.weight", _w(4, 3, 3, 3)), b.param("c.bias", _w(3)),
        [2, 2], [1, 1], [1, 1], True, [1, 1], 1)),
    "batch_norm": ([((2, 3, 4, 4), F)], lambda b, x: b.call(GETITEM, b.call(
        A("_native_batch_norm_legit_no_training"), x, b.param("bn.weight", _w(3)), b.param("bn.bias", _w(3)),
        b.param("bn.running_mean", _w(3)), b.param("bn.running_var", torch.rand(3, generator=W) + 0.5), 0.1, 1e-3), 0)),
    "layer_norm": ([((2, 3, 4), F)], lambda b, x: _items(b, b.call(
        A("native_layer_norm"), x, [3, 4], b.param("ln.weight", _w(3, 4)), None, 1e-4), (0, 2))),
    "pools": ([((1, 2, 6, 6), F)], lambda b, x: (b.call(A("avg_pool2d"), x, [3, 3], [2, 2], [1, 1], False, False),
                                                 b.call(A("max_pool2d"), x, [2, 2], [1, 1]),
                                                 b.call(GETITEM, b.call(A("max_pool2d_with_indices"), x, [2, 2]), 0),
                                                 b.call(A("_adaptive_avg_pool2d"), x, [1, 1]),
                                                 b.call(A("_adaptive_avg_pool2d"), x, [3, 2]))),
    "gru_batch_first": _gru(True, 1, False),
    "gru_2_layers_bidirectional": _gru(False, 2, True),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_each_op_matches_the_interpreter(case):
    graph, inputs = _build(CASES[case])
    emitted = emit_model(graph)
    assert emitted.declined is None and emitted.model is not None
    expected = Interpreter(graph).run(*inputs)
    got = _run(emitted.model, inputs)
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        assert g.dtype == e.dtype and g.shape == e.shape
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6, equal_nan=True)


def test_every_op_the_zoo_needs_has_a_rule():
    need = """
        _native_batch_norm_legit_no_training _softmax add.Tensor addmm avg_pool2d bmm cat convolution
        embedding expand gather gelu gru.input hardtanh isnan mean.dim mm mul.Scalar mul.Tensor
        native_layer_norm permute pow.Tensor_Scalar relu reshape rsqrt scalar_tensor select.int sigmoid
        slice.Tensor split_with_sizes squeeze.dims sub.Tensor tanh unsqueeze view where.self max_pool2d
        div.Tensor neg exp log sqrt clone _to_copy t transpose.int silu hardswish leaky_relu clamp
        sum.dim_IntList amax erf
    """.split()  # noqa: SIM905 - a list to read
    assert not [n for n in need if A(n) not in RULES]


def _text(proto) -> list[str]:
    import onnx

    def attr(a):
        value = onnx.helper.get_attribute_value(a)
        value = value.decode() if isinstance(value, bytes) else f"{value:.6g}" if isinstance(value, float) else value
        return f"{a.name}={value}"
    lines = [f"{n.op_type}({', '.join(n.input)}) -> {', '.join(n.output)}"
             + (f" {{{', '.join(attr(a) for a in n.attribute)}}}" if n.attribute else "") for n in proto.graph.node]
    lines += [f"init {t.name}: {list(t.dims)}" for t in proto.graph.initializer]
    return [f"in {i.name}" for i in proto.graph.input] + lines + [f"out {o.name}" for o in proto.graph.output]


MLP_TEXT = """\
in input
Gemm(input, 0.weight, 0.bias) -> addmm {transB=1}
Relu(addmm) -> relu
Gemm(relu, 2.weight, 2.bias) -> addmm_1 {transB=1}
Relu(addmm_1) -> relu_1
Gemm(relu_1, 4.weight, 4.bias) -> addmm_2 {transB=1}
init 0.weight: [256, 512]
init 0.bias: [256]
init 2.weight: [128, 256]
init 2.bias: [128]
init 4.weight: [2, 128]
init 4.bias: [2]
out addmm_2"""

CONV_TEXT = """\
in x
Conv(x, conv.weight, conv.bias) -> convolution {dilations=[1, 1], group=1, kernel_shape=[3, 3], \
pads=[1, 1, 1, 1], strides=[1, 1]}
BatchNormalization(convolution, bn.weight, bn.bias, bn.running_mean, bn.running_var) -> getitem {epsilon=1e-05}
Relu(getitem) -> relu
Reshape(relu, view/shape) -> view
Gemm(view, fc.weight, fc.bias) -> addmm {transB=1}
Softmax(addmm) -> _softmax {axis=1}
init conv.weight: [4, 2, 3, 3]
init conv.bias: [4]
init bn.weight: [4]
init bn.bias: [4]
init bn.running_mean: [4]
init bn.running_var: [4]
init view/shape: [2]
init fc.weight: [3, 64]
init fc.bias: [3]
out _softmax"""


def _conv_net() -> tuple[Graph, tuple[torch.Tensor, ...]]:
    """What capture gives for Conv2d + BatchNorm2d + ReLU + flatten + Linear + softmax."""
    b = GraphBuilder("tiny")
    x = b.input("x", (2, 2, 4, 4))
    conv = b.call(A("convolution"), x, b.param("conv.weight", _w(4, 2, 3, 3)), b.param("conv.bias", _w(4)),
                  [1, 1], [1, 1], [1, 1], False, [0, 0], 1)
    bn = b.call(A("_native_batch_norm_legit_no_training"), conv, b.param("bn.weight", _w(4)),
                b.param("bn.bias", _w(4)), b.param("bn.running_mean", _w(4)),
                b.param("bn.running_var", torch.rand(4, generator=W) + 0.5), 0.1, 1e-5)
    y = b.call(A("view"), b.call(A("relu"), b.call(GETITEM, bn, 0)), [2, 64])
    fc = b.call(A("addmm"), b.param("fc.bias", _w(3)), y, b.call(A("permute"), b.param("fc.weight", _w(3, 64)), [1, 0]))
    graph = b.output(b.call(A("_softmax"), fc, -1, False))
    return graph, (torch.randn(2, 2, 4, 4, generator=W),)


def test_emitted_graph_text_is_stable(captured):
    graph = captured("mlp", batch=1)[2]
    assert "\n".join(_text(emit_model(graph).model)) == MLP_TEXT
    conv, conv_inputs = _conv_net()
    model = emit_model(conv).model
    assert "\n".join(_text(model)) == CONV_TEXT
    assert _text(emit_model(conv).model) == _text(model)           # same names every time
    torch.testing.assert_close(_run(model, conv_inputs)[0], Interpreter(conv).run(*conv_inputs)[0],
                               rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["mlp", "lenet", "gru"])
def test_zoo_models_take_the_emitter_and_match_eager(captured, name, tmp_path):
    module, inputs, graph = captured(name)
    art = OnnxRuntimeTarget().compile(graph, CompileOptions())
    assert art.runtime.stats == {"onnx_export": MLCOMP}
    assert art.runtime.explain_lines() == [ExportRecord(MLCOMP).line()]
    with torch.no_grad():
        expected = module(*inputs)
    torch.testing.assert_close(art(*inputs), expected, rtol=1e-5, atol=1e-6)
    again = Artifact.load(art.save(tmp_path / name))
    assert again.runtime.stats == {"onnx_export": MLCOMP}
    torch.testing.assert_close(again(*inputs), expected, rtol=1e-5, atol=1e-6)


def test_emitted_model_equals_the_torchlib_export(captured):
    """mlp and lenet: the emitter's model and torchlib's give the same outputs and the same op histogram."""
    from collections import Counter

    import onnx

    for name in ("mlp", "lenet"):
        _, inputs, graph = captured(name)
        ours = OnnxRuntimeTarget().compile(graph, CompileOptions())
        theirs = OnnxRuntimeTarget(emit=False).compile(graph, CompileOptions())
        off = "it was turned off (emit=False)"
        assert theirs.runtime.stats == {"onnx_export": DIRECT, "onnx_emitter_declined": off}
        hist = [Counter(n.op_type for n in onnx.load_from_string(a.runtime.model).graph.node) for a in (ours, theirs)]
        assert hist[0] == hist[1]
        torch.testing.assert_close(ours(*inputs), theirs(*inputs), rtol=1e-6, atol=1e-6)


ZERO_BIAS_TEXT = """\
in x
Conv(x, c.weight) -> convolution {dilations=[1, 1], group=1, kernel_shape=[1, 1], pads=[0, 0, 0, 0], strides=[1, 1]}
Reshape(convolution, view/shape) -> view
Gemm(view, fc.weight) -> addmm {transB=1}
Gemm(addmm, proj.weight, proj.bias) -> addmm_1
Gemm(addmm_1, conv1d.weight) -> addmm_2 {alpha=2}
init c.weight: [2, 2, 1, 1]
init view/shape: [2]
init fc.weight: [4, 8]
init proj.weight: [4, 4]
init proj.bias: [4]
init conv1d.weight: [4, 3]
out addmm_2"""


def _zero_bias_net() -> tuple[Graph, tuple[torch.Tensor, ...]]:
    """Biases of zeros (HF's linear init; -0.0 too) are left off Gemm/Conv; a non-zero one stays."""
    b = GraphBuilder("zero_bias")
    x = b.input("x", (2, 2, 2, 2))
    conv = b.call(A("convolution"), x, b.param("c.weight", _w(2, 2, 1, 1)), b.param("c.bias", torch.zeros(2)),
                  [1, 1], [0, 0], [1, 1], False, [0, 0], 1)
    flat = b.call(A("view"), conv, [2, 8])
    fc = b.call(A("addmm"), b.param("fc.bias", -torch.zeros(4)), flat,
                b.call(A("permute"), b.param("fc.weight", _w(4, 8)), [1, 0]))
    bias = torch.zeros(4)
    bias[3] = 0.5
    proj = b.call(A("addmm"), b.param("proj.bias", bias), fc, b.param("proj.weight", _w(4, 4)))
    conv1d = b.call(A("addmm"), b.param("conv1d.bias", torch.zeros(1, 3)), proj, b.param("conv1d.weight", _w(4, 3)),
                    beta=3, alpha=2)          # HF Conv1D's [in, out] weight, unfolded; beta has nothing to scale
    return b.output(conv1d), (torch.randn(2, 2, 2, 2, generator=W),)


def test_zero_biases_are_left_off_as_torchlib_does():
    graph, inputs = _zero_bias_net()
    model = emit_model(graph).model
    assert "\n".join(_text(model)) == ZERO_BIAS_TEXT
    torch.testing.assert_close(_run(model, inputs)[0], Interpreter(graph).run(*inputs)[0], rtol=1e-5, atol=1e-6)


DECLINED = {
    "op": (lambda: _build(([((2, 3), F)], lambda b, x: b.call(A("cumsum"), x, 1)))[0],
           "no emitter rule for aten.cumsum.default"),
    "ceil_mode": (lambda: _build(([((1, 1, 5, 5), F)], lambda b, x: b.call(A("avg_pool2d"), x, [2, 2], [2, 2], [0, 0],
                                                                           True)))[0],
                  "%avg_pool2d (aten.avg_pool2d.default): ceil_mode=True"),
    "training": (lambda: GraphBuilder("t", mode=Mode.TRAINING).output(), "the graph is a training graph"),
    "opset": (lambda: _conv_net()[0], "opset 17 is below 18"),
}


@pytest.mark.parametrize("case", sorted(DECLINED))
def test_what_the_emitter_declines_and_why(case):
    make, reason = DECLINED[case]
    emitted = emit_model(make(), opset=17 if case == "opset" else 20)
    assert emitted.model is None and emitted.declined.startswith(reason)


def test_low_precision_values_and_constants_are_emitted_in_their_dtype():
    """bf16 weights become BFLOAT16 initializers with the same bits; the values keep bf16 (and f16)."""
    import onnx

    for dtype, elem in ((torch.bfloat16, onnx.TensorProto.BFLOAT16), (torch.float16, onnx.TensorProto.FLOAT16)):
        b = GraphBuilder("low")
        x = b.input("x", (2, 3), dtype)
        w = torch.tensor([1.0078125, -2.5, 3.0], dtype=dtype)
        graph = b.output(b.call(A("mul.Tensor"), b.call(A("relu"), x), b.param("w", w)))
        model = emit_model(graph).model
        init = {t.name: t for t in model.graph.initializer}["w"]
        assert init.data_type == elem and model.graph.output[0].type.tensor_type.elem_type == elem
        assert torch.equal(torch.frombuffer(bytearray(init.raw_data), dtype=dtype), w)


def test_a_declined_graph_takes_the_torchlib_path_and_says_why():
    graph, inputs = _build(([((2, 3), F)], lambda b, x: b.call(A("cumsum"), b.call(A("relu"), x), 1)))
    art = OnnxRuntimeTarget().compile(graph, CompileOptions())
    why = "no emitter rule for aten.cumsum.default"
    assert art.runtime.stats == {"onnx_export": DIRECT, "onnx_emitter_declined": why}
    assert art.runtime.explain_lines()[0].endswith(f"; mlcomp's emitter declined: {why}")
    torch.testing.assert_close(art(*inputs), Interpreter(graph).run(*inputs)[0])


def test_a_covered_compile_never_imports_onnxscript(tmp_path):
    """A fresh process compiles mlp for onnxruntime, asks supports() of every node, and imports no torchlib."""
    code = """if True:
        import sys
        import torch
        from mlcomp.frontend.loading import load_model
        from mlcomp.targets import CompileOptions, get_target
        source = load_model("mlp", batch=1)
        graph = source.capture()
        target = get_target("onnxruntime")
        assert all(target.explain_op(n.op) is None for n in graph.call_nodes())
        art = target.compile(graph, CompileOptions())
        assert art.runtime.stats == {"onnx_export": "mlcomp"}, art.runtime.stats
        loaded = sorted(m for m in sys.modules if m.startswith("onnxscript") or m in (
            "torch.onnx._internal.exporter._core", "torch.onnx._internal.exporter._registration",
            "torch.onnx._internal.exporter._torchlib._torchlib_registry"))
        print("LOADED", loaded)
    """
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "LOADED []" in out.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name", ["resnet18", "mobilenet", "transformer", "bert", "distilbert", "vit", "gpt2",
                                  "t5-encoder", "gru-tagger"])
def test_models_emitted_equal_the_torchlib_export(name):
    """Zoo and third-party models after -O2: the emitter covers them, and its model's outputs are the
    torchlib export's (and eager's)."""
    from mlcomp import models
    from mlcomp.frontend.loading import load_model
    from mlcomp.models.third_party import THIRD_PARTY, build_third_party
    from mlcomp.pipeline import Pipeline, run_pipeline
    from mlcomp.pipeline.presets import adapt_preset

    if name in THIRD_PARTY:
        pytest.importorskip("transformers")
        module, inputs = build_third_party(name, 2)
    else:
        module, inputs = models.get(name).build(), models.get(name).example_inputs(1)
    target = OnnxRuntimeTarget()
    preset = Pipeline.parse(adapt_preset("-O2", "onnxruntime", target.rewrites).text)
    graph, _ = run_pipeline(load_model(module, example_inputs=inputs).capture(), preset, example_inputs=inputs)
    ours = target.compile(graph, CompileOptions())
    theirs = OnnxRuntimeTarget(emit=False).compile(graph, CompileOptions())
    assert ours.runtime.stats == {"onnx_export": MLCOMP}
    with torch.no_grad():
        expected = module(*inputs)
    as_tuple = lambda v: v if isinstance(v, tuple) else (v,)  # noqa: E731
    for g, r, e in zip(as_tuple(ours(*inputs)), as_tuple(theirs(*inputs)), as_tuple(expected)):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-5)
