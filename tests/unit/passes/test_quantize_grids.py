"""quantize's grids for products of two activations per target, and batched linears folded to int8."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mlcomp.frontend.loading import load_model
from mlcomp.ir import Ref
from mlcomp.ir.builder import GraphBuilder
from mlcomp.ir.interpreter import Interpreter
from mlcomp.ir.linearize import linearize_batched_matmuls
from mlcomp.ir.ops import PARAM, aten
from mlcomp.ir.quant import QUANTIZE
from mlcomp.passes.quantize.grids import PRODUCT_OPERANDS, PRODUCT_SCHEMES, Grid, grid_params, operand_grids
from mlcomp.pipeline import run_pipeline
from mlcomp.pipeline.target_facts import TargetFacts
from tests.helpers.captures import captured_once


class Scores(nn.Module):
    """f(q kᵀ) v of three linear projections: two activation × activation products; with ``f`` a softmax,
    an attention (which openvino quantizes whole), else a ReLU (two products on any target)."""

    def __init__(self, soft: bool = False) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(8, 8), nn.Linear(8, 8), nn.Linear(8, 8)
        self.f = (lambda s: torch.softmax(s, -1)) if soft else torch.relu

    def forward(self, x):
        p = self.f(torch.bmm(self.q(x), self.k(x).transpose(1, 2)))
        return torch.bmm(p, self.v(x))


@captured_once
def _scores(soft: bool):
    torch.manual_seed(0)
    model = Scores(soft).eval()
    x = torch.randn(2, 5, 8, generator=torch.Generator().manual_seed(3))
    return model, x, load_model(model, example_inputs=(x,)).capture()


def _quantized(target: str | None, spec: str = "quantize", soft: bool = False):
    model, x, g = _scores(soft)
    facts = TargetFacts(target) if target else None
    out, report = run_pipeline(g, f"fold-constants,{spec}", example_inputs=(x,), target=facts)
    return model, x, out, report.records[-1].stats


def _operand_zero_points(graph) -> list[list[tuple[torch.dtype, int]]]:
    """For each bmm, its operands' quantize zero points (dtype, value), in argument order."""
    found = []
    for bmm in graph.nodes(aten("bmm")):
        zeros = []
        for operand in bmm.inputs:
            q = graph.node(graph.node(operand.name).inputs[0].name)
            assert q.op == QUANTIZE
            z = graph.constants[q.inputs[2].name]
            zeros.append((z.dtype, int(z)))
        found.append(zeros)
    return found


def test_openvino_products_have_no_zero_points_and_the_second_operand_is_signed():
    model, x, out, stats = _quantized("openvino")
    zeros = _operand_zero_points(out)
    assert len(zeros) == 2
    scores, weighted = zeros
    assert all(z == 0 for _, z in scores + weighted), zeros
    assert scores[1][0] == weighted[1][0] == torch.int8              # kᵀ and v: int8
    assert weighted[0] == (torch.uint8, 0)                         # relu's output: uint8 from 0
    grids = [i["grid"] for r in stats["layers"] if r["op"] == "aten.bmm.default" for i in r["inputs"]]
    assert grids == ["zero-free", "signed"] * 2
    with torch.no_grad():
        ref = model(x)
    got = Interpreter(out).run(x)[0]
    assert float((got - ref).abs().max() / ref.abs().max()) <= stats["declared_tolerance"]


GOLDEN_ATTENTION = """
  %unsqueeze_2: f32[1, 2, 5, 8] = aten.reshape.default(%addmm_2, [1, 2, 5, 8])   # <root>
  %unsqueeze_q: i8[1, 2, 5, 8] = mlcomp.quantize_linear(%unsqueeze, %unsqueeze.scale, %unsqueeze.zero, 1)   # <root>
  %unsqueeze_dq: f32[1, 2, 5, 8] = mlcomp.dequantize_linear(%unsqueeze_q, %unsqueeze.scale, %unsqueeze.zero, 1)   # <root>
  %unsqueeze_1_q: i8[1, 2, 5, 8] = mlcomp.quantize_linear(%unsqueeze_1, %unsqueeze_1.scale, %unsqueeze_1.zero, 1)   # <root>
  %unsqueeze_1_dq: f32[1, 2, 5, 8] = mlcomp.dequantize_linear(%unsqueeze_1_q, %unsqueeze_1.scale, %unsqueeze_1.zero, 1)   # <root>
  %scaled_dot_product_attention: f32[1, 2, 5, 8] = aten.scaled_dot_product_attention.default(%unsqueeze_dq, %unsqueeze_1_dq, %unsqueeze_2, scale=1.0)   # <root>
  %bmm_1: f32[2, 5, 8] = aten.squeeze.dims(%scaled_dot_product_attention, [0])   # <root>
  return (%bmm_1,)
}"""


