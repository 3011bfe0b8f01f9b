"""Models nobody tuned mlcomp for: random-weight Hugging Face BERT and GPT-2 built from configs.

Findings (torch 2.13): BERT captures through torch.export and the interpreter
matches eager; torch.fx.symbolic_trace cannot trace either (Python control flow
on shapes inside transformers); torch.export of GPT-2 yields a program whose
``view`` fails after decomposition (strides differ from eager's), so capture
retries with views as reshapes and GPT-2 captures too.  Each test fails if that
behaviour changes, in either direction.
"""
from __future__ import annotations

import pytest
import torch

from mlcomp.base.errors import CaptureError
from mlcomp.frontend.loading import load_model
from mlcomp.ir.interpreter import Interpreter

tf = pytest.importorskip("transformers", reason="transformers is part of the test extra")


class LastHidden(torch.nn.Module):
    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).last_hidden_state


def bert():
    torch.manual_seed(0)
    cfg = tf.BertConfig(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                        intermediate_size=256, vocab_size=1000)
    return LastHidden(tf.BertModel(cfg)).eval()


def gpt2():
    torch.manual_seed(0)
    cfg = tf.GPT2Config(n_embd=128, n_layer=2, n_head=4, vocab_size=1000, n_positions=128)
    return LastHidden(tf.GPT2Model(cfg)).eval()


IDS = torch.randint(0, 1000, (2, 32), generator=torch.Generator().manual_seed(0))


def test_bert_captures_and_interprets():
    model = bert()
    graph = load_model(model, example_inputs=(IDS,)).capture()
    graph.verify()
    ops = {str(n.op) for n in graph.call_nodes()}
    assert {"aten.embedding.default", "aten.native_layer_norm.default", "aten.bmm.default"} <= ops
    with torch.no_grad():
        torch.testing.assert_close(Interpreter(graph).run(IDS)[0], model(IDS), rtol=1e-5, atol=1e-5)


def test_bert_fx_path_fails_clearly():
    with pytest.raises(CaptureError, match="symbolic_trace could not trace LastHidden"):
        load_model(bert(), example_inputs=(IDS,)).capture(method="fx")


def test_gpt2_captures_and_interprets():
    """torch.export's program for GPT-2 calls ``view`` on a tensor whose decomposed strides differ
    from eager's (torch 2.13); capture retries with views as reshapes and then lowers it."""
    model = gpt2()
    graph = load_model(model, example_inputs=(IDS,)).capture()
    graph.verify()
    assert "aten._assert_tensor_metadata.default" not in {str(n.op) for n in graph.call_nodes()}
    with torch.no_grad():
        torch.testing.assert_close(Interpreter(graph).run(IDS)[0], model(IDS), rtol=1e-5, atol=1e-5)


def test_gpt2_fx_path_fails_clearly():
    with pytest.raises(CaptureError, match="symbolic_trace could not trace LastHidden"):
        load_model(gpt2(), example_inputs=(IDS,)).capture(method="fx")
