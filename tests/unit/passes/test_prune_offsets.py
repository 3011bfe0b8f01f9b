"""Issue 11: pruning through concat, split/slice and GroupNorm (offsets along the channel axis).

A channel c of input i of a ``cat`` is channel offset_i + c of its output; a
split or a step-1 slice is a concat read backwards; GroupNorm channels go a whole
group at a time.  Tested three ways: IR after (golden), numbers (the pruned graph
equals its masked reference to 1e-5), and the stats.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mlcomp.passes.prune.channel_groups import GroupKind, find_channel_groups
from mlcomp.analysis.cost import node_flops
from mlcomp.frontend.capture import capture_module
from mlcomp.ir.ops import PARAM
from mlcomp.pipeline import run_pipeline


class Inception(nn.Module):
    """Two conv branches concatenated on the channel axis, then BN and a conv reading all of them."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 8, 3, padding=1)
        self.b = nn.Conv2d(3, 16, 1)
        self.bn = nn.BatchNorm2d(24)
        self.c = nn.Conv2d(24, 4, 1)

    def forward(self, x):
        y = torch.cat([torch.relu(self.a(x)), self.b(x)], 1)
        return self.c(torch.relu(self.bn(y)))


class SplitHeads(nn.Module):
    """A fused q/k/v projection split into three, 4 heads of 8, attention, an output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(32, 96)
        self.proj = nn.Linear(32, 32)

    def forward(self, x):
        q, k, v = self.qkv(x).split(32, dim=-1)
        q, k, v = (t.view(2, 6, 4, 8).transpose(1, 2) for t in (q, k, v))
        y = nn.functional.scaled_dot_product_attention(q, k, v)
        return x + self.proj(y.transpose(1, 2).reshape(2, 6, 32))


class SplitConv(nn.Module):
    """One conv's channels split unevenly [4, 12] between two convs."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 16, 3, padding=1)
        self.b = nn.Conv2d(4, 4, 1)
        self.c = nn.Conv2d(12, 4, 1)

    def forward(self, x):
        p, q = torch.split(torch.relu(self.a(x)), [4, 12], dim=1)
        return self.b(p) + self.c(q)


class ConvGroupNorm(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Conv2d(3, 16, 3, padding=1)
        self.gn = nn.GroupNorm(4, 16)
        self.c = nn.Conv2d(16, 4, 1)

    def forward(self, x):
        return self.c(torch.relu(self.gn(self.a(x))))


def _capture(cls, *shape):
    torch.manual_seed(0)
    module = cls().eval()
    for m in module.modules():
        if isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1)
            m.running_var.uniform_(0.5, 2)
    x = (torch.randn(*shape),)
    return capture_module(module, x, name=cls.__name__.lower()), x


@pytest.fixture(scope="module")
def inception():
    return _capture(Inception, 1, 3, 5, 5)


def _body(graph) -> str:
    return "\n".join(str(graph).splitlines()[1:-2]) + "\n"


def _shapes(graph) -> dict[str, tuple[int, ...]]:
    return {n.name: tuple(graph.constants[n.name].shape) for n in graph.nodes(PARAM)}


def _macs(graph) -> int:
    return sum(node_flops(graph, n) for n in graph.call_nodes()) // 2


def _prune(graph, x, spec="prune{sparsity=0.5 round_to=1}"):
    out, report = run_pipeline(graph, spec, example_inputs=x, verify=True)
    record = report.records[0]
    assert record.max_error < 1e-5                                    # equals the masked reference
    out.verify()
    stats = record.stats
    assert stats["params_after"] == sum(out.constants[n.name].numel() for n in out.nodes(PARAM))
    assert (stats["macs_before"], stats["macs_after"]) == (_macs(graph), _macs(out))
    return out, stats


# ---------------------------------------------------------------------------
# concat

AFTER_INCEPTION = """\
  %a.weight: f32[4, 3, 3, 3] = param   # a
  %a.bias: f32[4] = param   # a
  %b.weight: f32[8, 3, 1, 1] = param   # b
  %b.bias: f32[8] = param   # b
  %bn.weight: f32[12] = param   # bn
  %bn.bias: f32[12] = param   # bn
  %c.weight: f32[4, 12, 1, 1] = param   # c
  %c.bias: f32[4] = param   # c
  %bn.running_mean: f32[12] = param   # bn
  %bn.running_var: f32[12] = param   # bn
  %bn.num_batches_tracked: i64[] = param   # bn
  %convolution: f32[1, 4, 5, 5] = aten.convolution.default(%x, %a.weight, %a.bias, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)   # a
  %relu: f32[1, 4, 5, 5] = aten.relu.default(%convolution)   # <root>
  %convolution_1: f32[1, 8, 5, 5] = aten.convolution.default(%x, %b.weight, %b.bias, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)   # b
  %cat: f32[1, 12, 5, 5] = aten.cat.default([%relu, %convolution_1], 1)   # <root>
  %_native_batch_norm_legit_no_training: (f32[1, 12, 5, 5], f32[12], f32[12]) = aten._native_batch_norm_legit_no_training.default(%cat, %bn.weight, %bn.bias, %bn.running_mean, %bn.running_var, 0.1, 1e-05)   # bn
  %getitem: f32[1, 12, 5, 5] = graph.getitem(%_native_batch_norm_legit_no_training, 0)   # bn
  %relu_1: f32[1, 12, 5, 5] = aten.relu.default(%getitem)   # <root>
  %convolution_2: f32[1, 4, 5, 5] = aten.convolution.default(%relu_1, %c.weight, %c.bias, [1, 1], [0, 0], [1, 1], False, [0, 0], 1)   # c
"""


