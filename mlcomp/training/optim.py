"""Optimizer specs: ``sgd{lr=0.05 momentum=0.9}`` / ``adam{lr=1e-3 betas=(0.9,0.99)}`` → a typed spec → ``torch.optim``.

    >>> spec = OptimizerSpec.parse("sgd{lr=0.05 momentum=0.9 weight_decay=1e-4}")
    >>> spec.kind, spec.options
    (<OptimizerKind.SGD: 'sgd'>, SgdOptions(lr=0.05, momentum=0.9, weight_decay=0.0001, dampening=0.0, nesterov=False))
    >>> spec.text()
    'sgd{lr=0.05,momentum=0.9,weight_decay=0.0001}'
    >>> opt = spec.build([w, b])            # torch.optim.SGD(..., foreach=True)

The text is parsed by the pipeline grammar (:mod:`mlcomp.pipeline.spec`) against a
registry whose entries are the option dataclasses below, declared with the same
``option(default, help, min=, max=)`` fields as pass options.  So an optimizer spec
reads and fails like a pass spec; before, a hand-written parser here said only
``optimizer sgd has no option 'foo'``, after::

    bad optimizer spec 'sgd{lr=0.1 momentm=0.9}' at column 12: optimizer 'sgd' has no option
    'momentm'; did you mean 'momentum'? Its options are: lr (float >= 0.0, default 0.01), …

Ranges the closed ``min``/``max`` bounds cannot say (``lr > 0``, ``momentum < 1``,
``0 <= beta < 1``) are checked when the options are built, in the same words.
``betas=(0.9,0.99)`` and ``betas=[0.9,0.99]`` are the same.  Defaults are torch's
(Adam ``eps=1e-8``); the torch optimizers run their ``foreach`` implementations.
"""
from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from mlcomp.base.errors import MlcompError, PipelineSpecError
from mlcomp.pipeline.pass_base import PassRegistry, option
from mlcomp.pipeline.spec import Pipeline

__all__ = ["AdamOptions", "AdamWOptions", "OptimizerKind", "OptimizerSpec", "OptimizerSpecError", "SgdOptions"]


class OptimizerSpecError(MlcompError):
    """An optimizer spec names an unknown optimizer or option, or a bad value."""


class OptimizerKind(enum.Enum):
    SGD = "sgd"
    ADAM = "adam"
    ADAMW = "adamw"


def _strictly(kind: str, key: str, value: float, ok: bool, rule: str) -> None:
    if not ok:
        raise OptimizerSpecError(f"option {key!r} of optimizer {kind!r} must be {rule}, got {value!r}",
                                 hint=f"for example {kind}{{{key}={_EXAMPLE[key]}}}")


_EXAMPLE = {"lr": "0.01", "momentum": "0.9", "dampening": "0", "betas": "(0.9,0.999)", "eps": "1e-8"}


@dataclass(frozen=True)
class SgdOptions:
    """Stochastic gradient descent with momentum and weight decay (torch.optim.SGD)."""

    lr: float = option(0.01, "learning rate, > 0", min=0.0)
    momentum: float = option(0.0, "momentum factor, in [0, 1)", min=0.0, max=1.0)
    weight_decay: float = option(0.0, "L2 penalty added to the gradient", min=0.0)
    dampening: float = option(0.0, "dampening of the momentum, in [0, 1]", min=0.0, max=1.0)
    nesterov: bool = option(False, "Nesterov momentum (needs momentum > 0 and dampening 0)")

    def __post_init__(self) -> None:
        _strictly("sgd", "lr", self.lr, self.lr > 0, "greater than 0")
        _strictly("sgd", "momentum", self.momentum, 0 <= self.momentum < 1, "in [0, 1)")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise OptimizerSpecError("option 'nesterov' of optimizer 'sgd' needs momentum > 0 and dampening=0",
                                     hint="for example sgd{lr=0.01 momentum=0.9 nesterov=true}")


