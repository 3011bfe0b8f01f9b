"""``nn.GRU`` on openvino: put back whole and converted to OpenVINO's ``GRUSequence`` (the CPU plugin's ``RNNSeq``),
not run as its unrolled cells; numbers against eager; a graph whose GRU weights were folded stays unrolled."""
from __future__ import annotations

import pytest
import torch
from torch import nn

import mlcomp
from mlcomp.frontend.loading import load_model
from mlcomp.measure.executed import ov_executed
from mlcomp.pipeline import run_pipeline

pytestmark = pytest.mark.openvino


class Tagger(nn.Module):
    """A GRU (``kw``: its options) read per step by a linear head."""

    def __init__(self, **kw) -> None:
        super().__init__()
        self.gru = nn.GRU(8, 16, **kw)
        self.out = nn.Linear(16 * (2 if kw.get("bidirectional") else 1), 4)

    def forward(self, x):
        return self.out(self.gru(x)[0])


def _kinds(compiled) -> dict[str, int]:
    found: dict[str, int] = {}
    for key, n in ov_executed(compiled).items():
        found[key.split()[0]] = found.get(key.split()[0], 0) + n
    return found


@pytest.mark.parametrize("kw, layers", [({"batch_first": True}, 1),
                                        pytest.param({"num_layers": 2, "bidirectional": True}, 2,
                                                     marks=pytest.mark.slow)])
def test_a_gru_runs_as_the_plugins_rnn_sequence_kernel(kw, layers):
    torch.manual_seed(0)
    model = Tagger(**kw).eval()
    x = torch.randn(3, 5, 8, generator=torch.Generator().manual_seed(1))
    x = x if kw.get("batch_first") else x.transpose(0, 1).contiguous()
    art = mlcomp.compile(model, (x,), target="openvino", pipeline="O0")
    kinds = _kinds(art.runtime.compiled)
    # unrolled, the cells' products run as FullyConnected/MatMul layers, one or more per step; whole, only the head
    assert kinds.get("RNNSeq", 0) >= layers and kinds.get("FullyConnected") == 1, kinds
    assert not {"MatMul", "TensorIterator", "Loop"} & set(kinds), kinds
    with torch.no_grad():
        assert torch.allclose(art(x), model(x), atol=1e-5)


def test_the_head_of_a_two_layer_gru_runs_with_its_bias_in_one_fully_connected():
    """The second layer's output reaches the head non-contiguous (captured ``bmm`` + bias ``add``): the bias
    moves before the view and the plugin runs product and bias as one ``FullyConnected``."""
    torch.manual_seed(0)
    model = Tagger(num_layers=2, batch_first=True).eval()
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(1))
    art = mlcomp.compile(model, (x,), target="openvino", pipeline="-O2")
    kinds = _kinds(art.runtime.compiled)
    assert kinds.get("RNNSeq") == 2 and kinds.get("FullyConnected") == 1, kinds
    assert not {"Subgraph", "Eltwise"} & set(kinds), kinds       # no element-wise layer after the head
    with torch.no_grad():
        assert torch.allclose(art(x), model(x), atol=1e-5)


def test_a_gru_whose_weights_cleanup_folded_stays_unrolled_with_the_reason():
    from mlcomp.targets.openvino.gru import whole_rnns

    torch.manual_seed(0)
    model = Tagger(batch_first=True).eval()
    x = torch.randn(3, 5, 8)
    graph = load_model(model, example_inputs=(x,)).capture()
    folded, _ = run_pipeline(graph, "cleanup", example_inputs=(x,))
    out, stats = whole_rnns(folded, (x,))
    assert out is folded and not stats.recomposed and "gru" in stats.skipped, stats.skipped
    whole, stats = whole_rnns(graph, (x,))
    assert stats.recomposed == ["gru"] and [str(n.op) for n in whole.call_nodes()].count("aten.gru.input") == 1


def test_the_default_preset_keeps_the_gru_whole_on_openvino_and_folds_it_elsewhere():
    """``-O2``'s cleanup folds weight transposes, but not those of a module openvino converts whole."""
    from mlcomp.pipeline.presets import adapt_preset
    from mlcomp.targets import get_target
    from mlcomp.targets.openvino.gru import whole_rnns

    torch.manual_seed(0)
    model = Tagger(batch_first=True).eval()
    x = torch.randn(3, 5, 8)
    graph = load_model(model, example_inputs=(x,)).capture()
    openvino = get_target("openvino")
    o2 = adapt_preset("-O2", "openvino", openvino.rewrites).text
    kept, _ = run_pipeline(graph, o2, example_inputs=(x,), target=openvino.capabilities.facts("openvino"))
    assert whole_rnns(kept, (x,))[1].recomposed == ["gru"]
    cpu = get_target("cpu")
    folded, _ = run_pipeline(graph, o2, example_inputs=(x,), target=cpu.capabilities.facts("cpu"))
    assert whole_rnns(folded, (x,))[1].recomposed == []
