"""Verification over a symbolic graph's ranges: at each range's ends and one middle value.

An artifact with symbolic sizes serves every size in its ranges, so the compile compares it
with eager at the example's sizes and at :func:`~mlcomp.ir.symbols.sample_points` (every
symbol at its minimum, at a middle value, at its maximum).  The inputs there are the example
inputs cut or tiled along each symbolic dimension, so their values stay valid (token ids,
masks).  The manifest's ``verification["shapes"]`` lists every size verified::

    {"sizes": {"batch": 1, "seq": 8}, "shapes": ["1x8"], "passed": true, "max_abs": 0.0, ...}

A point whose inputs would exceed :data:`MAX_ELEMENTS` is listed with ``"skipped"`` and why.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

import torch

from mlcomp.ir import TensorMeta
from mlcomp.ir.symbols import sample_points

__all__ = ["MAX_ELEMENTS", "resized", "sizes_line", "verify_ranges"]

MAX_ELEMENTS = 1 << 25       # inputs of one verification point, all together


def resized(t: torch.Tensor, shape: Sequence[int]) -> torch.Tensor:
    """``t`` cut or tiled (repeated whole) along each dimension to ``shape``.

    >>> resized(torch.arange(3).reshape(1, 3), (2, 5)).tolist()
    [[0, 1, 2, 0, 1], [0, 1, 2, 0, 1]]
    """
    for axis, size in enumerate(shape):
        have = t.shape[axis]
        if size > have:
            t = t.repeat(*[-(-size // have) if a == axis else 1 for a in range(t.dim())])
        t = t.narrow(axis, 0, size)
    return t.contiguous()


def _entry(sizes: dict[str, int], inputs: Sequence[torch.Tensor], result: Any) -> dict[str, Any]:
    return {"sizes": dict(sizes), "shapes": ["x".join(map(str, t.shape)) for t in inputs],
            "passed": result.passed, "max_abs": result.to_json()["max_abs"], "max_rel": result.to_json()["max_rel"]}


def verify_ranges(artifact: Any, source: Any, graph: Any, report: Any, first: Any, *,
                  tolerance: float | None, reference: Any) -> Any:
    """``first`` (the check at the example's sizes), or the first failing check at a range's end or middle.

    ``reference(source, inputs, report)`` gives eager's outputs (see
    :func:`mlcomp.api.lowering.eager_reference`); the points verified go to the manifest.
    """
    example = source.inputs()
    shapes = [_entry(dict(graph.symbols), example, first)]
    outcome = first
    for point in sample_points(graph.ranges, graph.symbols):
        symbols = dict(graph.symbols, **point)
        targets = [TensorMeta(spec.shape, spec.dtype).concrete_shape(symbols) for spec in artifact.inputs]
        total = sum(torch.Size(s).numel() for s in targets)
        if total > MAX_ELEMENTS:
            shapes.append({"sizes": point, "skipped": f"inputs of {total:.3g} elements (over {MAX_ELEMENTS:.3g})"})
            continue
        inputs = tuple(resized(t, s) for t, s in zip(example, targets))
        expected, _ = reference(source, inputs, report)
        result = artifact.verify(inputs, expected, tolerance=tolerance, record=False, raise_on_failure=False)
        shapes.append(_entry(point, inputs, result))
        if outcome.passed and not result.passed:
            where = ", ".join(f"{k}={v}" for k, v in point.items())
            outcome = replace(result, note=f"at {where} (inside the symbolic ranges): {result.summary()}")
    artifact.manifest["verification"] = dict(outcome.to_json(), shapes=shapes)
    return outcome


def sizes_line(verification: dict[str, Any] | None) -> str | None:
    """The sizes a verification ran at, for the CLI (None when it ran at the example's sizes only).

    >>> sizes_line({"shapes": [{"sizes": {"batch": 1}, "passed": True}, {"sizes": {"batch": 8}, "skipped": "big"}]})
    'verified at sizes batch=1 (passed), batch=8 (skipped: big)'
    """
    shapes = (verification or {}).get("shapes")
    if not shapes:
        return None
    parts = [" ".join(f"{k}={v}" for k, v in s["sizes"].items())
             + (f" (skipped: {s['skipped']})" if "skipped" in s else f" ({'passed' if s['passed'] else 'FAILED'})")
             for s in shapes]
    return "verified at sizes " + ", ".join(parts)
