"""Capture of a decoder-only language model as two graphs over a static KV cache.

A ``transformers`` causal LM (Llama-, GPT-2-, Qwen2-style) is wrapped in
:class:`DecoderStep`, whose inputs are the token ids, the position of the first
of them (``start``, a 0-d int64; :class:`PrefillStep` has none, it starts at 0) and one
key and one value tensor per layer of shape ``[batch, kv_heads, max_len, head_dim]``.  The step runs the model with a
``transformers`` static cache whose layers *are* those tensors; the model writes
the new keys and values into them in place (``index_copy_``), which
``torch.export`` turns into one state output per cache tensor::

    prefill: (ids[B, P], kv_0, kv_1, ..., kv_{2L-1}) -> (kv_0', ..., kv_{2L-1}', logits[B, P, V])
    decode:  (ids[B, 1], start=t, kv_0, ...)                   -> (kv_0', ..., kv_{2L-1}', logits[B, 1, V])

Every ``kv_i'`` is ``index_put(kv_i, [start + arange(T)], new_keys)``: the cache with
the step's rows written.  :class:`CacheSpec` says which output updates which
input (the graph's state); the runtime keeps one set of cache tensors for the
whole generation (:mod:`mlcomp.runtime.generator`).  The model itself is not changed: the
steps only call it.

    >>> from mlcomp.models.third_party import build_generative
    >>> model, (ids,) = build_generative("llama", batch=1, seq=8)
    >>> spec = cache_spec(model, batch=1, max_len=48)
    >>> spec.layers, spec.shape
    (2, (1, 2, 48, 16))
    >>> step = PrefillStep(model, spec)
    >>> logits = step(ids, *spec.allocate())
    >>> tuple(logits.shape)
    (1, 8, 256)
"""
from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn

from mlcomp.base.errors import CaptureError, InputSpecError, ModelLoadError
from mlcomp.frontend.capture import capture_exported
from mlcomp.frontend.provenance import explain_export_failure
from mlcomp.base.quiet import quiet_torch
from mlcomp.ir import Graph, Ref
from mlcomp.ir.dtypes import dtype_name, parse_dtype

__all__ = ["CacheSpec", "DecoderStep", "PrefillStep", "step_inputs", "cache_spec", "capture_step", "check_decoder", "state_updates"]

NO_CACHE_HINT = ("give a transformers *ForCausalLM model (Llama, GPT-2, Qwen2, Mistral, ...) built with "
                 "its config, whose forward takes cache=/past_key_values= and supports a static cache")


@dataclass(frozen=True)
class CacheSpec:
    """The static KV cache: ``layers`` key/value pairs of ``shape`` and ``dtype``, ``max_len`` positions."""

    layers: int
    batch: int
    kv_heads: int
    max_len: int
    head_dim: int
    dtype: str = "float32"

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.batch, self.kv_heads, self.max_len, self.head_dim)

    @property
    def names(self) -> list[str]:
        """Input names of the cache tensors in the order the step takes them: ``kv_{2i}`` keys, ``kv_{2i+1}``
        values of layer ``i``."""
        return [f"kv_{i}" for i in range(2 * self.layers)]

    def allocate(self, device: str = "cpu") -> tuple[torch.Tensor, ...]:
        """One zeroed tensor per name: the whole cache, allocated once."""
        return tuple(torch.zeros(self.shape, dtype=parse_dtype(self.dtype), device=device) for _ in self.names)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "CacheSpec":
        return cls(**{k: data[k] for k in ("layers", "batch", "kv_heads", "max_len", "head_dim", "dtype")})


def check_decoder(model: Any, name: str) -> Any:
    """The model's ``transformers`` config, or an error saying why ``model`` is no decoder with a cache."""
    config = getattr(model, "config", None)
    kind = type(model).__name__
    if not isinstance(model, nn.Module) or config is None or not hasattr(config, "num_hidden_layers"):
        raise ModelLoadError(f"{name} ({kind}) is not a transformers language model with a KV cache: generation "
                             "compiles a prefill and a one-token decode step over a static cache, which needs the "
                             "model's config (layers, heads) and a forward that takes a cache", where=name,
                             hint=NO_CACHE_HINT)
    text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    if getattr(text, "is_encoder_decoder", False) or not callable(getattr(model, "can_generate", None)) \
            or not model.can_generate():
        raise ModelLoadError(f"{name} ({kind}) is not a decoder-only model that generates (encoder-decoders and "
                             "models without a language-model head have no single decode step)", where=name,
                             hint=NO_CACHE_HINT)
    if getattr(text, "sliding_window", None) and getattr(text, "use_sliding_window", True) and \
            any(t != "full_attention" for t in (getattr(text, "layer_types", None) or ["sliding"])):
        raise ModelLoadError(f"{name} ({kind}) uses sliding-window attention, whose cache is a ring buffer; "
                             "the static cache compiled here keeps every position", where=name,
                             hint="set config.use_sliding_window=False (or sliding_window=None) to compile it")
    return text


