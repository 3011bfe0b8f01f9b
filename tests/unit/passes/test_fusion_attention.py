"""``fuse-attention``: golden IR on hand-built attentions, the mask kept or made to the attention's shape.

A mask added to the scores at the attention's own rank that broadcasts to them (``[b, 1, s, s]``, ``[1, h, s, s]``)
is handed to the attention as it is; any other (another rank, scores computed with the heads merged into the batch)
is expanded to the scores and viewed at the attention's rank.
"""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from mlcomp.ir import Ref
from mlcomp.ir.builder import GraphBuilder
from mlcomp.ir.interpreter import Interpreter
from mlcomp.ir.ops import aten
from mlcomp.pipeline import run_pipeline
from tests.unit.passes.test_fusion import capture, golden, ops, run


def attention_graph(mask_shape=(8, 8), merged: bool = False):
    """softmax(q kᵀ / 4 + mask) v over 4-d q, k, v with the heads merged into the batch for the products;
    ``merged``: the scores stay 3-d (``[b·h, s, s]``) for the mask and the softmax too."""
    b = GraphBuilder("attn")
    q, k, v = (b.input(n, (2, 4, 8, 16)) for n in "qkv")
    mask = b.input("mask", mask_shape)
    kt = b.call(aten("reshape"), b.call(aten("transpose.int"), k, -2, -1), [8, 16, 8])
    s = b.call(aten("bmm"), b.call(aten("view"), q, [8, 8, 16]), kt)
    s = s if merged else b.call(aten("view"), s, [2, 4, 8, 8])
    p = b.call(aten("_softmax"), b.call(aten("add.Tensor"), b.call(aten("div.Tensor"), s, 4.0), mask), -1, False)
    p = p if merged else b.call(aten("view"), p, [8, 8, 8])
    o = b.call(aten("bmm"), p, b.call(aten("view"), v, [8, 8, 16]))
    return b.output(b.call(aten("view"), o, [2, 4, 8, 16]))


def test_fuse_attention_golden():
    """q, k, v are 4-d with the heads merged into the batch only for the bmm: the attention takes them as
    they are, and the views around it cancel."""
    out, stats = run(attention_graph(), "fuse-attention")
    assert out.format() == golden("""
        graph attn(%q: f32[2, 4, 8, 16], %k: f32[2, 4, 8, 16], %v: f32[2, 4, 8, 16], %mask: f32[8, 8]) {
          %scaled_dot_product_attention: f32[2, 4, 8, 16] = aten.scaled_dot_product_attention.default(%q, %k, %v, scale=0.25, attn_mask=%mask)
          %bmm_1: f32[8, 8, 16] = aten.reshape.default(%scaled_dot_product_attention, [8, 8, 16])
          %view_4: f32[2, 4, 8, 16] = aten.view.default(%bmm_1, [2, 4, 8, 16])
          return (%view_4,)
        }""")
    simpler, _ = run(out, "simplify")                 # the views around it fold away
    assert [n.op.name for n in simpler.call_nodes()] == ["scaled_dot_product_attention"]
    assert stats == {"attention_fused": 1}


