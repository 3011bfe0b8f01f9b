"""Fusion passes: golden IR on hand-built graphs, decomposed forms, stats, refusals.

The fused kernels themselves (in-place code, tiling, trace/export) are in
test_passes_kernels.py; numerical agreement on the zoo in test_passes_zoo.py; ``fuse-attention`` in
test_fusion_attention.py.
"""
from __future__ import annotations

import math
import textwrap

import pytest
import torch
from mlcomp.passes.fusion.fusion import estimate_peak_bytes, materialize
from torch import nn

from mlcomp.base.errors import PassFailure
from mlcomp.frontend.loading import load_model
from mlcomp.ir import Mode, Ref
from mlcomp.ir.interpreter import Interpreter
from mlcomp.ir.builder import GraphBuilder
from mlcomp.ir.composites import fused_body, is_fused
from mlcomp.ir.ops import GETITEM, aten
from mlcomp.pipeline import run_pipeline


def run(graph, spec, **kw):
    out, report = run_pipeline(graph, spec, verify=True, **kw)
    return out, report.records[0].stats


def golden(text: str) -> str:
    return textwrap.dedent(text).strip()


def ops(graph) -> list[str]:
    return [str(n.op) for n in graph.call_nodes()]


def capture(module: nn.Module, *shapes: tuple[int, ...]):
    torch.manual_seed(0)
    return load_model(module.eval(), example_inputs=tuple(torch.randn(s) for s in shapes)).capture()


# ---------------------------------------------------------------------------
# batch norm


def conv_bn(mode: Mode = Mode.INFERENCE):
    torch.manual_seed(0)
    b = GraphBuilder("convbn", mode=mode)
    x = b.input("x", (1, 3, 8, 8))
    w = b.param("conv.weight", torch.randn(4, 3, 3, 3))
    c = b.call(aten("convolution"), x, w, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1, origin="conv")
    stats = [b.param("bn.weight", torch.rand(4) + 0.5), b.param("bn.bias", torch.randn(4)),
             b.param("bn.running_mean", torch.randn(4)), b.param("bn.running_var", torch.rand(4) + 0.5)]
    bn = b.call(aten("_native_batch_norm_legit_no_training"), c, *stats, 0.1, 1e-5, origin="bn")
    y = b.call(GETITEM, bn, 0, origin="bn", name="getitem")
    return b.output(b.call(aten("relu"), y, origin="act"))


def test_fold_batchnorm_golden():
    out, stats = run(conv_bn(), "fold-batchnorm")
    assert out.format() == golden("""
        graph convbn(%x: f32[1, 3, 8, 8]) {
          %conv.weight_bnfold: f32[4, 3, 3, 3] = param   # conv
          %conv.bias_bnfold: f32[4] = param   # conv
          %getitem: f32[1, 4, 8, 8] = aten.convolution.default(%x, %conv.weight_bnfold, %conv.bias_bnfold, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)   # conv
          %relu: f32[1, 4, 8, 8] = aten.relu.default(%getitem)   # act
          return (%relu,)
        }""")
    assert stats == {"batchnorms_folded": 1}


def test_fold_batchnorm_refuses_training_graphs_and_fuse_skips_it():
    with pytest.raises(PassFailure) as info:
        run_pipeline(conv_bn(Mode.TRAINING), "fold-batchnorm")
    msg = str(info.value)
    assert "graph convbn is a training graph" in msg and "fuse skips it on training graphs" in msg
    out, report = run_pipeline(conv_bn(Mode.TRAINING), "fuse{groups=false}")
    assert report.records[0].stats == {"batchnorm": "skipped (training graph)"}
    assert "aten._native_batch_norm_legit_no_training.default" in ops(out)


def test_fold_batchnorm_leaves_shared_convolutions():
    graph = conv_bn()
    conv = graph.node("convolution")
    from mlcomp.ir import Node, Ref

    out_node = graph.output_node
    graph.replace(out_node.with_(inputs=((Ref("relu"), Ref(conv.name)),)))
    out, stats = run(graph, "fold-batchnorm")
    assert stats == {"batchnorms_folded": 0} and isinstance(out.node("convolution"), Node)


