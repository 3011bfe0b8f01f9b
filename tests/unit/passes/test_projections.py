"""``split-projections``: golden IR, numbers against eager, stats, what stays packed, attention afterwards."""
from __future__ import annotations

import random
import textwrap

import pytest
import torch
from torch import nn

from mlcomp.frontend.loading import load_model
from mlcomp.ir import Mode
from mlcomp.ir.builder import GraphBuilder
from mlcomp.ir.ops import GETITEM, aten
from mlcomp.models.transformer import TransformerEncoderModel
from mlcomp.passes.layouts import compose
from mlcomp.passes.projections import split_projections
from mlcomp.pipeline import run_pipeline
from mlcomp.pipeline.presets import adapt_preset
from mlcomp.targets import get_target


def packed_graph(extra_reader: bool = False, mode: Mode = Mode.INFERENCE):
    """``x @ W + b`` ([4, 24]) as ``[4, 3, 8]``, q/k/v selected along the parts axis; ``extra_reader``: the
    packed view is also an output."""
    torch.manual_seed(0)
    b = GraphBuilder("qkv", mode=mode)
    x = b.input("x", (4, 8))
    w, bias = b.param("proj.weight_t", torch.randn(8, 24)), b.param("proj.bias", torch.randn(24))
    y = b.call(aten("addmm"), bias, x, w, origin="proj")
    v = b.call(aten("view"), y, [4, 3, 8], name="view")
    p = b.call(aten("permute"), v, [1, 0, 2], name="permute")
    q, k, val = (b.call(aten("select.int"), p, 0, i, name=n) for i, n in enumerate(("q", "k", "v")))
    s = b.call(aten("add.Tensor"), b.call(aten("mul.Tensor"), q, k, name="qk"), val, name="out")
    return b.output(s, v) if extra_reader else b.output(s)


def test_split_projections_golden():
    out, report = run_pipeline(packed_graph(), "split-projections", verify=True)
    assert out.format() == textwrap.dedent("""\
        graph qkv(%x: f32[4, 8]) {
          %proj.weight_t_0: f32[8, 8] = param   # proj
          %proj.bias_0: f32[8] = param   # proj
          %proj.weight_t_1: f32[8, 8] = param   # proj
          %proj.bias_1: f32[8] = param   # proj
          %proj.weight_t_2: f32[8, 8] = param   # proj
          %proj.bias_2: f32[8] = param   # proj
          %q: f32[4, 8] = aten.addmm.default(%proj.bias_0, %x, %proj.weight_t_0)
          %k: f32[4, 8] = aten.addmm.default(%proj.bias_1, %x, %proj.weight_t_1)
          %v: f32[4, 8] = aten.addmm.default(%proj.bias_2, %x, %proj.weight_t_2)
          %qk: f32[4, 8] = aten.mul.Tensor(%q, %k)
          %out: f32[4, 8] = aten.add.Tensor(%qk, %v)
          return (%out,)
        }""")
    assert report.records[0].stats == {"projections_split": 1, "parts": 3, "rows_reordered": 0}


def test_a_packed_value_with_another_reader_stays_packed():
    graph = packed_graph(extra_reader=True)
    before = graph.format()
    assert split_projections(graph) == {"projections_split": 0, "parts": 0, "rows_reordered": 0}
    assert graph.format() == before


def test_a_training_graph_keeps_its_packed_weight_and_a_preset_with_the_pass_runs_on_it():
    graph = packed_graph(mode=Mode.TRAINING)
    before = graph.format()
    out, report = run_pipeline(graph, adapt_preset("-O2", "cpu", get_target("cpu").rewrites).text)
    assert "split-projections" in [r.name for r in report.records]
    assert next(r for r in report.records if r.name == "split-projections").stats["projections_split"] == 0
    assert "proj.weight_t" in out.constants and not any(name.startswith("proj.weight_t_") for name in out.constants)
    assert graph.format() == before


