"""Optimizer specs: ``sgd{lr=0.05 momentum=0.9}`` / ``adam{lr=1e-3 betas=(0.9,0.99)}`` → a typed spec → ``torch.optim``.

    >>> spec = OptimizerSpec.parse("sgd{lr=0.05 momentum=0.9 weight_decay=1e-4}")
    >>> spec.kind, spec.options
    (<OptimizerKind.SGD: 'sgd'>, SgdOptions(lr=0.05, momentum=0.9, weight_decay=0.0001, dampening=0.0, nesterov=False))
    >>> spec.text()
    'sgd{lr=0.05,momentum=0.9,weight_decay=0.0001}'
    >>> opt = spec.build([torch.zeros(2, requires_grad=True)])
    >>> type(opt).__name__, opt.defaults["foreach"]
    ('SGD', True)

The text is read by the spec grammar of :mod:`mlcomp.base.spec` (noun ``optimizer``) against
a table whose entries are the option dataclasses below, declared with ``option()`` fields and
their open or closed ranges (``lr > 0``, ``momentum`` in ``[0, 1)``).  So an optimizer spec
reads and fails like a pass spec, in optimizer words, pointing at the column::

    bad optimizer spec at column 12 of 'sgd{lr=0.1 momentm=0.9}' (at 'momentm=0.9}'): optimizer 'sgd' has
    no option 'momentm'; did you mean 'momentum'? Its options are: …

Names and keys are case-insensitive; ``betas=(0.9,0.99)`` and ``betas=[0.9,0.99]`` are the same.
Defaults are torch's (Adam ``eps=1e-8``); the torch optimizers run their ``foreach`` implementations.
"""
from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from mlcomp.base.errors import MlcompError
from mlcomp.base.spec import Grammar, SpecTable
from mlcomp.base.spec_options import check_fields, option

__all__ = ["OPTIMIZER_GRAMMAR", "SCRATCH", "AdamOptions", "AdamWOptions", "OptimizerKind", "OptimizerSpec", "OptimizerSpecError",
           "SgdOptions"]


class OptimizerSpecError(MlcompError):
    """An optimizer spec names an unknown optimizer or option, or a bad value."""


class OptimizerKind(enum.Enum):
    SGD = "sgd"
    ADAM = "adam"
    ADAMW = "adamw"


def _check(options: Any, kind: str) -> None:
    check_fields(options, owner=kind, noun="optimizer", error=OptimizerSpecError)


@dataclass(frozen=True)
class SgdOptions:
    """Stochastic gradient descent with momentum and weight decay (torch.optim.SGD)."""

    lr: float = option(0.01, "learning rate", gt=0)
    momentum: float = option(0.0, "momentum factor", ge=0, lt=1)
    weight_decay: float = option(0.0, "L2 penalty added to the gradient", ge=0)
    dampening: float = option(0.0, "dampening of the momentum", ge=0, le=1)
    nesterov: bool = option(False, "Nesterov momentum (needs momentum > 0 and dampening 0)")

    def __post_init__(self) -> None:
        _check(self, "sgd")
        if self.nesterov and (self.momentum <= 0 or self.dampening != 0):
            raise OptimizerSpecError("option 'nesterov' of optimizer 'sgd' needs momentum > 0 and dampening=0",
                                     hint="for example sgd{lr=0.01 momentum=0.9 nesterov=true}")


@dataclass(frozen=True)
class AdamOptions:
    """Adam (torch.optim.Adam); defaults are torch's."""

    lr: float = option(1e-3, "learning rate", gt=0)
    betas: tuple[float, float] = option((0.9, 0.999), "decay of the first and second moment", ge=0, lt=1)
    eps: float = option(1e-8, "added to the denominator", ge=0)
    weight_decay: float = option(0.0, "L2 penalty (Adam) / decoupled decay (AdamW)", ge=0)
    amsgrad: bool = option(False, "the AMSGrad variant")

    def __post_init__(self) -> None:
        _check(self, "adamw" if isinstance(self, AdamWOptions) else "adam")


@dataclass(frozen=True)
class AdamWOptions(AdamOptions):
    """AdamW: Adam with decoupled weight decay (torch.optim.AdamW)."""

    weight_decay: float = option(0.01, "decoupled weight decay", ge=0)


# (kind, options that must be set, scratch per parameter byte): torch's foreach updates, first match wins.
# SGD with weight decay adds the decay into a new gradient list; Adam/AdamW divide by a new sqrt(v) list;
# momentum buffers and moments are optimizer state (allocated on the first step), not scratch.
SCRATCH: tuple[tuple[OptimizerKind, tuple[str, ...], float], ...] = (
    (OptimizerKind.SGD, ("weight_decay",), 1.0),
    (OptimizerKind.SGD, (), 0.0),
    (OptimizerKind.ADAM, (), 1.0),
    (OptimizerKind.ADAMW, (), 1.0),
)

_OPTIONS: dict[OptimizerKind, type] = {OptimizerKind.SGD: SgdOptions, OptimizerKind.ADAM: AdamOptions,
                                        OptimizerKind.ADAMW: AdamWOptions}
OPTIMIZER_GRAMMAR = Grammar(
    "optimizer", OptimizerSpecError, tuples=True, fold_case=True,
    hint=f"write one optimizer as name{{key=value ...}}, one of {', '.join(k.value for k in OptimizerKind)}, "
         "e.g. sgd{lr=0.05 momentum=0.9} or adam{lr=1e-3 betas=(0.9,0.999)}")
_TABLE = SpecTable(OPTIMIZER_GRAMMAR, {k.value: cls for k, cls in _OPTIONS.items()})


@dataclass(frozen=True)
class OptimizerSpec:
    kind: OptimizerKind
    options: Any

    @classmethod
    def parse(cls, text: str | OptimizerSpec) -> OptimizerSpec:
        if isinstance(text, OptimizerSpec):
            return text
        item, options = _TABLE.parse_one(str(text))
        return cls(OptimizerKind(item.name), options)

    def text(self) -> str:
        """Canonical spec text (options that differ from the defaults), parsed back to an equal spec."""
        default = type(self.options)()
        parts = [f"{f.name}={_fmt(getattr(self.options, f.name))}" for f in dataclasses.fields(self.options)
                 if getattr(self.options, f.name) != getattr(default, f.name)]
        return self.kind.value + ("{" + ",".join(parts) + "}" if parts else "")

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind.value, "options": dataclasses.asdict(self.options)}

    def scratch(self) -> float:
        """Temporary bytes one update allocates per byte of the parameters it updates (:data:`SCRATCH`)."""
        o = self.options
        return next(share for kind, needs, share in SCRATCH
                    if kind is self.kind and all(getattr(o, k) for k in needs))

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
