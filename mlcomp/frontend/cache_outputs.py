"""Models that return ``transformers`` cache objects: their tensors become ordinary outputs.

A decoder LM built with its default settings (``use_cache=True``) returns its
attention keys and values in a cache object (``DynamicCache``; an
encoder-decoder returns an ``EncoderDecoderCache`` holding two of them).
``torch.export`` refuses an output of a type it cannot flatten.  mlcomp keeps
the cache: the artifact returns every tensor the cache holds, where the model
returns the cache, in the cache's own order (layer by layer, keys before
values; an encoder-decoder's self-attention cache before its cross-attention
cache), and verification compares each of them with eager.

Two pieces, used together by :meth:`mlcomp.frontend.loading.ModelSource.capture`:

* :func:`flat_caches` — while active, every ``transformers`` cache class
  (``transformers.cache_utils.Cache`` and its subclasses) is a pytree node, so
  ``torch.export`` flattens a returned cache into its tensors.  Registration is
  scoped: classes the user registered are left alone, ours are removed on exit,
  and ``transformers`` is never imported here (only classes already loaded are
  registered).  The context is not thread-safe (torch's pytree registry is
  process-wide).
* :class:`PlainCacheOutputs` — the eager reference: the user's model with each
  cache object in its outputs replaced by a dict ``{"layers.0.keys": tensor,
  ...}`` in the same order, so eager outputs flatten to the artifact's outputs
  (and name them: ``cache_layers_0_keys``...).  The user's module is not changed.

Unflattening (which ``torch.export`` does inside capture only) rebuilds a cache
of the same classes holding the tensors and plain attributes; tensor-valued
bookkeeping that a layer creates at construction (a sliding window's size
tensor) is not rebuilt, and no tensor is created, so the rebuilt cache adds
nothing to the traced program.

    >>> import transformers as tf
    >>> cfg = tf.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=100, n_positions=16)
    >>> out = tf.GPT2LMHeadModel(cfg).eval()(torch.zeros(1, 4, dtype=torch.long))
    >>> type(out["cache"]).__name__, list(plain_outputs(out)["cache"])
    ('DynamicCache', ['layers.0.keys', 'layers.0.values', 'layers.1.keys', 'layers.1.values'])
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn
from torch.utils import _pytree as pytree

__all__ = ["CacheFlattening", "PlainCacheOutputs", "cache_classes", "flat_caches", "plain_outputs"]

CACHE_MODULE = "transformers.cache_utils"
# tensors a cache layer makes at construction from its config, not from the model's computation
BOOKKEEPING_TENSORS = frozenset({"_sliding_window_tensor"})
_PLAIN = (int, float, bool, str, type(None), torch.device, torch.dtype, type)
_LEAF, _DROP = "tensor", "drop"


def cache_classes() -> list[type]:
    """Every loaded ``transformers`` cache class (none when ``transformers`` is not imported)."""
    module = sys.modules.get(CACHE_MODULE)
    base = getattr(module, "Cache", None)
    if base is None:
        return []
    out, stack = [], [base]
    while stack:
        cls = stack.pop()
        out.append(cls)
        stack.extend(cls.__subclasses__())
    return list(dict.fromkeys(out))


def _is_cache(value: Any) -> bool:
    base = getattr(sys.modules.get(CACHE_MODULE), "Cache", None)
    return base is not None and isinstance(value, base)


def _owned(value: Any) -> bool:
    """An object of ``transformers`` (a cache layer) whose attributes are walked."""
    return hasattr(value, "__dict__") and type(value).__module__.startswith("transformers.")


def _describe(value: Any, path: str, leaves: list[tuple[str, torch.Tensor]]) -> Any:
    """A hashable skeleton of ``value``; its tensors are appended to ``leaves`` (path, tensor), in order."""
    if isinstance(value, torch.Tensor):
        leaves.append((path, value))
        return _LEAF
    if isinstance(value, _PLAIN):
        return ("value", value)
    if isinstance(value, (list, tuple)):
        return (type(value), tuple(_describe(v, f"{path}.{i}", leaves) for i, v in enumerate(value)))
    if isinstance(value, dict):
        return (dict, tuple((k, _describe(v, f"{path}.{k}", leaves)) for k, v in value.items()
                            if isinstance(k, _PLAIN)))
    if _owned(value):
        attrs = tuple((k, _describe(v, f"{path}.{k}" if path else k, leaves)) for k, v in vars(value).items()
                      if k not in BOOKKEEPING_TENSORS)
        return ("object", type(value), attrs)
    return _DROP                      # streams and other handles: not part of the value


def _rebuild(skeleton: Any, leaves: Iterator[Any]) -> Any:
    if skeleton == _LEAF:
        return next(leaves)
    kind = skeleton[0]
    if kind == "value":
        return skeleton[1]
    if kind in (list, tuple):
        return kind(_rebuild(s, leaves) for s in skeleton[1])
    if kind is dict:
        return {k: _rebuild(s, leaves) for k, s in skeleton[1]}
    obj = skeleton[1].__new__(skeleton[1])
    for name, s in skeleton[2]:
        if s != _DROP:
            obj.__dict__[name] = _rebuild(s, leaves)
    return obj


def _leaves(cache: Any) -> tuple[list[tuple[str, torch.Tensor]], Any]:
    leaves: list[tuple[str, torch.Tensor]] = []
    skeleton = _describe(cache, "", leaves)
    return leaves, skeleton


class CacheFlattening:
    """The record of one :func:`flat_caches` scope: the cache classes it registered and those it flattened."""

    def __init__(self) -> None:
        self.registered: list[type] = []
        self.flattened: dict[str, int] = {}     # class name -> tensors of the last one flattened

    def _flatten(self, cache: Any) -> tuple[list[torch.Tensor], Any]:
        leaves, skeleton = _leaves(cache)
        self.flattened[type(cache).__name__] = len(leaves)
        return [t for _, t in leaves], skeleton

    def _flatten_with_keys(self, cache: Any) -> tuple[list[tuple[Any, torch.Tensor]], Any]:
        leaves, skeleton = _leaves(cache)
        self.flattened[type(cache).__name__] = len(leaves)
        return [(pytree.MappingKey(path), t) for path, t in leaves], skeleton

    @staticmethod
    def _unflatten(values: Any, skeleton: Any) -> Any:
        return _rebuild(skeleton, iter(list(values)))

    def register(self) -> None:
        for cls in cache_classes():
            if cls in pytree.SUPPORTED_NODES:       # the user's (or transformers') own registration stays
                continue
            pytree._private_register_pytree_node(
                cls, self._flatten, self._unflatten, flatten_with_keys_fn=self._flatten_with_keys,
                serialized_type_name=f"mlcomp.flat_cache.{cls.__module__}.{cls.__qualname__}")
            self.registered.append(cls)

    def unregister(self) -> None:
        while self.registered:
            cls = self.registered.pop()
            if cls in pytree.SUPPORTED_NODES:
                pytree._deregister_pytree_node(cls)

    def note(self) -> str | None:
        """One sentence for the manifest when a cache was flattened, else ``None``."""
        if not self.flattened:
            return None
        kinds = ", ".join(f"{name} ({n} tensors)" for name, n in sorted(self.flattened.items()))
        return (f"the model returns {kinds}; each cache tensor is an output of its own, where the model "
                "returns the cache (layer by layer, keys before values), verified against eager")


_ACTIVE: list[CacheFlattening] = []


@contextmanager
def flat_caches() -> Iterator[CacheFlattening]:
    """Scope in which ``transformers`` cache objects flatten to their tensors (see the module docstring).

    Nested scopes share the outermost one's record and registration.
    """
    if _ACTIVE:
        yield _ACTIVE[0]
        return
    scope = CacheFlattening()
    scope.register()
    _ACTIVE.append(scope)
    try:
        yield scope
    finally:
        _ACTIVE.pop()
        scope.unregister()


def plain_outputs(value: Any) -> Any:
    """``value`` with each cache object replaced by ``{path: tensor}`` (same order as :func:`flat_caches`).

    Dicts (and ``ModelOutput``) become plain dicts of their present fields; lists
    and tuples keep their type; anything else is returned as it is.
    """
    if isinstance(value, torch.Tensor):
        return value
    if _is_cache(value):
        return dict(_leaves(value)[0])
    if isinstance(value, dict):
        return {k: plain_outputs(v) for k, v in value.items()}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return type(value)(*(plain_outputs(v) for v in value))
    if isinstance(value, (list, tuple)):
        return type(value)(plain_outputs(v) for v in value)
    return value


class PlainCacheOutputs(nn.Module):
    """The eager reference of a model whose outputs hold caches: ``plain_outputs(model(...))``.

    ``model`` is the user's module, unchanged; capture unwraps it (``unwrap``).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return plain_outputs(self.model(*args, **kwargs))

    @staticmethod
    def unwrap(model: Any) -> Any:
        return model.model if isinstance(model, PlainCacheOutputs) else model
