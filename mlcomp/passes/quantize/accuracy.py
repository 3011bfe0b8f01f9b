"""``quantize``'s accuracy as a result: the metric, per-layer sensitivity, and the refusal.

The metric, measured by running the quantized graph against the float one, per set of
samples (the calibration samples the ranges came from, and the held-back ones never
observed):

* ``max_rel``: max |int8 − fp32| / max |fp32| over the first output (the worst sample);
* ``mean_rel``: mean |int8 − fp32| / mean |fp32| (over all samples);
* ``top1``: the fraction of rows whose argmax over the last dim agrees.

Per layer (on the first calibration sample): ``rel_error``, the max relative error of
its output, and ``added``, that error less the largest error its activations already
carried when they reached it (its own loss: its input and weight rounding).  Layers
sorted by ``added`` are the sensitivity table ``--explain`` prints, and the first few
are the ``exclude`` suggestion::

    >>> import torch
    >>> metric([(torch.tensor([[1.0, 2.0]]),)], [(torch.tensor([[1.0, 1.5]]),)])
    {'samples': 1, 'max_rel': 0.25, 'mean_rel': 0.16666666666666666, 'top1': 1.0}
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from mlcomp.base.errors import VerificationError

__all__ = ["metric", "layer_errors", "sensitivity", "suggest", "explain_lines", "check_targets", "rel"]


def rel(ref: Any, got: Any) -> float | None:
    """max |got − ref| / max |ref| for float tensors of one shape, else ``None``."""
    if not (isinstance(ref, torch.Tensor) and ref.is_floating_point() and isinstance(got, torch.Tensor)
            and got.shape == ref.shape):
        return None
    top = float(ref.detach().abs().max()) if ref.numel() else 0.0
    diff = float((ref.detach().double() - got.detach().double()).abs().max()) if ref.numel() else 0.0
    return diff / top if top > 0 else diff


def _first(value: Any) -> Any:
    while isinstance(value, (tuple, list)) and value:
        value = value[0]
    return value


def metric(reference: Sequence[Any], got: Sequence[Any]) -> dict[str, Any]:
    """The metric of the outputs ``got`` against ``reference`` (one entry per sample, each the outputs)."""
    worst, diff, mag, agree, rows = 0.0, 0.0, 0.0, 0, 0
    for ref_out, got_out in zip(reference, got):
        ref, out = _first(ref_out), _first(got_out)
        if not (isinstance(ref, torch.Tensor) and ref.is_floating_point() and isinstance(out, torch.Tensor)):
            continue
        worst = max(worst, rel(ref, out) or 0.0)
        diff += float((ref.double() - out.double()).abs().sum())
        mag += float(ref.double().abs().sum())
        if ref.dim() >= 1 and ref.shape[-1] > 1:
            agree += int((ref.argmax(-1) == out.argmax(-1)).sum())
            rows += ref.argmax(-1).numel()
    return {"samples": len(reference), "max_rel": worst, "mean_rel": diff / mag if mag > 0 else 0.0,
            "top1": agree / rows if rows else None}


def layer_errors(records: list[dict[str, Any]], first: dict[str, Any], env: dict[str, Any]) -> None:
    """Fill each record's ``rel_error`` and ``added`` from the float values ``first`` and quantized ``env``."""
    for rec in records:
        own = rel(first.get(rec["node"]), env.get(rec["node"]))
        came = [rel(first.get(i["value"]), env.get(i["value"])) for i in rec.get("inputs", ())]
        inherited = max((c for c in came if c is not None), default=0.0)
        rec["rel_error"] = own
        rec["added"] = None if own is None else max(0.0, own - inherited)


def sensitivity(records: list[dict[str, Any]], top: int = 8) -> list[dict[str, Any]]:
    """The ``top`` layers that lose most (largest ``added``), each its node, module, op and errors."""
    ranked = sorted((r for r in records if r.get("added") is not None), key=lambda r: -r["added"])
    return [{"node": r["node"], "module": r["module"], "op": r["op"], "added": r["added"],
             "rel_error": r["rel_error"]} for r in ranked[:top]]


def suggest(ranked: list[dict[str, Any]], most: int = 3) -> list[str]:
    """``exclude`` patterns for the layers whose loss is at least a quarter of the largest (at most ``most``)."""
    if not ranked or ranked[0]["added"] <= 0:
        return []
    cut = ranked[0]["added"] / 4
    names = [r["module"] or r["node"] for r in ranked if r["added"] >= cut]
    return list(dict.fromkeys(names))[:most]


def _set_text(name: str, m: dict[str, Any]) -> str:
    top1 = f", top-1 agreement {m['top1']:.3f}" if m.get("top1") is not None else ""
    return (f"{name} ({m['samples']} sample{'s' * (m['samples'] != 1)}): max rel error {m['max_rel']:.3g}, "
            f"mean rel error {m['mean_rel']:.3g}{top1}")


def explain_lines(stats: dict[str, Any]) -> list[str]:
    """What ``--explain`` prints under the pass: the metric per set, the layers that lose most, what kept float."""
    lines = [_set_text(name, stats[key]) for key, name in (("calibration", "calibration set"),
                                                           ("held_back", "held-back set")) if stats.get(key)]
    for r in stats.get("sensitivity", ()):
        lines.append(f"  loses {r['added']:.3g} (output error {r['rel_error']:.3g}): %{r['node']} {r['op']}"
                     + (f" in {r['module']}" if r["module"] else ""))
    if stats.get("suggest_exclude"):
        lines.append("if accuracy matters more than speed there: quantize{exclude=[" +
                     ",".join(stats["suggest_exclude"]) + "]}")
    reasons: dict[str, int] = {}
    for why in stats.get("kept_float", {}).values():
        reasons[why] = reasons.get(why, 0) + 1
    lines += [f"kept float: {n} × {why}" for why, n in sorted(reasons.items(), key=lambda kv: -kv[1])]
    return lines


def check_targets(stats: dict[str, Any], tolerance: float | None, agreement: float | None) -> None:
    """Refuse, with the numbers, when a declared ``tolerance`` (max rel error) or ``agreement`` (top-1) is missed
    on any measured set."""
    misses = []
    for key, name in (("calibration", "the calibration set"), ("held_back", "the held-back set")):
        m = stats.get(key)
        if not m:
            continue
        if tolerance is not None and m["max_rel"] > tolerance:
            misses.append(f"max relative error {m['max_rel']:.3g} on {name} exceeds tolerance={tolerance:g}")
        if agreement is not None and m["top1"] is not None and m["top1"] < agreement:
            misses.append(f"top-1 agreement {m['top1']:.3f} on {name} is below agreement={agreement:g}")
    if not misses:
        return
    worst = "; ".join(f"{r['module'] or r['node']} ({r['op']}, loses {r['added']:.3g})"
                      for r in stats.get("sensitivity", ())[:3])
    excl = stats.get("suggest_exclude") or []
    raise VerificationError(
        f"the int8 graph misses its declared accuracy: {'; '.join(misses)}. The layers that lose most: "
        f"{worst or 'none measured'}", where="pass quantize",
        hint=(f"keep them in float with quantize{{exclude=[{','.join(excl)}]}}, " if excl else "")
             + "try method=percentile or method=entropy, give more calibration data, or declare a looser target")
