"""The one dtype table: short names (``f32``, ``bf16``), long names (``float32``), sizes.

Every printer, parser and report uses these names::

    >>> dtype_name(torch.bfloat16), parse_dtype("fp16"), parse_dtype("float32")
    ('bf16', torch.float16, torch.float32)
    >>> itemsize(torch.bfloat16)
    2
"""
from __future__ import annotations

import torch

__all__ = ["dtype_name", "parse_dtype", "itemsize", "DTYPE_NAMES"]

DTYPE_NAMES = {
    torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.float64: "f64",
    torch.int64: "i64", torch.int32: "i32", torch.int16: "i16", torch.int8: "i8",
    torch.uint8: "u8", torch.bool: "bool", torch.complex64: "c64",
}
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


def itemsize(dtype: torch.dtype) -> int:
    """Bytes per element."""
    return dtype.itemsize
