"""Fake hardware profiles: the machines users bring, for tests of hardware-dependent code.

A profile replaces what :mod:`mlcomp.hardware.probe` reads from the machine —
the CPU's name and flags (:func:`~mlcomp.hardware.probe.cpu_info`, from which
``vector_bits``, ``cpu_flags`` and bf16 support follow), the matrix-product
speed per precision (:func:`~mlcomp.hardware.probe.measure_precisions`) and,
for the GPU profile, ``torch.cuda``'s answer — so a test states what the code
decides on each machine, whatever machine runs the test.

    >>> PROFILES["avx512-bf16"].vector_bits, PROFILES["avx2"].vector_bits
    (512, 256)

Use through the ``fake_hardware`` fixture (``tests/conftest.py``)::

    def test_x(fake_hardware):
        profile = fake_hardware("amx")        # installed until the test ends
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from mlcomp.hardware import probe
from mlcomp.hardware.probe import CpuInfo, PrecisionSpeeds

_BASE = frozenset({"fpu", "sse", "sse2", "ssse3", "sse4_1", "sse4_2", "popcnt", "f16c", "fma"})
_AVX2 = _BASE | {"avx", "avx2"}
_AVX512 = _AVX2 | {"avx512f", "avx512dq", "avx512cd", "avx512bw", "avx512vl", "avx512_vnni"}
FP32_SECONDS = 1e-3      # the fake fp32 matrix product; other precisions are a ratio of it


@dataclass(frozen=True)
class FakeHardware:
    """One machine: CPU name and flags, low-precision speed relative to fp32, and a GPU name or none."""

    key: str
    name: str
    flags: frozenset[str]
    ratios: dict[str, float]                 # dtype -> its matmul time over fp32's (below 1: faster)
    gpu: str | None = None
    vector_bits: int = field(init=False)

    def __post_init__(self) -> None:
        bits = 512 if "avx512f" in self.flags else 256 if {"avx", "avx2"} & self.flags else 128
        object.__setattr__(self, "vector_bits", bits)

    @property
    def cpu(self) -> CpuInfo:
        return CpuInfo(self.name, self.flags)

    @property
    def native_bf16(self) -> bool:
        return bool({"avx512_bf16", "amx_bf16"} & self.flags)

    def precision_speeds(self, device: str = "cpu", dtypes: tuple[str, ...] = ("bf16",), *,
                         shape: tuple[int, int, int] = (64, 256, 256), **_: Any) -> PrecisionSpeeds:
        seconds = {"fp32": FP32_SECONDS, **{k: FP32_SECONDS * self.ratios[k] for k in dtypes}}
        flags = tuple(sorted(f for f in self.flags if f.startswith(("avx512", "amx")) or f == "f16c"))
        return PrecisionSpeeds(device, shape, seconds, flags if device == "cpu" else ())


PROFILES: dict[str, FakeHardware] = {p.key: p for p in (
    FakeHardware("avx2", "Intel(R) Core(TM) i7-8700 (fake AVX2)", _AVX2, {"bf16": 60.0, "fp16": 70.0}),
    FakeHardware("avx512", "Intel(R) Xeon(R) Gold 6248 (fake AVX-512, no BF16)", _AVX512,
                 {"bf16": 3.0, "fp16": 4.0}),
    FakeHardware("avx512-bf16", "AMD EPYC 9654 (fake AVX-512 BF16)", _AVX512 | {"avx512_bf16"},
                 {"bf16": 0.5, "fp16": 3.0}),
    FakeHardware("amx", "Intel(R) Xeon(R) Platinum 8480+ (fake AMX)",
                 _AVX512 | {"avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8"},
                 {"bf16": 0.1, "fp16": 0.6}),
    FakeHardware("gpu", "Intel(R) Core(TM) i7-8700 (fake AVX2, one GPU)", _AVX2, {"bf16": 60.0, "fp16": 70.0},
                 gpu="NVIDIA H100 80GB HBM3 (fake)"),
)}


class Installed:
    """Replaces a function wherever a module binds it, and puts every binding back on :meth:`undo`."""

    def __init__(self) -> None:
        self._done: list[tuple[str, Callable[..., Any], Callable[..., Any]]] = []
        self._attrs: list[tuple[Any, str, Any]] = []

    def function(self, name: str, original: Callable[..., Any], fake: Callable[..., Any]) -> None:
        for module in list(sys.modules.values()):
            if getattr(module, name, None) is original:
                setattr(module, name, fake)
        self._done.append((name, original, fake))

    def attr(self, owner: Any, name: str, value: Any) -> None:
        self._attrs.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    def undo(self) -> None:
        # modules imported while the profile was installed bound the fake: restored too
        for name, original, fake in reversed(self._done):
            for module in list(sys.modules.values()):
                if getattr(module, name, None) is fake:
                    setattr(module, name, original)
        for owner, name, value in reversed(self._attrs):
            setattr(owner, name, value)
        self._done.clear()
        self._attrs.clear()


ORIGINAL_CPU_INFO = probe.cpu_info
ORIGINAL_MEASURE_PRECISIONS = probe.measure_precisions
ORIGINAL_HOST_PRECISION_SPEEDS = probe.host_precision_speeds


def install(profile: FakeHardware, installed: Installed) -> FakeHardware:
    """Make the probe report ``profile`` (undone by ``installed.undo()``), replacing any profile installed before."""
    installed.undo()
    installed.function("cpu_info", ORIGINAL_CPU_INFO, lambda path="/proc/cpuinfo": profile.cpu)
    installed.function("measure_precisions", ORIGINAL_MEASURE_PRECISIONS, profile.precision_speeds)
    installed.function("host_precision_speeds", ORIGINAL_HOST_PRECISION_SPEEDS,      # cached per process: replaced
                       lambda device="cpu": profile.precision_speeds(device, ("bf16", "fp16")))
    if profile.gpu is not None:
        installed.attr(torch.cuda, "is_available", lambda: True)
        installed.attr(torch.cuda, "device_count", lambda: 1)
        installed.attr(torch.cuda, "get_device_name", lambda device=None: profile.gpu)
    return profile
