"""``mlcomp bench MODEL --generate N``: time to first token and decode tokens/s, eager vs compiled generators.

Variants, each a :class:`~mlcomp.runtime.generator.GreedyLoop` over its own static KV cache:

* ``eager``: the prefill and decode steps (:mod:`mlcomp.frontend.decoder`) run by PyTorch;
* ``eager-dynamic``: the model called as ``model.generate`` calls it, with ``transformers``'
  growing ``DynamicCache`` (:class:`DynamicLoop`), what a user of eager PyTorch runs;
* ``inductor``: the same two steps through ``torch.compile()`` (its default backend);
* a target name (``cpu``, ``onnxruntime``, ``openvino``): :func:`mlcomp.api.generate.compile_generator`.

Each variant first generates ``N`` tokens once (its tokens are compared with eager's, exactly),
then two measurements run interleaved round by round over every variant
(:func:`mlcomp.hardware.timing.measure_interleaved`, so load that comes and goes falls on all):
the prefill and first pick (time to first token), and ``N - 1`` decode steps from the filled
cache.  ``tokens/s`` is ``batch * (N - 1)`` over the decode median.  A variant that cannot be built
(tvm refuses generation; a missing backend) is a row with its reason, and the others go on::

    result = bench_generation("llama", 32, targets=("eager", "inductor", "cpu"))
    print(result.table().format())
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch

from mlcomp.base.errors import MlcompError
from mlcomp.base.table import Table
from mlcomp.hardware.timing import TimingPolicy, measure_interleaved
from mlcomp.runtime.generator import GenerationRun

__all__ = ["DynamicLoop", "GenerationResult", "GenerationRow", "bench_generation", "DYNAMIC", "EAGER", "INDUCTOR"]

EAGER, INDUCTOR, DYNAMIC = "eager", "inductor", "eager-dynamic"
DEFAULT_VARIANTS = (EAGER, DYNAMIC, INDUCTOR, "cpu", "onnxruntime")


@dataclass
class GenerationRow:
    """One variant: build time, time to first token, decode throughput, whether its tokens equal eager's."""

    variant: str
    compile_s: float | None = None
    ttft_ms: float | None = None
    tokens_per_s: float | None = None
    tokens_equal: bool | None = None
    note: str = ""

    def cells(self, eager: "GenerationRow | None") -> tuple[str, ...]:
        def num(v: float | None, fmt: str) -> str:
            return "-" if v is None else format(v, fmt)
        speedup = (self.tokens_per_s / eager.tokens_per_s
                   if eager is not None and eager.tokens_per_s and self.tokens_per_s else None)
        equal = {True: "yes", False: "NO", None: "-"}[self.tokens_equal]
        return (self.variant, num(self.compile_s, ".1f"), num(self.ttft_ms, ".2f"), num(self.tokens_per_s, ".1f"),
                num(speedup, ".2f"), equal, self.note)


@dataclass
class GenerationResult:
    model: str
    tokens: int
    prompt: tuple[int, int]
    rows: list[GenerationRow] = field(default_factory=list)

    def table(self) -> Table:
        eager = next((r for r in self.rows if r.variant == EAGER), None)
        return Table(f"{self.model}: greedy generation of {self.tokens} tokens after a {self.prompt[0]}x"
                     f"{self.prompt[1]} prompt",
                     ("variant", "build s", "first token ms", "tokens/s", "vs eager", "tokens = eager", "note"),
                     tuple(r.cells(eager) for r in self.rows), right=frozenset({1, 2, 3, 4}))

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "tokens": self.tokens, "prompt": list(self.prompt),
                "rows": [vars(r) for r in self.rows]}


