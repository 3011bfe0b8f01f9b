"""Measure this machine's roofline: peak FLOP/s per dtype, memory bandwidth, per-op overhead.

The cost model (:mod:`mlcomp.analysis.cost`) prices a node on a
:class:`~mlcomp.analysis.cost.HardwareSpec`.  Spec sheets give the numbers for GPUs;
for the machine we actually run on we measure them:

* compute: square matrix products (``2 n^3`` FLOPs) in fp32 and bf16 at a few
  sizes, the best achieved rate per dtype;
* bandwidth: a large copy (reads ``N`` bytes, writes ``N``) and a large add
  (reads ``2N``, writes ``N``), arrays far larger than the last-level cache;
* overhead: the median time of an add of two one-element tensors, i.e. the
  cost of dispatching one op that does no work.

:func:`measure_precisions` times one matrix product per dtype on one thread; it is
what ``mixed-precision{dtype=auto}`` decides from (bf16 only where it is faster).

Peaks are the *best* sample (a peak is what the machine can do; noise from
other processes only ever makes a sample slower); overhead is the median::

    profile = measure_hardware(quick=True)
    profile.spec.peak_flops["fp32"], profile.spec.bandwidth
"""
from __future__ import annotations

import functools
import os
import platform
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from mlcomp.hardware.decide import Decision, DecisionPolicy, call_samplers, decide
from mlcomp.hardware.spec import HardwareSpec
from mlcomp.hardware.timing import Clock, TimingPolicy, fmt_rate, fmt_seconds, measure, synchronizer


@dataclass(frozen=True)
class PeakMeasurement:
    """One microbenchmark: what ran, the best rate it reached and the time of that call."""

    kind: str            # "compute" | "bandwidth" | "overhead"
    label: str           # "matmul fp32 2048x2048"
    rate: float          # FLOP/s or bytes/s (0 for overhead)
    seconds: float       # seconds per call (best sample for rates, median for overhead)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "label": self.label, "rate": self.rate, "seconds": self.seconds}


@dataclass(frozen=True)
class MachineProfile:
    """The measured :class:`HardwareSpec` and the runs it was derived from."""

    spec: HardwareSpec
    measurements: tuple[PeakMeasurement, ...]
    device: str
    cpu_flags: tuple[str, ...] = ()

    def format(self) -> str:
        lines = [f"{self.spec.name}"]
        for m in self.measurements:
            rate = fmt_rate(m.rate, "FLOP/s" if m.kind == "compute" else "B/s") if m.rate else ""
            lines.append(f"  {m.label:<28} {rate:>14}  ({fmt_seconds(m.seconds)} per call)")
        if self.cpu_flags:
            lines.append("  CPU matrix/vector extensions: " + " ".join(self.cpu_flags))
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.spec.name, "device": self.device, "peak_flops": dict(self.spec.peak_flops),
                "bandwidth": self.spec.bandwidth, "launch_overhead": self.spec.launch_overhead,
                "cpu_flags": list(self.cpu_flags), "measurements": [m.to_json() for m in self.measurements]}


@dataclass(frozen=True)
class CpuInfo:
    """What the kernel reports about the CPU: model name and feature flags (``avx2``, ``avx512f``, ``amx_bf16``...).

    Every CPU-dependent decision (vector width, bf16 support) reads it through
    :func:`cpu_info`, the one place tests replace with a fake hardware profile.
    """

    name: str = ""
    flags: frozenset[str] = frozenset()


def cpu_info(path: str = "/proc/cpuinfo") -> CpuInfo:
    """This machine's :class:`CpuInfo` from ``path`` (empty where unreadable); ``Features`` on ARM."""
    name, flags = "", None
    try:
        with open(path) as fh:
            for line in fh:
                if not name and line.startswith("model name"):
                    name = line.split(":", 1)[1].strip()
                elif flags is None and line.startswith(("flags", "Features")):
                    flags = frozenset(line.split(":", 1)[1].split())
                if name and flags is not None:
                    break
    except OSError:
        pass
    return CpuInfo(name, flags or frozenset())


