"""The architectures of the support matrix: the zoo plus ``transformers`` models built from tiny configs.

Every ``transformers`` entry is a config class, a model class, the config's
keywords (2 layers, hidden 32-64, vocabulary 256: random weights, nothing
downloaded) and the kind of inputs it takes.  The model is the class a user
instantiates, called as a user calls it, with its default settings: decoder LMs
keep ``use_cache=True`` (their output holds ``logits`` and a ``transformers``
cache), encoders return their ``ModelOutput``::

    >>> model, inputs = build_architecture("llama")
    >>> type(model).__name__, tuple(inputs[0].shape)
    ('LlamaForCausalLM', (2, 16))
    >>> ARCHITECTURES["mixtral"].family
    'moe'

An architecture whose classes the installed ``transformers`` lacks is left out
of :func:`available_architectures` (with the reason), never silently skipped.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from mlcomp.models import ZOO
from mlcomp.models.third_party import GENERATIVE, LM_VOCAB, build_generative

__all__ = ["ARCHITECTURES", "Architecture", "available_architectures", "build_architecture"]

VOCAB = LM_VOCAB
BATCH, SEQ = 2, 16


@dataclass(frozen=True)
class Architecture:
    """One row of the matrix: a zoo model (``config`` empty) or a ``transformers`` config/model pair."""

    name: str
    family: str                         # zoo, encoder, decoder, moe, encoder-decoder, vision, audio
    config: str = ""                    # transformers config class name
    model: str = ""                     # transformers model class name
    kwargs: dict = field(default_factory=dict)
    inputs: str = "ids"                 # ids | pixels | waveform | mel (GENERATIVE: its own kinds)

    @property
    def source(self) -> str:
        return "zoo" if not self.config else "transformers"


_ENC = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=VOCAB,
            max_position_embeddings=64)
_DEC = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=VOCAB, max_position_embeddings=64)
_MOE = dict(_DEC, num_local_experts=4, num_experts_per_tok=2)
_WHISPER = dict(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=2,
                decoder_attention_heads=2, encoder_ffn_dim=64, decoder_ffn_dim=64, vocab_size=VOCAB, num_mel_bins=16, max_source_positions=16, max_target_positions=32, pad_token_id=0,
                bos_token_id=1, eos_token_id=2, decoder_start_token_id=1, suppress_tokens=[],
                begin_suppress_tokens=[])
_TOKENS = dict(bos_token_id=1, eos_token_id=2)   # inside the small vocabulary
_T5 = dict(d_model=32, d_kv=16, d_ff=64, num_layers=2, num_heads=2, vocab_size=VOCAB)
_VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, image_size=32,
            patch_size=8)
_STAGES = dict(num_channels=3, num_stages=2, hidden_sizes=[16, 32], depths=[1, 1])

# the LMs as users build them (*ForCausalLM / *ForConditionalGeneration, default cache): third_party.GENERATIVE
_GENERATIVE_FAMILY = {"bart": "encoder-decoder", "t5": "encoder-decoder", "whisper": "encoder-decoder"}
# name -> (family, config class, model class, config keywords, inputs); the rest of the matrix
_TABLE: dict[str, tuple[str, str, str, dict, str]] = {
    "bert": ("encoder", "BertConfig", "BertModel", _ENC, "ids"),
    "roberta": ("encoder", "RobertaConfig", "RobertaModel", dict(_ENC, max_position_embeddings=66), "ids"),
    "albert": ("encoder", "AlbertConfig", "AlbertModel", dict(_ENC, embedding_size=16), "ids"),
    "electra": ("encoder", "ElectraConfig", "ElectraModel", dict(_ENC, embedding_size=16), "ids"),
    "distilbert": ("encoder", "DistilBertConfig", "DistilBertModel",
                   dict(dim=32, n_layers=2, n_heads=2, hidden_dim=64, vocab_size=VOCAB), "ids"),
    "t5-encoder": ("encoder", "T5Config", "T5EncoderModel", _T5, "ids"),
    "clip-text": ("encoder", "CLIPTextConfig", "CLIPTextModel", dict(_ENC, projection_dim=32, **_TOKENS), "ids"),
    "gemma": ("decoder", "GemmaConfig", "GemmaForCausalLM", dict(_DEC, head_dim=16), "ids"),
    "mixtral": ("moe", "MixtralConfig", "MixtralForCausalLM", _MOE, "ids"),
    "qwen2-moe": ("moe", "Qwen2MoeConfig", "Qwen2MoeForCausalLM",
                  dict(_DEC, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                       shared_expert_intermediate_size=64), "ids"),
    "vit": ("vision", "ViTConfig", "ViTModel", _VIT, "pixels"),
    "deit": ("vision", "DeiTConfig", "DeiTModel", _VIT, "pixels"),
    "swin": ("vision", "SwinConfig", "SwinModel",
             dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1], num_heads=[2, 2], window_size=4),
             "pixels"),
    "convnext": ("vision", "ConvNextConfig", "ConvNextModel", _STAGES, "pixels"),
    "resnet": ("vision", "ResNetConfig", "ResNetModel", dict(_STAGES, embedding_size=16), "pixels"),
    "mobilevit": ("vision", "MobileViTConfig", "MobileViTModel",
                  dict(image_size=32, hidden_sizes=[32, 32, 32], neck_hidden_sizes=[8, 8, 16, 16, 16, 24, 32],
                       num_attention_heads=2), "pixels"),
    "segformer": ("vision", "SegformerConfig", "SegformerModel",
                  dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1], hidden_sizes=[16, 32],
                       patch_sizes=[7, 3], strides=[4, 2], num_attention_heads=[1, 2], mlp_ratios=[2, 2]),
                  "pixels"),
    "wav2vec2": ("audio", "Wav2Vec2Config", "Wav2Vec2Model",
                 dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                      conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3), num_conv_pos_embeddings=16,
                      num_conv_pos_embedding_groups=2, vocab_size=VOCAB), "waveform"),
    "whisper-encoder": ("audio", "WhisperConfig", "WhisperEncoder", _WHISPER, "mel"),
}

ARCHITECTURES: dict[str, Architecture] = {
    **{name: Architecture(name, "zoo") for name in ZOO},
    **{name: Architecture(name, _GENERATIVE_FAMILY.get(name, "decoder"), cfg, cls, kw, kind)
       for name, (cfg, cls, kw, kind) in GENERATIVE.items()},
    **{name: Architecture(name, fam, cfg, cls, kw, kind) for name, (fam, cfg, cls, kw, kind) in _TABLE.items()},
}


def available_architectures() -> tuple[list[str], dict[str, str]]:
    """``(names buildable here, {name: why not})``: a ``transformers`` row needs its classes installed."""
    missing: dict[str, str] = {}
    try:
        import transformers as tf
    except ImportError:
        tf = None
    for arch in ARCHITECTURES.values():
        if arch.source == "zoo":
            continue
        if tf is None:
            missing[arch.name] = "transformers is not installed"
        elif not all(hasattr(tf, c) for c in (arch.config, arch.model)) and not _whisper_encoder(arch):
            missing[arch.name] = f"transformers {tf.__version__} has no {arch.config}/{arch.model}"
    return [n for n in ARCHITECTURES if n not in missing], missing


def _whisper_encoder(arch: Architecture) -> bool:
    return arch.model == "WhisperEncoder"


def _inputs(kind: str, config: object, gen: torch.Generator) -> tuple[torch.Tensor, ...]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    mel = lambda: torch.randn(BATCH, config.num_mel_bins, 2 * config.max_source_positions, generator=gen)  # noqa: E731
    return {
        "ids": lambda: (ids,),
        "pixels": lambda: (torch.randn(BATCH, 3, 32, 32, generator=gen),),
        "waveform": lambda: (torch.randn(BATCH, 1600, generator=gen),),
        "mel": lambda: (mel(),),
    }[kind]()


def build_architecture(name: str, *, seed: int = 0) -> tuple[nn.Module, tuple[torch.Tensor, ...]]:
    """``(model in eval mode, example inputs)`` for one of :data:`ARCHITECTURES`; ``KeyError`` if unknown.

    Zoo models: batch 1.  ``transformers`` models: batch 2, 16 tokens / a 32x32 image /
    1600 audio samples / 16 mel bins x 32 frames; the LMs of :data:`~mlcomp.models.third_party.GENERATIVE`
    through :func:`~mlcomp.models.third_party.build_generative`.
    """
    arch = ARCHITECTURES[name]
    if arch.source == "zoo":
        entry = ZOO[name]
        return entry.build(seed), entry.example_inputs(batch=1)
    if name in GENERATIVE:
        return build_generative(name, BATCH, SEQ, seed=seed)
    import transformers as tf

    torch.manual_seed(seed)
    config = getattr(tf, arch.config)(**arch.kwargs)
    if _whisper_encoder(arch):
        from transformers.models.whisper.modeling_whisper import WhisperEncoder as model_cls
    else:
        model_cls = getattr(tf, arch.model)
    model = model_cls(config).eval()
    return model, _inputs(arch.inputs, config, torch.Generator().manual_seed(seed + 1))
