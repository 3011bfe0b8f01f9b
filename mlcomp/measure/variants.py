"""Bench variants: each target at each compute precision (``--dtypes fp32,bf16,int8``).

A variant is a target and the precision it computes in; its pipeline is the bench's
pipeline with that precision's passes after it (:data:`DTYPE_PASSES`), so fp32, bf16
and int8 rows of one target sit side by side in one comparison, timed in the same
rounds against the same eager reference::

    >>> [v.key for v in variants(("cpu", "openvino"), ("fp32", "int8"))]
    ['cpu', 'cpu int8', 'openvino', 'openvino int8']
    >>> Variant("openvino", "int8").pipeline(None)
    'fold-batchnorm,fold-constants,cleanup,quantize'
    >>> Variant("cpu", "bf16").pipeline("-O2")
    '-O2,mixed-precision{dtype=bf16}'
    >>> Variant.parse("openvino int8")
    Variant(target='openvino', dtype='int8')

An int8 variant runs ``quantize`` on an unfused graph when the bench's pipeline is none
or a preset (``-O2`` fuses, and a fused kernel has no int8 lowering): batch norms folded
into the convolutions, constant index arithmetic folded, then ``quantize``; after an
explicit pass list it is appended, as bf16's ``mixed-precision`` always is::

    >>> Variant("onnxruntime", "int8").pipeline("-O2")
    'fold-batchnorm,fold-constants,cleanup,quantize'
    >>> Variant("onnxruntime", "int8").pipeline("fold-constants")
    'fold-constants,quantize'

A target that cannot compute in that precision refuses it up front and its row says so
(skipped, with the refusal).
"""
from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Mapping, Sequence

from mlcomp.hardware.timing import BenchConfigError

__all__ = ["DTYPES", "DTYPE_PASSES", "Variant", "variants", "check_dtypes"]

FP32 = "fp32"
# precision -> (passes appended to a given pipeline, the whole pipeline when none is given)
DTYPE_PASSES: Mapping[str, tuple[str, str] | None] = MappingProxyType({
    FP32: None,
    "bf16": ("mixed-precision{dtype=bf16}", "mixed-precision{dtype=bf16}"),
    "int8": ("quantize", "fold-batchnorm,fold-constants,cleanup,quantize"),
})
DTYPES = tuple(DTYPE_PASSES)


@dataclass(frozen=True)
class Variant:
    target: str
    dtype: str = FP32

    @property
    def key(self) -> str:
        """The row's name: the target alone at fp32, else ``"target dtype"``."""
        return self.target if self.dtype == FP32 else f"{self.target} {self.dtype}"

    @classmethod
    def parse(cls, key: str) -> "Variant":
        target, _, dtype = key.partition(" ")
        return cls(target, dtype or FP32)

    def pipeline(self, base: str | None) -> str | None:
        """``base`` with this precision's passes after it (its own pipeline when ``base`` is None)."""
        passes = DTYPE_PASSES[self.dtype]
        if passes is None:
            return base
        if self.dtype == "int8" and (not base or base.startswith("-O")):   # a preset fuses: quantize before it
            return passes[1]
        return f"{base},{passes[0]}" if base else passes[1]


def check_dtypes(dtypes: Sequence[str]) -> tuple[str, ...]:
    """``dtypes`` checked against :data:`DTYPES` (BenchConfigError naming the known ones)."""
    bad = [d for d in dtypes if d not in DTYPE_PASSES]
    if bad or not dtypes:
        raise BenchConfigError(f"unknown compute precision {bad[0]!r}" if bad else "no compute precision given",
                               hint=f"--dtypes takes a comma-separated list of {', '.join(DTYPES)}")
    return tuple(dict.fromkeys(dtypes))


def variants(targets: Sequence[str], dtypes: Sequence[str]) -> list[Variant]:
    """Every target at every precision, target by target (eager only at fp32: it is the reference)."""
    return [Variant(t, d) for t in targets for d in dtypes if t != "eager" or d == FP32]