INT8_DOT_FLAGS = frozenset({"avx512_vnni", "avx_vnni", "amx_int8"})
"""x86 extensions whose int8 dot product accumulates in int32 (VNNI's ``vpdpbusd``, AMX tiles)."""


def int8_dot_saturates(info: CpuInfo | None = None) -> bool:
    """Whether the CPU's int8 GEMMs (ONNX Runtime's MLAS, oneDNN under OpenVINO) can saturate: an x86 CPU
    without :data:`INT8_DOT_FLAGS` multiplies u8 by s8 with ``vpmaddubsw``, which adds two products in int16
    (``2 * 255 * 127`` overflows it).  Unknown flags (no ``/proc/cpuinfo``) and ARM read as not saturating.

        >>> int8_dot_saturates(CpuInfo("EPYC", frozenset({"sse2", "avx2"})))
        True
        >>> int8_dot_saturates(CpuInfo("Xeon", frozenset({"sse2", "avx2", "avx512_vnni"})))
        False
        >>> int8_dot_saturates(CpuInfo("Graviton", frozenset({"asimd", "asimddp"})))
        False
    """
    flags = (info or cpu_info()).flags
    return "sse2" in flags and not flags & INT8_DOT_FLAGS


def cpu_flags() -> tuple[str, ...]:
    """The AVX-512 / AMX feature flags the kernel reports (what bf16 speed depends on)."""
    return tuple(sorted(f for f in cpu_info().flags if f.startswith(("avx512", "amx"))))


def measure_hardware(device: str = "cpu", *, quick: bool = False, budget_s: float = 0.3,
                     clock: Clock | None = None) -> MachineProfile:
    """Run the microbenchmarks on ``device`` and return the measured profile."""
    import torch

    dev = torch.device(device)
    sync = synchronizer(dev)
    clk = clock or time.perf_counter
    policy = (TimingPolicy(warmup=1, budget_s=min(budget_s, 0.02), min_repeats=1, max_repeats=3) if quick
              else TimingPolicy(warmup=2, budget_s=budget_s, min_repeats=3))
    out: list[PeakMeasurement] = []
    peaks: dict[str, float] = {}
    sizes = (128, 256) if quick else ((512, 1024, 2048, 4096) if dev.type == "cpu" else (2048, 4096, 8192))
    for dtype, key in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        best = 0.0
        for n in sizes:   # grow until one call takes a third of the budget (or the rate drops)
            m = _matmul(dev, dtype, n, policy, clk, sync)
            out.append(PeakMeasurement("compute", f"matmul {key} {n}x{n}", m[0], m[1]))
            if m[0] < best or m[1] > policy.budget_s / 3:
                best = max(best, m[0])
                break
            best = m[0]
        peaks[key] = best
    numel = (1 << 20) if quick else (64 << 20)        # 4 MiB / 256 MiB of fp32 per array
    bw = _stream(dev, numel, policy, clk, sync)
    out += bw
    tiny = TimingPolicy(warmup=10, budget_s=policy.budget_s, min_repeats=policy.min_repeats)
    p, q = torch.ones(1, device=dev), torch.ones(1, device=dev)
    t_tiny = measure(lambda: torch.add(p, q), tiny, clock=clk, sync=sync)
    out.append(PeakMeasurement("overhead", "one-element add (dispatch)", 0.0, t_tiny.median))
    spec = HardwareSpec(f"{_device_name(dev)} (measured)", peaks, max(m.rate for m in bw), t_tiny.median)
    return MachineProfile(spec, tuple(out), str(dev), cpu_flags() if dev.type == "cpu" else ())


def _matmul(dev: Any, dtype: Any, n: int, policy: TimingPolicy, clock: Clock, sync: Any) -> tuple[float, float]:
    """(FLOP/s, median seconds) of an ``n x n`` matrix product in ``dtype``."""
    import torch

    a = torch.randn(n, n, device=dev).to(dtype)
    b = torch.randn(n, n, device=dev).to(dtype)
    t = measure(lambda: torch.mm(a, b), policy, clock=clock, sync=sync)
    return 2.0 * n ** 3 / t.min, t.min


