"""Timing and peak memory, measured the way the textbook intends but correctly.

The chapter times a loop with a wall clock and, on asynchronous backends, a
barrier before the clock stops.  This module makes each of those steps explicit
and injectable so that tests can drive it with fakes:

* warm-up calls run before any sample is taken (first-call costs: allocator
  pools, kernel selection, lazy imports, JIT) — ``warmup`` of them, or fewer
  once they have used up one time budget;
* every sample is ``clock(); fn(); sync(); clock()`` — the synchroniser runs
  *before* the clock stops, so work still queued on a device is counted;
* samples are taken until the time budget is spent, but never fewer than
  ``min_repeats`` nor more than ``max_repeats``;
* the summary is the median and the 90th percentile, not the mean (one
  preempted sample does not move a median).

    >>> t = measure(lambda: model(x), TimingPolicy(budget_s=0.5))
    >>> t.median, t.p90, t.repeats

Peak memory is the growth of the process's resident set over a baseline taken
just before the measured block (Linux: the kernel's own high-water mark, reset
through ``/proc/self/clear_refs``; elsewhere a psutil sampling thread), or
``torch.cuda.max_memory_allocated`` growth on a CUDA device.  On CPU,
``PeakMemory(source=MemorySource.ALLOCATOR)`` instead follows torch's CPU
allocator (every tensor allocation and free), the figure a liveness prediction
is compared with.
"""
from __future__ import annotations

import ctypes
import enum
import math
import re
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from mlcomp.base.errors import MlcompError
from mlcomp.base.quiet import quiet_native

Clock = Callable[[], float]
Sync = Callable[[], None]


class BenchConfigError(MlcompError):
    """A benchmark or study option is out of range (budget, repeats, batch sizes, targets)."""


def no_sync() -> None:
    """The synchroniser of a synchronous device (CPU torch returns only when the work is done)."""


def synchronizer(device: Any) -> Sync:
    """The barrier for ``device``: ``torch.cuda.synchronize`` on CUDA, :func:`no_sync` on CPU."""
    import torch

    dev = torch.device(device)
    if dev.type == "cuda":
        return lambda: torch.cuda.synchronize(dev)
    return no_sync


# ---------------------------------------------------------------------------
# statistics


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between order statistics."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"percentile {q} outside 0..100")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def median(values: Sequence[float]) -> float:
    return percentile(values, 50.0)


@dataclass(frozen=True)
class TimingPolicy:
    """How to measure one thing: warm-up calls, time budget, bounds on the number of samples."""

    warmup: int = 3
    budget_s: float = 1.0
    min_repeats: int = 5
    max_repeats: int = 10_000

    def __post_init__(self) -> None:
        if self.warmup < 0:
            raise BenchConfigError(f"warm-up count {self.warmup} is negative", hint="use 0 or more")
        if not self.budget_s > 0:
            raise BenchConfigError(f"time budget {self.budget_s} s is not positive",
                                   hint="give --budget in seconds per measurement, e.g. --budget 1")
        if self.min_repeats < 1 or self.max_repeats < self.min_repeats:
            raise BenchConfigError(
                f"repeat bounds min={self.min_repeats} max={self.max_repeats} are inconsistent",
                hint="need 1 <= --min-repeats <= --max-repeats")


@dataclass(frozen=True)
class Timing:
    """Samples of one measurement, in seconds per call of the timed function."""

    samples: tuple[float, ...]
    warmup_s: float = 0.0
    budget_s: float = 0.0
    warmup_calls: int = 0

    @property
    def repeats(self) -> int:
        return len(self.samples)

    @property
    def median(self) -> float:
        return median(self.samples)

    @property
    def p90(self) -> float:
        return percentile(self.samples, 90.0)

    @property
    def min(self) -> float:
        return min(self.samples)

    @property
    def mean(self) -> float:
        return sum(self.samples) / len(self.samples)

    def to_json(self) -> dict[str, Any]:
        return {"median_s": self.median, "p90_s": self.p90, "min_s": self.min, "mean_s": self.mean,
                "repeats": self.repeats, "warmup_s": self.warmup_s, "warmup_calls": self.warmup_calls}


