"""``mlcomp.compile_generator``: a decoder LM compiled as a prefill and a decode graph over a static KV cache.

::

    import mlcomp
    from mlcomp.models.third_party import build_generative
    model, (prompt,) = build_generative("llama", batch=1, seq=8)
    gen = mlcomp.compile_generator(model, prompt, max_new_tokens=32, target="cpu", pipeline="-O2")
    gen.manifest["verification"]["tokens_equal"]      # 32 greedy tokens equal eager's
    True
    run = gen.generate(prompt, 32)                    # run.tokens [1, 32], run.first_token_s, run.tokens_per_s
    gen.save("out/llama-gen"); again = mlcomp.load_generator("out/llama-gen")

Both graphs go through the ordinary path: capture (:mod:`mlcomp.frontend.decoder`), the
pipeline, the target.  On the cpu target (TorchScript of the generated torch code) each cache update
``index_put(kv_i, ...)`` whose only reader is the update itself becomes
``index_put_`` on the input (:func:`update_in_place`), so the step writes its rows
into the one cache and copies nothing; onnxruntime binds those outputs to the cache's
memory, OpenVINO's runtime copies its outputs into it (:mod:`mlcomp.runtime.generator`).

Verification runs ``max_new_tokens`` greedy steps eagerly (the same steps, the same
kind of cache) and through the artifacts: the tokens must be equal and each step's
last-position logits within the tolerance; the result is ``manifest["verification"]``.
"""
from __future__ import annotations

import time
from typing import Any

import torch

from mlcomp.analysis.verify import check_tolerance, compare
from mlcomp.api.lowering import adapted_pipeline, resolve_target
from mlcomp.base.errors import InputSpecError, OptionError, VerificationError
from mlcomp.frontend.decoder import (CacheSpec, DecoderStep, PrefillStep, cache_spec, capture_step, check_decoder,
                                     state_updates)
from mlcomp.frontend.loading import kept_modes
from mlcomp.ir import Graph
from mlcomp.ir.ops import Op
from mlcomp.pipeline import run_pipeline
from mlcomp.runtime.generator import GenerationRun, Generator, GreedyLoop
from mlcomp.targets import CompileOptions

__all__ = ["compile_generator", "eager_generation", "load_decoder", "load_generator", "update_in_place"]

CACHE_ALIGN = 16          # cache lengths are rounded up to a multiple of this (and are at least this)
IN_PLACE_TARGETS = ("cpu",)      # targets that run the generated torch code, where an input can be written
GENERATING_TARGETS = ("cpu", "onnxruntime", "openvino")
WHY_NOT = {"cuda": "the generator keeps its KV cache in host memory; a cache on the device is not built yet"}


