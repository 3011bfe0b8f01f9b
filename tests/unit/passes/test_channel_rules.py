"""The channel walk's rules table: every op it understands has a rule; other ops take the defaults."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mlcomp.passes.prune import channel_rules as R
from mlcomp.passes.prune.channel_groups import GroupKind, find_channel_groups
from mlcomp.passes.prune.channel_walk import ChannelWalk
from mlcomp.frontend.capture import capture_module
from mlcomp.ir import Graph, Node, Ref, TensorMeta
from mlcomp.ir.ops import GETITEM, INPUT, OUTPUT, aten

# every op the walk dispatches on, and the rule that handles it
HANDLED = {
    "graph.getitem": "getitem", "aten.cat.default": "cat",
    "aten.convolution.default": "conv", "aten.addmm.default": "addmm", "aten.mm.default": "mm",
    "aten.bmm.default": "bmm", "aten._native_batch_norm_legit_no_training.default": "batch_norm",
    "aten.native_layer_norm.default": "layer_norm", "aten.native_group_norm.default": "group_norm",
    "aten.scaled_dot_product_attention.default": "attention",
    "aten.permute.default": "permute", "aten.transpose.int": "permute", "aten.t.default": "permute",
    "aten.view.default": "reshape", "aten._unsafe_view.default": "reshape", "aten.reshape.default": "reshape",
    "aten.unsqueeze.default": "unsqueeze", "aten.squeeze.dim": "squeeze", "aten.squeeze.dims": "squeeze",
    "aten.expand.default": "expand",
    "aten.full_like.default": "same", "aten.zeros_like.default": "same", "aten.ones_like.default": "same",
    "aten.empty_like.default": "same",
    "aten.split.Tensor": "split", "aten.split_with_sizes.default": "split", "aten.slice.Tensor": "slice_",
    "aten.select.int": "select", "aten.embedding.default": "embedding",
    "aten.mean.dim": "reduce", "aten.sum.dim_IntList": "reduce", "aten.amax.default": "reduce",
    "aten.amin.default": "reduce", "aten.any.dim": "reduce", "aten.var.correction": "reduce",
    "aten.prod.dim_int": "reduce",
    "aten.avg_pool2d.default": "pool", "aten._adaptive_avg_pool2d.default": "pool",
    "aten.adaptive_avg_pool2d.default": "pool", "aten.max_pool2d_with_indices.default": "pool",
    "aten.max_pool2d.default": "pool",
    "aten._softmax.default": "softmax", "aten._log_softmax.default": "softmax", "aten._safe_softmax.default": "softmax",
}


def test_every_handled_op_has_its_rule():
    table = {str(op): rule.apply.__name__ for op, rule in R.RULES.items()}
    assert table == HANDLED


def test_preconditions():
    assert not R.RULES[GETITEM].needs_meta and not R.RULES[GETITEM].needs_input
    assert not R.RULES[aten("cat")].needs_meta and not R.RULES[aten("cat")].needs_input
    assert R.RULES[aten("addmm")].needs_meta and not R.RULES[aten("addmm")].needs_input   # its bias may be a number
    assert all(r.needs_meta and r.needs_input for op, r in R.RULES.items()
               if str(op) not in ("graph.getitem", "aten.cat.default", "aten.addmm.default"))


@pytest.mark.parametrize("op, default", [(aten("relu"), R.BROADCAST), (aten("add.Tensor"), R.BROADCAST),
                                         (aten("cumsum"), R.UNKNOWN), (aten("flip"), R.UNKNOWN)])
def test_ops_not_in_the_table_take_the_default(op, default):
    assert op not in R.RULES
    assert R.rule_for(op) is default


def _meta(*shape):
    return TensorMeta(shape, torch.float32)


def test_an_unknown_op_fixes_what_it_reads_and_writes():
    g = Graph("g")
    g.add(Node("x", INPUT, meta=_meta(2, 8)))
    g.add(Node("w", aten("relu"), inputs=(Ref("x"),), meta=_meta(2, 8)))
    g.add(Node("c", aten("cumsum"), inputs=(Ref("w"), 1), meta=_meta(2, 8)))
    g.add(Node("output", OUTPUT, inputs=((Ref("c"),),)))
    walk = ChannelWalk(g, ()).run()
    relu_axis = walk.lay[("w", None)][1]
    out_axis = walk.lay[("c", None)][1]
    assert walk.A.fixed_reason(relu_axis[0]) == "a graph input"                    # joined to x by broadcast
    assert walk.A.fixed_reason(out_axis[0]) == "aten.cumsum.default is not understood by the channel walk"


class EmbedLinear(nn.Module):
    """Embedding rows (indexed) -> Linear without bias (mm) -> ReLU -> Linear (addmm)."""

    def __init__(self) -> None:
        super().__init__()
        self.e, self.a, self.b = nn.Embedding(10, 8), nn.Linear(8, 6, bias=False), nn.Linear(6, 3)

    def forward(self, ids):
        return self.b(torch.relu(self.a(self.e(ids))))


def test_embedding_and_mm_rules():
    graph = capture_module(EmbedLinear().eval(), (torch.tensor([1, 2, 3]),), name="embed")
    assert {n.op.name for n in graph.call_nodes()} >= {"embedding", "mm", "addmm"}
    groups = {tuple(g.params): g for g in find_channel_groups(graph).groups}
    assert groups[(("e.weight", 0),)].fixed == "indexed"                         # rows indexed by the ids
    assert groups[(("e.weight", 1), ("a.weight", 1))].fixed is None               # columns feed the mm
    hidden = groups[(("a.weight", 0), ("b.weight", 1))]
    assert (hidden.size, hidden.kind, hidden.fixed) == (6, GroupKind.LINEAR, None)
    assert groups[(("b.weight", 0), ("b.bias", 0))].fixed == "a graph output"
