"""Which compute ops a runtime ran in int8, read from the graph it executes.

A quantized graph is int8 only where the runtime picked integer kernels: a target
that runs the quantize/dequantize pairs as float arithmetic is not int8.  Each
int8-capable runtime records an :class:`Int8Record` from its own executed graph
(ONNX Runtime: the op types of the model the session writes after its
optimisations; OpenVINO: ``layerType``/``runtimePrecision`` of the compiled model's
runtime model); the record is saved in the manifest (``runtime_info.int8``),
``--explain`` prints its line and ``mlcomp bench`` its counts::

    >>> rec = Int8Record.from_op_types({"QLinearConv": 20, "QGemm": 1, "MaxPool": 1, "Gemm": 1})
    >>> rec.line()
    'int8: 21 of 22 compute ops (QGemm 1, QLinearConv 20); float: Gemm 1 [onnxruntime optimized model]'
    >>> rec.fraction()
    0.9545454545454546
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Mapping

__all__ = ["Int8Record", "ORT_INT8_OPS", "ORT_FLOAT_COMPUTE"]

# ONNX Runtime op types (after its graph optimisations) that multiply with integer kernels (its
# element-wise QLinear ops, QLinearSigmoid and friends, are left out: the count is of compute ops)
ORT_INT8_OPS = frozenset({"QLinearConv", "QLinearMatMul", "QGemm", "MatMulInteger", "ConvInteger",
                          "MatMulIntegerToFloat", "DynamicQuantizeMatMul", "QAttention"})
# ... and those that multiply in float: the ones int8 was meant to replace
ORT_FLOAT_COMPUTE = frozenset({"Conv", "FusedConv", "NhwcFusedConv", "Gemm", "FusedGemm", "MatMul", "FusedMatMul",
                               "Attention", "MultiHeadAttention", "ConvTranspose"})


@dataclass(frozen=True)
class Int8Record:
    """Compute ops by kind that ran in int8 and in float, and where that was read."""

    source: str
    int8: Mapping[str, int] = field(default_factory=dict)
    floating: Mapping[str, int] = field(default_factory=dict)

    @classmethod
    def from_op_types(cls, counts: Mapping[str, int]) -> "Int8Record":
        """From ONNX Runtime's optimized model: op type → count (``com.microsoft.`` prefixes dropped)."""
        int8: Counter = Counter()
        floating: Counter = Counter()
        for name, n in counts.items():
            kind = name.rsplit(".", 1)[-1]
            if kind in ORT_INT8_OPS:
                int8[kind] += n
            elif kind in ORT_FLOAT_COMPUTE:
                floating[kind] += n
        return cls("onnxruntime optimized model", dict(sorted(int8.items())), dict(sorted(floating.items())))

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "Int8Record":
        return cls(data.get("source", "?"), dict(data.get("int8", {})), dict(data.get("float", {})))

    def to_json(self) -> dict[str, Any]:
        return {"source": self.source, "int8": dict(self.int8), "float": dict(self.floating),
                "fraction": self.fraction()}

    def fraction(self) -> float | None:
        """The share of compute ops that ran in int8 (``None`` without compute ops)."""
        total = sum(self.int8.values()) + sum(self.floating.values())
        return sum(self.int8.values()) / total if total else None

    def line(self) -> str:
        """One line for ``--explain``."""
        def listed(counts: Mapping[str, int]) -> str:
            return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"

        n8 = sum(self.int8.values())
        total = n8 + sum(self.floating.values())
        return f"int8: {n8} of {total} compute ops ({listed(self.int8)}); float: {listed(self.floating)} " \
               f"[{self.source}]"
