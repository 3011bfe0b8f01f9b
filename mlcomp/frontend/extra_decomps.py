"""Decompositions mlcomp adds to torch's table at capture: ops of common models that the ONNX,
OpenVINO and TVM importers do not translate, lowered to core ATen ops every target runs, with
the values of the op.

==========================================  ===================================================
op                                          lowered to
==========================================  ===================================================
``transformers::grouped_mm_fallback``       the mixture-of-experts grouped matmul (rows sorted
                                            by expert, ``offs`` the running row counts): each
                                            expert's ``mm`` over all rows, every row keeping its
                                            own expert's result (``where``); rows past
                                            ``offs[-1]`` stay zero, as in the op
``aten.histc`` (``min < max`` given)        the bin of each element ``(x - min) * bins /
                                            (max - min)`` (``max`` itself in the last bin), as
                                            a one-hot row, summed over the in-range elements
``aten.empty_permuted``                     ``zeros`` of its size (an uninitialised tensor may
                                            hold any value; every use overwrites it)
==========================================  ===================================================

The grouped matmul's lowering has static shapes, so routing needs no data-dependent
sizes, at the price of every expert's product over every routed row: ``num_experts /
top_k`` times the routed multiply-adds (2x for 4 experts, top 2).  Each row's result is
its own expert's ``mm`` row, selected, never summed with others::

    >>> x, w = torch.randn(5, 3), torch.randn(2, 3, 4)
    >>> offs = torch.tensor([2, 4], dtype=torch.int32)      # rows 0-1: expert 0, 2-3: expert 1, 4: none
    >>> out = grouped_mm(x, w, offs)
    >>> torch.allclose(out[:2], x[:2] @ w[0]), torch.allclose(out[2:4], x[2:4] @ w[1]), bool(out[4].eq(0).all())
    (True, True, True)
    >>> h = histc(torch.tensor([0., 1., 1., 3., 7.]), bins=4, min=0, max=3)
    >>> h.tolist(), torch.histc(torch.tensor([0., 1., 1., 3., 7.]), bins=4, min=0, max=3).tolist()
    ([1.0, 2.0, 0.0, 1.0], [1.0, 2.0, 0.0, 1.0])
"""
from __future__ import annotations

from typing import Any, Callable

import torch

__all__ = ["extra_decompositions", "grouped_mm", "histc", "empty_permuted"]


def grouped_mm(input: torch.Tensor, weight: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """``out[r] = input[r] @ weight[e]`` for the expert ``e`` whose rows hold ``r``: ``offs[e-1] <= r < offs[e]``."""
    rows = torch.arange(input.shape[0], device=input.device)
    expert = (offs.to(torch.int64).unsqueeze(0) <= rows.unsqueeze(1)).to(torch.int64).sum(1, keepdim=True)
    out = torch.zeros(input.shape[0], weight.shape[2], dtype=input.dtype, device=input.device)
    for e in range(weight.shape[0]):
        out = torch.where(expert == e, torch.mm(input, weight[e]), out)
    return out


def histc(input: torch.Tensor, bins: int = 100, min: float = 0, max: float = 0) -> Any:
    """``torch.histc`` for a given range (``min < max``); a range read from the data is left to torch."""
    if not min < max:
        return NotImplemented
    flat = input.reshape(-1)
    pos = torch.floor((flat - min) * bins / (max - min)).to(torch.int64).clamp(0, bins - 1)
    inside = (flat >= min) & (flat <= max)
    hits = (pos.unsqueeze(1) == torch.arange(bins, device=input.device).unsqueeze(0)) & inside.unsqueeze(1)
    return hits.to(input.dtype).sum(0)


def empty_permuted(size: Any, physical_layout: Any, *, dtype: Any = None, layout: Any = None, device: Any = None,
                   pin_memory: Any = None) -> torch.Tensor:
    return torch.zeros(size, dtype=dtype, device=device)


def _custom(namespace: str, name: str) -> Any:
    """``torch.ops.<namespace>.<name>.default`` if a library registered it in this process, else None."""
    try:
        return getattr(getattr(torch.ops, namespace), name).default
    except (AttributeError, RuntimeError):
        return None


def extra_decompositions() -> dict[Any, Callable[..., Any]]:
    """The table above, for the ops registered in this process (a custom op only once its library loaded)."""
    table: dict[Any, Callable[..., Any]] = {torch.ops.aten.histc.default: histc,
                                            torch.ops.aten.empty_permuted.default: empty_permuted}
    grouped = _custom("transformers", "grouped_mm_fallback")
    if grouped is not None:
        table[grouped] = grouped_mm
    return table
