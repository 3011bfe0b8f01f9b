"""The openvino target hands OpenVINO graphs it fuses: assertions on the layers the CPU plugin runs.

Each test compiles a small module with mlcomp and with OpenVINO's own ``convert_model`` and
compares ``get_runtime_model()`` layer types (``mlcomp.measure.executed``); no clock.
"""
from __future__ import annotations

import pytest
import torch
from torch import fx, nn

import mlcomp
from mlcomp.measure.executed import compare, ov_executed, ov_own
from mlcomp.pipeline.presets import Rewrite, adapt_preset
from mlcomp.targets import get_target

pytestmark = pytest.mark.openvino


class Attention(nn.Module):
    """Multi-head self-attention with an additive mask, layer norm and a GELU MLP (BERT's block, tiny)."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.qkv, self.out = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.norm, self.mlp = nn.LayerNorm(dim), nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = (t.view(b, s, self.heads, d // self.heads).transpose(1, 2) for t in self.qkv(x).chunk(3, -1))
        a = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        x = self.norm(x + self.out(a.transpose(1, 2).reshape(b, s, d)))
        return x + self.mlp(x)


def _kinds(counts) -> dict[str, int]:
    found: dict[str, int] = {}
    for key, n in counts.items():
        kind = key.split()[0]
        found[kind] = found.get(kind, 0) + n
    return found


@pytest.fixture(scope="module")
def attention():
    torch.manual_seed(0)
    # a causal mask: a mask OpenVINO dropped would change the result, and compile verifies against eager
    causal = torch.triu(torch.full((8, 8), float("-inf")), diagonal=1).expand(2, 1, 8, 8).contiguous()
    return Attention().eval(), (torch.randn(2, 8, 32), causal)


@pytest.fixture(scope="module")
def diffs(attention):
    module, inputs = attention
    own = ov_own(module, inputs)                   # OpenVINO's own conversion once, compiled at each hint
    return {hint: compare("attention", module, inputs, "openvino", hint=hint, own=own) for hint in ("f32", "bf16")}


def test_attention_runs_as_openvinos_fused_subgraph(diffs):
    diff = diffs["f32"]
    ours, own = _kinds(diff.ours), _kinds(diff.own)
    # decomposed attention would run as MatMul, Softmax and Transpose layers OpenVINO's own conversion has not
    # (where this host's plugin fuses attention, as on AVX-512: none of them, and one Attention snippet)
    for kind in ("Softmax", "MatMul"):
        assert ours.get(kind, 0) <= own.get(kind, 0), kind
    assert ours.get("Attention", 0) == own.get("Attention", 0) <= 1
    assert ours.get("Transpose", 0) <= own.get("Transpose", 0) + 1
    assert ours.get("MVN", 0) == own.get("MVN", 0) == 1            # layer norm as one MVN
    assert all(key.endswith("f32") for key in diff.ours if not key.startswith(("Gather", "Reorder")))


def test_one_layer_kind_for_int8_counts_diffs_and_the_anchors_goal(attention):
    from mlcomp.targets.openvino.int8 import int8_layers
    from mlcomp.targets.openvino.layers import family

    module, inputs = attention
    art = mlcomp.compile(module, inputs, target="openvino", pipeline="-O2", verify=False)
    counts = _kinds(ov_executed(art.runtime.compiled))
    record = int8_layers(art.runtime.compiled)
    # the int8 record and the executed-graph counts name the same compute layers, attention included
    compute = {k: n for k, n in counts.items() if family(k) == "compute"}
    # (six linears: the packed q/k/v runs as three, decision 43)
    assert {**record.int8, **record.floating} == compute and compute.get("FullyConnected") == 6
    # a snippet holding the softmax is the attention, never an element-wise Subgraph
    softmax_snippets = sum("Softmax" in op.get_rt_info()["originalLayersNames"].astype(str)
                           for op in art.runtime.compiled.get_runtime_model().get_ops()
                           if op.get_rt_info()["layerType"].astype(str) == "Subgraph")
    assert counts.get("Attention", 0) == softmax_snippets


def test_bf16_hint_gives_the_kernels_of_openvinos_own_conversion(diffs):
    diff = diffs["bf16"]
    assert diff.hint == "bf16" and diff.effective["ours"] == diff.effective["own"]
    assert diff.anchor == diffs["f32"].anchor == "ov.convert_model(torch.export)"
    # the compute kernels, each in the precision the plugin picked, as many as OpenVINO's own conversion runs
    for kind in ("MatMul", "Softmax", "MVN"):
        assert {k: n for k, n in diff.ours.items() if k.startswith(kind + " ")} == \
               {k: n for k, n in diff.own.items() if k.startswith(kind + " ")}, kind
    # in the precision the plugin settled on for this host (bf16 where the CPU has it, else f32); the packed
    # q/k/v projection OpenVINO's own conversion runs as one product and a Split runs as three (decision 43)
    settled = diff.effective["ours"]
    assert diff.ours[f"FullyConnected {settled}"] == diff.own[f"FullyConnected {settled}"] + 2 == 6
    assert not any(k.startswith("Split") for k in diff.ours) and any(k.startswith("Split") for k in diff.own)


def test_a_bf16_cpu_gets_the_bf16_hint_over_an_fp32_graph(attention, fake_hardware):
    fake_hardware("avx512-bf16")
    module, inputs = attention
    o2 = adapt_preset("-O2", "openvino", get_target("openvino").rewrites).text
    art = mlcomp.compile(module, inputs, target="openvino", pipeline=f"{o2},mixed-precision{{dtype=bf16}}",
                         verify=False)
    assert art.runtime.precision["requested"] == "bf16" and art.runtime.precision["hint"] == "bf16"
    # the graph OpenVINO converts stays fp32 (no bf16 casts for its converter to refuse)
    assert {p.get_element_type().get_type_name() for p in art.runtime.model.get_parameters()} == {"f32"}
    # the plugin computes in the precision it settled on for the hint (bf16 on a host that has it)
    settled = art.runtime.compiled.get_property("INFERENCE_PRECISION_HINT").get_type_name()
    assert ov_executed(art.runtime.compiled)[f"FullyConnected {settled}"] == 6     # q, k, v, out, two MLP


class TokenMixing(nn.Module):
    """MLP-Mixer's token mixing: a linear layer over the transposed (non-contiguous) sequence axis."""

    def __init__(self, tokens: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.norm, self.mix = nn.LayerNorm(dim), nn.Linear(tokens, 2 * tokens)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mix(self.norm(x).transpose(1, 2)).transpose(1, 2)


@pytest.mark.parametrize("hint", ["f32", "bf16"])
def test_a_linear_over_a_transposed_axis_runs_with_its_weight_once(hint):
    torch.manual_seed(0)
    module, inputs = TokenMixing().eval(), (torch.randn(2, 16, 8),)
    diff = compare("token-mixing", module, inputs, "openvino", pipeline="-O2,mixed-precision{dtype=bf16}",
                   hint=hint)
    # capture leaves bmm(x, weight.expand(b, k, n)): run as a batched MatMul, the weight would be transposed
    # (and, at the bf16 hint, reordered) on every call; as one 2-d product it is a FullyConnected layer
    ours, own = _kinds(diff.ours), _kinds(diff.own)
    assert ours.get("FullyConnected") == own.get("FullyConnected") == 1
    for kind in ("MatMul", "Transpose", "Reorder"):
        assert ours.get(kind, 0) <= own.get(kind, 0), (kind, diff.extra())


def test_presets_keep_the_recompositions_for_openvino():
    text = adapt_preset("-O2", "openvino", frozenset({Rewrite.CLEANUP, Rewrite.WEIGHT_FOLDING,
                                                      Rewrite.RECOMPOSE})).text
    assert text == "cleanup,recompose,fuse-attention,cleanup"
    assert "recompose" not in adapt_preset("-O2", "onnxruntime", frozenset({Rewrite.CLEANUP})).text


def test_only_the_ops_openvino_lacks_are_decomposed():
    from torch.fx.passes.shape_prop import ShapeProp

    from mlcomp.targets.openvino.lower import lower_for_frontend

    def f(q, k, v):
        y = torch.ops.aten.scaled_dot_product_attention.default(q, k, v)
        return (torch.ops.aten.reshape.default(torch.ops.aten.permute.default(y, [0, 2, 1, 3]), [2, 8, 32]),)

    inputs = tuple(torch.randn(2, 4, 8, 8) for _ in range(3))
    module = fx.symbolic_trace(f)
    ShapeProp(module).propagate(*inputs)
    lowered = lower_for_frontend(module, inputs, {torch.ops.aten.reshape.default: "implicit"}, whole=False)
    targets = {n.target for n in lowered.graph.nodes if n.op == "call_function"}
    assert torch.ops.aten.scaled_dot_product_attention.default in targets     # kept whole for OpenVINO
    assert torch.ops.aten.reshape.default not in targets
    assert torch.allclose(lowered(*inputs)[0], f(*inputs)[0])



def test_int8_encoder_runs_q_k_v_as_three_products_without_transposes_to_pick_them():
    """The packed in-projection of ``nn.MultiheadAttention``, split by ``quantize`` on openvino (decision 43):
    q, k, v as three int8 ``FullyConnected`` layers where the packed one ran one, then picked them out through
    three ``Gather`` and a transposed 5-d view (``quantize{split_projections=false}``: FullyConnected 5,
    Gather 3, Transpose 8 on this layer)."""
    from mlcomp.models.transformer import TransformerEncoderModel

    torch.manual_seed(0)
    module, x = TransformerEncoderModel(d_model=32, heads=4, ff=64, layers=1).eval(), torch.randn(2, 8, 32)
    art = mlcomp.compile(module, (x,), target="openvino", threads=1,
                         pipeline="fold-batchnorm,fold-constants,cleanup,quantize")
    executed = ov_executed(art.runtime.compiled)
    kinds = _kinds(executed)
    assert kinds["FullyConnected"] == 3 + 1 + 2 + 1                       # q, k, v, out, the MLP, the head
    assert all(k.endswith(("u8", "i8")) for k in executed if k.startswith("FullyConnected"))
    fused = art.runtime.int8.int8.get("Attention") == 1                    # attention int8 and whole, or
    assert fused or art.runtime.int8.int8.get("MatMul") == 1               # (no fused int8 attention) Q·Kᵀ int8
    # the packed projection's picking-apart (Gather 3, Transpose 8) gone; one Transpose more where attention runs
    # as its own MatMuls (AVX2 hosts)
    assert "Gather" not in kinds and kinds.get("Transpose", 0) <= 3 + (not fused)


def test_the_encoder_at_batch_1_runs_no_layout_kernel_beyond_openvinos_own():
    """The zoo transformer's class at batch 1 (decision 56): q, k, v reach attention through the 4-d heads' permute
    OpenVINO takes into its attention kernel, as at batch 2.  Before, per layer: Transpose 5 where OpenVINO's own
    conversion of the module runs 1 (3-d permutes, unsqueezes to 4-d, a squeeze after) and Reshape 12 to its 4.
    (Numbers against eager: ``tests/unit/passes/test_layouts.py`` on the same IR.)"""
    import openvino as ov

    from mlcomp.base.quiet import quiet_converter
    from mlcomp.targets.openvino.layers import family
    from mlcomp.targets.openvino.target import cpu_config
    from tests.helpers.modules import small_transformer

    module, inputs = small_transformer(1)
    module.eval()
    with torch.no_grad(), quiet_converter():
        model = ov.convert_model(module, example_input=inputs)
    art = mlcomp.compile(module, inputs, target="openvino", pipeline="-O2,mixed-precision{dtype=bf16}", verify=False)
    ours, own = ({k: n for k, n in _kinds(ov_executed(ov.Core().compile_model(m, "CPU", cpu_config("bf16", 1))))
                  .items()} for m in (art.runtime.model, model))
    layers = len(module.encoder.layers)
    assert ours.get("Attention", 0) == own.get("Attention", 0)
    assert ours.get("Transpose", 0) <= own.get("Transpose", 0) and "Gather" not in ours
    layout = lambda kinds: sum(n for k, n in kinds.items() if family(k) == "layout")  # noqa: E731
    assert layout(ours) <= layout(own)
    # views beyond OpenVINO's own: the [s, E] rows around the four linears of a layer (in place), no more
    assert ours["Reshape"] <= own.get("Reshape", 0) + 4 * layers