# ---------------------------------------------------------------------------
# bias epilogues


def bias_graph():
    torch.manual_seed(0)
    b = GraphBuilder("bias")
    x, img, seq = b.input("x", (4, 8)), b.input("img", (1, 3, 8, 8)), b.input("seq", (5, 2, 8))
    y = b.call(aten("add.Tensor"), b.call(aten("mm"), x, b.param("fc.weight", torch.randn(8, 6)), origin="fc"),
               b.param("fc.bias", torch.randn(6)), origin="fc")
    conv = b.call(aten("convolution"), img, b.param("conv.weight", torch.randn(4, 3, 3, 3)), None, [1, 1], [1, 1],
                  [1, 1], False, [0, 0], 1, origin="conv")
    c = b.call(aten("add.Tensor"), conv, b.param("conv.bias", torch.randn(1, 4, 1, 1)), origin="conv")
    e = b.call(aten("expand"), b.param("lin.weight", torch.randn(8, 6)), [5, 8, 6], origin="lin")
    lin = b.call(aten("add.Tensor"), b.call(aten("bmm"), seq, e, origin="lin"), b.param("lin.bias", torch.randn(6)),
                 origin="lin")
    return b.output(y, c, lin)


def test_fold_bias_golden():
    out, stats = run(bias_graph(), "fold-bias")
    assert out.format() == golden("""
        graph bias(%x: f32[4, 8], %img: f32[1, 3, 8, 8], %seq: f32[5, 2, 8]) {
          %fc.weight: f32[8, 6] = param   # fc
          %fc.bias: f32[6] = param   # fc
          %conv.weight: f32[4, 3, 3, 3] = param   # conv
          %conv.bias: f32[1, 4, 1, 1] = param   # conv
          %lin.weight: f32[8, 6] = param   # lin
          %lin.bias: f32[6] = param   # lin
          %add: f32[4, 6] = aten.addmm.default(%fc.bias, %x, %fc.weight)   # fc
          %reshape_1: f32[4] = aten.reshape.default(%conv.bias, [4])   # conv
          %add_1: f32[1, 4, 8, 8] = aten.convolution.default(%img, %conv.weight, %reshape_1, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)   # conv
          %reshape: f32[10, 8] = aten.reshape.default(%seq, [10, 8])   # lin
          %addmm: f32[10, 6] = aten.addmm.default(%lin.bias, %reshape, %lin.weight)   # lin
          %add_2: f32[5, 2, 6] = aten.reshape.default(%addmm, [5, 2, 6])   # lin
          return (%add, %add_1, %add_2)
        }""")
    assert stats == {"bmm_linearized": 1, "biases_folded": 3}
    folded, _ = run(out, "cleanup")
    assert "reshape_1" in folded.constants          # the reshaped conv bias is now a constant


# ---------------------------------------------------------------------------
# recompose


class LayerNormMeanPow(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w, self.b = nn.Parameter(torch.rand(16) + 0.5), nn.Parameter(torch.randn(16))

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        var = ((x - mu) ** 2).mean(-1, keepdim=True)
        return (x - mu) / torch.sqrt(var + 1e-5) * self.w + self.b


class LayerNormVarMean(nn.Module):
    def forward(self, x):
        var, mu = torch.var_mean(x, dim=(-2, -1), keepdim=True, unbiased=False)
        return (x - mu) * torch.rsqrt(var + 1e-6)


class LayerNormWeightOnly(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.rand(16) + 0.5)

    def forward(self, x):
        mu = x.mean(-1, keepdim=True)
        return self.w * ((x - mu) / (x.var(-1, keepdim=True, unbiased=False) + 1e-5).sqrt())


class GeluErf(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))


class GeluTanh(nn.Module):
    def forward(self, x):
        return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * torch.pow(x, 3))))


class GeluTanhCube(nn.Module):
    def forward(self, x):
        return x * 0.5 * (1 + torch.tanh(0.7978845608028654 * (x + 0.044715 * x * x * x)))


