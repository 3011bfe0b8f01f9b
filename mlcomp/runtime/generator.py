"""A compiled generator: the prefill and decode artifacts of one decoder LM over one static KV cache.

:class:`Generator` owns the cache: ``2 * layers`` tensors of
:attr:`CacheSpec.shape <mlcomp.frontend.decoder.CacheSpec>`, allocated once when it
is built.  Each step passes them to an artifact as inputs; the artifact's first
outputs are the same tensors with the step's rows written.  Where the target wrote
them in place (cpu: the update is an ``index_put_`` on the input; onnxruntime: the output is
bound to the input's memory) the output *is* the cache tensor and nothing is copied; OpenVINO's
runtime copies its output buffers into the cache tensors (``with_state``); any other runtime's
returned tensors are copied into them by the loop.  The cache keeps its storage throughout::

    prefill(prompt[B, P], cache)        -> logits[B, P, V]   first token = argmax(logits[:, -1])
    decode(token[B, 1], start=P, cache) -> logits[B, 1, V]   start = P, P+1, ...

Saved as a folder: ``generator.json`` (format, cache spec, prompt length, what was
verified) and the two artifact folders ``prefill/`` and ``decode/``, each an ordinary
artifact (``mlcomp run DIR/decode --verify`` re-runs its stored reference step).
"""
from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from mlcomp.base.errors import ArtifactError, InputSpecError
from mlcomp.base.files import Kind, atomic_dir, check_destination
from mlcomp.frontend.decoder import CacheSpec
from mlcomp.runtime.artifact import Artifact

__all__ = ["GENERATOR_FORMAT", "GenerationRun", "Generator", "GreedyLoop"]

GENERATOR_FORMAT = "mlcomp-generator"
GENERATOR_FILE = "generator.json"
PARTS = ("prefill", "decode")


@dataclass
class GenerationRun:
    """The tokens of one greedy generation ``[B, N]``, the logits of each step, and its timings (seconds)."""

    tokens: torch.Tensor
    logits: list[torch.Tensor] = field(default_factory=list)
    first_token_s: float = 0.0
    decode_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        """Decode throughput: tokens after the first, per second of decode steps."""
        steps = self.tokens.shape[1] - 1
        return steps * self.tokens.shape[0] / self.decode_s if self.decode_s > 0 and steps > 0 else 0.0


class GreedyLoop:
    """Greedy decoding over a prefill and a decode step sharing one static cache, allocated once here.

    ``prefill(ids, *cache)`` and ``decode(ids, start, *cache)`` return the logits (a step that wrote
    the cache itself, as eager does) or ``(*updated cache, logits)``: an updated tensor that is not
    the cache tensor itself is copied into it (``copies`` counts them).
    """

    def __init__(self, prefill: Callable[..., Any], decode: Callable[..., Any], spec: CacheSpec,
                 prompt_len: int | None = None, where: str = "generator") -> None:
        self.steps, self.spec, self.prompt_len, self._where = (prefill, decode), spec, prompt_len, where
        self.cache = spec.allocate()          # the one allocation, reused by every generation
        self.copies = 0

    @property
    def where(self) -> str:
        return self._where

    def _run(self, step: Callable[..., Any], *inputs: torch.Tensor) -> torch.Tensor:
        outs = step(*inputs, *self.cache)
        if isinstance(outs, torch.Tensor):
            return outs
        for tensor, new in zip(self.cache, outs):
            if new.data_ptr() != tensor.data_ptr():
                tensor.copy_(new)
                self.copies += 1
        return outs[-1]

    def check_prompt(self, prompt_ids: torch.Tensor, max_new_tokens: int) -> None:
        """Refuse a prompt the steps were not built for, or a generation longer than the cache."""
        length = prompt_ids.shape[-1] if prompt_ids.dim() == 2 else -1
        expected = (self.spec.batch, self.prompt_len if self.prompt_len is not None else length)
        if tuple(prompt_ids.shape) != expected or prompt_ids.dtype != torch.int64:
            raise InputSpecError(f"the prompt is {tuple(prompt_ids.shape)} {prompt_ids.dtype}, but the prefill was "
                                 f"compiled for {expected} int64 token ids", where=self.where,
                                 hint="give a prompt of that shape, or compile again for this prompt length")
        total = expected[1] + max_new_tokens
        if max_new_tokens < 1 or total > self.spec.max_len:
            raise InputSpecError(f"{expected[1]} prompt tokens + {max_new_tokens} new tokens need {total} cache "
                                 f"positions; the cache holds {self.spec.max_len} (and at least one new token "
                                 "is generated)", where=self.where,
                                 hint="generate fewer tokens, or compile with a larger max_len")

    def first_token(self, prompt_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The prefill: ``(first token [B, 1], its logits [B, V])``; the cache holds the prompt's rows after it."""
        logits = self._run(self.steps[0], prompt_ids)[:, -1]
        return logits.argmax(-1, keepdim=True), logits

    def decode_from(self, token: torch.Tensor, start: int, steps: int, tokens: torch.Tensor | None = None,
                    logits: list[torch.Tensor] | None = None) -> torch.Tensor:
        """``steps`` decode steps feeding ``token`` at position ``start``, then each greedy pick; the picks."""
        tokens = torch.empty((token.shape[0], steps), dtype=torch.int64) if tokens is None else tokens
        decode = self.steps[1]
        for i in range(steps):
            out = self._run(decode, token, torch.tensor(start + i))[:, -1]
            token = out.argmax(-1, keepdim=True)
            tokens[:, i:i + 1] = token
            if logits is not None:
                logits.append(out.clone())
        return tokens

    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int, *, keep_logits: bool = False,
                 clock: Callable[[], float] = time.perf_counter) -> GenerationRun:
        """Greedy decoding: ``max_new_tokens`` tokens after ``prompt_ids`` ``[B, P]`` (int64)."""
        self.check_prompt(prompt_ids, max_new_tokens)
        run = GenerationRun(torch.empty((prompt_ids.shape[0], max_new_tokens), dtype=torch.int64))
        t0 = clock()
        token, logits = self.first_token(prompt_ids)
        run.tokens[:, :1] = token
        t1 = clock()
        run.first_token_s = t1 - t0
        if keep_logits:
            run.logits.append(logits.clone())
        self.decode_from(token, prompt_ids.shape[1], max_new_tokens - 1, run.tokens[:, 1:],
                         run.logits if keep_logits else None)
        run.decode_s = clock() - t1
        return run