def test_fuse_attention_keeps_a_per_batch_mask_unexpanded():
    """A ``[b, 1, s, s]`` mask (one per sequence, BERT's padding mask) broadcasts over the heads in the attention
    as in the add it replaces: no copy per head (at batch 32, 12 heads, 128 tokens one would be 25 MB)."""
    graph = attention_graph((2, 1, 8, 8))
    out, stats = run(graph, "fuse-attention")
    (sdpa,) = out.nodes(aten("scaled_dot_product_attention"))
    assert stats == {"attention_fused": 1} and sdpa.attrs["attn_mask"] == Ref("mask")
    assert not list(out.nodes(aten("expand")))
    xs = [torch.randn(2, 4, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    mask = torch.where(torch.rand(2, 1, 8, 8, generator=torch.Generator().manual_seed(5)) < 0.3, -1e4, 0.0)
    assert torch.allclose(Interpreter(out).run(*xs, mask)[0], Interpreter(graph).run(*xs, mask)[0], atol=1e-5)


class ScaledAttention(nn.Module):
    """Attention written out by hand: pre-scaled q and k, a causal mask, and the safe-softmax guard."""

    def forward(self, q, k, v):
        scale = q.shape[-1] ** -0.25
        s = (q * scale) @ (k * scale).transpose(-2, -1)
        s = s + torch.triu(torch.full((8, 8), float("-inf")), diagonal=1)
        return torch.softmax(s, dim=-1) @ v


def test_fuse_attention_folds_query_and_key_scales():
    graph = capture(ScaledAttention(), (2, 4, 8, 16), (2, 4, 8, 16), (2, 4, 8, 16))
    out, _ = run_pipeline(graph, "cleanup,fuse-attention,cleanup", verify=True)
    sdpa = [n for n in out.call_nodes() if n.op == aten("scaled_dot_product_attention")]
    assert len(sdpa) == 1 and math.isclose(sdpa[0].attrs["scale"], 0.25)
    assert not any(n.op in (aten("mul.Tensor"), aten("bmm"), aten("_softmax")) for n in out.call_nodes())


def test_attention_inside_the_zoo_transformer(captured):
    _, inputs, graph = captured("transformer")
    out, report = run_pipeline(graph, "cleanup,fuse-attention", example_inputs=inputs, verify=True)
    assert report.stats("fuse-attention") == {"attention_fused": 4}
    assert ops(out).count("aten.scaled_dot_product_attention.default") == 4
    assert "aten._softmax.default" not in ops(out)




def _same_numbers(graph, out, mask_shape) -> bool:
    xs = [torch.randn(2, 4, 8, 16, generator=torch.Generator().manual_seed(i)) for i in range(3)]
    mask = torch.where(torch.rand(mask_shape, generator=torch.Generator().manual_seed(5)) < 0.3, -1e4, 0.0)
    return torch.allclose(Interpreter(out).run(*xs, mask)[0], Interpreter(graph).run(*xs, mask)[0], atol=1e-5)


@pytest.mark.parametrize("mask_shape", [(1, 4, 8, 8), (2, 4, 8, 8)])
def test_a_mask_at_the_attentions_rank_that_broadcasts_is_handed_over_as_it_is(mask_shape):
    graph = attention_graph(mask_shape)
    out, stats = run(graph, "fuse-attention")
    (sdpa,) = out.nodes(aten("scaled_dot_product_attention"))
    assert stats == {"attention_fused": 1} and sdpa.attrs["attn_mask"] == Ref("mask")
    assert _same_numbers(graph, out, mask_shape)


# a mask that does not broadcast to the scores at the attention's rank: (its shape, whether the scores are 3-d)
# → the nodes that make the attention's mask of it
MADE_MASKS = {
    ((4, 8, 8), False): """
        %expand: f32[2, 4, 8, 8] = aten.expand.default(%mask, [2, 4, 8, 8])
        %reshape_1: f32[2, 4, 8, 8] = aten.reshape.default(%expand, [2, 4, 8, 8])""",
    ((8,), False): """
        %expand: f32[2, 4, 8, 8] = aten.expand.default(%mask, [2, 4, 8, 8])
        %reshape_1: f32[2, 4, 8, 8] = aten.reshape.default(%expand, [2, 4, 8, 8])""",
    ((8, 8, 8), True): """
        %reshape_1: f32[2, 4, 8, 8] = aten.reshape.default(%mask, [2, 4, 8, 8])""",
}


@pytest.mark.parametrize("mask_shape, merged", list(MADE_MASKS))
def test_any_other_mask_is_expanded_to_the_scores_and_viewed_at_the_attentions_rank(mask_shape, merged):
    """Another rank (a per-head ``[h, s, s]`` bias, a per-key ``[s]`` one) or scores with the heads merged into
    the batch (``full != want``): the mask the attention reads is the one the add saw, at the attention's rank."""
    graph = attention_graph(mask_shape, merged)
    out, stats = run(graph, "fuse-attention")
    made = [n.format() for n in out.call_nodes()][:-3]
    assert stats == {"attention_fused": 1} and "\n".join(made) == golden(MADE_MASKS[mask_shape, merged])
    (sdpa,) = out.nodes(aten("scaled_dot_product_attention"))
    assert sdpa.attrs["attn_mask"] == Ref("reshape_1")
    assert _same_numbers(graph, out, mask_shape)
