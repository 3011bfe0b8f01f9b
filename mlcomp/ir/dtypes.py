"""The one dtype table: short names (``f32``, ``bf16``), long names (``float32``), sizes.

Every printer, parser and report uses these names; the ONNX emitter reads the
element-type column (``onnx.TensorProto`` numbers, so ``onnx`` need not be imported)::

    >>> dtype_name(torch.bfloat16), parse_dtype("fp16"), parse_dtype("float32")
    ('bf16', torch.float16, torch.float32)
    >>> itemsize(torch.bfloat16), onnx_elem_type(torch.float32)
    (2, 1)
"""
from __future__ import annotations

import torch

__all__ = ["dtype_name", "parse_dtype", "itemsize", "onnx_elem_type", "DTYPE_NAMES"]

# dtype, short name, ONNX element type (onnx.TensorProto.DataType)
_TABLE = (
    (torch.float32, "f32", 1), (torch.float16, "f16", 10), (torch.bfloat16, "bf16", 16),
    (torch.float64, "f64", 11), (torch.int64, "i64", 7), (torch.int32, "i32", 6), (torch.int16, "i16", 5),
    (torch.int8, "i8", 3), (torch.uint8, "u8", 2), (torch.bool, "bool", 9), (torch.complex64, "c64", 14),
)
DTYPE_NAMES = {dtype: name for dtype, name, _ in _TABLE}
_ONNX = {dtype: elem for dtype, _, elem in _TABLE}
_DTYPE_LONG = {v: k for k, v in DTYPE_NAMES.items()}


def dtype_name(dtype: torch.dtype) -> str:
    return DTYPE_NAMES.get(dtype, str(dtype).replace("torch.", ""))


def parse_dtype(name: str) -> torch.dtype:
    """``"f32"``, ``"float32"`` or ``"bf16"`` → torch dtype; ``ValueError`` if unknown."""
    name = name.strip().lower()
    if name in _DTYPE_LONG:
        return _DTYPE_LONG[name]
    if name in _ALIASES:
        return _ALIASES[name]
    dtype = getattr(torch, name, None)
    if isinstance(dtype, torch.dtype):
        return dtype
    raise ValueError(f"unknown dtype {name!r}; use one of {', '.join(sorted(_DTYPE_LONG))}")




_ALIASES = {"fp32": torch.float32, "fp16": torch.float16, "fp64": torch.float64, "half": torch.float16,
            "float": torch.float32, "double": torch.float64, "bfloat16": torch.bfloat16}


def onnx_elem_type(dtype: torch.dtype) -> int:
    """The ``onnx.TensorProto`` element type of ``dtype``; ``KeyError`` if ONNX has none here."""
    return _ONNX[dtype]


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element."""
    return dtype.itemsize
