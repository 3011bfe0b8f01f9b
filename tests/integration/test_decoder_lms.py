"""Decoder LMs as users build them (default ``use_cache=True``): the cache's tensors are outputs, verified.

One decoder-only and one encoder-decoder model on cpu and onnxruntime run in ``make test``; every
family on every target is marked ``slow``.
"""
from __future__ import annotations

import pytest
import torch
import torch.utils._pytree as pytree

import mlcomp
from mlcomp.frontend.cache_outputs import cache_classes, flat_caches, plain_outputs
from mlcomp.models.third_party import GENERATIVE, build_generative

pytest.importorskip("transformers")

FAST = {("gpt2", "cpu"), ("llama", "onnxruntime"), ("bart", "cpu"), ("bart", "onnxruntime")}
TARGETS = ("cpu", "onnxruntime", "openvino", "tvm")
MARKS = {"onnxruntime": [pytest.mark.ort], "tvm": [pytest.mark.tvm], "openvino": [pytest.mark.openvino]}
CASES = [pytest.param(name, target, marks=MARKS.get(target, []) + ([] if (name, target) in FAST
                                                                  else [pytest.mark.slow]))
         for name in GENERATIVE for target in TARGETS]
CACHE_TENSORS = {"bart": 8, "t5": 8, "whisper": 8}     # encoder-decoders: self- and cross-attention, 2 layers


@pytest.mark.parametrize("name, target", CASES)
def test_a_generative_model_compiles_with_its_cache_and_verifies(name, target):
    model, inputs = build_generative(name)
    art = mlcomp.compile(model, inputs, target=target, pipeline="-O2")
    assert art.verification["passed"]
    with torch.no_grad():
        expected = pytree.tree_leaves(plain_outputs(model(*inputs)))
        got = art(*inputs)
    assert len(got) == len(expected) == 1 + CACHE_TENSORS.get(name, 4) + (1 if name in CACHE_TENSORS else 0)
    for e, g in zip(expected, got):                   # logits and every key/value tensor, in the cache's order
        torch.testing.assert_close(g, e, rtol=1e-3, atol=1e-4)
    assert "Cache (" in art.manifest["capture_notes"][0]
    assert not any(c in pytree.SUPPORTED_NODES for c in cache_classes() if c.__module__.startswith("transformers")
                   and c.__name__ in ("DynamicCache", "EncoderDecoderCache"))      # registration was undone


def test_flattening_is_scoped_and_matches_the_eager_order():
    model, inputs = build_generative("gpt2")
    with torch.no_grad():
        out = model(*inputs)
    cache = out["cache"]
    assert type(cache) not in pytree.SUPPORTED_NODES
    with flat_caches() as scope:
        leaves, spec = pytree.tree_flatten(out)
        with flat_caches() as inner:                  # nested: the same scope
            assert inner is scope
        rebuilt = pytree.tree_unflatten(leaves, spec)
        assert [t is u for t, u in zip(pytree.tree_leaves(rebuilt), leaves)] == [True] * len(leaves)
    assert type(cache) not in pytree.SUPPORTED_NODES
    assert scope.flattened == {"DynamicCache": 4}
    plain = plain_outputs(out)
    assert list(plain["cache"]) == ["layers.0.keys", "layers.0.values", "layers.1.keys", "layers.1.values"]
    assert [t is u for t, u in zip(pytree.tree_leaves(plain), leaves)] == [True] * 5


def test_a_traced_torchscript_gpt2_captures(tmp_path):
    from torch import nn

    class NoCache(nn.Module):
        def __init__(self, lm: nn.Module) -> None:
            super().__init__()
            self.lm = lm

        def forward(self, ids):
            return self.lm(ids, use_cache=False, return_dict=False)

    model, (ids,) = build_generative("gpt2")
    torch.jit.trace(NoCache(model), (ids,), check_trace=False).save(str(tmp_path / "gpt2.pt"))
    art = mlcomp.compile(str(tmp_path / "gpt2.pt"), (ids,), target="cpu", pipeline="-O2")
    assert art.verification["passed"]
    with torch.no_grad():
        got = art(ids)
        torch.testing.assert_close(got[0] if isinstance(got, tuple) else got, model(ids).logits,
                                   rtol=1e-4, atol=1e-5)
