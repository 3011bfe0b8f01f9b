"""``mlcomp bench``: eager vs compiled targets, timed correctly, one table per model.

For every batch size and target the bench

1. compiles the model (``mlcomp.compile``), timing the cold compile;
2. runs it once and compares its outputs with eager (max abs / rel error);
3. times it with :func:`mlcomp.timing.measure`: warm-up, the device's
   synchroniser before the clock stops, repeats sized to a time budget,
   median and p90;
4. records the peak memory growth around compile + run
   (:class:`mlcomp.timing.PeakMemory`).

Eager always runs first at each batch size: it is the reference for errors and
speedups.  A target that is unavailable (``mlcomp.targets.available_targets``)
is reported as skipped with its reason; one that fails to compile or run is
reported as failed with the error, and the bench goes on.

    >>> result = run_bench("mlp", BenchConfig(targets=("eager", "cpu"), batches=(1, 32)))
    >>> print(result.format())

Clock, synchroniser, compiler and target availability are injectable so the
timing logic can be tested with fakes.  Output: :meth:`BenchResult.format`
(text), ``to_json``, :func:`to_csv` and :func:`plot_bench` (PNG).
"""
from __future__ import annotations

import copy
import csv
import io
import time
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

from .errors import MlcompError
from .study.common import Table, machine_line
from .timing import (BenchConfigError, Clock, MemoryReading, PeakMemory, Sync, Timing, TimingPolicy, fmt_bytes,
                     fmt_seconds, measure, synchronizer)

EAGER = "eager"
Compiler = Callable[[Any, tuple, str, "str | None"], Callable[..., Any]]
Progress = Callable[[int, int, str], None]


@dataclass(frozen=True)
class BenchConfig:
    """What to measure: targets (``eager`` always included), batch sizes, pipeline, timing policy."""

    targets: tuple[str, ...] = (EAGER, "cpu")
    batches: tuple[int, ...] = (1,)
    pipeline: str | None = None
    policy: TimingPolicy = TimingPolicy()
    memory: bool = True

    def __post_init__(self) -> None:
        if not self.batches or any(b < 1 for b in self.batches):
            raise BenchConfigError(f"batch sizes {list(self.batches)} must be positive integers",
                                   hint="e.g. --batch 1,32")
        if not self.targets:
            raise BenchConfigError("no targets to benchmark", hint="e.g. --targets eager,cpu,onnxruntime")


@dataclass(frozen=True)
class BenchRow:
    """One (target, batch) cell; ``status`` is ok, skipped or failed (``reason`` says why)."""

    model: str
    target: str
    batch: int
    device: str = "cpu"
    status: str = "ok"
    reason: str = ""
    timing: Timing | None = None
    compile_s: float | None = None
    memory: MemoryReading | None = None
    max_abs_err: float | None = None
    max_rel_err: float | None = None
    speedup: float | None = None          # eager median / this median, same device and batch

    @property
    def label(self) -> str:
        return self.target if self.device == "cpu" or self.target != EAGER else f"{EAGER} ({self.device})"

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "target": self.target, "batch": self.batch, "device": self.device,
                "status": self.status, "reason": self.reason or None,
                "timing": self.timing.to_json() if self.timing else None, "compile_s": self.compile_s,
                "memory": self.memory.to_json() if self.memory else None, "max_abs_err": self.max_abs_err,
                "max_rel_err": self.max_rel_err, "speedup": self.speedup}


CSV_FIELDS = ("model", "target", "device", "batch", "status", "median_s", "p90_s", "repeats", "speedup",
              "compile_s", "peak_mem_bytes", "max_abs_err", "max_rel_err", "reason")


