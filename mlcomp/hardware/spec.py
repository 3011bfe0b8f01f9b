"""What a device can do: peak FLOP/s by dtype, memory bandwidth, per-op overhead.

Spec sheets for GPUs, a nominal CPU default, and the measured spec that
:func:`mlcomp.hardware.probe.measure_hardware` returns; passes read it from
``PassContext.hardware`` and decide from it::

    >>> spec = SPEC_SHEETS["H100"]
    >>> spec.ridge_point()            # FLOP/byte above which an op is compute-bound
    20.0
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Protocol

import torch

__all__ = ["HardwareSpec", "SPEC_SHEETS", "DEFAULT_CPU", "Costed"]


class Costed(Protocol):
    """What a roofline needs of a cost: FLOPs, bytes moved and their ratio."""

    flops: int

    @property
    def bytes(self) -> int: ...

    @property
    def intensity(self) -> float: ...


@dataclass(frozen=True)
class HardwareSpec:
    """Peak numbers of a device; ``peak_flops`` by dtype name (``"fp32"``, ``"bf16"``…)."""

    name: str
    peak_flops: Mapping[str, float]
    bandwidth: float                # bytes/s of main (or HBM) memory
    launch_overhead: float = 0.0    # seconds per kernel/op dispatch
    memory_bytes: int = 0

    def peak(self, dtype: torch.dtype) -> float:
        key = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(dtype, "fp32")
        return self.peak_flops.get(key, self.peak_flops["fp32"])

    def ridge_point(self, dtype: torch.dtype = torch.float32) -> float:
        """Intensity (FLOP/byte) above which an op is compute-bound."""
        return self.peak(dtype) / self.bandwidth

    def time(self, cost: Costed, dtype: torch.dtype = torch.float32, *, launches: int = 1) -> float:
        """Roofline estimate in seconds."""
        return max(cost.flops / self.peak(dtype), cost.bytes / self.bandwidth) + launches * self.launch_overhead

    def bound(self, cost: Costed, dtype: torch.dtype = torch.float32) -> str:
        return "compute" if cost.intensity >= self.ridge_point(dtype) else "memory"


# Spec-sheet devices (dense tensor-core numbers; fp32 = non-tensor-core FP32).
SPEC_SHEETS: dict[str, HardwareSpec] = {
    "V100": HardwareSpec("NVIDIA V100 (SXM2)", {"fp32": 15.7e12, "fp16": 125e12, "bf16": 15.7e12},
                         900e9, 5e-6, 32 << 30),
    "A100": HardwareSpec("NVIDIA A100 (SXM4 80GB)", {"fp32": 19.5e12, "fp16": 312e12, "bf16": 312e12},
                         2039e9, 5e-6, 80 << 30),
    "H100": HardwareSpec("NVIDIA H100 (SXM5)", {"fp32": 67e12, "fp16": 989e12, "bf16": 989e12},
                         3350e9, 4e-6, 80 << 30),
}

# A conservative default for this class of CPU (2 cores, AVX-512/AMX); `mlcomp study roofline`
# measures the real numbers and passes them in as a HardwareSpec.
DEFAULT_CPU = HardwareSpec("CPU (nominal 2-core AVX-512)", {"fp32": 150e9, "bf16": 600e9}, 20e9, 2e-6)
