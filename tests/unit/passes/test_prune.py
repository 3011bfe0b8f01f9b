"""Issue 11: the ``prune`` pass and the channel groups it stands on.

Tested three ways: IR before/after (golden text on a tiny model), numbers (the
pruned graph equals its masked reference to 1e-5; its deviation from the
unpruned model is reported), and the stats (channels, params, MACs from the
cost model).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mlcomp.passes.prune.channel_groups import GroupKind, find_channel_groups
from mlcomp.analysis.cost import node_flops
from mlcomp.base.errors import PipelineSpecError, VerificationError
from mlcomp.frontend.capture import capture_module
from mlcomp.ir.ops import PARAM
from mlcomp.passes.prune.prune import Prune, PruneMethod
from mlcomp.passes.prune.rewrite import two_four_mask
from mlcomp.pipeline import run_pipeline
from mlcomp.pipeline.instruments import Verify
from mlcomp.pipeline.pass_base import PassRegistry, PassResult


class Tiny(nn.Module):
    """conv → BN → ReLU → depthwise conv (+ strided skip) → flatten → Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 4, 3, padding=1, bias=False)
        self.bn = nn.BatchNorm2d(4)
        self.dw = nn.Conv2d(4, 4, 3, stride=2, padding=1, groups=4)
        self.fc = nn.Linear(4 * 2 * 2, 3)

    def forward(self, x):
        y = torch.relu(self.bn(self.conv(x)))
        y = torch.relu(self.dw(y)) + y[:, :, ::2, ::2]
        return self.fc(y.flatten(1))


class TinyEncoder(nn.Module):
    """One encoder layer (4 heads of 8, feed-forward 64) and a 5-way head."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(32, 5)

    def forward(self, x):
        return self.head(self.layer(x).mean(dim=1))


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    return capture_module(Tiny().eval(), (torch.randn(1, 2, 4, 4),), name="tiny")


@pytest.fixture(scope="module")
def encoder():
    torch.manual_seed(0)
    return capture_module(TinyEncoder().eval(), (torch.randn(2, 8, 32),), name="encoder")


def _shapes(graph) -> dict[str, tuple[int, ...]]:
    return {n.name: tuple(graph.constants[n.name].shape) for n in graph.nodes(PARAM)}


def _macs(graph) -> int:
    return sum(node_flops(graph, n) for n in graph.call_nodes()) // 2


# ---------------------------------------------------------------------------
# IR before/after

AFTER_TINY = """\
  %conv.weight: f32[2, 2, 3, 3] = param   # conv
  %bn.weight: f32[2] = param   # bn
  %bn.bias: f32[2] = param   # bn
  %dw.weight: f32[2, 1, 3, 3] = param   # dw
  %dw.bias: f32[2] = param   # dw
  %fc.weight: f32[3, 8] = param   # fc
  %fc.bias: f32[3] = param   # fc
  %bn.running_mean: f32[2] = param   # bn
  %bn.running_var: f32[2] = param   # bn
  %bn.num_batches_tracked: i64[] = param   # bn
  %convolution: f32[1, 2, 4, 4] = aten.convolution.default(%x, %conv.weight, None, [1, 1], [1, 1], [1, 1], False, [0, 0], 1)   # conv
  %_native_batch_norm_legit_no_training: (f32[1, 2, 4, 4], f32[2], f32[2]) = aten._native_batch_norm_legit_no_training.default(%convolution, %bn.weight, %bn.bias, %bn.running_mean, %bn.running_var, 0.1, 1e-05)   # bn
  %getitem: f32[1, 2, 4, 4] = graph.getitem(%_native_batch_norm_legit_no_training, 0)   # bn
  %relu: f32[1, 2, 4, 4] = aten.relu.default(%getitem)   # <root>
  %convolution_1: f32[1, 2, 2, 2] = aten.convolution.default(%relu, %dw.weight, %dw.bias, [2, 2], [1, 1], [1, 1], False, [0, 0], 2)   # dw
  %relu_1: f32[1, 2, 2, 2] = aten.relu.default(%convolution_1)   # <root>
  %slice_1: f32[1, 2, 2, 4] = aten.slice.Tensor(%relu, 2, 0, 9223372036854775807, 2)   # <root>
  %slice_2: f32[1, 2, 2, 2] = aten.slice.Tensor(%slice_1, 3, 0, 9223372036854775807, 2)   # <root>
  %add: f32[1, 2, 2, 2] = aten.add.Tensor(%relu_1, %slice_2)   # <root>
  %view: f32[1, 8] = aten.view.default(%add, [1, 8])   # <root>
  %permute: f32[8, 3] = aten.permute.default(%fc.weight, [1, 0])   # fc
  %addmm: f32[1, 3] = aten.addmm.default(%fc.bias, %view, %permute)   # fc