@dataclass(frozen=True)
class AdamOptions:
    """Adam (torch.optim.Adam); defaults are torch's."""

    lr: float = option(1e-3, "learning rate, > 0", min=0.0)
    betas: tuple[float, ...] = option((0.9, 0.999), "decay of the first and second moment, each in [0, 1)")
    eps: float = option(1e-8, "added to the denominator, >= 0", min=0.0)
    weight_decay: float = option(0.0, "L2 penalty (Adam) / decoupled decay (AdamW)", min=0.0)
    amsgrad: bool = option(False, "the AMSGrad variant")

    def __post_init__(self) -> None:
        kind = "adamw" if isinstance(self, AdamWOptions) else "adam"
        _strictly(kind, "lr", self.lr, self.lr > 0, "greater than 0")
        _strictly(kind, "betas", self.betas, len(self.betas) == 2 and all(0 <= b < 1 for b in self.betas),
                  "two numbers, each in [0, 1)")


@dataclass(frozen=True)
class AdamWOptions(AdamOptions):
    """AdamW: Adam with decoupled weight decay (torch.optim.AdamW)."""

    weight_decay: float = option(0.01, "decoupled weight decay", min=0.0)


_OPTIONS: dict[OptimizerKind, type] = {OptimizerKind.SGD: SgdOptions, OptimizerKind.ADAM: AdamOptions,
                                        OptimizerKind.ADAMW: AdamWOptions}
_REGISTRY = PassRegistry({k.value: cls for k, cls in _OPTIONS.items()})


def _as_optimizer_error(exc: PipelineSpecError, text: str) -> OptimizerSpecError:
    """The pipeline parser's message, in optimizer words and on one line (the caret drawing of a
    pipeline spec becomes ``at column N``)."""
    what = exc.what
    located = re.match(r"bad pipeline spec at column (\d+):\n.*\n\s*\^ (.*)", what, re.DOTALL)
    if located:
        what = f"bad optimizer spec {text!r} at column {located.group(1)}: {located.group(2)}"
    what = (what.replace("unknown pass", "unknown optimizer").replace("Known passes", "Known optimizers")
            .replace("of pass '", "of optimizer '").replace("pass '", "optimizer '"))
    return OptimizerSpecError(what, hint=f"write one optimizer as name{{key=value ...}}, one of "
                                         f"{', '.join(k.value for k in OptimizerKind)}, e.g. "
                                         f"sgd{{lr=0.05 momentum=0.9}} or adam{{lr=1e-3 betas=(0.9,0.999)}}")


def _brackets(text: str) -> str:
    """``(0.9,0.99)`` → ``[0.9,0.99]`` outside quotes (same length: columns stay right)."""
    out, quote = [], ""
    for c in text:
        if quote:
            quote = "" if c == quote else quote
        elif c in "'\"":
            quote = c
        elif c in "()":
            c = "[" if c == "(" else "]"
        out.append(c)
    return "".join(out)


@dataclass(frozen=True)
class OptimizerSpec:
    kind: OptimizerKind
    options: Any

    @classmethod
    def parse(cls, text: str | OptimizerSpec) -> OptimizerSpec:
        if isinstance(text, OptimizerSpec):
            return text
        try:
            pipe = Pipeline.parse(_brackets(str(text).strip().lower()), registry=_REGISTRY)
        except PipelineSpecError as exc:
            raise _as_optimizer_error(exc, str(text)) from None
        if len(pipe.passes) != 1:
            raise OptimizerSpecError(f"optimizer spec {text!r} names {len(pipe.passes)} optimizers; give one",
                                     hint="e.g. sgd{lr=0.05 momentum=0.9}")
        item = pipe.passes[0]
        return cls(OptimizerKind(item.name), _OPTIONS[OptimizerKind(item.name)](**dict(item.options)))

    def text(self) -> str:
        """Canonical spec text (options that differ from the defaults), parsed back to an equal spec."""
        default = type(self.options)()
        parts = [f"{f.name}={_fmt(getattr(self.options, f.name))}" for f in dataclasses.fields(self.options)
                 if getattr(self.options, f.name) != getattr(default, f.name)]
        return self.kind.value + ("{" + ",".join(parts) + "}" if parts else "")

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "options": dataclasses.asdict(self.options)}

    def build(self, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        """The torch optimizer over ``params`` (foreach implementation)."""
        o = self.options
        params = list(params)
        if self.kind is OptimizerKind.SGD:
            return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay,
                                   dampening=o.dampening, nesterov=o.nesterov, foreach=True)
        opt = torch.optim.Adam if self.kind is OptimizerKind.ADAM else torch.optim.AdamW
        return opt(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                   amsgrad=o.amsgrad, foreach=True)


def _fmt(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple):
        return "(" + ",".join(_fmt(v) for v in value) + ")"
    return repr(value)
