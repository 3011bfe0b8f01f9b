"""Models nobody here wrote: ``transformers`` models built from config classes (random weights, no downloads).

Small configurations (2 layers, hidden 64) that capture in seconds; every one
returns a plain tensor (its last hidden state), so verification compares one
output::

    model, inputs = build_third_party("bert", batch=2)
    model(*inputs).shape
    torch.Size([2, 32, 64])

:data:`GENERATIVE` are the language models as users build them: the
``*ForCausalLM`` / ``*ForConditionalGeneration`` class with its default settings
(``use_cache=True``), so the output holds ``logits`` and a ``transformers`` cache
(``DynamicCache``; ``EncoderDecoderCache`` for encoder-decoders).  Encoder-decoders
take ``(input_ids, decoder_input_ids)`` (Whisper: ``(input_features,
decoder_input_ids)``), passed by keyword through :class:`KeywordCall`::

    >>> model, inputs = build_generative("llama")
    >>> out = model(*inputs)
    >>> out.logits.shape, type(out.cache).__name__
    (torch.Size([2, 16, 256]), 'DynamicCache')

``transformers`` is optional (the test extra installs it); it is imported only
when a model is built.  ``gru-tagger`` (embedding → GRU → linear) needs nothing
beyond torch.
"""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["GENERATIVE", "THIRD_PARTY", "KeywordCall", "LastHidden", "GRUTagger", "build_generative",
           "build_third_party", "token_ids"]

THIRD_PARTY = ("bert", "vit", "distilbert", "gpt2", "t5-encoder", "gru-tagger")
VOCAB = 1000


class LastHidden(nn.Module):
    """A ``transformers`` model returning its last hidden state as a plain tensor."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.model(x).last_hidden_state


class GRUTagger(nn.Module):
    """Token ids → embedding → GRU → per-token tags."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, hidden: int = 64, tags: int = 10) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.gru = nn.GRU(dim, hidden, batch_first=True)
        self.out = nn.Linear(hidden, tags)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.emb(ids))
        return self.out(h)


def token_ids(batch: int, seq: int = 32, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """Deterministic token ids in ``[0, VOCAB)``."""
    return (torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(seed)),)


def build_third_party(name: str, batch: int = 2, *, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """``(model in eval mode, example inputs)`` for one of :data:`THIRD_PARTY`; ``KeyError`` if unknown."""
    if name not in THIRD_PARTY:
        raise KeyError(name)
    torch.manual_seed(seed)
    if name == "gru-tagger":
        return GRUTagger().eval(), token_ids(batch)
    import transformers as tf

    if name == "bert":
        cfg = tf.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                            vocab_size=VOCAB)
        return LastHidden(tf.BertModel(cfg)).eval(), token_ids(batch)
    if name == "distilbert":
        cfg = tf.DistilBertConfig(dim=64, n_layers=2, n_heads=4, hidden_dim=128, vocab_size=VOCAB)
        return LastHidden(tf.DistilBertModel(cfg)).eval(), token_ids(batch)
    if name == "vit":
        cfg = tf.ViTConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                           image_size=32, patch_size=8)
        gen = torch.Generator().manual_seed(seed + 1)
        return LastHidden(tf.ViTModel(cfg)).eval(), (torch.randn(batch, 3, 32, 32, generator=gen),)
    if name == "t5-encoder":
        cfg = tf.T5Config(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, vocab_size=VOCAB)
        return LastHidden(tf.T5EncoderModel(cfg)).eval(), token_ids(batch)
    cfg = tf.GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=64)
    return LastHidden(tf.GPT2Model(cfg)).eval(), token_ids(batch)


class KeywordCall(nn.Module):
    """Calls ``model(**dict(zip(names, inputs)))`` and returns its output unchanged (caches included)."""

    def __init__(self, model: nn.Module, names: tuple[str, ...]) -> None:
        super().__init__()
        self.model, self.names = model, names

    def forward(self, *inputs: torch.Tensor) -> object:
        return self.model(**dict(zip(self.names, inputs)))


LM_VOCAB = 256
_DECODER = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                vocab_size=LM_VOCAB, max_position_embeddings=64)
# name -> (config class, model class, config keywords, inputs: "ids" | "ids+decoder" | "features+decoder")
GENERATIVE: dict[str, tuple[str, str, dict, str]] = {
    "gpt2": ("GPT2Config", "GPT2LMHeadModel", dict(n_embd=64, n_layer=2, n_head=4, vocab_size=LM_VOCAB,
                                                   n_positions=64), "ids"),
    "gpt-neo": ("GPTNeoConfig", "GPTNeoForCausalLM", dict(hidden_size=64, num_layers=2, num_heads=4,
                                                          vocab_size=LM_VOCAB, max_position_embeddings=64,
                                                          attention_types=[[["global", "local"], 1]],
                                                          window_size=8), "ids"),
    "opt": ("OPTConfig", "OPTForCausalLM", dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                                ffn_dim=128, vocab_size=LM_VOCAB, max_position_embeddings=64,
                                                word_embed_proj_dim=64), "ids"),
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(_DECODER, num_key_value_heads=2), "ids"),
    "mistral": ("MistralConfig", "MistralForCausalLM", dict(_DECODER, num_key_value_heads=2), "ids"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", dict(_DECODER, num_key_value_heads=2), "ids"),
    "phi": ("PhiConfig", "PhiForCausalLM", dict(_DECODER), "ids"),
    "bart": ("BartConfig", "BartForConditionalGeneration", dict(
        d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=LM_VOCAB, max_position_embeddings=64), "ids"),
    "t5": ("T5Config", "T5ForConditionalGeneration", dict(d_model=64, d_kv=16, d_ff=128, num_layers=2,
                                                          num_heads=4, vocab_size=LM_VOCAB), "ids+decoder"),
    "whisper": ("WhisperConfig", "WhisperForConditionalGeneration", dict(
        d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=128, decoder_ffn_dim=128, vocab_size=LM_VOCAB, num_mel_bins=16,
        max_source_positions=16, max_target_positions=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
        decoder_start_token_id=1, suppress_tokens=[], begin_suppress_tokens=[]), "features+decoder"),
}


def build_generative(name: str, batch: int = 2, seq: int = 16, *, seed: int = 0
                     ) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """``(model in eval mode, example inputs)`` for one of :data:`GENERATIVE`; ``KeyError`` if unknown."""
    import transformers as tf

    config_cls, model_cls, kwargs, kind = GENERATIVE[name]
    torch.manual_seed(seed)
    config = getattr(tf, config_cls)(**kwargs)
    model = getattr(tf, model_cls)(config).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    ids = torch.randint(0, LM_VOCAB, (batch, seq), generator=gen)
    if kind == "ids":
        return model, (ids,)
    decoder = torch.randint(0, LM_VOCAB, (batch, seq // 2), generator=gen)
    if kind == "ids+decoder":
        return KeywordCall(model, ("input_ids", "decoder_input_ids")).eval(), (ids, decoder)
    features = torch.randn(batch, config.num_mel_bins, 2 * config.max_source_positions, generator=gen)
    return KeywordCall(model, ("input_features", "decoder_input_ids")).eval(), (features, decoder)
