"""Activation ranges for ``quantize``: the IR interpreter run on calibration samples.

:func:`observe` runs the graph once per sample and keeps, for each value asked for,
its smallest and largest element (``minmax``), the 0.01% / 99.99% quantiles
(``percentile``, which ignores rare outliers), merged over the samples, or (``entropy``)
the clipping of ``|x|`` whose 128-level histogram loses least information (smallest
Kullback-Leibler divergence from the 2048-bin histogram of all samples; a second run
over the samples builds it within the min-max range); it also keeps
the float values of the first sample (the reference the per-layer error is measured
against) and every sample's outputs (for top-1 agreement).  :func:`uint8_params` turns
a range into ONNX's asymmetric uint8 scale and zero point::

    >>> uint8_params(-1.0, 3.0)          # 255 steps over [-1, 3]; 0.0 is exactly level 64
    (0.01568627543747425, 64)
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from mlcomp.ir import Graph
from mlcomp.ir.interpreter import Interpreter

__all__ = ["Observed", "observe", "channel_mean", "uint8_params", "kl_clip", "PERCENTILE", "SAMPLE_CAP", "BINS", "LEVELS"]

PERCENTILE = 0.9999        # method=percentile: the range spans the 0.01% .. 99.99% quantiles
SAMPLE_CAP = 1 << 20       # elements per value and sample the quantile is taken over (a strided subsample)
BINS, LEVELS, STRIDE = 2048, 128, 16   # method=entropy: histogram bins, levels compared, candidate step


@dataclass
class Observed:
    ranges: dict[str, tuple[float, float]] = field(default_factory=dict)   # value -> (lo, hi)
    first: dict[str, torch.Tensor] = field(default_factory=dict)           # value -> float value, sample 0
    outputs: list[tuple[Any, ...]] = field(default_factory=list)           # per sample, the float outputs


def _range(t: torch.Tensor, method: str) -> tuple[float, float]:
    flat = t.detach().reshape(-1).float()
    if flat.numel() == 0:
        return 0.0, 0.0
    if method == "percentile":
        flat = flat[:: max(1, flat.numel() // SAMPLE_CAP)]
        q = torch.quantile(flat, torch.tensor([1 - PERCENTILE, PERCENTILE]))
        return float(q[0]), float(q[1])
    return float(flat.min()), float(flat.max())


def observe(graph: Graph, samples: Sequence[tuple[torch.Tensor, ...]], names: Sequence[str],
            method: str, keep: Sequence[str] = ()) -> Observed:
    """Ranges of ``names`` over ``samples``; the first sample's values of ``names`` and ``keep``."""
    out = Observed()
    interp = Interpreter(graph)
    wanted = set(names) | set(keep)
    with torch.no_grad():
        for i, sample in enumerate(samples):
            env = interp.run_all(*sample)
            out.outputs.append(env["__output__"])
            for name in names:
                lo, hi = _range(env[name], method)
                old = out.ranges.get(name)
                out.ranges[name] = (lo, hi) if old is None else (min(lo, old[0]), max(hi, old[1]))
            if i == 0:
                out.first = {n: env[n] for n in wanted}
        if method == "entropy":
            out.ranges = _entropy(interp, samples, names, out.ranges)
    return out


def channel_mean(value: torch.Tensor, axis: int) -> torch.Tensor:
    """The mean of ``value`` over every axis but ``axis`` (float64), one per channel.

    >>> channel_mean(torch.tensor([[1.0, 2.0], [3.0, 6.0]]), -1)
    tensor([2., 4.], dtype=torch.float64)
    """
    axis = axis % value.dim()
    return value.detach().double().movedim(axis, -1).reshape(-1, value.shape[axis]).mean(0)


def _entropy(interp: Interpreter, samples: Sequence[tuple[torch.Tensor, ...]], names: Sequence[str],
             ranges: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
    """The min-max ``ranges`` clipped where :func:`kl_clip` says, from histograms of ``|x|`` over all samples."""
    top = {n: max(abs(lo), abs(hi)) for n, (lo, hi) in ranges.items()}
    hists = {n: torch.zeros(BINS, dtype=torch.float64) for n in names}
    for sample in samples:
        env = interp.run_all(*sample)
        for n in names:
            if top[n] > 0 and math.isfinite(top[n]):
                hists[n] += torch.histc(env[n].detach().abs().double().reshape(-1), BINS, 0.0, top[n])
    out = dict(ranges)
    for n in names:
        if top[n] > 0 and math.isfinite(top[n]):
            t = top[n] * kl_clip(hists[n]) / BINS
            out[n] = (max(ranges[n][0], -t), min(ranges[n][1], t))
    return out


def kl_clip(hist: torch.Tensor, levels: int = LEVELS, stride: int = STRIDE) -> int:
    """The number of leading bins of ``hist`` to keep (the rest clipped into the last) whose ``levels``-level
    quantization is closest to the clipped histogram in Kullback-Leibler divergence.

    >>> x = torch.randn(100000, generator=torch.Generator().manual_seed(0))
    >>> h = torch.histc(torch.cat([x, torch.tensor([40.0])]).abs(), 2048, 0, 40.0)   # one far outlier
    >>> kl_clip(h.double()) < 300             # bins of 40/2048: clipped near |x| = 5, not stretched to 40
    True
    """
    n = hist.numel()
    best, best_kl = n, math.inf
    for i in range(levels, n + 1, stride):
        ref = hist[:i]
        p = ref.clone()
        p[-1] += hist[i:].sum()
        idx = torch.arange(i) * levels // i
        nz = (ref > 0).double()
        sums = torch.zeros(levels, dtype=torch.float64).index_add_(0, idx, ref)
        counts = torch.zeros(levels, dtype=torch.float64).index_add_(0, idx, nz)
        q = nz * (sums / counts.clamp(min=1))[idx]
        if p.sum() <= 0 or q.sum() <= 0:
            continue
        p, q = p / p.sum(), q / q.sum()
        mask = p > 0
        kl = float((p[mask] * torch.log(p[mask] / q[mask].clamp(min=1e-12))).sum())
        if kl < best_kl:
            best, best_kl = i, kl
    return best


def uint8_params(lo: float, hi: float) -> tuple[float, int]:
    """Scale and zero point of the uint8 grid over ``[min(lo, 0), max(hi, 0)]`` (0.0 exactly representable)."""
    lo, hi = min(lo, 0.0), max(hi, 0.0)
    scale = float(torch.tensor((hi - lo) / 255.0, dtype=torch.float32))
    if scale == 0.0 or not torch.isfinite(torch.tensor(scale)):
        return 1.0, 0
    zero = int(round(-lo / scale))
    return scale, max(0, min(255, zero))


def int8_weight(w: torch.Tensor, axis: int | None, levels: int = 127) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 scales (one per slice along ``axis``; one in all when ``None``) and the int8 weight on
    ``[-levels, levels]`` (63: seven bits, where the CPU's int8 dot product saturates)."""
    w = w.detach().float()
    if axis is None:
        absmax = w.abs().max().reshape(())
    else:
        absmax = w.abs().transpose(0, axis).reshape(w.shape[axis], -1).max(dim=1).values
    scale = torch.where(absmax > 0, absmax / levels, torch.ones_like(absmax))
    shaped = scale if axis is None else scale.reshape([-1 if d == axis else 1 for d in range(w.dim())])
    q = torch.clamp(torch.round(w / shaped), -levels, levels).to(torch.int8)
    return scale.to(torch.float32), q