def measure(fn: Callable[[], Any], policy: TimingPolicy = TimingPolicy(), *, clock: Clock = time.perf_counter,
            sync: Sync = no_sync) -> Timing:
    """Time ``fn`` per :class:`TimingPolicy`; see the module docstring for the protocol."""
    w0 = clock()
    warm, calls = 0.0, 0
    while calls < policy.warmup:
        fn()
        sync()
        calls += 1
        warm = clock() - w0
        if warm >= policy.budget_s:      # a slow model: one budget of warm-up is enough
            break
    samples: list[float] = []
    begin = clock()
    while len(samples) < policy.max_repeats:
        start = clock()
        fn()
        sync()                      # drain queued device work before the clock stops
        stop = clock()
        samples.append(stop - start)
        if len(samples) >= policy.min_repeats and stop - begin >= policy.budget_s:
            break
    return Timing(tuple(samples), warm, policy.budget_s, calls)


def measure_interleaved(fns: Mapping[str, Callable[[], Any]], policy: TimingPolicy = TimingPolicy(), *,
                        clock: Clock = time.perf_counter,
                        sync: Sync | Mapping[str, Sync] = no_sync) -> dict[str, Timing]:
    """Time several variants round-robin, one sample of each per round.

    On a shared machine the load drifts; timing variant A for a second and then
    B for a second compares A's moment with B's.  Interleaving spreads the drift
    over every variant.  Each variant is warmed up first; rounds continue until
    ``len(fns) * budget_s`` is spent (at least ``min_repeats`` rounds, at most
    ``max_repeats``).  ``sync`` is one synchroniser or one per variant.
    """
    syncs = {k: (sync[k] if isinstance(sync, Mapping) else sync) for k in fns}
    warm: dict[str, tuple[float, int]] = {}
    for name, fn in fns.items():
        w0, calls = clock(), 0
        while calls < policy.warmup:
            fn()
            syncs[name]()
            calls += 1
            if clock() - w0 >= policy.budget_s:
                break
        warm[name] = (clock() - w0, calls)
    samples: dict[str, list[float]] = {k: [] for k in fns}
    begin, rounds = clock(), 0
    while rounds < policy.max_repeats:
        for name, fn in fns.items():
            start = clock()
            fn()
            syncs[name]()
            samples[name].append(clock() - start)
        rounds += 1
        if rounds >= policy.min_repeats and clock() - begin >= policy.budget_s * len(fns):
            break
    return {k: Timing(tuple(samples[k]), warm[k][0], policy.budget_s, warm[k][1]) for k in fns}


# ---------------------------------------------------------------------------
# peak memory

_HWM_RE = re.compile(r"^(VmHWM|VmRSS):\s+(\d+)\s+kB", re.M)


def _proc_status() -> dict[str, int] | None:
    try:
        with open("/proc/self/status") as fh:
            return {k: int(v) * 1024 for k, v in _HWM_RE.findall(fh.read())}
    except OSError:
        return None


def _reset_hwm() -> bool:
    """Reset the kernel's peak-RSS counter (Linux >= 4.0); False where not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        return True
    except OSError:
        return False


def _trim_heap() -> None:
    """Give freed heap pages back to the OS so the baseline is not inflated by earlier runs."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _rss() -> int:
    status = _proc_status()
    if status and "VmRSS" in status:
        return status["VmRSS"]
    import psutil

    return int(psutil.Process().memory_info().rss)


@dataclass(frozen=True)
class MemoryReading:
    """Memory around a measured block, in bytes; ``growth`` is the figure reported."""

    baseline: int
    peak: int
    end: int
    method: str

    @property
    def growth(self) -> int:
        """Peak bytes above the baseline (never negative)."""
        return max(0, self.peak - self.baseline)

    def to_json(self) -> dict[str, Any]:
        return {"baseline_bytes": self.baseline, "peak_bytes": self.peak, "end_bytes": self.end,
                "growth_bytes": self.growth, "method": self.method}


class MemorySource(enum.Enum):
    """What a CPU :class:`PeakMemory` reads (a CUDA device always reads its caching allocator)."""

    RSS = "rss"              # the process's resident set: everything, at page and malloc-arena granularity
    ALLOCATOR = "allocator"  # every tensor allocation and free of torch's CPU allocator, exactly


def _allocator_peak(events: Any) -> tuple[int, int]:
    """(peak, end) of the running sum of CPU allocation sizes (frees are negative) in time order."""
    from torch._C._profiler import _EventType

    sizes: list[tuple[int, int]] = []
    stack = list(events)
    while stack:
        e = stack.pop()
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            sizes.append((e.start_time_ns, e.extra_fields.alloc_size))
        stack.extend(e.children)
    sizes.sort()
    run = peak = 0
    for _, size in sizes:
        run += size
        peak = max(peak, run)
    return peak, run


