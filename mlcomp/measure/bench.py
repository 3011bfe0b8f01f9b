"""``mlcomp bench``: eager vs compiled targets, timed correctly, one table per model.

For every batch size (and device) the bench

1. compiles the model for each target (``mlcomp.compile``), timing the cold compile;
2. runs it once and compares its outputs with eager (:func:`mlcomp.analysis.verify.compare`:
   max abs / rel error, pass or fail at the tolerance for the output dtype);
3. times eager and every target that runs *together*, in rotated rounds of one sample each
   (:mod:`mlcomp.measure.bench_timing`), each in a worker process of its own where it can be,
   so load that comes and goes falls on all alike; the speedup of a target is the median of
   its per-round ratios to eager, with a 95 % interval, and the cell is marked unreliable with
   the reason when the machine was busy, the hypervisor stole time, the ratios spread too far
   or the interval includes 1 (:mod:`mlcomp.hardware.noise`);
4. records the peak memory growth around compile + first call
   (:class:`mlcomp.hardware.peak_memory.PeakMemory`).

A target that is unavailable (``mlcomp.targets.available_targets``) is reported as skipped
with its reason; one that fails to compile or run is reported as failed with the error, and
the bench goes on::

    result = run_bench("mlp", BenchConfig(targets=("eager", "cpu"), batches=(1, 32)))
    print(result.format())

Clock, synchroniser, compiler and target availability are injectable so the
timing logic can be tested with fakes.  Output: :meth:`BenchResult.format`
(text), ``to_json``, :func:`to_csv` and :func:`plot_bench` (PNG).
"""
from __future__ import annotations

import contextlib
import copy
import time
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

from mlcomp.base.errors import MlcompError, PipelineSpecError, VerificationError
from mlcomp.base.registry import did_you_mean
from mlcomp.ir.dtypes import dtype_name
from mlcomp.hardware.peak_memory import PeakMemory
from mlcomp.hardware.noise import LoadWatch
from mlcomp.hardware.probe import machine_line
from mlcomp.hardware.timing import BenchConfigError, Clock, Sync, TimingPolicy, synchronizer
from mlcomp.measure.bench_results import BenchResult, BenchRow
from mlcomp.measure.bench_timing import Cell, WatchFactory, time_group
from mlcomp.measure.plots import EAGER, bench_plot
from mlcomp.measure.variants import Variant, check_dtypes, variants

DESIGN_TARGETS = ("cpu", "cuda", "onnxruntime", "tvm")   # the targets DESIGN.md names
# compiler(model, example_inputs, target, pipeline, options) -> callable artifact
MAX_PROCS = 4          # worker processes per variant at most
Compiler = Callable[[Any, tuple, str, "str | None", Mapping[str, Any]], Callable[..., Any]]
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class BenchConfig:
    """What to measure: targets (``eager`` always included), batch sizes, pipeline, timing policy."""

    targets: tuple[str, ...] = (EAGER, "cpu")
    batches: tuple[int, ...] = (1,)
    pipeline: str | None = None
    policy: TimingPolicy = TimingPolicy()
    memory: bool = True
    threads: int | None = None        # intra-op threads for every runtime (None: each runtime's default)
    isolate: bool = True              # each variant in a worker process of its own where it can be
    precision: float | None = 0.03    # stop timing once every speedup's interval is within +-this
    settle_s: float = 0.0             # wait up to this long for a quiet machine before each comparison
    crosscheck: bool = False          # also time eager and each artifact as whole processes
    dtypes: tuple[str, ...] = ("fp32",)   # compute precisions per target (mlcomp.measure.variants)
    procs: int = 1                    # worker processes per variant (2: each runtime in two, both reported)

    def compile_options(self) -> dict[str, Any]:
        """Options passed to ``mlcomp.compile`` so every target runs with the same thread count."""
        return {} if self.threads is None else {"threads": self.threads}

    def __post_init__(self) -> None:
        if not self.batches or any(b < 1 for b in self.batches):
            raise BenchConfigError(f"batch sizes {list(self.batches)} must be positive integers",
                                   hint="e.g. --batch 1,32")
        if not self.targets:
            raise BenchConfigError("no targets to benchmark", hint="e.g. --targets eager,cpu,onnxruntime")
        if self.precision is not None and not 0 < self.precision < 1:
            raise BenchConfigError(f"precision {self.precision} is not between 0 and 1",
                                   hint="e.g. --precision 0.03 (stop once intervals are within +-3%)")
        if not 1 <= self.procs <= MAX_PROCS:
            raise BenchConfigError(f"--procs {self.procs} is not between 1 and {MAX_PROCS}",
                                   hint="--procs 2 times each runtime in two worker processes and reports both")
        check_dtypes(self.dtypes)
        if self.settle_s < 0:
            raise BenchConfigError(f"--settle {self.settle_s} is negative", hint="give seconds to wait, e.g. 30")


