"""Dynamic loss scaling for training steps whose backward runs in fp16.

fp16 flushes magnitudes below 2^-24 to zero, so small gradients of fp16
intermediates vanish.  Scaling the loss by ``S`` before backward scales every
gradient by ``S``; the step divides the gradients by ``S`` again, in fp32, before
the optimizer sees them.  The graph side is the ``loss-scale`` pass
(:mod:`mlcomp.passes.precision.loss_scale`): it multiplies the seed of backward by
a new scalar graph input ``%loss_scale``, which :class:`LossScaler` feeds.

:class:`LossScaler` holds the running scale.  Dynamic mode (the defaults follow
``torch.amp.GradScaler``): start at 2^16; on a non-finite gradient skip the
update and halve the scale; after ``interval`` (2000) clean steps in a row
double it.  ``stats()`` is its history: every scale change and every skipped step.

    >>> spec = LossScaleSpec.parse("dynamic{init=1024 interval=100}")
    >>> LossScaleSpec.parse("none").active, LossScaleSpec.parse("128").text()
    (False, 'static{scale=128.0}')
"""
from __future__ import annotations

import enum
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mlcomp.base.errors import LossScaleError
from mlcomp.base.spec import Grammar, SpecTable
from mlcomp.base.spec_options import check_fields, option
from mlcomp.ir import Graph, TensorMeta
from mlcomp.passes.precision.loss_scale import LOSS_SCALE_INPUT, find_backward_seed

__all__ = [
    "LOSS_SCALE_GRAMMAR",
    "LOSS_SCALE_INPUT",
    "LossScaleError",
    "LossScaleMode",
    "LossScaleSpec",
    "LossScaler",
    "find_backward_seed",
]

class LossScaleMode(enum.Enum):
    NONE = "none"         # gradients as computed
    STATIC = "static"     # one fixed scale
    DYNAMIC = "dynamic"   # grows after clean steps, backs off (and skips the update) on inf/NaN


@dataclass(frozen=True)
class LossScaleSpec:
    """A parsed ``--loss-scale``: ``dynamic``, ``none``, a number, or ``dynamic{init=… interval=…}``."""

    mode: LossScaleMode = LossScaleMode.DYNAMIC
    init: float = 2.0 ** 16       # the first scale (static: the scale)
    growth: float = 2.0           # factor after ``interval`` clean steps
    backoff: float = 0.5          # factor after an overflow
    interval: int = 2000          # clean steps before growing

    @property
    def active(self) -> bool:
        return self.mode is not LossScaleMode.NONE

    @classmethod
    def parse(cls, value: str | float | int | LossScaleSpec | None, *, graph: Graph | None = None) -> LossScaleSpec:
        """``None``: dynamic when ``graph`` computes anything in fp16 (the range problem), else none.

        Text is read by the spec grammar of :mod:`mlcomp.base.spec` (noun ``loss-scale mode``), as
        optimizer specs are: ``dynamic{init=65536 growth_interval=2000}`` reads, and fails, like a pass spec."""
        if isinstance(value, LossScaleSpec):
            return value
        if value is None:
            fp16 = graph is not None and any(isinstance(n.meta, TensorMeta) and n.meta.dtype == torch.float16
                                             for n in graph.nodes())
            return cls() if fp16 else cls(LossScaleMode.NONE)
        if isinstance(value, bool):
            raise _bad(value, "a boolean is not a loss scale")
        if isinstance(value, (int, float)):
            return cls._static(float(value), str(value))
        text = str(value).strip()
        try:
            return cls._static(float(text), text)
        except ValueError:
            pass
        item, o = _TABLE.parse_one(text)
        mode = LossScaleMode(item.name)
        if mode is LossScaleMode.NONE:
            return cls(LossScaleMode.NONE)
        if mode is LossScaleMode.STATIC:
            return cls(mode, init=float(o.scale))
        return cls(mode, init=float(o.init), growth=float(o.growth), backoff=float(o.backoff),
                   interval=int(o.growth_interval or o.interval))

    @classmethod
    def _static(cls, scale: float, text: str) -> LossScaleSpec:
        if not (scale > 0 and math.isfinite(scale)):
            raise _bad(text, "a loss scale must be a positive finite number")
        return cls(LossScaleMode.STATIC, init=scale)

    def text(self) -> str:
        if self.mode is LossScaleMode.NONE:
            return "none"
        if self.mode is LossScaleMode.STATIC:
            return f"static{{scale={self.init!r}}}"
        return (f"dynamic{{init={self.init!r} growth={self.growth!r} backoff={self.backoff!r} "
                f"interval={self.interval}}}")

    def to_json(self) -> dict[str, Any]:
        return {"mode": self.mode.value, "init": self.init, "growth": self.growth, "backoff": self.backoff,
                "interval": self.interval}


@dataclass(frozen=True)
class DynamicOptions:
    """``dynamic{…}``: torch.amp.GradScaler's schedule (its ``growth_interval`` is accepted for ``interval``)."""

    init: float = option(2.0 ** 16, "the first scale (finite)", gt=0, lt=math.inf)
    growth: float = option(2.0, "factor after interval clean steps", gt=1)
    backoff: float = option(0.5, "factor after an inf/NaN gradient", gt=0, lt=1)
    interval: int = option(2000, "clean steps in a row before growing", ge=1)
    growth_interval: int = option(0, "the same as interval (torch.amp.GradScaler's name); 0: not given", ge=0)

    def __post_init__(self) -> None:
        _check(self, LossScaleMode.DYNAMIC)


