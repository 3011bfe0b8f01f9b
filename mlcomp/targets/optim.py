"""Optimizer specs: ``sgd{lr=0.05 momentum=0.9}`` / ``adam{lr=1e-3}`` → a typed spec → ``torch.optim``.

    >>> spec = OptimizerSpec.parse("sgd{lr=0.05 momentum=0.9 weight_decay=1e-4}")
    >>> spec.kind, spec.options
    (<OptimizerKind.SGD: 'sgd'>, SgdOptions(lr=0.05, momentum=0.9, weight_decay=0.0001, dampening=0.0, nesterov=False))
    >>> spec.text()
    'sgd{lr=0.05 momentum=0.9 weight_decay=0.0001 dampening=0.0 nesterov=false}'
    >>> opt = spec.build([w, b])            # torch.optim.SGD(..., foreach=True)

Options are separated by spaces or commas; an unknown option or a value of the
wrong type is an :class:`OptimizerSpecError` naming the valid options.  The
torch optimizers run their ``foreach`` implementations (one kernel per group of
tensors instead of a Python loop per parameter).
"""
from __future__ import annotations

import dataclasses
import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from mlcomp.base.errors import MlcompError

__all__ = ["AdamOptions", "OptimizerKind", "OptimizerSpec", "OptimizerSpecError", "SgdOptions"]


class OptimizerSpecError(MlcompError):
    """An optimizer spec names an unknown optimizer or option, or a bad value."""


class OptimizerKind(enum.Enum):
    SGD = "sgd"
    ADAM = "adam"
    ADAMW = "adamw"


@dataclass(frozen=True)
class SgdOptions:
    lr: float = 0.01
    momentum: float = 0.0
    weight_decay: float = 0.0
    dampening: float = 0.0
    nesterov: bool = False


@dataclass(frozen=True)
class AdamOptions:
    lr: float = 1e-3
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    amsgrad: bool = False


@dataclass(frozen=True)
class AdamWOptions(AdamOptions):
    weight_decay: float = 0.01


_OPTIONS: dict[OptimizerKind, type] = {OptimizerKind.SGD: SgdOptions, OptimizerKind.ADAM: AdamOptions,
                                        OptimizerKind.ADAMW: AdamWOptions}
_SPEC = re.compile(r"^\s*([A-Za-z_]\w*)\s*(?:\{(.*)\})?\s*$", re.DOTALL)


@dataclass(frozen=True)
class OptimizerSpec:
    kind: OptimizerKind
    options: Any

    @classmethod
    def parse(cls, text: str | OptimizerSpec) -> OptimizerSpec:
        if isinstance(text, OptimizerSpec):
            return text
        m = _SPEC.match(str(text))
        if not m:
            raise OptimizerSpecError(f"optimizer spec {text!r} is not of the form name{{key=value ...}}",
                                     hint='write e.g. "sgd{lr=0.05 momentum=0.9}" or "adam{lr=1e-3}"')
        name, body = m.group(1).lower(), m.group(2) or ""
        try:
            kind = OptimizerKind(name)
        except ValueError:
            raise OptimizerSpecError(f"there is no optimizer named {name!r} (in {text!r})",
                                     hint=f"choose one of: {', '.join(k.value for k in OptimizerKind)}") from None
        fields = {f.name: f for f in dataclasses.fields(_OPTIONS[kind])}
        values: dict[str, Any] = {}
        for item in filter(None, re.split(r"[\s,]+", body.strip())):
            key, eq, raw = item.partition("=")
            if not eq or not key:
                raise OptimizerSpecError(f"{item!r} in optimizer spec {text!r} is not key=value",
                                         hint=f"{kind.value} takes: {', '.join(fields)}")
            if key not in fields:
                raise OptimizerSpecError(f"optimizer {kind.value} has no option {key!r} (in {text!r})",
                                         hint=f"{kind.value} takes: {', '.join(fields)}")
            values[key] = _value(kind, key, raw, fields[key].type, text)
        return cls(kind, _OPTIONS[kind](**values))

    def text(self) -> str:
        parts = [f"{k}={str(v).lower() if isinstance(v, bool) else v}"
                 for k, v in dataclasses.asdict(self.options).items()]
        return f"{self.kind.value}{{{' '.join(parts)}}}"

    def build(self, params: Iterable[torch.Tensor]) -> torch.optim.Optimizer:
        """The torch optimizer over ``params`` (foreach implementation)."""
        o = self.options
        params = list(params)
        if self.kind is OptimizerKind.SGD:
            return torch.optim.SGD(params, lr=o.lr, momentum=o.momentum, weight_decay=o.weight_decay,
                                   dampening=o.dampening, nesterov=o.nesterov, foreach=True)
        cls = torch.optim.Adam if self.kind is OptimizerKind.ADAM else torch.optim.AdamW
        return cls(params, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                   amsgrad=o.amsgrad, foreach=True)


def _value(kind: OptimizerKind, key: str, raw: str, typ: Any, text: str) -> Any:
    typ = typ if isinstance(typ, str) else getattr(typ, "__name__", str(typ))
    if typ == "bool":
        if raw.lower() in ("true", "1", "yes"):
            return True
        if raw.lower() in ("false", "0", "no"):
            return False
        raise OptimizerSpecError(f"{kind.value} option {key}={raw!r} must be true or false (in {text!r})")
    try:
        value = float(raw)
    except ValueError:
        raise OptimizerSpecError(f"{kind.value} option {key}={raw!r} must be a number (in {text!r})",
                                 hint=f"e.g. {key}=0.01") from None
    if value < 0:
        raise OptimizerSpecError(f"{kind.value} option {key}={raw!r} must not be negative (in {text!r})")
    return value
