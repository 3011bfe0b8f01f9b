"""Peak memory over a measured block: the process's resident set or torch's CPU allocator.

Peak memory is the growth of the process's resident set over a baseline taken
just before the measured block (Linux: the kernel's own high-water mark, reset
through ``/proc/self/clear_refs``; elsewhere a psutil sampling thread), or
``torch.cuda.max_memory_allocated`` growth on a CUDA device.  On CPU,
``PeakMemory(source=MemorySource.ALLOCATOR)`` instead follows torch's CPU
allocator (every tensor allocation and free), the figure a liveness prediction
is compared with.

    >>> import torch
    >>> with PeakMemory("cpu") as peak:
    ...     buffer = torch.ones(1 << 20)                # 4 MiB
    >>> r = peak.reading             # resident-set bytes: at entry, the highest sampled, the difference
    >>> r.peak >= r.baseline > 0, r.growth == r.peak - r.baseline
    (True, True)
"""
from __future__ import annotations

import ctypes
import enum
import re
import threading
from dataclasses import dataclass
from typing import Any

from mlcomp.base.quiet import quiet_native


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

        >>> import torch
        >>> with PeakMemory("cpu", source=MemorySource.ALLOCATOR) as mem:
        ...     buffer = torch.ones(1 << 20)
        >>> isinstance(mem.reading.growth, int)       # bytes; how many depends on the allocator
        True
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