def cache_length(prompt_len: int, max_new_tokens: int, max_len: int | None, limit: int | None) -> int:
    """The cache's positions: ``max_len``, else prompt + new tokens rounded up to :data:`CACHE_ALIGN` (capped at
    the model's ``limit``); refused when the generation does not fit.

    >>> cache_length(8, 32, None, 64), cache_length(8, 32, 40, 64)
    (48, 40)
    """
    need = prompt_len + max_new_tokens
    size = max_len if max_len is not None else max(CACHE_ALIGN, -(-need // CACHE_ALIGN) * CACHE_ALIGN)
    if max_len is None and limit is not None:
        size = min(size, max(limit, need))
    if need > size:
        raise InputSpecError(f"the prompt of {prompt_len} tokens and {max_new_tokens} new tokens need {need} cache "
                             f"positions, but the cache holds {size}", where="compile_generator(max_len=...)",
                             hint=f"give max_len >= {need}, a shorter prompt, or fewer new tokens")
    return size


def sole_updates(graph: Graph, spec: CacheSpec) -> list[tuple[int, str]]:
    """The state pairs ``(output index, input name)`` whose input is read by its update alone."""
    return [(i, name) for i, name in state_updates(graph, spec)
            if [u.name for u in graph.users(name)] == [graph.output_refs[i].name]]


def update_in_place(graph: Graph, spec: CacheSpec) -> tuple[Graph, int]:
    """``graph`` with each cache update ``index_put(kv_i, idx, rows)`` that is ``kv_i``'s only reader written as
    ``index_put_``: the step writes into its input, and its state output is that input. Returns the count.

    Before / after (``kv_0`` read by the update only)::

        index_put = aten.index_put(kv_0, [None, None, add], view_3)      # a new [B, H, max_len, D] tensor
        index_put = aten.index_put_(kv_0, [None, None, add], view_3)     # kv_0 itself, rows written
    """
    inplace = Op.from_torch(torch.ops.aten.index_put_.default)
    out = graph.copy()
    pairs = sole_updates(out, spec)
    for index, _ in pairs:
        out.replace(out.node(out.output_refs[index].name).with_(op=inplace))
    return out, len(pairs)


def _compile_part(graph: Graph, target: Any, pipeline: Any, options: CompileOptions, inputs: tuple,
                  spec: CacheSpec) -> tuple[Any, dict[str, Any]]:
    """Pipeline and lowering of one step graph; the artifact and what was done."""
    pipe, _ = adapted_pipeline(pipeline, target)
    facts: dict[str, Any] = {"captured_nodes": len(graph)}
    if pipe is not None:
        t0 = time.perf_counter()
        graph, _ = run_pipeline(graph, pipe, example_inputs=inputs, target=target.facts(options),
                                deterministic=options.deterministic)
        facts.update(pipeline=pipe.spec, pipeline_seconds=round(time.perf_counter() - t0, 4))
    facts["sole_readers"] = len(sole_updates(graph, spec))    # also checks the pipeline kept the cache as state
    if target.name in IN_PLACE_TARGETS:
        graph, facts["in_place_updates"] = update_in_place(graph, spec)
    art = target.compile(graph, options)
    facts.update(nodes=len(graph), compile_seconds=round(art.compile_seconds, 4))
    return art, facts


def eager_generation(model: torch.nn.Module, spec: CacheSpec, prompt_ids: torch.Tensor,
                     max_new_tokens: int) -> GenerationRun:
    """Greedy generation in eager PyTorch through the same prefill and decode steps and the same kind of cache."""
    loop = GreedyLoop(PrefillStep(model, spec).eval(), DecoderStep(model, spec).eval(), spec, where="eager")
    with torch.no_grad():
        return loop.generate(prompt_ids, max_new_tokens, keep_logits=True)


def _verify(gen: Generator, expected: GenerationRun, prompt_ids: torch.Tensor, max_new_tokens: int,
            tolerance: float | None) -> dict[str, Any]:
    """Tokens equal to eager's, every step's logits within ``tolerance``; the record for the manifest."""
    got = gen.generate(prompt_ids, max_new_tokens, keep_logits=True)
    result = compare(tuple(expected.logits), tuple(got.logits), tolerance,
                     names=[f"step{i}" for i in range(max_new_tokens)])
    same = torch.equal(got.tokens, expected.tokens)
    first = next((i for i in range(max_new_tokens) if not torch.equal(got.tokens[:, i], expected.tokens[:, i])), None)
    return {"tokens_equal": same, "tokens": max_new_tokens, "first_differing_step": first,
            "logits_passed": result.passed, "logits": result.summary(),
            "max_abs": result.max_abs, "passed": same and result.passed}


def _reference(art: Any, step: torch.nn.Module, inputs: tuple[torch.Tensor, ...], layers: int
               ) -> tuple[torch.Tensor, ...]:
    """Store one eager step on ``inputs`` as the artifact's reference; the cache after that step."""
    work = tuple(t.clone() for t in inputs)
    with torch.no_grad():
        logits = step(*work)
    cache = work[len(work) - 2 * layers:]
    art.set_reference(inputs, (*cache, logits))
    return cache


def _check_prompt(prompt_ids: Any, max_new_tokens: int, vocab: int | None, name: str) -> torch.Tensor:
    if not isinstance(prompt_ids, torch.Tensor) or prompt_ids.dim() != 2 or prompt_ids.shape[1] < 1 \
            or prompt_ids.dtype not in (torch.int64, torch.int32):
        shape = tuple(prompt_ids.shape) if isinstance(prompt_ids, torch.Tensor) else type(prompt_ids).__name__
        raise InputSpecError(f"the prompt for {name} is {shape}; generation takes token ids as an int64 tensor "
                             "[batch, prompt length] with at least one token", where="compile_generator(prompt_ids)",
                             hint="e.g. torch.tensor([[1, 2, 3]]) (one prompt of three tokens)")
    if vocab is not None and (int(prompt_ids.min()) < 0 or int(prompt_ids.max()) >= vocab):
        raise InputSpecError(f"the prompt holds token ids outside [0, {vocab}), the vocabulary of {name}",
                             where="compile_generator(prompt_ids)", hint=f"give ids below {vocab}")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise InputSpecError(f"max_new_tokens={max_new_tokens!r}: generation makes at least one new token",
                             where="compile_generator(max_new_tokens)", hint="give a positive integer")
    return prompt_ids.to(torch.int64)


def compile_generator(model: torch.nn.Module, prompt_ids: torch.Tensor, max_new_tokens: int = 32, *,
                      max_len: int | None = None, target: Any = None, pipeline: Any = None, verify: bool = True,
                      tolerance: float | None = None, name: str | None = None, **options: Any) -> Generator:
    """Compile ``model`` (a ``transformers`` decoder LM) for greedy generation after ``prompt_ids`` ``[B, P]``.

    ``max_len``: cache positions (default: ``P + max_new_tokens`` rounded up to 16, within the model's
    limit).  ``target``, ``pipeline`` and the remaining options are :func:`mlcomp.compile`'s.  With
    ``verify`` the artifacts' ``max_new_tokens`` greedy tokens must equal eager's (else
    :class:`~mlcomp.base.errors.VerificationError`).  The user's model is not modified.
    """
    name = name or type(model).__name__
    chosen = resolve_target(target, pipeline)
    if chosen.name not in GENERATING_TARGETS:
        why = WHY_NOT.get(chosen.name, "the decode step keeps its KV cache as graph state (inputs written every "
                                       "token), which mlcomp lowers for " + ", ".join(GENERATING_TARGETS) + " only")
        raise OptionError(
            f"target {chosen.name} cannot compile a generator: {why}",
            where=f"compile_generator(target={chosen.name!r})", hint="use --target cpu or onnxruntime")
    opts = CompileOptions.make(**options)
    tolerance = check_tolerance(tolerance, option="tolerance")
    with kept_modes(model):
        model.eval()
        text = check_decoder(model, name)
        prompt_ids = _check_prompt(prompt_ids, max_new_tokens, getattr(text, "vocab_size", None), name)
        batch, prompt_len = prompt_ids.shape
        limit = getattr(text, "max_position_embeddings", None) or getattr(text, "n_positions", None)
        spec = cache_spec(model, batch=batch, max_len=cache_length(prompt_len, max_new_tokens, max_len, limit),
                          name=name)
        t0 = time.perf_counter()
        graphs = [capture_step(model, spec, prompt_len, prefill=True, name=f"{name}_prefill"),
                  capture_step(model, spec, 1, prefill=False, name=f"{name}_decode")]
        capture_s = time.perf_counter() - t0
        steps = (PrefillStep(model, spec).eval(), DecoderStep(model, spec).eval())
        expected = eager_generation(model, spec, prompt_ids, max_new_tokens)
        examples = ((prompt_ids, *spec.allocate()),)
        parts, facts = [], {}
        for part, graph, step in zip(("prefill", "decode"), graphs, steps):
            inputs = examples[-1]
            art, facts[part] = _compile_part(graph, chosen, pipeline, opts, inputs, spec)
            cache = _reference(art, step, inputs, spec.layers)
            examples += ((expected.tokens[:, :1], torch.tensor(prompt_len), *cache),)
            parts.append(art)
    manifest = {"model": name, "target": chosen.name, "prompt_shape": [batch, prompt_len],
                "max_new_tokens": max_new_tokens, "capture_seconds": round(capture_s, 4), "parts": facts}
    gen = Generator(parts[0], parts[1], spec, manifest)
    if verify:
        gen.manifest["verification"] = check = _verify(gen, expected, prompt_ids, max_new_tokens, tolerance)
        if not check["passed"]:
            raise VerificationError(
                f"the compiled generator of {name} differs from eager greedy generation: "
                + (f"token {check['first_differing_step']} differs" if not check["tokens_equal"] else
                   f"the logits differ ({check['logits']})"), where=gen.where,
                hint="try another target or pipeline (-O0) to narrow it down, or loosen --tolerance if only the "
                     "logits differ")
    return gen


def load_generator(directory: Any) -> Generator:
    """A generator saved with :meth:`Generator.save <mlcomp.runtime.generator.Generator.save>`."""
    return Generator.load(directory)


def load_decoder(spec: Any, *, batch: int = 1, prompt_len: int = 8, trust_pickle: bool = False
                 ) -> tuple[torch.nn.Module, torch.Tensor, str]:
    """``(model, prompt ids, name)``: a decoder of :data:`~mlcomp.models.third_party.GENERATIVE` by name
    (random weights; ``batch`` prompts of ``prompt_len`` tokens), else what
    :func:`~mlcomp.frontend.loading.load_model` loads, whose first example input is the prompt."""
    from mlcomp.frontend.loading import load_model
    from mlcomp.models.third_party import GENERATIVE, build_generative

    if isinstance(spec, str) and spec in GENERATIVE:
        model, inputs = build_generative(spec, batch=batch, seq=prompt_len)
        return model, inputs[0], spec
    source = load_model(spec, trust_pickle=trust_pickle, batch=batch)
    if not source.example_inputs:
        raise InputSpecError(f"{source.name} comes without example inputs, so there is no prompt to start from",
                             where=str(spec), hint="return (model, (prompt_ids,)) from the factory")
    return source.eager, source.example_inputs[0], source.name
