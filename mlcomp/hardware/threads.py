"""torch's intra-op thread count for the duration of a block.

    >>> import torch
    >>> before = torch.get_num_threads()
    >>> with threads(1):
    ...     torch.get_num_threads()
    1
    >>> torch.get_num_threads() == before
    True
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

__all__ = ["threads"]


@contextlib.contextmanager
def threads(n: int | None) -> Iterator[None]:
    """Run with ``n`` intra-op threads, restoring the previous count (no-op for ``None`` or 0)."""
    if not n or n == torch.get_num_threads():
        yield
        return
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)