def cache_spec(model: nn.Module, *, batch: int, max_len: int, name: str | None = None) -> CacheSpec:
    """The cache a generation of ``batch`` sequences of up to ``max_len`` tokens needs."""
    name = name or type(model).__name__
    text = check_decoder(model, name)
    limit = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
    if limit is not None and max_len > limit:
        raise InputSpecError(f"a cache of {max_len} positions exceeds what {name} was built for "
                             f"(max_position_embeddings {limit})", where=name,
                             hint=f"generate at most {limit} tokens in all (prompt + new tokens)")
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    return CacheSpec(int(text.num_hidden_layers), batch, int(kv_heads), max_len, int(head_dim), dtype_name(dtype))


def _bound_cache(config: Any, spec: CacheSpec, start: torch.Tensor, kv: tuple[torch.Tensor, ...]) -> Any:
    """A ``transformers`` StaticCache whose layer tensors are ``kv`` and whose length so far is ``start``."""
    from transformers.cache_utils import StaticCache

    cache = StaticCache(config=config, max_cache_len=spec.max_len)
    if len(cache.layers) != spec.layers:
        raise CaptureError(f"the model's static cache has {len(cache.layers)} layers, its config "
                           f"{spec.layers}", hint=NO_CACHE_HINT)
    for i, layer in enumerate(cache.layers):
        layer.keys, layer.values = kv[2 * i], kv[2 * i + 1]
        layer.device = kv[2 * i].device
        layer.cumulative_length = start.clone()   # each layer counts on its own copy
        layer.is_initialized = True
    return cache


class DecoderStep(nn.Module):
    """``(ids, start, *kv) -> logits``, writing the step's keys and values into ``kv`` in place."""

    def __init__(self, model: nn.Module, spec: CacheSpec) -> None:
        super().__init__()
        self.model, self.spec = model, spec

    def forward(self, ids: torch.Tensor, start: torch.Tensor, *kv: torch.Tensor) -> torch.Tensor:
        cache = _bound_cache(self.model.config, self.spec, start, kv)
        return self.model(input_ids=ids, cache=cache, use_cache=True).logits


class PrefillStep(DecoderStep):
    """``(ids, *kv) -> logits``: the step from position 0 (the prompt), which needs no ``start``."""

    def forward(self, ids: torch.Tensor, *kv: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return super().forward(ids, torch.zeros((), dtype=torch.int64, device=ids.device), *kv)


def step_inputs(spec: CacheSpec, tokens: int, *, prefill: bool) -> tuple[torch.Tensor, ...]:
    """Example inputs of the prefill over ``tokens`` ids, or of the decode step (position 1), on a fresh cache."""
    ids = torch.zeros((spec.batch, tokens), dtype=torch.int64)
    return (ids, *spec.allocate()) if prefill else (ids, torch.tensor(1, dtype=torch.int64), *spec.allocate())


def capture_step(model: nn.Module, spec: CacheSpec, tokens: int, *, prefill: bool, name: str) -> Graph:
    """The IR of the prefill (``tokens`` prompt ids) or of the one-token decode step.

    Inputs ``ids, [start,] kv_0, ...``; outputs the updated cache tensors, then the logits.
    """
    step = (PrefillStep if prefill else DecoderStep)(model, spec).eval()
    inputs = step_inputs(spec, tokens, prefill=prefill)
    with torch.no_grad(), quiet_torch():
        try:
            ep = torch.export.export(step, inputs)
        except Exception as exc:  # noqa: BLE001 - converted to a user error
            raise explain_export_failure(exc, name) from None
    graph = capture_exported(ep, name=name)
    _check_inputs(graph, ["ids", *([] if prefill else ["start"]), *spec.names])
    state_updates(graph, spec)          # checks that the cache is the graph's state
    return graph


def _check_inputs(graph: Graph, names: list[str]) -> None:
    found = [n.name for n in graph.input_nodes]
    if found != names:
        raise CaptureError(f"the captured step takes inputs {', '.join(found)}, expected {', '.join(names)}",
                           where=graph.name, hint=NO_CACHE_HINT)


def state_updates(graph: Graph, spec: CacheSpec) -> list[tuple[int, str]]:
    """``(output index, input name)`` per cache tensor: the output that is the input with the step's rows written.

    A model whose captured step does not write each cache tensor exactly once
    (``index_put`` of that input) keeps its cache some other way and is refused.
    """
    outputs = graph.output_refs
    if len(outputs) != len(spec.names) + 1:
        raise CaptureError(f"{graph.name}: the captured step returns {len(outputs)} values; a model that writes "
                           f"its {len(spec.names)} cache tensors in place returns {len(spec.names) + 1} "
                           "(the updated cache, then the logits)", where=graph.name, hint=NO_CACHE_HINT)
    pairs = []
    for i, name in enumerate(spec.names):
        node = graph.node(outputs[i].name)
        if node.op.name not in ("index_put", "index_put_") or node.inputs[0] != Ref(name):
            raise CaptureError(f"{graph.name}: output {i} is {node.op.name}({node.inputs[0]}), not the cache "
                               f"tensor {name} with this step's rows written (index_put)", where=graph.name,
                               hint=NO_CACHE_HINT)
        pairs.append((i, name))
    return pairs