# ---------------------------------------------------------------------------
# running


def default_compiler(model: Any, inputs: tuple, target: str, pipeline: str | None,
                     options: Mapping[str, Any] = MappingProxyType({})) -> Callable[..., Any]:
    """``mlcomp.compile`` without its own verification (the bench compares outputs itself)."""
    from mlcomp.api import compile as mlcomp_compile

    return mlcomp_compile(model, example_inputs=inputs, target=target, pipeline=pipeline, verify=False,
                          **dict(options))


def default_availability() -> dict[str, str | None]:
    """``mlcomp.targets.available_targets()``.

    Should that fail (the module missing, or one target's module broken), each
    designed target is asked on its own through ``get_target(name).available()``
    and any that cannot be asked is reported unavailable with the error.
    """
    try:
        from mlcomp.targets import available_targets

        return dict(available_targets())
    except Exception:  # noqa: BLE001 - fall back to asking target by target
        pass
    out: dict[str, str | None] = {}
    for name in DESIGN_TARGETS:
        try:
            from mlcomp.targets import get_target

            out[name] = get_target(name).available()
        except Exception as exc:  # noqa: BLE001
            out[name] = f"mlcomp.targets cannot provide it ({type(exc).__name__}: {exc})"
    return out


@dataclass(frozen=True)
class Compiled:
    """A target's runnable for one model, or why there is none (``fn is None``)."""

    target: str
    fn: Callable[..., Any] | None
    reason: str = ""
    compile_s: float | None = None


def compile_for(model: Any, inputs: tuple, target: str, *, pipeline: str | None = None,
                options: Mapping[str, Any] = MappingProxyType({}), compiler: Compiler = default_compiler,
                availability: Callable[[], Mapping[str, str | None]] = default_availability,
                clock: Clock = time.perf_counter) -> Compiled:
    """Compile ``model`` for ``target``; unavailable or failing targets come back with a reason."""
    avail = dict(availability())
    reason = _reason(target, avail) if target in avail else "unknown target (see `mlcomp targets`)"
    if reason:
        return Compiled(target, None, reason)
    t0 = clock()
    try:
        fn = compiler(model, tuple(inputs), target, pipeline, options)
    except MlcompError as err:
        return Compiled(target, None, f"failed: {err.message}")
    except Exception as err:  # noqa: BLE001
        return Compiled(target, None, f"failed: {type(err).__name__}: {err}")
    return Compiled(target, fn, "", clock() - t0)


def target_device(target: str) -> str:
    """Where ``target`` (or a variant of it, ``"cuda bf16"``) runs."""
    return "cuda" if target == "cuda" or target.startswith("cuda:") else "cpu"