def test_recompose_layernorm_golden():
    graph = capture(LayerNormMeanPow(), (2, 4, 16))
    assert len(graph.call_nodes()) == 10
    out, stats = run(graph, "recompose")
    assert out.format() == golden("""
        graph LayerNormMeanPow(%x: f32[2, 4, 16]) {
          %w: f32[16] = param
          %b: f32[16] = param
          %native_layer_norm: (f32[2, 4, 16], f32[2, 4, 1], f32[2, 4, 1]) = aten.native_layer_norm.default(%x, [16], %w, %b, 1e-05)   # <root>
          %add_1: f32[2, 4, 16] = graph.getitem(%native_layer_norm, 0)   # <root>
          return (%add_1,)
        }""")
    assert stats == {"layernorms_recomposed": 1, "gelus_recomposed": 0}


@pytest.mark.parametrize("module, normalized, affine", [
    (LayerNormVarMean, [4, 16], (None, None)),
    (LayerNormWeightOnly, [16], ("w", None)),
])
def test_recompose_other_layernorm_forms(module, normalized, affine):
    out, stats = run(capture(module(), (2, 4, 16)), "recompose")
    assert stats["layernorms_recomposed"] == 1
    ln = out.call_nodes()[0]
    assert ln.op == aten("native_layer_norm") and ln.inputs[1] == normalized
    assert tuple(None if a is None else a.name for a in ln.inputs[2:4]) == affine


@pytest.mark.parametrize("module, approximate", [(GeluErf, None), (GeluTanh, "tanh"), (GeluTanhCube, "tanh")])
def test_recompose_gelu(module, approximate):
    out, stats = run(capture(module(), (2, 4, 16)), "recompose")
    assert stats == {"layernorms_recomposed": 0, "gelus_recomposed": 1}
    (node,) = out.call_nodes()
    assert node.op == aten("gelu") and node.attrs.get("approximate") == approximate


def test_recompose_keeps_values_used_elsewhere():
    class Leaky(nn.Module):
        def forward(self, x):
            mu = x.mean(-1, keepdim=True)
            var = ((x - mu) ** 2).mean(-1, keepdim=True)
            return (x - mu) / torch.sqrt(var + 1e-5), var          # the variance is an output too

    graph = capture(Leaky(), (2, 16))
    out, stats = run(graph, "recompose")
    assert stats["layernorms_recomposed"] == 0 and len(out) == len(graph)


# ---------------------------------------------------------------------------
# grouping


def chain_graph():
    torch.manual_seed(0)
    b = GraphBuilder("chain")
    x, y = b.input("x", (16, 32)), b.input("y", (32,))
    m = b.call(aten("mm"), x, b.param("fc.weight", torch.randn(32, 32)), origin="fc")
    e = b.call(aten("mul.Tensor"), b.call(aten("relu"), m, origin="act"), 2.0, origin="scale")
    t = b.call(aten("tanh"), b.call(aten("add.Tensor"), e, y, origin="shift"), origin="shift")
    h = b.call(aten("mul.Tensor"), b.call(aten("sum.dim_IntList"), t, [-1], True, origin="pool"), 0.5, origin="pool")
    return b.output(h, e)


def test_fuse_elementwise_golden():
    out, stats = run(chain_graph(), "fuse-elementwise")
    assert out.format() == golden("""
        graph chain(%x: f32[16, 32], %y: f32[32]) {
          %fc.weight: f32[32, 32] = param   # fc
          %mul: f32[16, 32] = mlcomp.fused_mm_relu_mul_967a58998142(%x, %fc.weight)   # fc {fusion_group=0}
          %mul_1: f32[16, 1] = mlcomp.fused_add_tanh_sum_mul_30233b6f0eb9(%mul, %y)   # pool {fusion_group=1}
          return (%mul_1, %mul)
        }""")
    assert stats == {"groups_formed": 2, "nodes_fused": 7, "bytes_saved": 16512, "groups_tiled": 0,
                     "groups_rejected_small": 0, "groups_rejected_peak": 0}
    epilogue = fused_body(out.node("mul").op)
    assert [n.op.name for n in epilogue.call_nodes()] == ["mm", "relu", "mul"]


def test_fuse_epilogue_only_groups_compute_ops():
    out, stats = run(chain_graph(), "fuse-epilogue")
    assert stats["groups_formed"] == 1 and stats["nodes_fused"] == 3
    assert [n.op.name for n in out.call_nodes()][1:] == ["add", "tanh", "sum", "mul"]