def _no_grad(fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(*args: Any) -> Any:
        with torch.no_grad():
            return fn(*args)
    return call


class DynamicLoop:
    """Greedy decoding with ``transformers``' DynamicCache (grown per token); each decode run starts from the
    prompt's cache, cropped back to it after the run."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.cache = model, None

    @torch.no_grad()
    def first_token(self, prompt_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        out = self.model(input_ids=prompt_ids, use_cache=True)
        self.cache = out.past_key_values
        logits = out.logits[:, -1]
        return logits.argmax(-1, keepdim=True), logits

    @torch.no_grad()
    def decode_from(self, token: torch.Tensor, start: int, steps: int) -> torch.Tensor:
        tokens = torch.empty((token.shape[0], steps), dtype=torch.int64)
        for i in range(steps):
            out = self.model(input_ids=token, past_key_values=self.cache, use_cache=True)
            token = out.logits[:, -1].argmax(-1, keepdim=True)
            tokens[:, i:i + 1] = token
        if steps:
            self.cache.crop(-steps)
        return tokens

    def generate(self, prompt_ids: torch.Tensor, max_new_tokens: int) -> GenerationRun:
        token, _ = self.first_token(prompt_ids)
        rest = self.decode_from(token, prompt_ids.shape[1], max_new_tokens - 1)
        return GenerationRun(torch.cat([token, rest], dim=1))


def _build(variant: str, model: torch.nn.Module, prompt: torch.Tensor, tokens: int, *, pipeline: Any,
           threads: int | None, name: str) -> Any:
    """The variant's loop (built and, for compiled ones, verified against eager)."""
    from mlcomp.api.generate import cache_length, compile_generator
    from mlcomp.frontend.decoder import DecoderStep, PrefillStep, cache_spec
    from mlcomp.runtime.generator import GreedyLoop

    if variant == DYNAMIC:
        return DynamicLoop(model)
    if variant not in (EAGER, INDUCTOR):
        options = {} if threads is None else {"threads": threads}
        return compile_generator(model, prompt, tokens, target=variant, pipeline=pipeline, name=name, **options)
    spec = cache_spec(model, batch=prompt.shape[0], max_len=cache_length(prompt.shape[1], tokens, None, None))
    steps = [PrefillStep(model, spec).eval(), DecoderStep(model, spec).eval()]
    if variant == INDUCTOR:
        steps = [torch.compile(s) for s in steps]
    return GreedyLoop(*map(_no_grad, steps), spec, where=variant)


def bench_generation(model_spec: Any, tokens: int, *, targets: Sequence[str] = DEFAULT_VARIANTS,
                     pipeline: Any = "-O2", policy: TimingPolicy = TimingPolicy(warmup=2, budget_s=1.0),
                     prompt_len: int = 8, batch: int = 1, threads: int | None = None,
                     note: Callable[[str], None] = lambda text: None) -> GenerationResult:
    """Build every variant, check its tokens against eager's, time first token and decode (see module doc)."""
    from mlcomp.api.generate import load_decoder

    model, prompt, name = load_decoder(model_spec, batch=batch, prompt_len=prompt_len)
    result = GenerationResult(name, tokens, tuple(prompt.shape))
    loops: dict[str, Any] = {}
    expected = None
    for variant in dict.fromkeys((EAGER, *targets)):
        row = GenerationRow(variant)
        result.rows.append(row)
        note(f"build {variant}")
        t0 = time.perf_counter()
        try:
            loop = _build(variant, model, prompt, tokens, pipeline=pipeline, threads=threads, name=name)
            got = loop.generate(prompt, tokens).tokens        # inductor compiles here
        except MlcompError as exc:
            if variant == EAGER:            # the model itself cannot generate: nothing to compare with
                raise
            row.note = f"skipped: {exc.what}"
            continue
        row.compile_s = None if variant in (EAGER, DYNAMIC) else time.perf_counter() - t0
        expected = got if expected is None else expected
        row.tokens_equal = bool(torch.equal(got, expected))
        loops[variant] = loop
    note("time first token and decode")
    first = {v: (lambda lp=lp: lp.first_token(prompt)) for v, lp in loops.items()}
    ttft = measure_interleaved(first, policy)
    token = expected[:, :1] if expected is not None else None
    decode = {v: (lambda lp=lp: lp.decode_from(token, prompt.shape[1], tokens - 1)) for v, lp in loops.items()}
    steps = measure_interleaved(decode, policy) if tokens > 1 else {}
    for row in result.rows:
        if row.variant in ttft:
            row.ttft_ms = ttft[row.variant].median * 1e3
        if row.variant in steps:
            row.tokens_per_s = batch * (tokens - 1) / steps[row.variant].median
    return result
