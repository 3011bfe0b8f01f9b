"""The ``remat`` pass's limits: ``budget`` (where between the lowest and the unchanged peak), ``peak``, ``saved``.

* ``budget=B`` (``0 <= B <= 1``) -- the predicted step peak allowed, as a point
  between the lowest peak any plan of the pool reaches (0) and the peak without
  remat (1): ``lowest + B * (peak without remat - lowest)``.  It normalises like
  torch's ``activation_memory_budget`` (0: recompute all it can, 1: recompute
  nothing), over the peak instead of the saved bytes, so a tighter budget never
  gives a higher peak.
* ``peak=96MiB`` -- the predicted peak allowed, as a size.
* ``saved=0.25`` or ``saved=256MB`` -- a cap on the saved activations the
  backward still reads (a fraction of their bytes without remat, or a size):
  plans keeping more are left out of the pool.

    >>> parse_budget("0.25"), parse_saved("0.5"), parse_saved("1KiB").nbytes, parse_peak("96MiB")
    (0.25, Saved(fraction=0.5, nbytes=None), 1024, 100663296)
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from mlcomp.base.errors import PassFailure, PipelineSpecError
from mlcomp.base.units import SizeError, parse_size, size_unit

__all__ = ["RematError", "Saved", "infeasible", "parse_budget", "parse_peak", "parse_saved", "peak_unmet"]

_SIZES = "KB, MB, GB: powers of 1000; KiB, MiB, GiB: powers of 1024"


class RematError(PassFailure):
    """Rematerialisation cannot run on this graph or cannot meet the budget."""


@dataclass(frozen=True)
class Saved:
    """A cap on the saved activations: a fraction of their bytes without remat, or bytes."""

    fraction: float | None = None
    nbytes: int | None = None

    def resolve(self, saved: int) -> int:
        """The bytes of saved activations allowed, given ``saved`` bytes without remat."""
        return int(self.fraction * saved) if self.fraction is not None else int(self.nbytes or 0)


def parse_budget(text: str) -> float:
    """``0.25``: a number in [0, 1] (0: the lowest peak any plan reaches, 1: the peak without remat)."""
    raw = str(text).strip()
    hint = ("give a number in [0, 1]: 0 asks for the lowest predicted peak any plan reaches, 1 for the peak "
            "without remat, e.g. remat{budget=0.25}; a peak as a size is remat{peak=96MiB}, a cap on the saved "
            "activations remat{saved=0.5} or remat{saved=256MB}")
    try:
        value, unit = size_unit(raw)
    except SizeError as exc:
        raise PipelineSpecError(f"option 'budget' of pass 'remat' got {raw!r}: {exc}", hint=hint) from None
    if unit:
        raise PipelineSpecError(f"option 'budget' of pass 'remat' got {raw!r}: the budget is a number in [0, 1] "
                                "between the lowest reachable peak and the peak without remat, not a size",
                                hint=hint)
    if not 0.0 <= value <= 1.0:
        raise PipelineSpecError(f"option 'budget' of pass 'remat' must be between 0 and 1, got {raw!r}", hint=hint)
    return value


def parse_saved(text: str) -> Saved:
    """``0.5`` (a fraction in (0, 1]) or ``256MB`` / ``1.5GiB`` / ``4096`` B (a size, :mod:`mlcomp.base.units`)."""
    raw = str(text).strip()
    hint = ("give a fraction in (0, 1] of the saved activations without remat, e.g. remat{saved=0.5}, "
            f"or a size such as remat{{saved=256MB}} ({_SIZES})")
    try:
        value, unit = size_unit(raw)
    except SizeError as exc:
        raise PipelineSpecError(f"option 'saved' of pass 'remat' got {raw!r}: {exc}", hint=hint) from None
    if value <= 0:
        raise PipelineSpecError(f"option 'saved' of pass 'remat' must be above 0, got {raw!r}", hint=hint)
    if unit == "" and value <= 1.0:
        return Saved(fraction=value)
    if unit == "" and value != int(value):
        raise PipelineSpecError(f"option 'saved' of pass 'remat' got {raw!r}: a fraction must be at most 1 "
                                "and a size a whole number of bytes", hint=hint)
    return Saved(nbytes=parse_size(raw))


def parse_peak(text: str) -> int:
    """``96MiB`` / ``100MB`` / ``4096`` (bytes) → bytes (:mod:`mlcomp.base.units`)."""
    hint = f"give the step's peak as a size, e.g. remat{{peak=96MiB}} ({_SIZES})"
    try:
        value = parse_size(str(text).strip())
    except SizeError as exc:
        raise PipelineSpecError(f"option 'peak' of pass 'remat' got {text!r}: {exc}", hint=hint) from None
    if value <= 0:
        raise PipelineSpecError(f"option 'peak' of pass 'remat' must be above 0, got {text!r}", hint=hint)
    return value


def peak_unmet(graph_name: str, text: str, limit: int, lowest: int, at: str, kinds: dict[str, int]) -> RematError:
    return RematError(
        f"remat cannot bring the predicted peak of the training step of {graph_name} under {text} ({limit} "
        f"bytes): the lowest any plan reaches is {lowest} bytes, at %{at} "
        f"({', '.join(f'{k} {v}' for k, v in kinds.items())})",
        where=f"pass remat, graph {graph_name}",
        hint=f"raise the limit to at least peak={math.ceil(lowest / 2**20)}MiB, lower the batch, or use "
             "fused=true with compile_training(update_in_backward=True) so gradients do not coexist")


def infeasible(graph_name: str, text: str, target: int, saved: int, least: int) -> RematError:
    frac = least / max(saved, 1)
    return RematError(
        f"remat cannot keep the saved activations of graph {graph_name} within saved={text} ({target} "
        f"bytes, {target / max(saved, 1):.3f} of the {saved} bytes saved without remat): the values that cannot be "
        f"recomputed (graph inputs and outputs, random or in-place ops, keep patterns) and what recomputing around "
        f"them needs hold at least {least} bytes, so the minimum feasible cap is {least} bytes "
        f"({frac:.3f} of the saved activations)", where=f"pass remat, graph {graph_name}",
        hint=f"raise the cap to at least saved={math.ceil(frac * 1000) / 1000} or saved={least}B, drop keep "
             "patterns, or drop saved and bound the peak with budget= or peak=")