def test_openvino_quantizes_an_attention_whole_q_and_k_without_zero_points():
    """softmax(q kᵀ) v on openvino: one attention op reading q on the zero-free grid and k signed, both
    written so by their linears (one rounding each); v's linear writes float (the attention reads v in float)."""
    model, x, out, stats = _quantized("openvino", soft=True)
    assert stats["attention_fused"] == 1 and out.format().endswith(GOLDEN_ATTENTION), out.format()
    (sdpa,) = [r for r in stats["layers"] if "scaled_dot_product_attention" in r["op"]]
    assert [(i["grid"], i["zero_point"]) for i in sdpa["inputs"]] == [("zero-free", 0), ("signed", 0)]
    outputs = [r.get("output") for r in stats["layers"] if r["op"] == "aten.addmm.default"]
    assert sum(o is None for o in outputs) == 1                     # v: float
    written = {(round(o["scale"], 9), o["zero_point"]) for o in outputs if o}
    assert written == {(round(i["scale"], 9), 0) for i in sdpa["inputs"]}
    with torch.no_grad():
        ref = model(x)
    got = Interpreter(out).run(x)[0]
    assert float((got - ref).abs().max() / ref.abs().max()) <= stats["declared_tolerance"]
    _, _, ort, _ = _quantized("onnxruntime", soft=True)             # onnxruntime: two int8 products
    assert len(list(ort.nodes(aten("bmm")))) == 2


@pytest.mark.parametrize("exclude", ["aten.bmm.default", "aten.scaled_dot_product_attention.default"])
def test_an_excluded_attention_stays_float_on_openvino(exclude):
    """``exclude`` naming the attention's products keeps the attention decomposed and both products float, as on
    onnxruntime; naming the attention op keeps the recovered op float."""
    _, _, out, stats = _quantized("openvino", f"quantize{{exclude=[{exclude}]}}", soft=True)
    quantized_ops = {r["op"] for r in stats["layers"]}
    assert not quantized_ops & {"aten.bmm.default", "aten.scaled_dot_product_attention.default"}, quantized_ops
    assert stats["attention_fused"] == (0 if "bmm" in exclude else 1)
    if "bmm" in exclude:
        assert {"bmm", "bmm_1"} <= set(stats["kept_float"]) and len(list(out.nodes(aten("bmm")))) == 2


@pytest.mark.parametrize("target, dtype", [("openvino", torch.int8), ("onnxruntime", torch.uint8)])
def test_a_projection_writes_on_the_grid_its_product_reads(target, dtype):
    """q, k, v's linears quantize their outputs once, on the grid of the product operand that reads them:
    the operand's pair has the same scale and zero point (an identity the runtime drops), not a second
    rounding to another grid."""
    _, _, out, stats = _quantized(target)
    outputs = {r["node"]: r["output"] for r in stats["layers"] if r["op"] == "aten.addmm.default"}
    assert len(outputs) == 3 and {o["zero_point"] == 0 for o in outputs.values()} == {target == "openvino"}
    reads = [i for r in stats["layers"] if r["op"] == "aten.bmm.default" for i in r["inputs"]]
    written = {(round(o["scale"], 9), o["zero_point"]) for o in outputs.values()}
    assert sum((round(i["scale"], 9), i["zero_point"]) in written for i in reads) == 3, (reads, written)
    kinds = {out.constants[q.inputs[2].name].dtype for q in out.nodes(QUANTIZE)
             if out.node(q.inputs[0].name).op == aten("addmm")}
    assert kinds == {dtype}, kinds


@pytest.mark.parametrize("target", ["onnxruntime", None])
def test_other_targets_keep_minmax_uint8_operands(target):
    _, _, out, stats = _quantized(target)
    zeros = _operand_zero_points(out)
    assert {dtype for pair in zeros for dtype, _ in pair} == {torch.uint8}
    assert any(z != 0 for pair in zeros for _, z in pair), zeros   # q kᵀ's operands straddle 0: a zero point
    assert {i["grid"] for r in stats["layers"] for i in r.get("inputs", [])} == {"minmax"}


