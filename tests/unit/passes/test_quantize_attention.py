"""quantize on a whole attention (``scaled_dot_product_attention``): queries and keys on the product grids."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mlcomp.frontend.loading import load_model
from mlcomp.ir.interpreter import Interpreter
from mlcomp.ir.ops import aten
from mlcomp.ir.quant import DEQUANTIZE, QUANTIZE
from mlcomp.measure.variants import Variant
from mlcomp.pipeline import run_pipeline
from mlcomp.pipeline.target_facts import TargetFacts

SDPA = aten("scaled_dot_product_attention")


class Attention(nn.Module):
    """softmax(q kᵀ / 2) v of three linear projections, then an output linear."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(8, 8) for _ in range(4))

    def forward(self, x):
        p = torch.softmax(torch.bmm(self.q(x), self.k(x).transpose(1, 2)) * 0.5, -1)
        return self.o(torch.bmm(p, self.v(x)))


@pytest.fixture(scope="module")
def quantized():
    torch.manual_seed(0)
    model = Attention().eval()
    x = torch.randn(2, 64, 8, generator=torch.Generator().manual_seed(3))
    g = load_model(model, example_inputs=(x,)).capture()
    pipeline = Variant("openvino", "int8").pipeline(None)
    out, report = run_pipeline(g, pipeline, example_inputs=(x,), target=TargetFacts("openvino"))
    return model, x, out, report.records[-1].stats


def _producer_op(graph, value):
    return graph.node(value.name).op


def test_openvino_quantizes_the_queries_and_keys_of_a_whole_attention(quantized):
    model, x, out, stats = quantized
    (sdpa,) = out.nodes(SDPA)
    q, k, v = sdpa.inputs[:3]
    assert _producer_op(out, q) == _producer_op(out, k) == DEQUANTIZE     # Q·Kᵀ in int8
    assert _producer_op(out, v) != DEQUANTIZE                             # P·V in float
    assert not list(out.nodes(aten("bmm"))) and not list(out.nodes(aten("_softmax")))
    (record,) = [r for r in stats["layers"] if r["op"] == str(SDPA)]
    assert [i["grid"] for i in record["inputs"]] == ["zero-free", "signed"]
    assert "values and mask float" in record["float_args"]
    # its output is read in int8 by the output linear: one pair, the subgraph writes uint8
    users = out.users(sdpa.name)
    assert record["output"]["value"] == sdpa.name and any(u.op == QUANTIZE for u in users)
    with torch.no_grad():
        ref = model(x)
    got = Interpreter(out).run(x)[0]
    assert float((got - ref).abs().max() / ref.abs().max()) <= stats["declared_tolerance"]


def test_the_projections_write_on_the_grids_the_attention_reads(quantized):
    """q and k's linears quantize their outputs once, on the grid the attention reads them on (no second
    rounding between the linear and the attention)."""
    _, _, _, stats = quantized
    written = {r["output"]["value"]: (r["output"]["scale"], r["output"]["zero_point"])
               for r in stats["layers"] if r["op"] == "aten.addmm.default" and "output" in r}
    (record,) = [r for r in stats["layers"] if r["op"] == str(SDPA)]
    read = [(i["scale"], i["zero_point"]) for i in record["inputs"]]
    assert len(written) == 2 and sorted(read) == sorted(written.values()), (written, read)