def test_materialize_a_multi_output_group():
    b = GraphBuilder("multi")
    x = b.input("x", (64, 64))
    e = b.call(aten("exp"), x)
    s = b.call(aten("add.Tensor"), b.call(aten("sigmoid"), e), b.call(aten("neg"), e))
    graph = b.output(s, e)                                 # exp is read inside and returned
    reference = graph.copy()
    materialize(graph, ["exp", "sigmoid", "neg", "add"], None, 7)
    graph.verify()
    text = graph.format()
    assert "%fused_exp: (f32[64, 64], f32[64, 64]) = mlcomp.fused_exp_sigmoid_neg_add_" in text
    assert "%exp: f32[64, 64] = graph.getitem(%fused_exp, 0)" in text
    assert "%add: f32[64, 64] = graph.getitem(%fused_exp, 1)" in text
    assert graph.node("fused_exp").ann.fusion_group == 7
    x = torch.randn(64, 64)
    from mlcomp.ir.interpreter import Interpreter

    for got, want in zip(Interpreter(graph).run(x), Interpreter(reference).run(x)):
        torch.testing.assert_close(got, want)


def test_groups_never_take_two_compute_ops_or_opaque_ops():
    b = GraphBuilder("two")
    x = b.input("x", (8, 8))
    m1 = b.call(aten("relu"), b.call(aten("mm"), x, x))
    m2 = b.call(aten("relu"), b.call(aten("mm"), m1, x))
    c = b.call(aten("flip"), m2, [0])                         # not in any fusion class
    graph = b.output(b.call(aten("neg"), b.call(aten("exp"), c)))
    out, stats = run(graph, "fuse-elementwise")
    assert stats["groups_formed"] == 3
    for node in out.call_nodes():
        if is_fused(node.op):
            names = [n.op.name for n in fused_body(node.op).call_nodes()]
            assert names.count("mm") <= 1 and "flip" not in names


def test_peak_memory_guard_rejects_groups_that_keep_big_inputs_alive():
    b = GraphBuilder("peak")
    big, x = b.input("big", (1024, 256)), b.input("x", (256, 256))
    col = b.call(aten("sum.dim_IntList"), b.call(aten("flip"), big, [0]), [0], True)   # 1 MiB in, 1 KiB out
    w = b.call(aten("flip"), b.call(aten("flip"), b.call(aten("flip"), x, [0]), [1]), [0])
    graph = b.output(b.call(aten("add.Tensor"), w, col))  # fusing sum with the add delays it past the flips
    growth = estimate_peak_bytes(graph, [["sum", "add"]]) - estimate_peak_bytes(graph, [])
    assert growth == 2 * 256 * 256 * 4 - 256 * 4          # two flips' outputs, less the column sum
    _, stats = run(graph, "fuse-elementwise")                # within the default 1 MiB of slack
    assert stats["groups_formed"] == 1
    _, stats = run(graph, "fuse-elementwise{peak_slack_bytes=0}")
    assert stats["groups_formed"] == 0 and stats["groups_rejected_peak"] == 1
    _, stats = run(graph, "fuse-elementwise{peak_slack_bytes=0,peak_slack=0.5}")
    assert stats["groups_formed"] == 1


def test_min_bytes_and_max_group_size():
    _, stats = run(chain_graph(), "fuse-elementwise{min_bytes_saved=100000}")
    assert stats["groups_formed"] == 0 and stats["groups_rejected_small"] == 2
    _, stats = run(chain_graph(), "fuse-elementwise{max_group_size=2}")
    assert stats["groups_formed"] >= 1 and stats["nodes_fused"] <= 2 * stats["groups_formed"]


def test_fuse_runs_the_whole_family(captured):
    _, inputs, graph = captured("resnet18")
    out, report = run_pipeline(graph, "-O2", example_inputs=inputs, verify=True)
    stats = report.stats("fuse")
    assert stats["batchnorms_folded"] == 20 and stats["groups_formed"] >= 15
    assert "aten._native_batch_norm_legit_no_training.default" not in ops(out)
    assert len(out) < len(graph) / 2