def test_the_products_option_overrides_the_targets_row():
    _, _, out, _ = _quantized("onnxruntime", "quantize{products=zero-free}")
    assert all(z == 0 for pair in _operand_zero_points(out) for _, z in pair)
    _, _, out, _ = _quantized("openvino", "quantize{products=minmax}")
    assert {d for pair in _operand_zero_points(out) for d, _ in pair} == {torch.uint8}


def test_grid_table_rows_and_ranges():
    assert operand_grids("openvino") == PRODUCT_SCHEMES[PRODUCT_OPERANDS["openvino"]] == (Grid.ZERO_FREE, Grid.SIGNED)
    assert operand_grids("tvm") == (Grid.MINMAX, Grid.MINMAX)
    assert grid_params(-2.0, 1.0, Grid.SIGNED) == (pytest.approx(2.0 / 127), 0, torch.int8)
    assert grid_params(0.5, 2.0, Grid.SIGNED)[2] == torch.int8           # signed even when never negative
    assert grid_params(0.5, 2.0, Grid.ZERO_FREE) == (pytest.approx(2.0 / 255), 0, torch.uint8)
    assert grid_params(0.0, 0.0, Grid.SIGNED) == (1.0, 0, torch.int8)   # an all-zero tensor


def _batched_linear(folded: bool):
    """bmm(x, expand(w [K, N], [B, K, N])) + bias: a linear on a 3-D input read as a batched product."""
    b = GraphBuilder("bl")
    x = b.input("x", (4, 3, 8))
    w = torch.randn(5, 8, generator=torch.Generator().manual_seed(2))
    weight = b.param("w_t", w.t().contiguous()) if folded else b.call(aten("permute"), b.param("w", w), [1, 0])
    prod = b.call(aten("bmm"), x, b.call(aten("expand"), weight, [4, 8, 5]))
    return b.output(b.call(aten("add.Tensor"), prod, b.param("bias", torch.randn(5)))), w


@pytest.mark.parametrize("folded", [False, True])
def test_linearize_takes_the_weight_as_written_or_folded(folded):
    graph, _ = _batched_linear(folded)
    x = torch.randn(4, 3, 8)
    ref = Interpreter(graph).run(x)
    out = graph.copy()
    assert linearize_batched_matmuls(out) == 1
    ops = [n.op for n in out.call_nodes()]
    assert aten("bmm") not in ops and aten("expand") not in ops and aten("addmm") in ops
    assert torch.allclose(Interpreter(out).run(x)[0], ref[0], atol=1e-6)


def test_quantize_folds_a_batched_linears_weight_to_int8():
    graph, _ = _batched_linear(folded=False)
    x = torch.randn(4, 3, 8, generator=torch.Generator().manual_seed(5))
    out, report = run_pipeline(graph, "fold-constants,cleanup,quantize", example_inputs=(x,))
    stats = report.records[-1].stats
    assert stats["batched_linears"] == 1 and stats["quantized"] == 1
    floats = {n: t.shape for n, t in out.constants.items() if t.dtype == torch.float32 and t.dim() == 2}
    assert floats == {}, floats                              # no float weight left beside the int8 one
    assert [t.dtype for n, t in out.constants.items() if n.endswith(".int8")] == [torch.int8]
    addmm = out.nodes(aten("addmm"))[0]
    assert all(isinstance(a, Ref) and out.node(a.name).op != PARAM for a in addmm.inputs)


def test_an_add_reading_an_attention_counts_it_as_an_int8_op_only_where_the_target_has_its_row():
    """``add(attention, x)``: on openvino the attention has an int8 row, so the add reads an int8 op's output and
    is quantized; without a target the attention is float and the add keeps float (no operand from an int8 op)."""
    from mlcomp.passes.quantize.selection import choose

    b = GraphBuilder("residual")
    q, k, v = (b.input(n, (1, 2, 5, 8)) for n in "qkv")
    sdpa = b.call(aten("scaled_dot_product_attention"), q, k, v)
    graph = b.output(b.call(aten("add.Tensor"), sdpa, q))
    picked, kept = choose(graph, (), "openvino")
    assert [(n.op, r.activations) for n, r in picked] == [(aten("scaled_dot_product_attention"), (0, 1)),
                                                          (aten("add.Tensor"), (0, 1))] and not kept
    picked, kept = choose(graph, ())
    assert not picked and list(kept) == ["add"] and kept["add"].startswith("no operand comes from an int8 op")