def test_an_excluded_product_stays_packed():
    graph = packed_graph()
    assert split_projections(graph, leave=lambda n: n.op == aten("addmm"))["projections_split"] == 0


class HandSplit(nn.Module):
    """GPT-2's ``c_attn(x).split(E, dim=2)`` and a ``chunk`` of a second packed linear (two of three parts read)."""

    def __init__(self, e: int = 16) -> None:
        super().__init__()
        self.c_attn, self.kv = nn.Linear(e, 3 * e), nn.Linear(e, 3 * e)

    def forward(self, x):
        q, k, v = self.c_attn(x).split(x.shape[-1], dim=2)
        a, _, c = self.kv(x).chunk(3, dim=-1)
        return q * k + v, a - c


def test_hand_written_splits_become_one_linear_per_part_read():
    torch.manual_seed(0)
    module, x = HandSplit().eval(), torch.randn(2, 5, 16)
    graph = load_model(module, example_inputs=(x,)).capture()
    out, report = run_pipeline(graph, "fold-constants,cleanup,split-projections,cleanup", example_inputs=(x,),
                               verify=True)
    assert report.records[2].stats == {"projections_split": 2, "parts": 6, "rows_reordered": 0}
    ops = [n.op for n in out.call_nodes()]
    assert aten("split_with_sizes") not in ops and ops.count(aten("addmm")) == 5     # the unread part: none
    assert sum(t.numel() for t in out.constants.values()) < sum(t.numel() for t in graph.constants.values())


@pytest.fixture(scope="module")
def encoder():
    torch.manual_seed(0)
    module = TransformerEncoderModel(d_model=32, heads=4, ff=64, layers=2).eval()
    x = torch.randn(2, 8, 32)
    return module, x, load_model(module, example_inputs=(x,)).capture()


def test_the_zoo_encoder_computes_what_eager_does_with_q_k_v_apart(encoder):
    module, x, graph = encoder
    out, report = run_pipeline(graph, "cleanup,split-projections,cleanup", example_inputs=(x,), verify=True)
    # and the out-projection's (s, b) rows permuted once, not before and after it
    assert report.records[1].stats == {"projections_split": 2, "parts": 6, "rows_reordered": 2}
    ops = [n.op for n in out.call_nodes()]
    assert aten("select.int") not in ops and aten("squeeze.dims") not in ops
    # per layer q, k, v: product, bias, one reshape to heads and the one permute attention reads
    assert ops.count(aten("permute")) < [n.op for n in run_pipeline(graph, "cleanup")[0].call_nodes()].count(
        aten("permute"))
    from mlcomp.ir.interpreter import Interpreter
    with torch.no_grad():
        torch.testing.assert_close(Interpreter(out).run(x)[0], module(x), rtol=1e-5, atol=1e-5)
    assert sum(t.numel() for t in out.constants.values()) <= sum(t.numel() for t in graph.constants.values())


def test_attention_is_recovered_after_the_split(encoder):
    module, x, graph = encoder
    out, report = run_pipeline(graph, "cleanup,split-projections,recompose,fuse-attention,cleanup",
                               example_inputs=(x,), verify=True)
    assert report.records[3].stats == {"attention_fused": 2}
    sdpa = out.nodes(aten("scaled_dot_product_attention"))
    # q, k and v each come from their own product through one reshape and one permute
    for node in sdpa:
        for ref in node.inputs[:3]:
            permute = out.node(ref.name)
            assert permute.op == aten("permute") and list(permute.inputs[1]) == [0, 2, 1, 3]
            assert out.node(out.node(permute.inputs[0].name).inputs[0].name).op == aten("add.Tensor")


def test_presets_split_where_it_measured_faster():
    for target in ("openvino", "onnxruntime", "cpu"):
        assert "split-projections" in adapt_preset("-O2", target, get_target(target).rewrites).text
    cuda = adapt_preset("-O2", "cuda", get_target("cuda").rewrites)          # not measured: opt-in, not dropped
    assert "split-projections" not in cuda.text and not any("split" in d.spec for d in cuda.dropped)