def run_bench(model: Any, config: BenchConfig = BenchConfig(), *, input_shapes: Sequence[str] = (),
              trust_pickle: bool = False, clock: Clock = time.perf_counter,
              sync_for: Callable[[str], Sync] = synchronizer, compiler: Compiler = default_compiler,
              availability: Callable[[], Mapping[str, str | None]] = default_availability,
              progress: Progress | None = None, watch: WatchFactory | None = LoadWatch) -> BenchResult:
    """Benchmark ``model`` (a spec :func:`mlcomp.frontend.loading.load_model` accepts) per ``config``.

    Per batch and device: every target is compiled and checked against eager, then eager and
    every target that runs are timed together in rotated rounds (:func:`mlcomp.measure.rounds.compare`).
    ``watch(pids)`` reads the machine's load while they are timed (None: not read).
    """
    import torch

    from mlcomp.frontend.loading import load_model

    source = load_model(model, input_shapes=input_shapes, trust_pickle=trust_pickle, batch=config.batches[0])
    base_inputs = source.inputs()
    targets = [t for t in dict.fromkeys(config.targets) if t != EAGER]
    avail = dict(availability())
    _check_known(targets, avail)
    groups = _groups(config.batches, [v.key for v in variants(targets, config.dtypes)], avail)
    rows: list[BenchRow] = []
    notes: list[str] = []
    label = getattr(source, "name", str(model))
    total, step = sum(len(names) + 1 for _, _, names in groups), 0
    expected: dict[int, Any] = {}
    with torch.inference_mode():
        for batch, device, names in groups:
            cpu_inputs = rebatch(base_inputs, batch)
            if batch not in expected:
                expected[batch] = source.eager(*cpu_inputs)
            inputs = tuple(t.to(device) for t in cpu_inputs)
            cell = Cell(source, label, batch, device, inputs, expected[batch])
            built: dict[str, Callable[..., Any]] = {}
            group: dict[str, BenchRow] = {}
            for target in names:
                if progress:
                    where = "" if device == "cpu" else f" ({device})"
                    progress(step, total, f"{label} {target}{where} batch {batch}: compile and check")
                step += 1
                group[target], fn = _prepare(cell, target, _reason(target, avail), config, clock,
                                             sync_for(device), compiler)
                if fn is not None:
                    built[target] = fn
            if progress:
                progress(step, total, f"{label} batch {batch}: timing {len(built)} variants in rounds")
            step += 1
            if EAGER in built:
                group, note = time_group(model, cell, built, group, config, clock=clock, sync=sync_for(device),
                                         input_shapes=input_shapes, trust_pickle=trust_pickle, watch=watch)
                notes.append(note)
            rows += group.values()
        if progress:
            progress(total, total, f"{label} done")
    shapes = ", ".join(f"{dtype_name(t.dtype)}[B, {', '.join(map(str, t.shape[1:]))}]"
                       for t in base_inputs)
    return BenchResult(label, shapes, config.pipeline, machine_line(), config.policy, tuple(rows), tuple(notes),
                       crosscheck=config.crosscheck)


def _groups(batches: Sequence[int], targets: Sequence[str],
            avail: Mapping[str, str | None]) -> list[tuple[int, str, list[str]]]:
    """(batch, device, names) per comparison: eager first (the reference), then the targets on that device."""
    out = []
    for batch in batches:
        out.append((batch, "cpu", [EAGER] + [t for t in targets if target_device(t) == "cpu"]))
        on_gpu = [t for t in targets if target_device(t) != "cpu"]
        if any(not _reason(t, avail) for t in on_gpu):
            out.append((batch, "cuda", [EAGER] + on_gpu))       # the reference for speedups on the GPU
        elif on_gpu:
            out[-1][2].extend(on_gpu)                           # reported skipped with their reasons
    return out


def _reason(key: str, avail: Mapping[str, str | None]) -> str | None:
    """Why the target of variant ``key`` is unavailable here (None: it is available, or is eager)."""
    return None if key == EAGER else avail.get(Variant.parse(key).target)


def _check_known(targets: Sequence[str], avail: Mapping[str, str | None]) -> None:
    unknown = [t for t in targets if t != EAGER and t not in avail]
    if unknown:
        close = did_you_mean(unknown[0], avail)
        raise BenchConfigError(
            f"unknown target {unknown[0]!r}" + (f" (did you mean {close!r}?)" if close else ""),
            hint=f"known targets: {', '.join([EAGER, *avail])} (see `mlcomp targets`)")


def rebatch(inputs: Sequence[Any], batch: int) -> tuple[Any, ...]:
    """The example inputs with their leading dimension set to ``batch`` (seeded random data)."""
    import torch

    from mlcomp.frontend.loading import InputSpec

    out = []
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] == batch:
            out.append(t)
        else:
            out.append(InputSpec((batch, *t.shape[1:]), t.dtype).random(torch.Generator().manual_seed(i)))
    return tuple(out)