@dataclass(frozen=True)
class BenchResult:
    """All cells of one model."""

    model: str
    inputs: str
    pipeline: str | None
    machine: str
    policy: TimingPolicy
    rows: tuple[BenchRow, ...]

    def table(self) -> Table:
        cols = ("target", "batch", "median", "p90", "speedup", "compile", "peak mem", "max abs err", "runs",
                "note")
        rows = []
        for r in self.rows:
            if r.status != "ok":
                rows.append((r.label, str(r.batch), "—", "—", "—", fmt_seconds(r.compile_s), "—", "—", "—",
                             f"{r.status}: {_short(r.reason)}"))
                continue
            t = r.timing
            assert t is not None
            rows.append((r.label, str(r.batch), fmt_seconds(t.median), fmt_seconds(t.p90),
                         f"{r.speedup:.2f}x" if r.speedup else "—", fmt_seconds(r.compile_s),
                         fmt_bytes(r.memory.growth, sign=True) if r.memory else "—",
                         "—" if r.max_abs_err is None else f"{r.max_abs_err:.1e}", str(t.repeats), r.reason))
        title = (f"{self.model}  input {self.inputs}  pipeline {self.pipeline or '(none)'}  "
                 f"budget {self.policy.budget_s:g} s/measurement")
        return Table(title, cols, tuple(rows), frozenset({1, 2, 3, 4, 5, 6, 7, 8}))

    def format(self) -> str:
        return self.table().format() + f"\n({self.machine})"

    def to_json(self) -> dict[str, Any]:
        return {"model": self.model, "inputs": self.inputs, "pipeline": self.pipeline, "machine": self.machine,
                "policy": {"warmup": self.policy.warmup, "budget_s": self.policy.budget_s,
                           "min_repeats": self.policy.min_repeats, "max_repeats": self.policy.max_repeats},
                "rows": [r.to_json() for r in self.rows]}

    def csv_rows(self) -> list[dict[str, Any]]:
        out = []
        for r in self.rows:
            t = r.timing
            out.append({"model": r.model, "target": r.target, "device": r.device, "batch": r.batch,
                        "status": r.status, "median_s": t.median if t else "", "p90_s": t.p90 if t else "",
                        "repeats": t.repeats if t else "", "speedup": r.speedup or "",
                        "compile_s": "" if r.compile_s is None else r.compile_s,
                        "peak_mem_bytes": r.memory.growth if r.memory else "",
                        "max_abs_err": "" if r.max_abs_err is None else r.max_abs_err,
                        "max_rel_err": "" if r.max_rel_err is None else r.max_rel_err, "reason": r.reason})
        return out


def to_csv(results: Sequence[BenchResult]) -> str:
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_FIELDS, lineterminator="\n")
    w.writeheader()
    for res in results:
        w.writerows(res.csv_rows())
    return buf.getvalue()


def _short(text: str, n: int = 70) -> str:
    text = " ".join(text.split())
    return text if len(text) <= n else text[: n - 1] + "…"


# ---------------------------------------------------------------------------
# running


def default_compiler(model: Any, inputs: tuple, target: str, pipeline: str | None) -> Callable[..., Any]:
    """``mlcomp.compile`` without its own verification (the bench compares outputs itself)."""
    from .api import compile as mlcomp_compile

    return mlcomp_compile(model, example_inputs=inputs, target=target, pipeline=pipeline, verify=False)


def default_availability() -> dict[str, str | None]:
    """``mlcomp.targets.available_targets()``; every target unavailable if that module is missing."""
    try:
        from .targets import available_targets
    except ImportError as exc:
        return {"__missing__": f"mlcomp.targets cannot be imported ({exc})"}
    return dict(available_targets())


@dataclass(frozen=True)
class Compiled:
    """A target's runnable for one model, or why there is none (``fn is None``)."""

    target: str
    fn: Callable[..., Any] | None
    reason: str = ""
    compile_s: float | None = None


def compile_for(model: Any, inputs: tuple, target: str, *, pipeline: str | None = None,
                compiler: Compiler = default_compiler,
                availability: Callable[[], Mapping[str, str | None]] = default_availability,
                clock: Clock = time.perf_counter) -> Compiled:
    """Compile ``model`` for ``target``; unavailable or failing targets come back with a reason."""
    avail = dict(availability())
    reason = _reason(target, avail) if (target in avail or "__missing__" in avail) else "unknown target"
    if reason:
        return Compiled(target, None, reason)
    t0 = clock()
    try:
        fn = compiler(model, tuple(t.cpu() for t in inputs), target, pipeline)
    except MlcompError as err:
        return Compiled(target, None, f"failed: {err.message}")
    except Exception as err:  # noqa: BLE001
        return Compiled(target, None, f"failed: {type(err).__name__}: {err}")
    return Compiled(target, fn, "", clock() - t0)


def target_device(target: str) -> str:
    return "cuda" if target == "cuda" or target.startswith("cuda:") else "cpu"


