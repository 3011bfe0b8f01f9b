"""Bad input to ``compile_generator`` / ``compile --generate``: one paragraph, refused before any capture."""
from __future__ import annotations

import pytest
import torch

from mlcomp.api.generate import compile_generator
from mlcomp.base.errors import InputSpecError, ModelLoadError, OptionError
from mlcomp.models.third_party import build_generative, build_third_party

pytest.importorskip("transformers")


def one_paragraph(err: pytest.ExceptionInfo) -> str:
    text = str(err.value)
    assert "\n" not in text and "Traceback" not in text
    return text


@pytest.fixture(scope="module")
def llama():
    return build_generative("llama", batch=1, seq=8)


def test_prompt_longer_than_the_cache(llama):
    model, (prompt,) = llama
    with pytest.raises(InputSpecError) as err:
        compile_generator(model, prompt, 32, max_len=16)
    text = one_paragraph(err)
    assert "8 tokens and 32 new tokens need 40 cache positions, but the cache holds 16" in text
    assert "max_len >= 40" in text


def test_cache_beyond_the_models_positions(llama):
    model, (prompt,) = llama
    with pytest.raises(InputSpecError) as err:
        compile_generator(model, prompt, 32, max_len=128)
    assert "exceeds what LlamaForCausalLM was built for (max_position_embeddings 64)" in one_paragraph(err)


@pytest.mark.parametrize("build", [lambda: torch.nn.Linear(4, 4), lambda: build_third_party("bert")[0]],
                         ids=["plain-module", "encoder-without-lm-head"])
def test_a_model_without_a_cache_interface(build):
    with pytest.raises(ModelLoadError) as err:
        compile_generator(build(), torch.zeros(1, 4, dtype=torch.int64), 4, name="m")
    text = one_paragraph(err)
    assert "KV cache" in text or "decoder-only" in text
    assert "*ForCausalLM" in text                     # what to give instead


def test_bad_prompt(llama):
    model, _ = llama
    with pytest.raises(InputSpecError) as err:
        compile_generator(model, torch.randn(1, 8), 4)
    assert "int64 tensor [batch, prompt length]" in one_paragraph(err)
    with pytest.raises(InputSpecError) as err:
        compile_generator(model, torch.tensor([[1, 999]]), 4)
    assert "outside [0, 256)" in one_paragraph(err)


def test_tvm_refuses_up_front(llama):
    model, (prompt,) = llama
    with pytest.raises(OptionError) as err:
        compile_generator(model, prompt, 4, target="tvm")
    text = one_paragraph(err)
    assert "target tvm cannot compile a generator" in text and "--target cpu or onnxruntime" in text


def test_the_users_model_is_not_changed_by_a_refusal(llama):
    model, (prompt,) = llama
    model.train()
    with pytest.raises(InputSpecError):
        compile_generator(model, prompt, 32, max_len=16)
    assert model.training
    model.eval()


@pytest.mark.parametrize("args, expected", [
    (["llama", "--generate", "32", "--max-len", "16"], "need 40 cache positions, but the cache holds 16"),
    (["mlp", "--generate", "4"], "is not a transformers language model with a KV cache"),
    (["llama", "--generate", "4", "--target", "tvm"], "target tvm cannot compile a generator"),
])
def test_compile_generate_refusals_on_the_command_line(args, expected, tmp_path):
    from click.testing import CliRunner

    from mlcomp.cli.main import main

    res = CliRunner().invoke(main, ["compile", *args, "-o", str(tmp_path / "out")])
    assert res.exit_code == 2, res.output
    assert res.output.startswith("error: ") and "Traceback" not in res.output
    assert expected in res.output and "\n" not in res.output.strip()
    assert not (tmp_path / "out").exists()