def test_concat_groups_are_its_branches(inception):
    graph, _ = inception
    groups = find_channel_groups(graph)
    a, b = groups.group_of("a.weight", 0), groups.group_of("b.weight", 0)
    assert (a.kind, a.size, a.fixed, b.size, b.fixed) == (GroupKind.CONV, 8, None, 16, None)
    cat = groups.group_of("c.weight", 1)                             # the consumer reads the concat
    assert cat.size == 24 and cat.fixed.startswith("made of other groups")
    assert {("bn.weight", 0), ("bn.running_var", 0)} <= set(cat.params)
    keep = {a.id: torch.tensor([1, 6]), b.id: torch.tensor([0, 15])}
    assert groups.with_concats(keep)[cat.id].tolist() == [1, 6, 8 + 0, 8 + 15]   # offset 8 for b's channels


def test_prune_through_a_concat(inception):
    graph, x = inception
    before = str(graph)
    out, stats = _prune(graph, x)
    assert _body(out) == AFTER_INCEPTION
    assert str(graph) == before
    assert [(g["modules"], g["channels_before"], g["channels_after"]) for g in stats["groups"]] == \
        [(["a"], 8, 4), (["b"], 16, 8)]
    assert stats["channels_before"] == 24 and stats["channels_after"] == 12 and stats["macs_reduction"] == 2.0
    # the consumer keeps the columns of the kept branch channels, in order: 4 of a's, then 4 of b's (offset 8)
    old, new = graph.constants["c.weight"][:, :, 0, 0], out.constants["c.weight"][:, :, 0, 0]
    cols = [next(i for i in range(24) if torch.equal(old[:, i], new[:, j])) for j in range(12)]
    assert cols == sorted(cols) and sum(i < 8 for i in cols) == 4


# ---------------------------------------------------------------------------
# split and slice: a concat read backwards


def test_uneven_split_sizes_follow_their_parts():
    graph, x = _capture(SplitConv, 1, 3, 5, 5)
    groups = find_channel_groups(graph)
    assert groups.group_of("a.weight", 0).fixed.startswith("made of other groups")
    assert [(g.size, g.fixed) for g in (groups.group_of("b.weight", 1), groups.group_of("c.weight", 1))] == \
        [(4, None), (12, None)]
    out, stats = _prune(graph, x)
    assert "aten.split_with_sizes.default(%relu, [2, 6], 1)" in str(out)
    assert _shapes(out)["a.weight"] == (8, 3, 3, 3) and _shapes(out)["c.weight"] == (4, 6, 1, 1)
    assert stats["macs_reduction"] == 2.0


def test_fused_qkv_split_gives_one_head_group():
    graph, x = _capture(SplitHeads, 2, 6, 32)
    groups = find_channel_groups(graph)
    (heads,) = [g for g in groups.groups if g.kind is GroupKind.HEAD]
    assert heads.size == 4 and heads.fixed is None and ("proj.weight", 1) in heads.params
    assert groups.group_of("qkv.weight", 0).fixed.startswith("made of other groups")
    out, stats = _prune(graph, x, "prune{method=head sparsity=0.25}")
    assert _shapes(out)["qkv.weight"] == (72, 32) and _shapes(out)["proj.weight"] == (32, 24)
    assert "split" in str(out) and "[2, 6, 3, 8]" in str(out)
    assert stats["groups"][0]["kind"] == "head" and stats["channels_after"] == 3


# ---------------------------------------------------------------------------
# GroupNorm: whole groups


def test_group_norm_prunes_whole_groups():
    graph, x = _capture(ConvGroupNorm, 1, 3, 5, 5)
    groups = find_channel_groups(graph)
    whole = groups.group_of("a.weight", 0)
    assert (whole.kind, whole.size, whole.fixed) == (GroupKind.CONV, 4, None)      # 4 groups of 4 channels
    assert [s for _, s in groups.layout("gn.weight", 0)] == [4, 4]
    out, stats = _prune(graph, x)
    assert "aten.native_group_norm.default(%convolution, %gn.weight, %gn.bias, 1, 8, 25, 2, 1e-05)" in str(out)
    assert "(f32[1, 8, 5, 5], f32[1, 2], f32[1, 2])" in str(out)
    assert _shapes(out)["c.weight"] == (4, 8, 1, 1)
    kept = out.constants["gn.weight"]
    full = graph.constants["gn.weight"].reshape(4, 4)
    assert sum(bool((full == row).all(1).any()) for row in kept.reshape(2, 4)) == 2   # whole groups kept
    assert stats["groups"][0]["channels_after"] == 2


# ---------------------------------------------------------------------------
# GPT-2: HF's fused c_attn split into q, k, v


@pytest.mark.slow
def test_gpt2_head_pruning():
    pytest.importorskip("transformers")
    from mlcomp.models.third_party import build_third_party

    model, inputs = build_third_party("gpt2")
    graph = capture_module(model, inputs, name="gpt2")
    heads = [g for g in find_channel_groups(graph).groups if g.kind is GroupKind.HEAD]
    assert [(g.size, g.fixed) for g in heads] == [(4, None), (4, None)]           # one per layer
    out, stats = _prune(graph, inputs, "prune{method=head sparsity=0.25}")
    assert stats["macs_after"] < stats["macs_before"]
    assert _shapes(out)["model.h.0.attn.c_attn.weight"] == (64, 144)             # Conv1D: [in, 3 x 3 heads x 16]
    assert _shapes(out)["model.h.0.attn.c_proj.weight"] == (48, 64)
    assert "[48, 48, 48], 2)" in str(out)                                          # the split sizes follow
