"""What the pipeline's target can build in low precision, as facts handed to passes.

Passes never import targets; a target states its low-precision support as
:class:`LowPrecision` rows (in its capabilities), and the compiler hands them to
the passes in ``PassContext.target`` as a :class:`TargetFacts`.  Together with the
host's measured matrix-product speeds and CPU features
(``PassContext.host_precision``, a :class:`~mlcomp.hardware.probe.PrecisionSpeeds`)
that is all ``mixed-precision{dtype=auto}`` decides from::

    >>> facts = TargetFacts("openvino", (LowPrecision(torch.bfloat16, LowMode.HINT,
    ...                                                needs=("avx512_bf16", "amx_bf16")),))
    >>> facts.support(torch.bfloat16).mode
    <LowMode.HINT: 'hint'>
    >>> facts.support(torch.float16) is None
    True
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

import torch

from mlcomp.ir.dtypes import dtype_name

__all__ = ["LowMode", "LowPrecision", "TargetFacts", "TORCH_LOW_PRECISION"]


class LowMode(enum.Enum):
    """How a target computes in a low precision."""

    GRAPH = "graph"   # the graph's casts say which ops compute in bf16/fp16; the backend follows them
    HINT = "hint"     # the graph stays fp32; the runtime lowers it itself (OpenVINO's INFERENCE_PRECISION_HINT)


@dataclass(frozen=True)
class LowPrecision:
    """One low-precision dtype a target builds, how, and on what hardware it pays.

    ``needs``: CPU features (``/proc/cpuinfo`` names), one of which makes the dtype
    worth it on this target; empty: the measured torch matrix-product speed decides
    (the target runs torch's own kernels).  ``fp32_ops``: ATen op names the target
    cannot compute in this dtype; a mixed-precision pass keeps them fp32.
    """

    dtype: torch.dtype
    mode: LowMode = LowMode.GRAPH
    needs: tuple[str, ...] = ()
    fp32_ops: frozenset[str] = field(default_factory=frozenset)

    def describe(self) -> str:
        how = "fp32 graph + runtime precision hint" if self.mode is LowMode.HINT else "casts in the graph"
        pays = f", pays with {' or '.join(self.needs)}" if self.needs else ", pays where torch's kernels are faster"
        keep = f", keeps {', '.join(sorted(self.fp32_ops))} in fp32" if self.fp32_ops else ""
        return f"{dtype_name(self.dtype)} ({how}{pays}{keep})"


# what the torch targets (cpu, cuda) build: any op, from the graph's casts, paying where torch measures it
TORCH_LOW_PRECISION: tuple[LowPrecision, ...] = (LowPrecision(torch.bfloat16), LowPrecision(torch.float16))


@dataclass(frozen=True)
class TargetFacts:
    """The target a pipeline runs for: its name, device kind and low-precision support."""

    name: str
    low_precision: tuple[LowPrecision, ...] = TORCH_LOW_PRECISION
    device: str = "cpu"
    # module types (``nn.GRU``: "GRU") the target converts whole from their own parameters: passes keep
    # the nodes captured from them unfolded, so their weights stay the module's
    whole_modules: frozenset[str] = frozenset()

    def support(self, dtype: torch.dtype) -> LowPrecision | None:
        return next((lp for lp in self.low_precision if lp.dtype == dtype), None)

    def low_names(self) -> str:
        return ", ".join(dtype_name(lp.dtype) for lp in self.low_precision) or "none"
