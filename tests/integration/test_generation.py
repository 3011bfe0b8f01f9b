"""Greedy generation through a compiled prefill and decode graph over one static KV cache.

Each decoder (Llama, GPT-2, Qwen2 tiny configs, random weights) compiles once per module on cpu
(-O2); its 32 greedy tokens must equal ``model.generate(do_sample=False)``'s exactly, the cache
tensors keep their storage through a whole generation and nothing is copied into them, and the
saved generator reloads and generates the same tokens.  llama runs in ``make test`` (cpu and
onnxruntime), gpt2 and qwen2 are ``slow`` (each compile captures two graphs).
"""
from __future__ import annotations

import pytest
import torch

from mlcomp.api.generate import compile_generator, load_generator, update_in_place
from mlcomp.frontend.decoder import cache_spec, capture_step, state_updates
from mlcomp.models.third_party import build_generative

pytest.importorskip("transformers")

DECODERS = ("llama", "gpt2", "qwen2")
NEW = 32
PROMPT = 8


def eager_tokens(model, prompt):
    with torch.no_grad():
        out = model.generate(prompt, do_sample=False, max_new_tokens=NEW, min_new_tokens=NEW)
    return out[:, prompt.shape[1]:]


@pytest.fixture(scope="module", params=[pytest.param(n, marks=[] if n == "llama" else [pytest.mark.slow])
                                        for n in DECODERS])
def compiled(request):
    model, (prompt,) = build_generative(request.param, batch=1, seq=PROMPT)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    gen = compile_generator(model, prompt, NEW, target="cpu", pipeline="-O2", name=request.param)
    after = model.state_dict()
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)   # untouched
    return request.param, model, prompt, gen


def test_greedy_tokens_equal_eager_generate(compiled):
    name, model, prompt, gen = compiled
    assert gen.manifest["verification"]["tokens_equal"] and gen.manifest["verification"]["logits_passed"]
    run = gen.generate(prompt, NEW)
    assert run.tokens.shape == (1, NEW)
    assert torch.equal(run.tokens, eager_tokens(model, prompt)), name


def test_cache_is_one_allocation_written_in_place(compiled):
    _, _, prompt, gen = compiled
    before = [t.data_ptr() for t in gen.cache]
    gen.copies = 0
    gen.generate(prompt, NEW)
    assert [t.data_ptr() for t in gen.cache] == before
    assert gen.copies == 0 and gen.cache_update == "in place by the graph (index_put_)"
    assert all(p["in_place_updates"] == 2 * gen.spec.layers for p in gen.manifest["parts"].values())
    last = PROMPT + NEW - 2            # the last decode step feeds token 31 at this position (token 32 is not fed)
    assert gen.cache[0][:, :, last].abs().sum() > 0 and gen.cache[0][:, :, last + 1:].abs().sum() == 0


def test_saved_generator_reloads_and_generates_the_same(compiled, tmp_path):
    _, _, prompt, gen = compiled
    path = gen.save(tmp_path / "gen")
    again = load_generator(path)
    assert again.spec == gen.spec and again.manifest["verification"]["passed"]
    assert torch.equal(again.generate(prompt, NEW).tokens, gen.generate(prompt, NEW).tokens)
    assert again.decode.verify(record=False).passed       # the stored reference step, as `mlcomp run --verify`


@pytest.mark.ort
@pytest.mark.parametrize("name", [pytest.param(n, marks=[] if n == "llama" else [pytest.mark.slow])
                                  for n in DECODERS])
def test_onnxruntime_generates_eagers_tokens_into_the_same_cache(name, tmp_path):
    model, (prompt,) = build_generative(name, batch=1, seq=PROMPT)
    gen = compile_generator(model, prompt, NEW, target="onnxruntime", pipeline="-O2", name=name)
    before = [t.data_ptr() for t in gen.cache]
    run = gen.generate(prompt, NEW)
    assert torch.equal(run.tokens, eager_tokens(model, prompt))
    assert [t.data_ptr() for t in gen.cache] == before
    assert gen.copies == 0 and gen.cache_update == "in place through onnxruntime's I/O binding"
    assert gen.cache[0][:, :, PROMPT + NEW - 2].abs().sum() > 0          # ORT wrote the rows into our tensors
    again = load_generator(gen.save(tmp_path / "gen"))
    assert torch.equal(again.generate(prompt, NEW).tokens, run.tokens) and again.cache_update == gen.cache_update


