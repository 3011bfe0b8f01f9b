"""What ``--generate N`` does in ``mlcomp compile`` and ``mlcomp bench``: a decoder LM compiled for generation.

    $ mlcomp compile gpt2 --generate 32 -o out/gpt2-gen
    captured gpt2: prefill 214 nodes, decode 212 nodes (cache: 2 layers, keys and values 1x4x48x16 f32)
    in 21.8s
    compiled for cpu: prefill 97 nodes, decode 108 nodes; the cache (one allocation) is written in place by
    the graph (index_put_)
    verified against eager greedy generation: 32 of 32 tokens equal, logits passed: 32 output(s), max abs ...
    saved out/gpt2-gen (generator.json, prefill/, decode/); reloaded: 32 tokens equal
    $ mlcomp bench llama --generate 32 --targets inductor,cpu,onnxruntime   # time to first token, tokens/s

MODEL is a decoder of :data:`~mlcomp.models.third_party.GENERATIVE` by name (llama, gpt2,
qwen2, ...; random weights, ``--batch`` prompts of ``--prompt-len`` tokens) or a factory
``file.py:fn`` returning ``(model, (prompt_ids,))``.  Everything is checked before capture;
the folder is written atomically (:meth:`mlcomp.runtime.generator.Generator.save`).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click
import torch

from mlcomp.base.errors import VerificationError

__all__ = ["compile_generate", "describe"]


def describe(gen: Any) -> list[str]:
    """The lines that say what was compiled: captured sizes, the cache, what the target did with it."""
    parts, spec = gen.manifest["parts"], gen.spec
    shape = "x".join(map(str, spec.shape))
    how = f"the cache (one allocation) is written {gen.cache_update}"
    return [f"captured {gen.manifest['model']}: prefill {parts['prefill']['captured_nodes']} nodes, decode "
            f"{parts['decode']['captured_nodes']} nodes (cache: {spec.layers} layers, keys and values {shape} "
            f"{spec.dtype}) "
            f"in {gen.manifest['capture_seconds']:.1f}s",
            f"compiled for {gen.prefill.target}: prefill {parts['prefill']['nodes']} nodes, decode "
            f"{parts['decode']['nodes']} nodes; {how}"]


def compile_generate(model: str, tokens: int, *, target: str | None, pipeline: str | None, output: Path | None,
                     batch: int | None, prompt_len: int, max_len: int | None, tolerance: float | None,
                     threads: int | None, trust_pickle: bool, force: bool, as_json: bool,
                     verify: bool = True) -> None:
    """``mlcomp compile MODEL --generate N``: compile, verify N greedy tokens against eager, save, reload."""
    from mlcomp.api.generate import compile_generator, load_decoder, load_generator
    from mlcomp.base.files import Kind, check_destination

    if output is not None:
        check_destination(output, Kind.DIR, force=force, inputs=(model,))
    decoder, prompt, name = load_decoder(model, batch=batch or 1, prompt_len=prompt_len, trust_pickle=trust_pickle)
    gen = compile_generator(decoder, prompt, tokens, max_len=max_len, target=target or "cpu", pipeline=pipeline,
                            verify=verify, tolerance=tolerance, name=name, threads=threads)
    lines = describe(gen)
    check = gen.manifest.get("verification")
    if check is None:
        lines.append("not verified against eager (--no-verify)")
    else:
        lines.append(f"verified against eager greedy generation: {tokens} of {tokens} tokens equal, logits "
                     f"{check['logits']}")
    output = check_destination(output or Path("mlcomp-out") / f"{name}-{gen.prefill.target}-generate", Kind.DIR,
                               force=force, inputs=(model,))
    gen.save(output, force=force)
    again = load_generator(output)
    same = torch.equal(again.generate(prompt, tokens).tokens, gen.generate(prompt, tokens).tokens)
    if not same:
        raise VerificationError(f"the generator reloaded from {output} generates other tokens than the one saved",
                                where=str(output), hint="this is a bug in mlcomp's artifact format; report it")
    lines.append(f"saved {output} (generator.json, prefill/, decode/); reloaded: {tokens} tokens equal")
    if as_json:
        click.echo(json.dumps(dict(gen.manifest, output=str(output)), indent=2, default=str))
    else:
        for line in lines:
            click.echo(line)
