"""The onnxruntime target: every zoo model, plain-ORT reload, support checks (call overhead: tests/perf)."""
from __future__ import annotations

import pytest
import torch
from mlcomp.targets import CompileOptions, Fallback, get_target
from torch import nn

from mlcomp.base.errors import UnsupportedOpError
from mlcomp.frontend.loading import load_model
from tests.helpers.targets import FP32_RTOL, ZOO_NAMES, KthValueNet, compile_zoo, fresh_process_check

pytestmark = pytest.mark.ort


@pytest.fixture(scope="module")
def built(captured, tmp_path_factory):
    return compile_zoo("onnxruntime", captured, tmp_path_factory.mktemp("ort"))


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_zoo_compiles_and_verifies(built, name):
    b = built[name]
    assert b.max_rel <= FP32_RTOL
    assert (b.directory / "model.onnx").is_file()
    assert b.artifact.manifest["versions"]["onnxruntime"]


def test_fresh_process_reload_and_plain_onnxruntime(built):
    report = fresh_process_check([b.directory for b in built.values()], plain="onnx")
    assert set(report) == set(ZOO_NAMES)
    for name, r in report.items():
        assert r["passed"] and r["target"] == "onnxruntime", name
        assert r["mlcomp_rel"] <= FP32_RTOL and r["plain_rel"] <= FP32_RTOL, (name, r)


def test_session_is_fully_optimised_with_thread_option(captured):
    import onnxruntime as ort

    _, inputs, graph = captured("mlp")
    art = get_target("onnxruntime").compile(graph, CompileOptions(threads=1))
    opts = art.runtime.session.get_session_options()
    assert opts.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert opts.intra_op_num_threads == 1
    assert art.runtime.session.get_providers()[0] == "CPUExecutionProvider"


def test_op_without_onnx_translation_is_reported_and_falls_back():
    module, x = KthValueNet().eval(), torch.randn(4, 16)
    graph = load_model(module, example_inputs=(x,)).capture()
    assert get_target("cpu").unsupported(graph) == {}
    with pytest.raises(UnsupportedOpError, match="kthvalue") as err:
        get_target("onnxruntime").compile(graph, CompileOptions())
    assert "no ONNX translation" in str(err.value)
    art = get_target("onnxruntime").compile(graph, CompileOptions(fallback=Fallback.EAGER))
    assert [r["runs_on"] for r in art.manifest["fallback_regions"]] == \
        ["onnxruntime", "torch (eager)", "onnxruntime"]
    with torch.no_grad():
        assert torch.allclose(art(x), module(x), atol=1e-5)


def test_export_onnx_reloads_in_plain_onnxruntime(tmp_path):
    import onnxruntime as ort

    from mlcomp.api import export

    path, result = export("lenet", tmp_path / "lenet.onnx", format="onnx")
    assert result.passed and path.is_file()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == [1, 1, 28, 28]


# --- issue 14 part 4: the exported graph keeps what ORT fuses (mlcomp.targets.onnx.patterns) ---------


