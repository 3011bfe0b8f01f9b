"""Calibration samples for ``quantize``: where they come from, and the checks they pass.

A sample is one call's positional inputs (a tuple of tensors).  They come from, in order:

* ``quantize{calibration=batches.pt}``: a file written by ``torch.save`` holding one
  batch (a tensor, for a one-input graph, shaped as the graph's input), several
  stacked along a new first axis (``[N, *input shape]``), or a list/tuple of batches
  (each a tensor, or a tuple/list of tensors for a graph with several inputs);
* the API's ``calibration_data=`` (``mlcomp.compile(..., calibration_data=iterable)``,
  ``run_pipeline(..., calibration_data=...)``): any iterable of batches as above;
* the example inputs (one sample), else random inputs shaped as the graph's.

Every sample must match the graph's inputs in number, shape and dtype: a wrong one
is refused with its position and both shapes, before any range is observed::

    >>> import torch
    >>> as_samples([torch.zeros(2, 3)], [((2, 3), torch.float32)], "calibration_data=")
    [(tensor([[0., 0., 0.],
            [0., 0., 0.]]),)]
    >>> len(as_samples(torch.zeros(5, 2, 3), [((2, 3), torch.float32)], "x.pt"))   # five stacked batches
    5

``held_back`` splits the samples: the last ``k`` are not observed, only measured.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterable, Sequence

import torch

from mlcomp.base.errors import InputSpecError

__all__ = ["as_samples", "load_file", "input_specs", "held_back"]

Spec = tuple[tuple["int | None", ...], torch.dtype]      # None: a symbolic dim, any size

_HINT = ("give a list of batches, each a tensor shaped like the model's input (or a tuple of tensors, one per "
         "input), e.g. torch.save([x1, x2, x3], 'calibration.pt')")


def input_specs(graph: Any) -> list[Spec]:
    """The shape and dtype of each graph input (the shapes calibration batches must have)."""
    return [(tuple(d if isinstance(d, int) else None for d in n.tensor_meta.shape), n.tensor_meta.dtype)
            for n in graph.input_nodes]


def load_file(path: str) -> Any:
    """The object in the ``.pt`` file ``path`` (tensors only: no pickled code is run)."""
    p = Path(path)
    if not p.is_file():
        raise InputSpecError(f"quantize's calibration file {path} does not exist (calibration= takes a number of "
                             f"samples or a .pt file of example batches)", where=f"calibration={path}",
                             hint=f"check the path (relative paths start at {Path.cwd()}); " + _HINT)
    try:
        return torch.load(p, map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
        raise InputSpecError(f"quantize's calibration file {path} cannot be read as tensors: "
                             f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}",
                             where=f"calibration={path}", hint=_HINT) from None


def as_samples(given: Any, specs: Sequence[Spec], source: str) -> list[tuple[torch.Tensor, ...]]:
    """``given`` (a tensor, a stack, or an iterable of batches) as checked samples for inputs ``specs``."""
    if isinstance(given, torch.Tensor):
        one = len(specs) == 1 and _fits(tuple(given.shape), specs[0][0])
        items: Iterable[Any] = [given] if one or given.dim() == 0 else list(given.unbind(0))
    elif isinstance(given, dict):
        raise InputSpecError(f"quantize's calibration data from {source} is a dict; it needs batches in order",
                             where=source, hint=_HINT)
    else:
        try:
            items = iter(given)
        except TypeError:
            raise InputSpecError(f"quantize's calibration data from {source} is a {type(given).__name__}, "
                                 f"not a tensor or an iterable of batches", where=source, hint=_HINT) from None
    out = [_check(i, item, specs, source) for i, item in enumerate(items)]
    if not out:
        raise InputSpecError(f"quantize's calibration data from {source} holds 0 batches: there is nothing to "
                             f"observe activation ranges on", where=source, hint=_HINT)
    return out


def _check(i: int, item: Any, specs: Sequence[Spec], source: str) -> tuple[torch.Tensor, ...]:
    sample = (item,) if isinstance(item, torch.Tensor) else tuple(item) if isinstance(item, (tuple, list)) else None
    where = f"batch {i} of {source}"
    if sample is None or not all(isinstance(t, torch.Tensor) for t in sample):
        raise InputSpecError(f"quantize's calibration {where} is a {type(item).__name__}, not a tensor or a tuple "
                             f"of tensors", where=where, hint=_HINT)
    if len(sample) != len(specs):
        raise InputSpecError(f"quantize's calibration {where} has {len(sample)} tensors and the model takes "
                             f"{len(specs)} inputs", where=where, hint=_HINT)
    for k, (t, (shape, dtype)) in enumerate(zip(sample, specs)):
        if not _fits(tuple(t.shape), shape) or t.dtype != dtype:
            raise InputSpecError(
                f"quantize's calibration {where}, input {k}, is {_text(tuple(t.shape), t.dtype)} and the model was "
                f"captured with {_text(shape, dtype)} (quantize observes the graph at the shapes it was captured "
                f"with)", where=where,
                hint="give batches shaped like the example inputs (same batch size), or capture the model with "
                     "example inputs shaped like the calibration batches")
    return sample


def _fits(shape: tuple[int, ...], want: tuple["int | None", ...]) -> bool:
    return len(shape) == len(want) and all(w is None or s == w for s, w in zip(shape, want))


def _text(shape: tuple[Any, ...], dtype: torch.dtype) -> str:
    return f"{str(dtype).removeprefix('torch.')}[{', '.join('?' if d is None else str(d) for d in shape)}]"


def held_back(samples: list[tuple[torch.Tensor, ...]], count: int) -> tuple[list[Any], list[Any]]:
    """(observed, held back): the last ``count`` samples are only measured, never observed; at least one is
    always observed."""
    keep = max(1, len(samples) - count)
    return samples[:keep], samples[keep:]