class Generator(GreedyLoop):
    """:class:`GreedyLoop` over a prefill and a decode :class:`~mlcomp.runtime.artifact.Artifact`; saves and loads."""

    def __init__(self, prefill: Artifact, decode: Artifact, spec: CacheSpec,
                 manifest: dict[str, Any] | None = None) -> None:
        self.prefill, self.decode = prefill, decode
        self.manifest = dict(manifest or {}, format=GENERATOR_FORMAT, cache=spec.to_json())
        steps = [self._stepper(art, part, spec) for art, part in zip((prefill, decode), PARTS)]
        super().__init__(*steps, spec, prompt_len=int(prefill.inputs[0].shape[1]))
        parts = self.manifest.get("parts") or {}
        bound = [getattr(step, "how", None) for step in steps]
        self.cache_update = ("in place by the graph (index_put_)" if all(
            (parts.get(p) or {}).get("in_place_updates") == len(spec.names) for p in PARTS) else
            bound[0] if bound[0] and bound[0] == bound[1] else "copied into the cache after each step")

    def _stepper(self, art: Artifact, part: str, spec: CacheSpec) -> Callable[..., Any]:
        """The artifact, or its runtime's call that writes the state outputs into the cache (``with_state``:
        onnxruntime's I/O binding, OpenVINO's copy into the cache) where every cache input is read by its
        update alone."""
        bind = getattr(art.runtime, "with_state", None)
        count = len(spec.names)
        if bind is None or ((self.manifest.get("parts") or {}).get(part) or {}).get("sole_readers") != count:
            return art
        offset = len(art.inputs) - count
        runner = bind({i: offset + i for i in range(count)}, [(tuple(s.shape), s.dtype) for s in art.outputs])
        return runner or art

    @property
    def where(self) -> str:
        return f"generator of {self.manifest.get('model', '?')} for target {self.prefill.target}"

    # -- persistence ------------------------------------------------------
    def save(self, directory: str | Path, *, force: bool = True) -> Path:
        """Write ``generator.json``, ``prefill/`` and ``decode/`` (atomically); returns the folder."""
        directory = check_destination(directory, Kind.DIR, force=force)
        with atomic_dir(directory, label="generator") as tmp:
            for part in PARTS:
                getattr(self, part).save(tmp / part)
            (tmp / GENERATOR_FILE).write_text(json.dumps(self.manifest, indent=1, default=str))
        return directory

    @classmethod
    def load(cls, directory: str | Path) -> "Generator":
        """Load a folder written by :meth:`save`; any problem is an :class:`ArtifactError`."""
        directory = Path(directory)
        path = directory / GENERATOR_FILE
        try:
            manifest = json.loads(path.read_text())
            spec = CacheSpec.from_json(manifest["cache"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ArtifactError(f"{directory} is not a generator folder ({path.name}: {type(exc).__name__})",
                                where=str(path), hint="compile one with `mlcomp compile MODEL --generate N -o DIR`"
                                ) from None
        if manifest.get("format") != GENERATOR_FORMAT:
            raise ArtifactError(f"{path} is not a {GENERATOR_FORMAT} manifest", where=str(path),
                                hint="compile one with `mlcomp compile MODEL --generate N -o DIR`")
        parts = [Artifact.load(directory / part) for part in PARTS]
        return cls(parts[0], parts[1], spec, manifest)