"""


def test_golden_ir_depthwise_residual_and_flatten(tiny):
    before = str(tiny)
    assert "%view: f32[1, 16] = aten.view.default(%add, [1, 16])" in before
    assert "[0, 0], 4)   # dw" in before                               # depthwise: groups = 4
    out, report = run_pipeline(tiny, "prune{sparsity=0.5 round_to=1}", verify=True)
    assert "\n".join(str(out).splitlines()[1:-2]) + "\n" == AFTER_TINY
    assert report.records[0].max_error < 1e-5                         # equals the masked reference
    assert str(tiny) == before                                        # the input graph is untouched


# ---------------------------------------------------------------------------
# groups found by walking the IR


def test_groups_on_lenet_expand_a_channel_into_its_spatial_block(captured):
    _, _, graph = captured("lenet")
    groups = find_channel_groups(graph)
    conv2 = groups.group_of("features.3.weight", 0)
    assert conv2.kind is GroupKind.CONV and conv2.fixed is None and conv2.size == 16
    assert ("classifier.1.weight", 1) in conv2.params                 # 400 = 16 channels x 5x5
    assert [s for _, s in groups.layout("classifier.1.weight", 1)] == [16, 5, 5]
    assert groups.group_of("classifier.5.weight", 0).fixed == "a graph output"


def test_groups_on_mobilenet_couple_depthwise_in_and_out(captured):
    _, _, graph = captured("mobilenet")
    groups = find_channel_groups(graph)
    hidden = groups.group_of("blocks.1.block.0.weight", 0)            # expand conv of block 1
    assert ("blocks.1.block.3.weight", 0) in hidden.params            # the depthwise conv
    assert ("blocks.1.block.6.weight", 1) in hidden.params            # the projection reads it
    # block 2 adds its input: block 1's projection and block 2's are one group
    out = groups.group_of("blocks.1.block.6.weight", 0)
    assert ("blocks.2.block.6.weight", 0) in out.params and out.fixed is None
    excluded = find_channel_groups(graph, exclude=("blocks.1.block.3",))
    assert excluded.group_of("blocks.1.block.0.weight", 0).fixed == "excluded"


def test_attention_heads_are_one_group_with_q_k_v_and_out_proj(encoder):
    groups = find_channel_groups(encoder)
    heads = [g for g in groups.groups if g.kind is GroupKind.HEAD]
    assert len(heads) == 1 and heads[0].size == 4 and heads[0].fixed is None
    assert set(heads[0].params) >= {("layer.self_attn.in_proj_weight", 0), ("layer.self_attn.out_proj.weight", 1)}
    assert [s for _, s in groups.layout("layer.self_attn.in_proj_weight", 0)] == [3, 4, 8]
    d_model = groups.group_of("layer.linear2.weight", 0)
    assert d_model.fixed == "a graph input"                           # the residual stream stays
    ffn = groups.group_of("layer.linear1.weight", 0)
    assert ffn.kind is GroupKind.LINEAR and ffn.fixed is None and ffn.size == 64


def test_groups_match_torch_pruning_on_resnet18(captured):
    tp = pytest.importorskip("torch_pruning")
    module, inputs, graph = captured("resnet18")
    groups = find_channel_groups(graph)
    dep = tp.DependencyGraph().build_dependency(module, example_inputs=inputs)
    names = {m: n for n, m in module.named_modules()}
    for conv in ("stem.0", "layer1.0.conv1", "layer2.0.conv1", "layer3.0.conv1", "layer4.0.conv1"):
        theirs = dep.get_pruning_group(dict(module.named_modules())[conv], tp.prune_conv_out_channels, idxs=[0])
        expected = sorted({names[d.target.module] for d, _ in theirs if d.target.module in names})
        assert list(groups.group_of(f"{conv}.weight", 0).modules) == expected, conv


# ---------------------------------------------------------------------------
# numbers: equal to the masked reference; deviation reported


@pytest.mark.parametrize("name", ["lenet", "mobilenet"])
def test_pruned_zoo_models_equal_their_masked_reference(captured, name):
    _, inputs, graph = captured(name)
    out, report = run_pipeline(graph, "prune{sparsity=0.5}", example_inputs=inputs, verify=True)
    stats = report.records[0].stats
    assert report.records[0].max_error < 1e-5
    out.verify()
    assert stats["params_after"] == sum(t.numel() for t in _shapes_numel(out))
    assert stats["macs_before"] == _macs(graph) and stats["macs_after"] == _macs(out)
    assert stats["macs_reduction"] > 2.0
    assert 0 < stats["output_rel_error"] and -1 <= stats["output_cosine"] <= 1
    assert 0 <= stats["top1_agreement"] <= 1
    assert all(g["channels_after"] % 8 == 0 for g in stats["groups"] if g["channels_before"] % 8 == 0)


def _shapes_numel(graph):
    return [graph.constants[n.name] for n in graph.nodes(PARAM)]


def test_head_and_ffn_pruning(encoder):
    x = (torch.randn(2, 8, 32),)
    heads, report = run_pipeline(encoder, "prune{method=head sparsity=0.5}", example_inputs=x, verify=True)
    assert _shapes(heads)["layer.self_attn.in_proj_weight"] == (48, 32)     # 3 x 2 heads x 8
    assert _shapes(heads)["layer.self_attn.out_proj.weight"] == (32, 16)
    assert _shapes(heads)["layer.linear1.weight"] == (64, 32)               # FFN untouched
    assert report.records[0].stats["groups"][0]["kind"] == "head"
    both, report = run_pipeline(encoder, "prune{sparsity=0.5}", example_inputs=x, verify=True)
    assert _shapes(both)["layer.linear1.weight"] == (32, 32) and _shapes(both)["layer.linear2.weight"] == (32, 32)
    assert report.records[0].max_error < 1e-5
    assert "[2, 2, 8, 8]" in str(both) and "[2, 4, 8, 8]" not in str(both)   # view literals follow


def test_a_wrong_reference_fails_verification(tiny):
    """The declared reference is really compared: the unpruned graph as 'reference' is caught."""

    class Liar(Prune):
        def run(self, graph, ctx):
            result = super().run(graph, ctx)
            return PassResult(result.graph, True, result.stats, reference=graph)

    Liar.name = "liar"
    registry = PassRegistry({"liar": Liar})
    with pytest.raises(VerificationError, match="pass 'liar'"):
        run_pipeline(tiny, "liar{round_to=1}", registry=registry, verify=True)


def test_bn_recalibration_keeps_the_reference_exact(tiny):
    calib = [torch.randn(1, 2, 4, 4, generator=torch.Generator().manual_seed(i)) + 1.0 for i in range(4)]
    out, report = run_pipeline(tiny, "prune{sparsity=0.5 round_to=1 recalibrate_bn=true}",
                               calibration_data=calib, instruments=[Verify()])
    assert report.records[0].max_error < 1e-5
    mean = out.constants["bn.running_mean"]
    assert mean.shape == (2,) and not torch.allclose(mean, tiny.constants["bn.running_mean"][:2])
    x = torch.cat(calib)
    conv = torch.nn.functional.conv2d(x, out.constants["conv.weight"], padding=1)
    assert torch.allclose(mean, conv.mean((0, 2, 3)), atol=1e-5)       # the statistics of the pruned conv


# ---------------------------------------------------------------------------
# selection, stats, options


def test_per_group_stats_add_up_when_one_group_is_pruned(captured):
    _, inputs, graph = captured("mlp")
    out, report = run_pipeline(graph, "prune{sparsity=0.5 exclude=4}", example_inputs=inputs, verify=True)
    stats = report.records[0].stats
    assert [g["channels_before"] for g in stats["groups"]] == [256]
    (group,) = stats["groups"]
    assert group["flops_removed"] == 2 * (stats["macs_before"] - stats["macs_after"])
    assert group["params_removed"] == stats["params_before"] - stats["params_after"]


def test_round_to_may_keep_a_whole_group(captured):
    _, inputs, graph = captured("lenet")
    out, report = run_pipeline(graph, "prune{sparsity=0.25}", example_inputs=inputs, verify=True)
    stats = report.records[0].stats
    sizes = [(g["channels_before"], g["channels_after"]) for g in stats["groups"]]
    assert sizes == [(6, 5), (16, 16), (120, 96), (84, 63)]           # 12 of 16 rounds up to 16, 90 to 96
    assert stats["channels_after"] == 5 + 16 + 96 + 63


def test_global_ranking_clamps_a_group_it_would_empty(captured, tiny):
    _, inputs, graph = captured("lenet")
    out, report = run_pipeline(graph, "prune{sparsity=0.9 ranking=global round_to=1}", example_inputs=inputs,
                               verify=True)
    stats = report.records[0].stats
    assert "group 0 (features.0, features.3): pruning would remove all 6 channels; kept 1" in stats["notes"]
    assert stats["groups"][0]["channels_after"] == 1 and report.records[0].max_error < 1e-5
    sparsity0 = run_pipeline(tiny, "prune{sparsity=0.0}")[1].records[0]
    assert not sparsity0.changed and "removes no channel" in sparsity0.stats["notes"][-1]


def test_sparsity_must_be_below_one():
    with pytest.raises(PipelineSpecError, match=r"in \[0, 1\)"):
        Prune(sparsity=1.0)
    with pytest.raises(PipelineSpecError, match=r"must be in \[0, 1\), got -0.1"):
        Prune(sparsity=-0.1)


def test_scope_that_matches_nothing_is_an_error(tiny):
    from mlcomp.base.errors import PassFailure

    with pytest.raises(PassFailure, match=r"prune\{method=head\} with scope .* matches nothing in graph tiny: it has no head groups"):
        run_pipeline(tiny, "prune{method=head}")


# ---------------------------------------------------------------------------
# magnitude and 2:4


@pytest.mark.parametrize("per_layer", [False, True])
def test_magnitude_writes_zeros_and_says_it_is_dense(captured, per_layer):
    _, inputs, graph = captured("lenet")
    out, report = run_pipeline(graph, f"prune{{method=magnitude sparsity=0.5 per_layer={str(per_layer).lower()}}}",
                               example_inputs=inputs, verify=True)
    stats = report.records[0].stats
    assert _shapes(out) == _shapes(graph)
    assert abs(stats["weight_sparsity"] - 0.5) < 0.01 and "no sparse kernel" in stats["kernel"]
    assert stats["compressed_bytes_after"] < stats["compressed_bytes_before"]
    w = out.constants["features.3.weight"]
    if per_layer:
        assert abs(float((w == 0).float().mean()) - 0.5) < 0.01
    assert out.node("features.3.weight").ann.sparsity == pytest.approx(float((w == 0).float().mean()), abs=1e-4)


def test_two_four_pattern_and_refusal_without_a_kernel():
    w = torch.randn(8, 16)
    mask = two_four_mask(w)
    assert (mask.reshape(8, 4, 4).sum(-1) == 2).all()
    assert two_four_mask(torch.randn(4, 6)) is None
    two_four = Prune(method=PruneMethod.TWO_FOUR)
    for target in ("cpu", "onnxruntime", "tvm"):
        with pytest.raises(PipelineSpecError, match=f"compute capability 8.0 or newer; target {target} cannot"):
            two_four.check_target(target)
    Prune().check_target("cpu")                                       # channel pruning runs anywhere
    from mlcomp.pipeline import Pipeline

    with pytest.raises(PipelineSpecError, match=r"must be in \[0, 1\)"):          # refused when parsed
        Pipeline.parse("cleanup,prune{sparsity=1.0}")


# ---------------------------------------------------------------------------
# every capture route


@pytest.mark.parametrize("fmt", ["torchscript", "pt2"])
def test_prune_a_saved_file(tmp_path, fmt):
    from click.testing import CliRunner

    from mlcomp.cli.main import main
    from mlcomp.frontend.loading import load_model

    path = tmp_path / ("lenet.pt" if fmt == "torchscript" else "lenet.pt2")
    res = CliRunner().invoke(main, ["models", "save", "lenet", "--format", fmt, "--batch", "2", "-o", str(path)])
    assert res.exit_code == 0, res.output
    graph = load_model(str(path)).capture()
    out, report = run_pipeline(graph, "prune{sparsity=0.5 round_to=1}", verify=True)
    assert report.records[0].max_error < 1e-5
    assert _shapes(out)[next(n for n in _shapes(out) if n.endswith("classifier.1.weight"))][1] == 200