class PeakMemory:
    """Context manager measuring peak memory growth over the baseline at entry.

    ``device="cpu"`` with ``source=MemorySource.RSS`` (the default) measures the
    process RSS: the kernel's high-water mark where it can be reset, otherwise a
    psutil sampling thread every ``interval_s``.  RSS sees everything the process
    touches but not every free: glibc serves tensors of a size it has seen freed
    from its heap (the mmap threshold adapts upwards) and keeps freed chunks there,
    so the high-water mark includes fragmentation and pages of earlier steps.

    ``source=MemorySource.ALLOCATOR`` records every allocation and free of torch's
    CPU allocator (``torch.profiler`` with ``profile_memory``: c10 reports each
    ``alloc``/``free`` with its size) and returns the highest running sum of live
    tensor bytes.  It sees a freed activation the moment its last reference goes,
    which is what a liveness prediction models; it does not see memory that
    bypasses the allocator (BLAS packing buffers, Python objects).  The profiler
    slows the measured block, so time it separately.

    ``device="cuda[:i]"`` measures ``torch.cuda.max_memory_allocated``.  After the
    block, ``.reading`` holds a :class:`MemoryReading`.

        >>> with PeakMemory("cpu", source=MemorySource.ALLOCATOR) as mem:
        ...     run()
        >>> mem.reading.growth
    """

    def __init__(self, device: str = "cpu", *, interval_s: float = 0.001,
                 source: MemorySource = MemorySource.RSS) -> None:
        self.device = str(device)
        self.interval_s = interval_s
        self.source = source
        self.reading: MemoryReading | None = None
        self._baseline = 0
        self._peak = 0
        self._method = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._profiler: Any = None

    def __enter__(self) -> "PeakMemory":
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._baseline = torch.cuda.memory_allocated(self.device)
            self._method = "torch.cuda.max_memory_allocated"
            return self
        if self.source is MemorySource.ALLOCATOR:
            import torch.profiler

            self._method = "torch CPU allocator (profiler memory events: live tensor bytes)"
            self._profiler = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU],
                                                    profile_memory=True)
            with quiet_native():                 # kineto prints "profiler_start" to fd 2
                self._profiler.__enter__()
            return self
        _trim_heap()
        self._baseline = _rss()
        if _reset_hwm() and _proc_status() is not None:
            self._method = "VmHWM (kernel peak RSS, reset at start)"
        else:
            self._method = f"RSS sampled every {self.interval_s * 1e3:g} ms"
            self._peak = self._baseline
            self._stop.clear()
            self._thread = threading.Thread(target=self._sample, name="mlcomp-rss", daemon=True)
            self._thread.start()
        return self

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._peak = max(self._peak, _rss())

    def __exit__(self, *exc: Any) -> None:
        if self.device.startswith("cuda"):
            import torch

            torch.cuda.synchronize(self.device)
            peak, end = torch.cuda.max_memory_allocated(self.device), torch.cuda.memory_allocated(self.device)
        elif self._profiler is not None:
            prof, self._profiler = self._profiler, None
            with quiet_native():                 # and "profiler_stop"
                prof.__exit__(*exc)
            # relative to the state at entry: the baseline is 0, growth is the peak of live bytes
            peak, end = _allocator_peak(prof.profiler.kineto_results.experimental_event_tree())
        elif self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
            end = _rss()
            peak = max(self._peak, end)
        else:
            status = _proc_status() or {}
            end = status.get("VmRSS", _rss())
            peak = max(status.get("VmHWM", end), end)
        self.reading = MemoryReading(self._baseline, peak, end, self._method)


# ---------------------------------------------------------------------------
# formatting


def fmt_seconds(s: float | None) -> str:
    """``1.23 ms`` style, three significant digits."""
    if s is None or (isinstance(s, float) and math.isnan(s)):
        return "—"
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6), ("ns", 1e-9)):
        if abs(s) >= scale or unit == "ns":
            v = s / scale
            return f"{v:.3g} {unit}" if v < 100 else f"{v:.0f} {unit}"
    return f"{s:g} s"  # pragma: no cover


def fmt_bytes(n: float | None, *, sign: bool = False) -> str:
    """``12.3 MiB``; ``+12.3 MiB`` with ``sign``."""
    if n is None:
        return "—"
    pre = "+" if sign and n >= 0 else ""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{pre}{n / scale:.1f} {unit}"
    return f"{pre}{int(n)} B"


def fmt_rate(v: float | None, unit: str) -> str:
    """``45.1 GFLOP/s`` style with SI prefixes."""
    if v is None:
        return "—"
    for prefix, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(v) >= scale:
            return f"{v / scale:.3g} {prefix}{unit}"
    return f"{v:.3g} {unit}"