class AttentionBlock(nn.Module):
    """A post-norm encoder block as transformers writes it: SDPA, heads merged by transpose + reshape."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.ff1, self.ff2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.qkv(x).view(b, s, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v)
        x = self.norm1(x + self.proj(a.transpose(1, 2).reshape(b, s, d)))
        return self.norm2(x + self.ff2(torch.nn.functional.gelu(self.ff1(x))))


def _ort_op_types(model: bytes, tmp_path) -> list[str]:
    """Op types, in order, of the graph ORT runs after its own optimisations."""
    import onnx
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    so.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    so.log_severity_level = 3
    ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
    return [n.op_type for n in onnx.load(so.optimized_model_filepath).graph.node]


def _ort_op_counts(model: bytes, tmp_path) -> dict[str, int]:
    """Node counts by op type of the graph ORT runs after its own optimisations."""
    import collections

    return dict(collections.Counter(_ort_op_types(model, tmp_path)))


@pytest.fixture(scope="module")
def attention_art():
    torch.manual_seed(0)
    module, x = AttentionBlock().eval(), torch.randn(2, 4, 16)
    graph = load_model(module, example_inputs=(x,)).capture()
    return module, x, graph, get_target("onnxruntime").compile(graph, CompileOptions(threads=1))


def test_attention_block_exports_the_ops_ort_fuses(attention_art, tmp_path):
    module, x, _graph, art = attention_art
    assert art.runtime.rewritten["rewrites"] == {"batched_linear": 1, "safe_softmax": 1}
    counts = _ort_op_counts(art.runtime.model, tmp_path)
    # every Linear a Gemm (the merged-heads projection no longer a MatMul against an expanded weight),
    # the softmax guard IsNaN + Where as torch.onnx's own SDPA (no row reduction), each residual add and its
    # LayerNorm on [rows, width] (ORT's SkipLayerNormalization kernel is the slower one: never fused)
    assert counts.get("Gemm") == 4 and "MatMul" in counts and counts.get("FusedMatMul", 0) + counts["MatMul"] == 2
    assert counts.get("IsNaN") == 1 and counts.get("Where") == 1
    assert not {"ReduceMax", "Equal", "Not", "Cast"} & set(counts)
    assert counts.get("LayerNormalization") == 2 and "SkipLayerNormalization" not in counts
    assert counts.get("Gelu", 0) + counts.get("BiasGelu", 0) == 1
    with torch.no_grad():
        assert torch.allclose(art(x), module(x), rtol=1e-4, atol=1e-5)


class Masked(nn.Module):
    def forward(self, q, mask):
        return torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)


SAFE_SOFTMAX_BEFORE = """\
  %_softmax: f32[1, 1, 3, 3] = aten._softmax.default(%add, -1, False)
  %eq: bool[1, 1, 3, 3] = aten.eq.Scalar(%add, -inf)
  %logical_not: bool[1, 1, 3, 3] = aten.logical_not.default(%eq)
  %any_1: bool[1, 1, 3, 1] = aten.any.dim(%logical_not, -1, True)
  %logical_not_1: bool[1, 1, 3, 1] = aten.logical_not.default(%any_1)
  %full_like: f32[1, 1, 3, 3] = aten.full_like.default(%_softmax, 0, pin_memory=False, \
memory_format=torch.preserve_format)
  %where_1: f32[1, 1, 3, 3] = aten.where.self(%logical_not_1, %full_like, %_softmax)"""

SAFE_SOFTMAX_AFTER = """\
  %_softmax: f32[1, 1, 3, 3] = aten._softmax.default(%add, -1, False)
  %where_1_nan: bool[1, 1, 3, 3] = aten.isnan.default(%_softmax)
  %where_1_zero: f32[] = aten.scalar_tensor.default(0.0, dtype=f32)
  %where_1: f32[1, 1, 3, 3] = aten.where.self(%where_1_nan, %where_1_zero, %_softmax)"""


def _between(graph, first: str, last: str) -> str:
    """The lines of ``graph`` from the one defining ``%first`` to the one defining ``%last``, origins cut."""
    lines = [line.split("   #")[0] for line in str(graph).splitlines()]
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  %{first}:"))
    end = next(i for i, line in enumerate(lines) if line.startswith(f"  %{last}:"))
    return "\n".join(lines[start:end + 1])


def test_safe_softmax_rewrite_keeps_fully_masked_rows_zero(tmp_path):
    """The guard becomes torch.onnx's own: softmax, then NaN → 0 (ORT: IsNaN + Where, no row reduction).
    A fully masked row still gives 0, in torch and in ORT."""
    from mlcomp.runtime.codegen import to_fx
    from mlcomp.targets.onnx.patterns import cheap_safe_softmax

    q = torch.randn(1, 1, 3, 4, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[True, True, True], [False, False, False], [True, False, True]])
    graph = load_model(Masked().eval(), example_inputs=(q, mask)).capture()
    rewritten = graph.copy()
    assert cheap_safe_softmax(rewritten) == 1
    assert _between(graph, "_softmax", "where_1") == SAFE_SOFTMAX_BEFORE
    assert _between(rewritten, "_softmax", "where_1") == SAFE_SOFTMAX_AFTER
    assert len(rewritten.order()) == len(graph.order()) - 3
    expected = Masked()(q, mask).nan_to_num(0.0)
    art = get_target("onnxruntime").compile(graph, CompileOptions(threads=1))
    assert art.runtime.rewritten["rewrites"] == {"batched_linear": 0, "safe_softmax": 1}
    # unrewritten, ORT ran Equal, Not, Cast, ReduceMax, Cast before the Softmax (test_batched_linear_after_cleanup…)
    assert _ort_op_types(art.runtime.model, tmp_path) == ["FusedMatMul", "Where", "Add", "Softmax", "IsNaN", "Where",
                                                          "MatMul"]
    with torch.no_grad():
        for out in (to_fx(rewritten)(q, mask)[0], art(q, mask)):
            assert torch.equal(out[0, 0, 1], torch.zeros(4))
            assert torch.allclose(out, expected, atol=1e-6)


class SafeSoftmax(nn.Module):
    def forward(self, x):
        return torch.ops.aten._safe_softmax(x, -1)


def test_safe_softmax_rewrite_maps_a_nan_row_to_zero_like_torch_onnx():
    """Where the guard's own value is NaN (a row with NaN or +inf) the rewrite gives 0, as the IsNaN guard
    torch.onnx emits for SDPA does; everywhere else the two are bit for bit equal."""
    from mlcomp.runtime.codegen import to_fx
    from mlcomp.targets.onnx.patterns import cheap_safe_softmax

    inf, nan = float("inf"), float("nan")
    x = torch.tensor([[0.5, -inf, 1.0, 2.0], [-inf, -inf, -inf, -inf], [0.0, nan, 1.0, -inf], [0.0, inf, 1.0, 2.0]])
    graph = load_model(SafeSoftmax().eval(), example_inputs=(x,)).capture()
    rewritten = graph.copy()
    assert cheap_safe_softmax(rewritten) == 1
    assert [n.op.name for n in rewritten.nodes()][1:-1] == ["_softmax", "isnan", "scalar_tensor", "where"]
    with torch.no_grad():
        original, ours = to_fx(graph)(x)[0], to_fx(rewritten)(x)[0]
    assert torch.equal(original[:2], ours[:2]) and torch.equal(ours[1], torch.zeros(4))
    assert original[2:].isnan().all() and torch.equal(ours[2:], torch.zeros(2, 4))


class HeadsProj(nn.Module):
    """Attention whose merged heads go through a Linear: capture gives ``bmm`` against the broadcast weight."""

    def __init__(self, bias: bool = True) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8, bias=bias)

    def forward(self, q):
        b, h, s, d = q.shape
        a = torch.nn.functional.scaled_dot_product_attention(q, q, q)
        return self.proj(a.transpose(1, 2).reshape(b, s, h * d))


HEADS_PROJ_BEFORE = """\
  %view_6: f32[2, 3, 8] = aten.reshape.default(%permute_3, [2, 3, 8])
  %permute_4: f32[8, 8] = aten.permute.default(%proj.weight, [1, 0])
  %expand_5: f32[2, 8, 8] = aten.expand.default(%permute_4, [2, 8, 8])
  %bmm_2: f32[2, 3, 8] = aten.bmm.default(%view_6, %expand_5)
  %add: f32[2, 3, 8] = aten.add.Tensor(%bmm_2, %proj.bias)"""

HEADS_PROJ_AFTER = """\
  %view_6: f32[2, 3, 8] = aten.reshape.default(%permute_3, [2, 3, 8])
  %permute_4: f32[8, 8] = aten.permute.default(%proj.weight, [1, 0])
  %bmm_2_flat: f32[6, 8] = aten.reshape.default(%view_6, [6, 8])
  %bmm_2_addmm: f32[6, 8] = aten.addmm.default(%proj.bias, %bmm_2_flat, %permute_4)
  %add: f32[2, 3, 8] = aten.view.default(%bmm_2_addmm, [2, 3, 8])"""


@pytest.fixture(scope="module")
def heads_proj_o2():
    """HeadsProj captured and run through onnxruntime's -O2 (``cleanup{fold_params=false}``), which drops the
    no-op ``view(expand(x))`` pairs the batched-linear rewrite first matched."""
    from mlcomp.pipeline.manager import run_pipeline

    torch.manual_seed(0)
    q = torch.randn(2, 2, 3, 4)
    out = {}
    for bias in (True, False):
        module = HeadsProj(bias).eval()
        graph, _ = run_pipeline(load_model(module, example_inputs=(q,)).capture(), "cleanup{fold_params=false}")
        out[bias] = module, graph
    return q, out


def test_batched_linear_after_cleanup_is_one_gemm(heads_proj_o2, tmp_path):
    from mlcomp.runtime.codegen import to_fx
    from mlcomp.targets.onnx.patterns import ort_friendly
    from mlcomp.targets.onnx.target import export_onnx

    q, graphs = heads_proj_o2
    module, graph = graphs[True]
    before = str(graph)
    rewritten, stats = ort_friendly(graph, (q,))
    assert str(graph) == before
    assert _between(graph, "view_6", "add") == HEADS_PROJ_BEFORE
    assert _between(rewritten, "view_6", "add") == HEADS_PROJ_AFTER
    assert stats.rewrites == {"batched_linear": 1, "safe_softmax": 1}
    assert (stats.nodes_before, stats.nodes_after) == (28, 25)
    assert _ort_op_types(export_onnx(to_fx(graph).eval(), (q,)), tmp_path) == \
        ["FusedMatMul", "Equal", "Not", "Cast", "ReduceMax", "Cast", "Softmax", "Where", "MatMul", "Transpose",
         "Reshape", "MatMul", "Add"]
    art = get_target("onnxruntime").compile(graph, CompileOptions(threads=1))
    assert art.runtime.rewritten["rewrites"] == {"batched_linear": 1, "safe_softmax": 1}
    assert _ort_op_types(art.runtime.model, tmp_path) == \
        ["FusedMatMul", "Softmax", "IsNaN", "Where", "MatMul", "Transpose", "Reshape", "Gemm", "Reshape"]
    with torch.no_grad():
        assert torch.allclose(art(q), module(q), rtol=1e-5, atol=1e-6)


def test_batched_linear_without_bias_after_cleanup(heads_proj_o2):
    """No bias: the product itself (no view after it at -O2) becomes ``view(mm(reshape(x), w.T))``."""
    from mlcomp.runtime.codegen import to_fx
    from mlcomp.targets.onnx.patterns import linearize_batched_matmuls

    q, graphs = heads_proj_o2
    module, graph = graphs[False]
    rewritten = graph.copy()
    assert linearize_batched_matmuls(rewritten) == 1
    assert _between(rewritten, "view_6", "bmm_2") == """\
  %view_6: f32[2, 3, 8] = aten.reshape.default(%permute_3, [2, 3, 8])
  %permute_4: f32[8, 8] = aten.permute.default(%proj.weight, [1, 0])
  %bmm_2_flat: f32[6, 8] = aten.reshape.default(%view_6, [6, 8])
  %bmm_2_mm: f32[6, 8] = aten.mm.default(%bmm_2_flat, %permute_4)
  %bmm_2: f32[2, 3, 8] = aten.view.default(%bmm_2_mm, [2, 3, 8])"""
    assert not any(n.op.name == "expand" for n in rewritten.nodes())
    with torch.no_grad():
        assert torch.allclose(to_fx(rewritten)(q)[0], module(q), rtol=1e-5, atol=1e-6)


GRU_GOLDEN = """\
graph GRUTagger(%ids: i64[2, 5]) {
  %emb.weight: f32[20, 4] = param   # emb
  %gru.weight_ih_l0: f32[18, 4] = param   # gru
  %gru.weight_hh_l0: f32[18, 6] = param   # gru
  %gru.bias_ih_l0: f32[18] = param   # gru
  %gru.bias_hh_l0: f32[18] = param   # gru
  %out.weight: f32[3, 6] = param   # out
  %out.bias: f32[3] = param   # out
  %embedding: f32[2, 5, 4] = aten.embedding.default(%emb.weight, %ids)   # emb
  %gru_h0: f32[1, 2, 6] = aten.full.default([1, 2, 6], 0.0, dtype=f32)   # gru
  %gru_rnn: (f32[2, 5, 6], f32[1, 2, 6]) = aten.gru.input(%embedding, %gru_h0, [%gru.weight_ih_l0, \
%gru.weight_hh_l0, %gru.bias_ih_l0, %gru.bias_hh_l0], True, 1, 0.0, False, False, True)   # gru
  %permute_7: f32[2, 5, 6] = graph.getitem(%gru_rnn, 0)   # gru
  %permute_8: f32[6, 3] = aten.permute.default(%out.weight, [1, 0])   # out
  %bmm_1_flat: f32[10, 6] = aten.reshape.default(%permute_7, [10, 6])   # out
  %bmm_1_addmm: f32[10, 3] = aten.addmm.default(%out.bias, %bmm_1_flat, %permute_8)   # out
  %add_21: f32[2, 5, 3] = aten.view.default(%bmm_1_addmm, [2, 5, 3])   # out
  return (%add_21,)
}"""


@pytest.fixture(scope="module")
def gru_tagger():
    from mlcomp.models.third_party import GRUTagger

    torch.manual_seed(0)
    module = GRUTagger(vocab=20, dim=4, hidden=6, tags=3).eval()
    ids = torch.randint(0, 20, (2, 5), generator=torch.Generator().manual_seed(1))
    return module, ids, load_model(module, example_inputs=(ids,)).capture()


def test_gru_tagger_exports_one_onnx_gru(gru_tagger, tmp_path):
    from mlcomp.targets.onnx.patterns import ort_friendly

    module, ids, graph = gru_tagger
    before = str(graph)
    rewritten, stats = ort_friendly(graph, (ids,))
    assert str(graph) == before                               # the input graph is untouched
    assert str(rewritten) == GRU_GOLDEN
    assert stats.recomposed == ["gru"] and stats.rewrites == {"batched_linear": 1, "safe_softmax": 0}
    assert stats.nodes_before > 100 and stats.nodes_after == GRU_GOLDEN.count(" = ") + 2   # + input, output
    art = get_target("onnxruntime").compile(graph, CompileOptions(threads=1))
    assert art.runtime.rewritten["recomposed"] == ["gru"]
    counts = _ort_op_counts(art.runtime.model, tmp_path)
    assert counts.get("GRU") == 1 and counts.get("Gemm") == 1
    assert not {"Sigmoid", "Tanh", "Split"} & set(counts)    # no unrolled cell left
    with torch.no_grad():
        assert torch.allclose(art(ids), module(ids), rtol=1e-4, atol=1e-5)


def test_gru_region_reading_a_foreign_constant_is_left_alone(gru_tagger):
    """A region whose weights a pass replaced (not ``<module>.weight_ih_l0`` …) is exported unrolled."""
    from mlcomp.ir.builder import rename
    from mlcomp.targets.onnx.patterns import ort_friendly

    _module, ids, graph = gru_tagger
    graph = graph.copy()
    rename(graph, "gru.weight_hh_l0", "folded_constant")
    rewritten, stats = ort_friendly(graph, (ids,))
    assert stats.recomposed == [] and "folded_constant" in stats.skipped["gru"]
    assert any(n.op.name == "sigmoid" for n in rewritten.nodes())


def test_gru_tagger_at_o2_is_still_one_onnx_gru(gru_tagger):
    """-O2 for onnxruntime keeps the weights unfolded, and the folded initial state (``h0`` and
    ``h0.view(batch, hidden)``, two constants with the same zeros) is read as one state."""
    import mlcomp

    module, ids, _graph = gru_tagger
    art = mlcomp.compile(module, (ids,), target="onnxruntime", pipeline="-O2", threads=1)
    assert art.manifest["pipeline"] == "cleanup{fold_params=false},split-projections,cleanup{fold_params=false}"
    assert art.runtime.rewritten["recomposed"] == ["gru"] and art.runtime.rewritten["skipped"] == {}
    with torch.no_grad():
        assert torch.allclose(art(ids), module(ids), rtol=1e-4, atol=1e-5)