@dataclass(frozen=True)
class StaticOptions:
    """``static{scale=…}``: one fixed scale (a bare number means the same)."""

    scale: float = option(2.0 ** 16, "the scale (finite)", gt=0, lt=math.inf)

    def __post_init__(self) -> None:
        _check(self, LossScaleMode.STATIC)


@dataclass(frozen=True)
class NoOptions:
    """``none``: gradients as computed."""


def _check(options: Any, mode: LossScaleMode) -> None:
    check_fields(options, owner=mode.value, noun=LOSS_SCALE_GRAMMAR.noun, error=LossScaleError)


_HINT = ("write dynamic, none, a positive number (a static scale such as 1024), or "
         "dynamic{init=65536 growth=2 backoff=0.5 interval=2000}")
LOSS_SCALE_GRAMMAR = Grammar("loss-scale mode", LossScaleError, whole="loss scale", fold_case=True, hint=_HINT)
_TABLE = SpecTable(LOSS_SCALE_GRAMMAR, {LossScaleMode.DYNAMIC.value: DynamicOptions,
                                        LossScaleMode.STATIC.value: StaticOptions,
                                        LossScaleMode.NONE.value: NoOptions})


def _bad(text: Any, why: str) -> LossScaleError:
    return LossScaleError(f"loss scale {text!r} is malformed: {why}", hint=_HINT)


# ---------------------------------------------------------------------------
# The step side


class LossScaler:
    """The running scale of one training artifact: feeds ``%loss_scale``, unscales, decides to skip."""

    def __init__(self, spec: LossScaleSpec) -> None:
        self.spec = spec
        self.scale = spec.init if spec.active else 1.0
        self.clean = 0                    # clean steps since the last change
        self.steps = 0
        self.skipped: list[int] = []      # step numbers whose update was skipped
        self.changes: list[dict[str, Any]] = []   # {"step", "scale", "why"} for every change

    def inputs(self, device: str | torch.device) -> tuple[torch.Tensor, ...]:
        """The extra graph input (``%loss_scale``), empty when scaling is off."""
        if not self.spec.active:
            return ()
        return (torch.tensor(self.scale, dtype=torch.float32, device=device),)

    def unscale(self, grads: Sequence[torch.Tensor]) -> tuple[list[torch.Tensor], bool]:
        """``(grads / scale in fp32, all finite)``; the inputs are left as they are."""
        grads = [g.float() for g in grads]
        if self.spec.active and self.scale != 1.0:
            grads = list(torch._foreach_mul(grads, 1.0 / self.scale))
        if not grads:
            return grads, True
        peaks = torch._foreach_norm(grads, math.inf)
        return grads, bool(torch.stack(peaks).isfinite().all())

    def update(self, finite: bool) -> bool:
        """Record one step; returns whether its optimizer update should be applied."""
        step = self.steps
        self.steps += 1
        if self.spec.mode is not LossScaleMode.DYNAMIC:
            if not finite:
                self.skipped.append(step)
            return finite
        if not finite:
            self.skipped.append(step)
            self.clean = 0
            self.scale *= self.spec.backoff
            self.changes.append({"step": step, "scale": self.scale, "why": "inf/NaN gradient: update skipped"})
            return False
        self.clean += 1
        if self.clean >= self.spec.interval:
            self.clean = 0
            self.scale *= self.spec.growth
            self.changes.append({"step": step, "scale": self.scale,
                                 "why": f"{self.spec.interval} clean steps"})
        return True

    def stats(self) -> dict[str, Any]:
        return {"loss_scale": self.spec.text(), "scale": self.scale, "steps": self.steps,
                "skipped_steps": list(self.skipped), "scale_changes": [dict(c) for c in self.changes]}

    def state_dict(self) -> dict[str, Any]:
        """Everything the next step depends on, and the history (JSON: floats round-trip exactly)."""
        return {"spec": self.spec.to_json(), "scale": self.scale, "clean": self.clean, "steps": self.steps,
                "skipped": list(self.skipped), "changes": [dict(c) for c in self.changes]}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> LossScaler:
        """The scaler :meth:`state_dict` described, mid-run (a saved training artifact reloaded)."""
        s = dict(state["spec"])
        scaler = cls(LossScaleSpec(LossScaleMode(s["mode"]), init=float(s["init"]), growth=float(s["growth"]),
                                   backoff=float(s["backoff"]), interval=int(s["interval"])))
        scaler.scale, scaler.clean, scaler.steps = float(state["scale"]), int(state["clean"]), int(state["steps"])
        scaler.skipped = [int(i) for i in state["skipped"]]
        scaler.changes = [dict(c) for c in state["changes"]]
        return scaler

    def __repr__(self) -> str:
        return f"<LossScaler {self.spec.text()} scale={self.scale} skipped={len(self.skipped)}>"