def test_update_in_place_rewrites_only_the_cache_writes():
    model, _ = build_generative("gpt2", batch=1, seq=4)
    spec = cache_spec(model, batch=1, max_len=16)
    graph = capture_step(model, spec, 1, prefill=False, name="gpt2_decode")
    out, done = update_in_place(graph, spec)
    assert done == 2 * spec.layers
    ops = {out.node(out.output_refs[i].name).op.name for i, _ in state_updates(out, spec)}
    assert ops == {"index_put_"}
    assert "index_put_" not in {n.op.name for n in graph.call_nodes()}   # the captured graph is untouched


@pytest.mark.slow
def test_compile_generate_on_the_command_line(tmp_path):
    from click.testing import CliRunner

    from mlcomp.cli.main import main

    res = CliRunner().invoke(main, ["compile", "qwen2", "--generate", "32", "-o", str(tmp_path / "gen")])
    assert res.exit_code == 0, res.output
    assert "32 of 32 tokens equal" in res.output and "reloaded: 32 tokens equal" in res.output
    assert "written in place by the graph (index_put_)" in res.output
    assert {p.name for p in (tmp_path / "gen").iterdir()} >= {"generator.json", "prefill", "decode"}


@pytest.mark.openvino
@pytest.mark.slow
def test_openvino_generates_eagers_tokens_copying_into_the_same_cache():
    """OpenVINO's outputs are its own buffers: copied into the cache, which keeps its storage."""
    model, (prompt,) = build_generative("llama", batch=1, seq=PROMPT)
    gen = compile_generator(model, prompt, NEW, target="openvino", pipeline="-O2", name="llama")
    before = [t.data_ptr() for t in gen.cache]
    assert torch.equal(gen.generate(prompt, NEW).tokens, eager_tokens(model, prompt))
    assert [t.data_ptr() for t in gen.cache] == before
    assert gen.cache_update == "by OpenVINO's outputs copied into it after each step (no allocation)"


@pytest.mark.slow
def test_a_batch_of_prompts_generates_each_rows_tokens():
    model, (prompt,) = build_generative("qwen2", batch=2, seq=6)
    gen = compile_generator(model, prompt, 16, target="cpu", name="qwen2")
    assert gen.spec.batch == 2 and gen.spec.max_len == 32
    assert torch.equal(gen.generate(prompt, 16).tokens,
                       model.generate(prompt, do_sample=False, max_new_tokens=16, min_new_tokens=16)[:, 6:])


FACTORY = '''
import torch, transformers as tf

def decoder():
    torch.manual_seed(0)
    cfg = tf.Qwen2Config(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                         intermediate_size=64, vocab_size=128, max_position_embeddings=32)
    return tf.Qwen2ForCausalLM(cfg).eval(), (torch.tensor([[5, 17, 3, 99]]),)
'''


@pytest.mark.slow
def test_compile_generate_takes_a_factory_file(tmp_path):
    import json

    from click.testing import CliRunner

    from mlcomp.cli.main import main

    (tmp_path / "lm.py").write_text(FACTORY)
    res = CliRunner().invoke(main, ["compile", f"{tmp_path / 'lm.py'}:decoder", "--generate", "12", "--target",
                                    "onnxruntime", "-o", str(tmp_path / "gen"), "--json"])
    assert res.exit_code == 0, res.output
    facts = json.loads(res.output[res.output.index("{"):])
    assert facts["verification"]["tokens_equal"] and facts["cache"]["max_len"] == 16
    assert facts["prompt_shape"] == [1, 4] and facts["target"] == "onnxruntime"