def run_bench(model: Any, config: BenchConfig = BenchConfig(), *, input_shapes: Sequence[str] = (),
              trust_pickle: bool = False, clock: Clock = time.perf_counter,
              sync_for: Callable[[str], Sync] = synchronizer, compiler: Compiler = default_compiler,
              availability: Callable[[], Mapping[str, str | None]] = default_availability,
              progress: Progress | None = None) -> BenchResult:
    """Benchmark ``model`` (a spec :func:`mlcomp.loading.load_model` accepts) per ``config``."""
    import torch

    from .loading import load_model

    source = load_model(model, input_shapes=input_shapes, trust_pickle=trust_pickle, batch=config.batches[0])
    base_inputs = source.inputs()
    targets = [t for t in dict.fromkeys(config.targets) if t != EAGER]
    avail = dict(availability())
    _check_known(targets, avail)
    cells: list[tuple[int, str, str]] = []
    for batch in config.batches:
        cells.append((batch, "cpu", EAGER))
        cells += [(batch, "cpu", t) for t in targets if target_device(t) == "cpu"]
        on_gpu = [t for t in targets if target_device(t) != "cpu"]
        if any(not _reason(t, avail) for t in on_gpu):
            cells.append((batch, "cuda", EAGER))       # the reference for speedups on the GPU
        cells += [(batch, target_device(t), t) for t in on_gpu]
    rows: list[BenchRow] = []
    label = getattr(source, "name", str(model))
    expected: dict[int, Any] = {}
    with torch.inference_mode():
        for i, (batch, device, target) in enumerate(cells):
            if progress:
                where = "" if device == "cpu" else f" ({device})"
                progress(i, len(cells), f"{label} {target}{where} batch {batch}")
            reason = _reason(target, avail)
            if reason:
                rows.append(BenchRow(label, target, batch, device, "skipped", reason))
                continue
            cpu_inputs = rebatch(base_inputs, batch)
            if batch not in expected:
                expected[batch] = source.eager(*cpu_inputs)
            inputs = tuple(t.to(device) for t in cpu_inputs)
            rows.append(_bench_cell(source, label, target, batch, device, inputs, config, clock,
                                    sync_for(device), compiler, rows, expected[batch]))
        if progress:
            progress(len(cells), len(cells), f"{label} done")
    shapes = ", ".join(f"{str(t.dtype).replace('torch.', '')}[B, {', '.join(map(str, t.shape[1:]))}]"
                       for t in base_inputs)
    return BenchResult(label, shapes, config.pipeline, machine_line(), config.policy, tuple(rows))


def _reason(target: str, avail: Mapping[str, str | None]) -> str | None:
    if target == EAGER:
        return None
    if "__missing__" in avail:
        return avail["__missing__"]
    return avail.get(target)


def _check_known(targets: Sequence[str], avail: Mapping[str, str | None]) -> None:
    if "__missing__" in avail:
        return
    unknown = [t for t in targets if t != EAGER and t not in avail]
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], list(avail), n=1)
        raise BenchConfigError(
            f"unknown target {unknown[0]!r}" + (f" (did you mean {close[0]!r}?)" if close else ""),
            hint=f"known targets: {', '.join([EAGER, *avail])} (see `mlcomp targets`)")


def rebatch(inputs: Sequence[Any], batch: int) -> tuple[Any, ...]:
    """The example inputs with their leading dimension set to ``batch`` (seeded random data)."""
    import torch

    from .loading import InputSpec

    out = []
    for i, t in enumerate(inputs):
        if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] == batch:
            out.append(t)
        else:
            out.append(InputSpec((batch, *t.shape[1:]), t.dtype).random(torch.Generator().manual_seed(i)))
    return tuple(out)


def _outputs(value: Any) -> list[Any]:
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _outputs(v)]
    return []


def max_errors(expected: Any, actual: Any) -> tuple[float, float]:
    """(max abs error, max error relative to the largest expected magnitude) over all outputs."""
    exp, act = _outputs(expected), _outputs(actual)
    if len(exp) != len(act):
        raise MlcompError(f"the compiled model returned {len(act)} output(s), eager returned {len(exp)}")
    abs_err, rel_err = 0.0, 0.0
    for e, a in zip(exp, act):
        e, a = e.detach().float().cpu(), a.detach().float().cpu()
        if e.shape != a.shape:
            raise MlcompError(f"output shape {list(a.shape)} differs from eager's {list(e.shape)}")
        if e.numel() == 0:
            continue
        d = float((e - a).abs().max())
        abs_err = max(abs_err, d)
        rel_err = max(rel_err, d / max(float(e.abs().max()), 1e-12))
    return abs_err, rel_err


