"""quantize's int8 embedding tables: the lookup reads int8 rows, the float table is gone, the numbers hold."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mlcomp.frontend.loading import load_model
from mlcomp.ir.interpreter import Interpreter
from mlcomp.ir.ops import aten
from mlcomp.pipeline import run_pipeline


class Tagger(nn.Module):
    """A token embedding (100 × 64: quantized), a two-row type embedding (kept float), a linear."""

    def __init__(self) -> None:
        super().__init__()
        self.words, self.types, self.out = nn.Embedding(100, 64), nn.Embedding(2, 64), nn.Linear(64, 8)

    def forward(self, ids):
        return self.out(torch.relu(self.words(ids) + self.types(torch.zeros_like(ids))))


def _quantized(pipeline: str):
    torch.manual_seed(0)
    model = Tagger().eval()
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    g = load_model(model, example_inputs=(ids,)).capture()
    out, report = run_pipeline(g, pipeline, example_inputs=(ids,))
    stats = next(p for p in report.to_json()["passes"] if p["name"] == "quantize")["stats"]
    return model, ids, out, stats


def test_a_large_table_is_looked_up_in_int8_and_scaled_per_row():
    model, ids, out, stats = _quantized("quantize")
    [table] = stats["embeddings"]
    assert table["shape"] == [100, 64] and table["module"] == "words"
    lookups = [n for n in out.call_nodes() if n.op == aten("embedding")]
    tables = sorted((str(out.constants[n.inputs[0].name].dtype), tuple(out.constants[n.inputs[0].name].shape))
                    for n in lookups)
    # the int8 rows, their scales looked up with the same ids, and the two-row table kept float
    assert tables == [("torch.float32", (2, 64)), ("torch.float32", (100, 1)), ("torch.int8", (100, 64))], tables
    w = model.words.weight.detach()
    scales = out.constants[next(n.inputs[0].name for n in lookups if n.name.endswith("_s"))]
    assert torch.allclose(scales[:, 0], w.abs().amax(1) / 127)       # one symmetric scale per row
    assert not any(v.dtype == torch.float32 and tuple(v.shape) == (100, 64) for v in out.constants.values())
    with torch.no_grad():
        ref = model(ids)
        got = Interpreter(out).run(ids)[0]
    assert 0 < float((got - ref).abs().max() / ref.abs().max()) < 0.02


def test_embeddings_false_and_exclude_keep_the_table_float():
    for pipeline in ("quantize{embeddings=false}", "quantize{exclude=[words]}"):
        _, _, out, stats = _quantized(pipeline)
        assert stats["embeddings"] == [], pipeline
        assert any(tuple(v.shape) == (100, 64) and v.dtype == torch.float32 for v in out.constants.values())


@pytest.mark.ort
def test_onnxruntime_gathers_the_int8_table(tmp_path):
    import onnx
    import mlcomp
    torch.manual_seed(0)
    model = Tagger().eval()
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(1))
    art = mlcomp.compile(model, (ids,), target="onnxruntime", pipeline="quantize")
    proto = onnx.load_from_string(art.runtime.model)
    gathers = {n.input[0] for n in proto.graph.node if n.op_type == "Gather"}
    tables = {i.name: i for i in proto.graph.initializer if i.name in gathers}
    assert sorted(onnx.helper.tensor_dtype_to_np_dtype(t.data_type).name for t in tables.values()) == \
        ["float32", "float32", "int8"]        # the type table, the row scales, the int8 word table
    with torch.no_grad():
        assert float((art(ids) - model(ids)).abs().max() / model(ids).abs().max()) < 0.02