def _stream(dev: Any, numel: int, policy: TimingPolicy, clock: Clock, sync: Any) -> list[PeakMeasurement]:
    """Copy (reads N, writes N bytes) and add (reads 2N, writes N) over arrays of ``numel`` fp32."""
    import torch

    x = torch.ones(numel, device=dev)
    y = torch.empty_like(x)
    z = torch.empty_like(x)
    nbytes = x.numel() * x.element_size()
    t_copy = measure(lambda: y.copy_(x), policy, clock=clock, sync=sync)
    t_add = measure(lambda: torch.add(x, y, out=z), policy, clock=clock, sync=sync)
    mib = nbytes >> 20
    return [PeakMeasurement("bandwidth", f"copy {mib} MiB", 2 * nbytes / t_copy.min, t_copy.min),
            PeakMeasurement("bandwidth", f"add {mib} MiB", 3 * nbytes / t_add.min, t_add.min)]


def _device_name(dev: Any) -> str:
    import torch

    if dev.type == "cuda":
        return torch.cuda.get_device_name(dev)
    n = torch.get_num_threads()
    return f"{cpu_name() or 'CPU'}, {n} thread{'' if n == 1 else 's'}"


def last_level_cache_bytes() -> int:
    """Size of the CPU's largest cache from sysfs (0 where unknown)."""
    import glob

    best = 0
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path) as fh:
                text = fh.read().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best


def vector_bits() -> int:
    """Widest SIMD register the CPU reports (512 AVX-512F, 256 AVX/AVX2, else 128 SSE/NEON)."""
    flags = cpu_info().flags
    return 512 if "avx512f" in flags else 256 if flags & {"avx", "avx2"} else 128


def cpu_name() -> str:
    """The CPU model name from ``/proc/cpuinfo`` ("" where unknown)."""
    return cpu_info().name


def machine_line() -> str:
    """One line naming this machine: CPU, cores torch uses, torch version, GPU if any."""
    cpu = cpu_name() or platform.processor() or platform.machine()
    n = torch.get_num_threads()
    line = f"{cpu}; torch {torch.__version__}, {n} intra-op thread{'' if n == 1 else 's'}"
    if torch.cuda.is_available():
        line += f"; GPU {torch.cuda.get_device_name(0)}"
    if hasattr(os, "getloadavg"):
        line += f"; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores"
    return line


# ---------------------------------------------------------------------------
# Matrix-product speed per precision (what `mixed-precision{dtype=auto}` decides from)


@dataclass(frozen=True)
class PrecisionSpeeds:
    """Seconds of one ``m x k @ k x n`` matrix product per dtype name, measured on ``device``, and per
    low dtype the :class:`~mlcomp.hardware.decide.Decision` "use it instead of fp32?" (paired rounds, sign test)."""

    device: str
    shape: tuple[int, int, int]
    seconds: dict[str, float]          # "fp32", "bf16", "fp16" -> median time of one call
    cpu_flags: tuple[str, ...] = ()
    decisions: dict[str, Decision] = field(default_factory=dict)    # low dtype name -> against fp32

    def ratio(self, key: str) -> float:
        """How many times slower ``key`` is than fp32 (below 1: faster): the median paired ratio where
        measured in rounds, else the ratio of the times."""
        decision = self.decisions.get(key)
        if decision is not None and key in decision.ratios:
            return decision.ratios[key]
        return self.seconds[key] / self.seconds["fp32"]

    def faster(self, key: str) -> bool:
        """Whether ``key`` was decided faster than fp32 (by the sign test, past the decision's threshold)."""
        decision = self.decisions.get(key)
        return decision.choice == key if decision is not None else self.ratio(key) < PRECISION_TIMING.threshold

    def describe(self, key: str) -> str:
        m, k, n = self.shape
        flags = " ".join(f for f in self.cpu_flags if "bf16" in f or "fp16" in f or f.startswith("amx")) \
            if self.device == "cpu" else ""
        where = f" ({flags})" if flags else (" (no avx512_bf16/avx512_fp16/amx)" if self.device == "cpu" else "")
        return (f"{m}x{k}@{k}x{n} matmul on {self.device}{where}: {key} {fmt_seconds(self.seconds[key])} vs fp32 "
                f"{fmt_seconds(self.seconds['fp32'])} ({self.ratio(key):.3g}x the fp32 time)")


