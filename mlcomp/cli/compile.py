"""``mlcomp compile``: capture, pipeline, lower to a target, verify against eager, save.

    $ mlcomp compile resnet18 --target onnxruntime -p -O2 -o out/r18
    captured resnet18: 213 nodes in 4.1s
    compiled for onnxruntime in 3.9s
    verified against eager: passed: 1 output(s), max abs 6.7e-08, max rel 5.2e-07 (...)
    saved out/r18 (model.onnx 44.7 MB); reloaded from disk and verified again
    $ mlcomp run out/r18 --input x.npy --output y.npz

``--train`` hands over to :mod:`mlcomp.cli.training`; ``export`` (:mod:`mlcomp.cli.export`) shares
the --tolerance and --force options and the output naming defined here.  Registered lazily by
:mod:`mlcomp.cli.main`; user errors are :class:`MlcompError` and are printed there without a traceback.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from mlcomp.analysis.verify import check_tolerance
from mlcomp.base.errors import ArtifactError, OptionError
from mlcomp.base.files import Kind, check_destination
from mlcomp.base.progress import Progress
from mlcomp.base.units import fmt_bytes
from mlcomp.cli.cache import cache_for_compile, cache_max_size_option, eviction_lines
from mlcomp.cli.main import auto_pool_starter, checked_threads, load_and_capture, model_options
from mlcomp.cli.passes import pipeline_from_cli, pipeline_options, resolve_pipeline
from mlcomp.cli.train_options import train_step_options
from mlcomp.pipeline.instruments import Instrument
from mlcomp.targets.registry import target_list

__all__ = ["compile_cmd", "force_option", "names_of", "size_on_disk", "tolerance_callback"]


def tolerance_callback(ctx: click.Context, param: click.Parameter, value: float | None) -> float | None:
    return check_tolerance(value)


def force_option(fn: Any) -> Any:
    return click.option("--force", is_flag=True,
                        help="Replace an earlier mlcomp output at -o (never a folder mlcomp did not write).")(fn)


def _check_target_flags(target: str, tune_trials: int, tuning_dir: str | None, tf32: bool = False) -> str:
    """Unknown target names and flags that do not apply to the target, before any capture."""
    from mlcomp.targets import get_target

    name = get_target(target).name
    for flag, given, owner in (("--tune-trials", tune_trials, "tvm"), ("--tuning-dir", tuning_dir, "tvm"),
                               ("--tf32", tf32, "cuda")):
        if given and name != owner:
            raise OptionError(f"{flag} applies to the {owner} target only, not to {name}",
                              hint=f"drop {flag}, or compile with --target {owner}")
    return name


def size_on_disk(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file()) if path.is_dir() else path.stat().st_size


@click.command("compile")
@model_options
@click.option("-t", "--target", default=None, metavar="TARGET",
              help=f"{target_list()}, or auto: compile for every target available here, verify "
                   "and time each, keep the fastest that verified (default: the pipeline file's target, else cpu).")
@click.option("--candidates", default=None, metavar="T,T...",
              help="With --target auto: the targets to try, names or specs with options, e.g. "
                   "'cpu,tvm{kernels=off}' (default: every target available here but distributed).")
@click.option("-o", "--output", type=click.Path(path_type=Path), default=None,
              help="Artifact folder to write (default mlcomp-out/MODEL-TARGET).")
@pipeline_options
@click.option("--tolerance", type=float, default=None, callback=tolerance_callback,
              help="Relative tolerance for verification (default by dtype).")
@click.option("--fallback", type=click.Choice(["none", "eager"]), default="none", show_default=True,
              help="What to do with ops the target cannot run: fail, or run them in torch.")
@click.option("--threads", type=click.IntRange(min=1), default=None, callback=checked_threads,
              help="Intra-op threads of the runtime (at most the cores here: more are stored as the core count).")
@click.option("--device", default=None, help="Device for the target (cpu, cuda:0); default: the target's own.")
@click.option("--tune-trials", type=click.IntRange(min=0), default=0, show_default=True,
              help="TVM MetaSchedule trial budget (0 = untuned).")
@click.option("--tuning-dir", type=click.Path(file_okay=False), default=None,
              help="TVM tuning database folder, reused across runs.")
@click.option("--fresh-check", is_flag=True, help="Also reload and verify the artifact in a new Python process.")
@click.option("--cache/--no-cache", "use_cache", default=True, show_default=True,
              help="Reuse an artifact compiled before for the same captured graph, pipeline, target, options and "
                   "versions, and store new ones (--no-cache: neither).")
@click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Compile cache folder (default ~/.cache/mlcomp; `mlcomp cache clear` empties it).")
@cache_max_size_option
@click.option("--no-verify", is_flag=True,
              help="Skip comparing the artifact with eager PyTorch (a cache hit is otherwise verified too); an "
                   "unverified artifact is not stored in the cache.")
@click.option("--tf32", is_flag=True,
              help="cuda: let fp32 matrix products and convolutions use TF32 tensor cores (faster; products "
                   "rounded to a 10-bit mantissa, verified at the tolerance the target declares for TF32, "
                   "mlcomp.targets.torch.cuda.TF32_RTOL). Default: IEEE fp32.")
@click.option("--output-names", default=None, metavar="NAME,NAME...",
              help="Names of the model's outputs in the artifact (default: the model's own: dict keys or "
                   "named-tuple fields, else output, output_1, ...).")
@click.option("--json", "as_json", is_flag=True,
              help="Print what was done (capture, pipeline, compile, verification, saved files) as one JSON "
                   "object on stdout instead of text; progress goes to stderr.")
@click.option("--deterministic", is_flag=True,
              help="Replace every choice made by timing with its fixed rule (cpu: the plain trace; tvm: the "
                   "untuned build, GEMMs in torch; mixed-precision dtype=auto: fp32; auto: the first candidate "
                   "that verifies) and save nothing time- or path-dependent: two compiles write identical folders.")
@force_option
@click.option("--train", is_flag=True, help="Compile a training step (forward, loss, backward, optimizer).")
@train_step_options
@click.option("--generate", "generate", type=click.IntRange(min=1), default=None, metavar="N",
              help="Compile a decoder LM for generation (prefill + one-token decode over a static KV cache) and "
                   "check N greedy tokens against eager (mlcomp.cli.generation).")
@click.option("--prompt-len", type=click.IntRange(min=1), default=8, show_default=True,
              help="With --generate and a named decoder: the prompt's length in tokens.")
@click.option("--max-len", type=click.IntRange(min=1), default=None,
              help="With --generate: cache positions (default: prompt + N rounded up to 16).")
def compile_cmd(model: str, input_shapes: tuple[str, ...], batch: int | None, capture_method: str,
                dynamic: str | None, trust_pickle: bool, target: str | None, candidates: str | None,
                output: Path | None, pipeline: str | None, opt_level: str | None, dump_after: str | None,
                dump_dir: str, verify_passes: bool, explain: bool, tolerance: float | None, fallback: str,
                threads: int | None, device: str | None, tune_trials: int, tuning_dir: str | None,
                fresh_check: bool, use_cache: bool = True, cache_dir: Path | None = None,
                cache_max_size: int | None = None, no_verify: bool = False, tf32: bool = False,
                output_names: str | None = None, as_json: bool = False, force: bool = False,
                train: bool = False, loss: str = "cross_entropy", optimizer: str = "sgd", steps: int = 5,
                loss_scale: str | None = None, deterministic: bool = False, generate: int | None = None,
                prompt_len: int = 8, max_len: int | None = None, fused_update: bool = False,
                host_memory: str = "auto") -> None:
    """Capture MODEL, run a pipeline (default -O2), lower it to a target (or the fastest of several: --target
    auto), verify against eager and save it.  A second compile of the same model reuses the cached artifact."""
    from mlcomp.api import compile_model, is_auto
    from mlcomp.api.compiler import check_pipeline_target
    from mlcomp.pipeline.seeding import DETERMINISTIC_SEED, seed_everything

    request = pipeline_from_cli(pipeline, opt_level, dump_after, dump_dir, verify_passes, explain)
    request.check_dump_dir(force, inputs=(model,))
    if tuning_dir:               # a tuning database is extended, never a user's folder
        from mlcomp.cli.tune import check_tuning_db

        check_tuning_db(tuning_dir, "--tuning-dir", model)
    if train:   # the training path: mlcomp.cli.training (runs a pipeline only when one is given)
        from mlcomp.cli.training import compile_train

        return compile_train(model, input_shapes, batch, trust_pickle, target=target, output=output, loss=loss,
                             optimizer=optimizer, steps=steps, tolerance=tolerance, device=device,
                             pipeline=resolve_pipeline(pipeline, opt_level, default=None),
                             instruments=request.instruments(), force=force, loss_scale=loss_scale,
                             fused=fused_update, host_memory=host_memory)

    if generate is not None:   # the generation path: mlcomp.cli.generation
        from mlcomp.cli.generation import compile_generate

        return compile_generate(model, generate, target=target, pipeline=request.text, output=output, batch=batch,
                                prompt_len=prompt_len, max_len=max_len, tolerance=tolerance, threads=threads,
                                trust_pickle=trust_pickle, force=force, as_json=as_json, verify=not no_verify)
    if output is not None:
        check_destination(output, Kind.DIR, force=force, inputs=(model,))
    target = target or request.pipeline.target or "cpu"      # a TOML file may name the target
    auto = is_auto(target)
    canonical = "auto" if auto else _check_target_flags(target, tune_trials, tuning_dir, tf32)
    chosen = _candidates(candidates, canonical)
    cache, bypass = cache_for_compile(use_cache, cache_dir, request, cache_max_size)
    check_pipeline_target(canonical, request.pipeline, device=device)   # prune{method=2:4} off CUDA, bf16 unbuilt
    names = _parse_names(output_names)
    progress = Progress.for_command(machine_output=as_json)
    say = _Say(progress, quiet=as_json)
    facts: dict[str, Any] = {"model": model}
    if deterministic:
        seed_everything(DETERMINISTIC_SEED)         # before the model is built
    pool, early = auto_pool_starter(target, chosen, deterministic)      # auto: started before the capture
    source, graph, capture_seconds = _capture(model, (input_shapes, batch, capture_method, dynamic, trust_pickle,
                                                     early), progress, say, facts)
    names = _check_names(names, len(graph.output_refs), graph.name)
    output = check_destination(output or Path("mlcomp-out") / f"{graph.name}-{canonical}", Kind.DIR, force=force,
                               inputs=(model,))
    build = f"build for {canonical}" + (f" (tuning {tune_trials} trials)" if tune_trials else "")
    progress.note(f"pipeline {request.text} for {canonical}" if request.text else build)
    def instruments(name: str) -> list[Any]:          # one set per target tried (auto: per candidate)
        return [*request.instruments(), _PassProgress(progress, f"build for {name}" if auto else build)]
    result = compile_model(source, graph, target=target, candidates=chosen, pipeline=request.text,
                           verify=not no_verify, cache=cache, note=progress.note,
                           instruments=instruments if auto else instruments(canonical),
                           capture_seconds=capture_seconds, tolerance=tolerance, fallback=fallback,
                           threads=threads, device=device, tune_trials=tune_trials, work_dir=tuning_dir,
                           tf32=tf32 or None, deterministic=deterministic or None, pool=(pool or [None])[0])
    progress.clear()
    hit = _say_cache(result, cache, bypass, request.explain, facts, say)
    _name_outputs(result.artifact, names or _model_output_names(source, len(result.artifact.outputs)))
    _say_compiled(result, request, hit, facts, say)
    _verify_and_save(result, graph.name, output, force=force, fresh_check=fresh_check, progress=progress,
                     facts=facts, say=say)
    if as_json:
        click.echo(json.dumps(facts, indent=2, default=str))


def _capture(model: str, how: tuple[Any, ...], progress: Progress, say: _Say,
             facts: dict[str, Any]) -> tuple[Any, Any, float]:
    """Load and capture the model (``how``: load_and_capture's arguments after the model); (source, graph, seconds)."""
    t0 = time.perf_counter()
    with progress.stage(f"capture {model}"):
        source, graph = load_and_capture(model, *how)
    capture_seconds = time.perf_counter() - t0
    facts.update(model=graph.name, nodes=len(graph), capture_seconds=round(capture_seconds, 3))
    say(f"captured {graph.name}: {len(graph)} nodes in {capture_seconds:.1f}s")
    facts["kept_ops"] = dict(graph.kept_ops)
    for op, why in graph.kept_ops.items():   # frontend/decompose.py: ops left undecomposed
        say(f"capture kept {op} undecomposed: {why}")
    return source, graph, capture_seconds


def _say_cache(result: Any, cache: Any, bypass: str | None, explain: bool, facts: dict[str, Any], say: _Say) -> bool:
    """The compile cache's lines and (auto) the choice made; True on a cache hit."""
    from mlcomp.api import AutoReport

    art = result.artifact
    hit = result.cache is not None and result.cache.status.value == "hit"
    for line in [*(result.cache.removed if result.cache else []), *([bypass] if bypass else [])]:
        say(line)
    if result.cache is not None:
        say(result.cache.line())
        facts["cache"] = dict(result.cache.to_json(), folder=str(cache.root))
        for line in eviction_lines(cache, facts["cache"], each=explain):   # after this store
            say(line)
    if art.manifest.get("auto"):
        facts["auto"] = art.manifest["auto"]
        say(("the cached artifact's choice, " if hit else "") + AutoReport.format_json(art.manifest["auto"]))
    return hit


def _say_compiled(result: Any, request: Any, hit: bool, facts: dict[str, Any], say: _Say) -> None:
    """What the build did: the pipeline report, fallback regions, tuning, the target's own explanation."""
    art = result.artifact
    report = result.pipeline_report
    facts.update(target=art.target, device=art.manifest.get("device"), pipeline=art.manifest.get("pipeline"),
                 pipeline_given=request.text, pipeline_report=report.to_json() if report is not None else None,
                 compile_seconds=round(art.compile_seconds, 3), inputs=[str(s) for s in art.inputs],
                 outputs=[str(s) for s in art.outputs], fallback_regions=art.manifest.get("fallback_regions", []))
    if report is not None:
        say(report.format(nested=request.explain))
    facts["decisions"] = art.decisions
    for decision in art.decisions:
        say(f"decision ({decision.get('made_by', '?')}): {decision['question']} -> {decision['choice']}: "
            f"{decision['why']}")
    say(f"compiled for {art.target} in {art.compile_seconds:.1f}s" + (" (when it was stored)" if hit else ""))
    for region in facts["fallback_regions"]:
        if region["runs_on"] != art.target:
            say(f"fallback: region {region['region']} ({region['nodes']} nodes: "
                f"{', '.join(region['ops'])}) runs in {region['runs_on']}")
    stats = getattr(art.runtime, "stats", None)
    if isinstance(stats, dict) and stats.get("tune_trials"):
        facts["tuning"] = {"trials_run": stats.get("trials_run", 0), "work_dir": str(stats.get("work_dir")),
                           "tasks_reused": len(stats.get("tasks_reused", []))}
        say(f"tvm tuning: {stats.get('trials_run', 0)} trials run, tasks reused: "
            f"{len(stats.get('tasks_reused', []))} (database {stats.get('work_dir')})")
    int8 = getattr(art.runtime, "int8", None)        # a quantized graph: what the runtime ran in int8
    if int8 is not None:
        facts["int8"] = int8.to_json()
        if not request.explain:                        # --explain prints it among the runtime's lines
            say(f"{art.target}: {int8.line()}")
    if request.explain and hasattr(art.runtime, "explain_lines"):   # e.g. tvm: which ops run in which kernel
        for line in art.runtime.explain_lines():
            say(f"{art.target}: {line}")


def _verify_and_save(result: Any, model: str, output: Path, *, force: bool, fresh_check: bool,
                     progress: Progress, facts: dict[str, Any], say: _Say) -> None:
    """The verification against eager (raises if it failed), then save, reload and verify the reloaded copy."""
    from mlcomp.api.range_check import sizes_line
    from mlcomp.runtime.artifact import Artifact

    art = result.artifact
    against = art.manifest.get("verified_against") or "eager"
    check = result.check
    if check is None:
        say("not verified against eager (--no-verify)")
    else:
        say(f"verified against {against}: {check.summary()}")
        if sizes_line(art.verification):
            say(sizes_line(art.verification))
        check.raise_if_failed(where=f"target {art.target}, model {model}")
    with progress.stage(f"save {output}"):
        art.save(output, force=force)
        again = Artifact.load(output)
        reloaded = again.verify(record=False) if check is not None else None
    files = [e["path"] for e in art.manifest["payload"]]
    size = size_on_disk(output)
    facts.update(verification=check.to_json() if check else None, output=str(output), files=files,
                 size_bytes=size, reloaded=reloaded.to_json() if reloaded else None)
    say(f"saved {output} ({', '.join(files[:4])}; {fmt_bytes(size)}); reloaded from disk"
        + (f": {reloaded.summary()}" if reloaded else ""))
    if fresh_check:
        with progress.stage("reload in a fresh process"):
            line = _fresh_check(output)
        facts["fresh_process"] = line
        say(f"fresh process: {line}")


def _candidates(text: str | None, target: str) -> list[str] | None:
    """--candidates checked before any capture: only with --target auto, known targets (specs with options allowed)."""
    from mlcomp.targets import get_target
    from mlcomp.targets.registry import split_targets

    if text is None:
        return None
    if target != "auto":
        raise OptionError(f"--candidates applies to --target auto only, not to {target}",
                          hint="drop --candidates, or compile with --target auto")
    names = [] if "auto" in text.lower().replace(" ", "").split(",") else split_targets(text)
    if not names:
        raise OptionError(f"--candidates {text!r} must name one or more targets other than auto",
                          hint="e.g. --candidates cpu,onnxruntime or --candidates 'cpu,tvm{kernels=off}'")
    return [get_target(n).spec for n in names]


class _Say:
    """The command's text lines (stdout), after erasing a live progress line; nothing with --json."""

    def __init__(self, progress: Progress, *, quiet: bool) -> None:
        self.progress, self.quiet = progress, quiet

    def __call__(self, text: str) -> None:
        if not self.quiet:
            self.progress.clear()
            click.echo(text)


class _PassProgress(Instrument):
    """Reports each top-level pass, then the target build, as a progress stage."""

    def __init__(self, progress: Progress, build: str) -> None:
        self.progress, self.build, self.depth = progress, build, 0

    def before_pass(self, p: Any, graph: Any, ctx: Any) -> None:
        if self.depth == 0:
            self.progress.note(f"pass {p.name} ({len(graph)} nodes)")
        self.depth += 1

    def after_pass(self, p: Any, result: Any, record: Any) -> None:
        self.depth -= 1

    def end_pipeline(self, graph: Any, report: Any) -> None:
        self.progress.note(self.build)


def _parse_names(text: str | None) -> list[str] | None:
    if text is None:
        return None
    names = [n.strip() for n in text.split(",")]
    if not all(n.isidentifier() for n in names) or len(set(names)) != len(names):
        raise OptionError(f"--output-names {text!r} must be distinct identifiers separated by commas",
                          hint="e.g. --output-names logits,aux")
    return names


def _check_names(names: list[str] | None, count: int, model: str) -> list[str] | None:
    if names is not None and len(names) != count:
        raise OptionError(f"--output-names gives {len(names)} name(s) but {model} has {count} output(s)",
                          hint=f"give exactly {count} comma-separated name(s)")
    return names


def _model_output_names(source: Any, count: int) -> list[str]:
    """The model's own names for its outputs (see :func:`mlcomp.frontend.capture.output_names`)."""
    import torch

    with torch.no_grad():
        return names_of(source.eager(*source.inputs()), count)


def names_of(outputs: Any, count: int) -> list[str]:
    from mlcomp.frontend.capture import output_names

    names = output_names(outputs)
    return names if len(names) == count else ["output" if i == 0 else f"output_{i}" for i in range(count)]


def _name_outputs(art: Any, names: list[str]) -> None:
    """Give the artifact's outputs public names (in memory and in the manifest it saves)."""
    art.outputs = [replace(spec, name=name) for spec, name in zip(art.outputs, names)]
    art.manifest["outputs"] = [spec.to_json() for spec in art.outputs]


def _fresh_check(output: Path) -> str:
    proc = subprocess.run([sys.executable, "-m", "mlcomp", "run", str(output), "--verify"],
                          capture_output=True, text=True)
    if proc.returncode != 0:
        raise ArtifactError(f"reloading {output} in a fresh process failed: "
                            f"{(proc.stderr or proc.stdout).strip().splitlines()[-1:]}",
                            hint="the artifact depends on state of this process; report it")
    last = [ln for ln in proc.stdout.splitlines() if ln.startswith("verified")]
    return last[-1] if last else "ok"