def _prepare(cell: "Cell", target: str, unavailable: str | None, config: BenchConfig, clock: Clock, sync: Sync,
             compiler: Compiler) -> tuple[BenchRow, Callable[..., Any] | None]:
    """Compile ``target`` (eager: the model itself), call it once and check it against eager; the row so
    far and the runnable (None when skipped or failed)."""
    variant = Variant.parse(target)
    row = BenchRow(cell.label, variant.target, cell.batch, cell.device, dtype=variant.dtype)
    if unavailable:
        return replace(row, status="skipped", reason=unavailable), None
    probe = PeakMemory(cell.device) if config.memory else None
    try:
        with probe if probe else contextlib.nullcontext():
            if target == EAGER:
                src = cell.source
                fn = src.eager if cell.device == "cpu" else copy.deepcopy(src.eager).to(cell.device)
            else:
                t0 = clock()
                fn = compiler(_compile_input(cell.source), tuple(t.cpu() for t in cell.inputs), variant.target,
                              variant.pipeline(config.pipeline), config.compile_options())
                row = replace(row, compile_s=clock() - t0)
            t1 = clock()
            out = fn(*cell.inputs)                   # the first call: checked against eager, and warm-up 1
            sync()
            row = replace(row, first_call_s=clock() - t1)
    except PipelineSpecError as err:    # the target refuses this precision up front (no int8 lowering)
        return replace(row, status="skipped", reason=err.message), None
    except MlcompError as err:      # a compile whose own verification failed is a verification failure
        return replace(row, status="failed", reason=err.message,
                       verified=False if isinstance(err, VerificationError) else None), None
    except Exception as err:  # noqa: BLE001 - one broken target must not end the bench
        return replace(row, status="failed", reason=f"{type(err).__name__}: {err}"), None
    row = replace(row, memory=probe.reading if probe else None)
    if target == EAGER:
        return replace(row, reason=_eager_ref_note(row)), fn
    from mlcomp.analysis.verify import compare

    manifest = getattr(fn, "manifest", None) or {}
    check = compare(cell.expected, out, manifest.get("declared_tolerance"))   # int8's looser one, if declared
    if check.note:
        return replace(row, status="failed", verified=False, reason=f"outputs do not match eager: {check.note}"), None
    ran = _ran_in(getattr(fn, "runtime", None), variant.dtype)
    return replace(row, max_abs_err=check.max_abs, max_rel_err=check.max_rel, verified=check.passed,
                   reason=ran if check.passed else f"differs from eager: {check.summary()}"), fn


def _ran_in(runtime: Any, dtype: str) -> str:
    """What a low-precision variant's runtime says it ran: its int8 compute ops, or the precision its
    runtime settled on (OpenVINO's hint falls back to f32 on a CPU without bf16 instructions)."""
    int8 = getattr(runtime, "int8", None)
    if int8 is not None:
        return int8.line().split(";")[0]                     # "int8: 20 of 21 compute ops (…)"
    precision = getattr(runtime, "precision", None)
    if dtype != "fp32" and isinstance(precision, dict) and precision.get("effective"):
        return f"ran {precision['effective']}: {precision.get('reason', '')}"
    return ""


def _eager_ref_note(row: BenchRow) -> str:
    return "reference" if row.device == "cpu" else "reference for cuda targets"


def _compile_input(source: Any) -> Any:
    """What to hand ``mlcomp.compile``: the loaded module, or its file for TorchScript / .pt2."""
    if getattr(source, "kind", "module") in ("torchscript", "exported") and getattr(source, "path", None):
        return source.path
    return source.eager


def plot_bench(results: Sequence[BenchResult], path: str) -> None:
    """PNG per model: speedup per target and batch, latency vs batch size (see :mod:`mlcomp.measure.plots`)."""

    bench_plot(results, path)


__all__ = ["BenchConfig", "run_bench", "plot_bench", "rebatch",
           "EAGER"]