def test_compose_computes_what_the_steps_do():
    rng = random.Random(0)
    for _ in range(300):
        shape = [rng.choice([1, 2, 3, 4, 6]) for _ in range(rng.randint(1, 4))]
        x, steps = torch.randn(shape), []
        for _ in range(rng.randint(1, 4)):
            cur = _apply(x, steps)
            if rng.random() < 0.5:
                steps.append(("permute", rng.sample(range(cur.dim()), cur.dim())))
            else:
                steps.append(("reshape", _factors(rng, cur.numel())))
        composed = compose(tuple(shape), steps)
        if composed is not None:
            assert torch.equal(_apply(x, composed), _apply(x, steps)), (shape, steps, composed)
            assert sum(kind == "permute" for kind, _ in composed) <= 1 and len(composed) <= 3


def _apply(x, steps):
    for kind, arg in steps:
        x = x.permute(arg) if kind == "permute" else x.reshape(arg)
    return x


def _factors(rng, n):
    dims = []
    while n > 1 and len(dims) < 3:
        d = rng.choice([d for d in range(2, n + 1) if n % d == 0])
        dims.append(d)
        n //= d
    return dims + ([n] if n > 1 else []) or [1]


def test_getitem_of_a_split_is_a_part():
    """A split whose getitems are all its readers; the golden parts read the same input."""
    b = GraphBuilder("split")
    x = b.input("x", (3, 4))
    y = b.call(aten("mm"), x, b.param("w", torch.randn(4, 6)))
    parts = b.call(aten("split_with_sizes"), y, [2, 4], 1, name="parts")
    graph = b.output(b.call(aten("relu"), b.call(GETITEM, parts, 1, name="second")))
    out, report = run_pipeline(graph, "split-projections", verify=True)
    assert [str(n.op) for n in out.call_nodes()] == ["aten.mm.default", "aten.relu.default"]
    assert out.constants["w_1"].shape == (4, 4) and "w" not in out.constants


def test_a_linears_rows_are_permuted_once_not_before_and_after_it():
    torch.manual_seed(0)
    b = GraphBuilder("rows")
    a = b.input("attn", (2, 4, 8, 8))
    p = b.call(aten("permute"), a, [2, 0, 1, 3], name="p")
    r = b.call(aten("reshape"), p, [16, 32], name="r")
    y = b.call(aten("addmm"), b.param("bias", torch.randn(32)), r, b.param("w", torch.randn(32, 32)), name="y")
    o = b.call(aten("permute"), b.call(aten("view"), y, [8, 2, 32], name="v"), [1, 0, 2], name="o")
    out, report = run_pipeline(b.output(o), "split-projections,cleanup", verify=True)
    assert report.records[0].stats["rows_reordered"] == 1
    assert out.format() == textwrap.dedent("""\
        graph rows(%attn: f32[2, 4, 8, 8]) {
          %bias: f32[32] = param
          %w: f32[32, 32] = param
          %y_rows: f32[2, 8, 4, 8] = aten.permute.default(%attn, [0, 2, 1, 3])
          %y_rows_1: f32[16, 32] = aten.reshape.default(%y_rows, [16, 32])
          %y_linear: f32[16, 32] = aten.addmm.default(%bias, %y_rows_1, %w)
          %o: f32[2, 8, 32] = aten.reshape.default(%y_linear, [2, 8, 32])
          return (%o,)
        }""")


def test_a_module_the_target_converts_whole_stays_packed(encoder):
    from mlcomp.pipeline.target_facts import TargetFacts

    _, x, graph = encoder
    facts = TargetFacts("openvino", whole_modules=frozenset({"MultiheadAttention"}))
    _, report = run_pipeline(graph, "split-projections", example_inputs=(x,), target=facts)
    assert report.records[0].stats["projections_split"] == 0