# a low precision must take < 0.9 x fp32's time; emulated bf16/fp16 are tens of times slower, so the
# sign test decides in its fewest rounds
PRECISION_TIMING = DecisionPolicy(warmup=1, budget_s=0.03, min_rounds=6, max_rounds=50, threshold=0.9)


def measure_precisions(device: str = "cpu", dtypes: tuple[str, ...] = ("bf16",), *,
                       shape: tuple[int, int, int] = (64, 256, 256), policy: DecisionPolicy = PRECISION_TIMING,
                       clock: Clock | None = None) -> PrecisionSpeeds:
    """Time one matrix product in fp32 against each of ``dtypes`` (:func:`~mlcomp.hardware.decide.decide`).

    On CPUs without native bf16/fp16 the low-precision product is emulated and much
    slower, by orders of magnitude rather than percent; a few paired rounds are enough to see
    which side of the threshold the ratio falls.
    """
    dev = torch.device(device)
    sync = synchronizer(dev)
    table = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
    m, k, n = shape
    gen = torch.Generator().manual_seed(0)
    a32, b32 = torch.randn(m, k, generator=gen).to(dev), torch.randn(k, n, generator=gen).to(dev)
    seconds: dict[str, float] = {}
    decisions: dict[str, Decision] = {}
    clock = clock or time.perf_counter
    # one intra-op thread on the CPU (scoped, restored): a per-core comparison that other
    # processes on a shared machine cannot skew (two spinning threads on two busy cores
    # made fp32 60x slower than its one-thread time)
    before = torch.get_num_threads()
    if dev.type == "cpu":
        torch.set_num_threads(1)
    try:
        mats = {key: (a32.to(table[key]), b32.to(table[key])) for key in ("fp32", *dtypes)}
        fns = {key: (lambda a=a, b=b: torch.mm(a, b)) for key, (a, b) in mats.items()}
        for key in dtypes:
            pair = {"fp32": fns["fp32"], key: fns[key]}
            samplers = call_samplers(pair, warmup=policy.warmup, budget_s=policy.budget_s, clock=clock,
                                     syncs={name: sync for name in pair})
            decisions[key] = decide(f"compute in {key} instead of fp32 on {dev}?", samplers, default="fp32",
                                    policy=policy, clock=clock)
            seconds[key] = decisions[key].medians[key]
            seconds["fp32"] = min(seconds.get("fp32", float("inf")), decisions[key].medians["fp32"])
    finally:
        torch.set_num_threads(before)
    flags = _precision_flags() if dev.type == "cpu" else ()
    return PrecisionSpeeds(str(dev), shape, seconds, flags, decisions)


@functools.lru_cache(maxsize=None)
def host_precision_speeds(device: str = "cpu") -> PrecisionSpeeds:
    """:func:`measure_precisions` of bf16 and fp16 on ``device``, measured once per process.

    What a pipeline hands its passes as ``PassContext.host_precision`` (passes never
    probe); tests give a :class:`PrecisionSpeeds` of a fake machine instead.
    """
    return measure_precisions(device, ("bf16", "fp16"))


def _precision_flags() -> tuple[str, ...]:
    """All CPU flags that matter for low precision (AVX-512 BF16/FP16, AMX, F16C)."""
    return tuple(sorted(f for f in cpu_info().flags if f.startswith(("avx512", "amx")) or f == "f16c"))