def _bench_cell(source: Any, label: str, target: str, batch: int, device: str, inputs: tuple, config: BenchConfig,
                clock: Clock, sync: Sync, compiler: Compiler, done: Sequence[BenchRow], expected: Any) -> BenchRow:
    row = BenchRow(label, target, batch, device)
    probe = PeakMemory(device) if config.memory else None
    try:
        if probe:
            probe.__enter__()
        try:
            if target == EAGER:
                fn = source.eager if device == "cpu" else copy.deepcopy(source.eager).to(device)
            else:
                t0 = clock()
                fn = compiler(_compile_input(source), tuple(t.cpu() for t in inputs), target, config.pipeline)
                row = replace(row, compile_s=clock() - t0)
            out = fn(*inputs)
            sync()
            timing = measure(lambda: fn(*inputs), config.policy, clock=clock, sync=sync)
        finally:
            if probe:
                probe.__exit__(None, None, None)
    except MlcompError as err:
        return replace(row, status="failed", reason=err.message)
    except Exception as err:  # noqa: BLE001 - one broken target must not end the bench
        return replace(row, status="failed", reason=f"{type(err).__name__}: {err}")
    row = replace(row, timing=timing, memory=probe.reading if probe else None)
    if target == EAGER:
        return replace(row, speedup=1.0, reason=_eager_ref_note(row))
    ref = next((r for r in done if r.target == EAGER and r.batch == batch and r.device == device
                and r.status == "ok"), None)
    if ref is None:
        return replace(row, reason="no eager reference")
    try:
        abs_err, rel_err = max_errors(expected, out)
    except MlcompError as err:
        return replace(row, status="failed", reason=err.message)
    speedup = ref.timing.median / timing.median if ref.timing and timing.median > 0 else None
    return replace(row, max_abs_err=abs_err, max_rel_err=rel_err, speedup=speedup)


def _eager_ref_note(row: BenchRow) -> str:
    return "reference" if row.device == "cpu" else "reference for cuda targets"


def _compile_input(source: Any) -> Any:
    """What to hand ``mlcomp.compile``: the loaded module, or its file for TorchScript / .pt2."""
    if getattr(source, "kind", "module") in ("torchscript", "exported") and getattr(source, "path", None):
        return source.path
    return source.eager


# ---------------------------------------------------------------------------
# plotting


def plot_bench(results: Sequence[BenchResult], path: str) -> None:
    """Per model: speedup per target and batch (bars), latency vs batch on log axes (lines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .output import atomic_path

    n = max(len(results), 1)
    fig, axes = plt.subplots(n, 2, figsize=(12, 3.6 * n), squeeze=False)
    for (ax_s, ax_l), res in zip(axes, results):
        ok = [r for r in res.rows if r.status == "ok" and r.timing]
        batches = sorted({r.batch for r in res.rows})
        labels = list(dict.fromkeys(r.label for r in ok))
        compiled = [lb for lb in labels if not lb.startswith(EAGER)]
        width = 0.8 / max(len(compiled), 1)
        for k, lb in enumerate(compiled):
            xs, ys = [], []
            for j, b in enumerate(batches):
                r = next((r for r in ok if r.label == lb and r.batch == b), None)
                if r and r.speedup:
                    xs.append(j + (k - (len(compiled) - 1) / 2) * width)
                    ys.append(r.speedup)
            bars = ax_s.bar(xs, ys, width, label=lb)
            ax_s.bar_label(bars, fmt="%.2f", fontsize=7)
        ax_s.axhline(1.0, color="black", lw=0.8, ls="--")
        ax_s.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
        ax_s.set_ylabel("speedup over eager (median)")
        ax_s.set_title(f"{res.model}: speedup per target", fontsize=10)
        if compiled:
            ax_s.legend(fontsize=8)
        for lb in labels:
            pts = sorted((r.batch, r.timing.median) for r in ok if r.label == lb)
            ax_l.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker="o", label=lb)
        eager = sorted((r.batch, r.timing.median) for r in ok if r.label == EAGER)
        if eager and len(batches) > 1:    # guides through eager's smallest batch: flat and proportional
            b0, t0 = eager[0]
            ax_l.plot(batches, [t0 * 1e3] * len(batches), color="grey", lw=0.7, ls=":",
                      label="flat: overhead-bound")
            ax_l.plot(batches, [t0 * 1e3 * b / b0 for b in batches], color="grey", lw=0.7, ls="--",
                      label="∝ batch: compute-bound")
        ax_l.set_xscale("log")
        ax_l.set_yscale("log")
        ax_l.set_xlabel("batch size")
        ax_l.set_ylabel("latency per call, ms (median)")
        ax_l.set_title(f"{res.model}: latency vs batch size", fontsize=10)
        ax_l.legend(fontsize=7)
        ax_l.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)


__all__ = ["BenchConfig", "BenchRow", "BenchResult", "run_bench", "to_csv", "plot_bench", "rebatch",
           "max_errors", "EAGER"]
