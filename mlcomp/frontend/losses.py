"""Losses and batches for a training step: the loss kinds, a target that fits, the model checks.

    >>> import torch.nn.functional as F
    >>> loss_function("cross_entropy") is F.cross_entropy
    True
    >>> model, x = torch.nn.Linear(8, 3), torch.randn(4, 8)
    >>> y = example_target(model, (x,), "cross_entropy")   # class indices fitting the logits
    >>> y.shape, y.dtype, bool(((0 <= y) & (y < 3)).all())
    (torch.Size([4]), torch.int64, True)
    >>> check_trainable(model, (x,), y, F.cross_entropy, "linear")   # raises TrainingError if it cannot train
    frozenset()

A factory returning ``(model, loss_fn)`` trains with its ``loss_fn``, and
``--loss`` beside it is refused (:func:`resolve_loss`).  :mod:`mlcomp.frontend.joint`
re-exports everything here.
"""
from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from mlcomp.base.errors import MlcompError
from mlcomp.base.quiet import quiet_torch

__all__ = ["LossKind", "TrainingError", "check_trainable", "example_target", "loss_function", "model_output",
           "resolve_loss", "without_dropout"]


class TrainingError(MlcompError):
    """A model, loss or optimizer cannot be used for a training step."""


class LossKind(enum.Enum):
    CROSS_ENTROPY = "cross_entropy"
    MSE = "mse"
    MODEL = "model"     # the model's forward already returns the scalar loss

    @classmethod
    def parse(cls, value: str | LossKind) -> LossKind:
        if isinstance(value, LossKind):
            return value
        try:
            return cls(str(value).strip().lower().replace("-", "_"))
        except ValueError:
            raise TrainingError(f"there is no loss named {value!r}",
                                hint="use cross_entropy, mse, model (the forward returns the loss) "
                                     "or pass a callable loss_fn(output, target)") from None


def loss_function(loss: str | LossKind | Callable[..., torch.Tensor] | None) -> Callable[..., Any] | None:
    """The callable ``loss(output, target)`` (``None`` when the model returns its own loss)."""
    if callable(loss) and not isinstance(loss, (str, LossKind)):
        return loss
    kind = LossKind.parse(loss or LossKind.CROSS_ENTROPY)
    return {LossKind.CROSS_ENTROPY: F.cross_entropy, LossKind.MSE: F.mse_loss, LossKind.MODEL: None}[kind]


def resolve_loss(source: Any, loss: str | LossKind | Callable[..., Any] | None,
                 option: str = "loss") -> str | LossKind | Callable[..., Any]:
    """The loss of a training step: ``loss`` if given, else the factory's ``loss_fn``
    (``file.py:fn`` returning ``(model, loss_fn)``), else cross_entropy.  Both given is an
    error: a factory that names its loss and a loss on the command line disagree."""
    own = getattr(source, "loss_fn", None)
    if own is None:
        return LossKind.CROSS_ENTROPY if loss is None else loss
    if loss is not None:
        given = loss.value if isinstance(loss, LossKind) else getattr(loss, "__name__", str(loss))
        raise TrainingError(f"{source.path or source.name} returns its own loss function "
                            f"({getattr(own, '__name__', type(own).__name__)}) and {option} {given} was given too; "
                            "mlcomp does not pick one", where=source.path or source.name,
                            hint=f"drop {option} to train with the factory's loss, or return only the model "
                                 f"(or (model, example_inputs)) from the factory to use {option}")
    return own


def model_output(value: Any) -> Any:
    """The tensor a loss reads from a model's output (first element of a tuple or ``ModelOutput``)."""
    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, (tuple, list)) and value:
        return model_output(value[0])
    if hasattr(value, "to_tuple"):   # transformers' ModelOutput
        return model_output(value.to_tuple())
    return value


def example_target(model: nn.Module, inputs: Sequence[torch.Tensor],
                   loss: str | LossKind | Callable[..., Any] | None, seed: int = 2) -> torch.Tensor | None:
    """A random target fitting ``model``'s output: class indices for cross_entropy, values for mse."""
    if loss_function(loss) is None:
        return None
    saved = {k: v.detach().clone() for k, v in model.named_buffers()}
    with torch.no_grad(), quiet_torch():
        out = model_output(model(*inputs))
        for k, v in model.named_buffers():
            v.copy_(saved[k])
    gen = torch.Generator().manual_seed(seed)
    if not isinstance(out, torch.Tensor) or not out.is_floating_point() or out.dim() == 0:
        return None   # check_trainable explains what is wrong with this output
    if loss_function(loss) is F.cross_entropy:
        return torch.randint(0, out.shape[-1], out.shape[:-1], generator=gen).to(out.device)
    return torch.randn(out.shape, generator=gen, dtype=out.dtype).to(out.device)


def without_dropout(module: nn.Module) -> nn.Module:
    """Set every dropout probability in ``module`` to 0 (in place); returns it."""
    for m in module.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            m.p = 0.0
        for attr in ("dropout", "attention_dropout", "hidden_dropout_prob", "attention_probs_dropout_prob"):
            if isinstance(getattr(m, attr, None), float):
                setattr(m, attr, 0.0)
    return module


def check_trainable(model: nn.Module, inputs: Sequence[torch.Tensor], target: torch.Tensor | None,
                    loss_fn: Callable[..., Any] | None, name: str) -> frozenset[str]:
    """Raise :class:`TrainingError` for a model/loss pair that cannot make a training step; else the
    names of trainable parameters the loss does not reach (an unused pooler): eager autograd leaves
    their ``.grad`` None and optimizers skip them, so the joint graph treats them as frozen."""
    if not any(p.requires_grad and p.is_floating_point() for p in model.parameters()):
        raise TrainingError(f"{name} has no parameters that require grad, so a training step has nothing "
                            "to update", where=name,
                            hint="unfreeze some parameters (p.requires_grad_(True)) or compile for inference")
    saved = {k: v.detach().clone() for k, v in model.named_buffers()}   # the check must not move BN stats
    try:
        return _reached(model, inputs, target, loss_fn, name)
    finally:
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(saved[k])


def _reached(model: nn.Module, inputs: Sequence[torch.Tensor], target: torch.Tensor | None,
             loss_fn: Callable[..., Any] | None, name: str) -> frozenset[str]:
    with quiet_torch(), torch.enable_grad():
        try:
            out = model_output(model(*inputs))
        except Exception as exc:  # noqa: BLE001 - a user model failing on its inputs
            raise TrainingError(f"{name} fails on the example inputs: {type(exc).__name__}: {exc}",
                                where=name, hint="check the example inputs' shapes") from None
    if not isinstance(out, torch.Tensor):
        raise TrainingError(f"{name} returns a {type(out).__name__}, not a tensor a loss can read", where=name,
                            hint="return a tensor (or a tuple whose first element is the logits/loss)")
    if not out.is_floating_point():
        raise TrainingError(f"{name} returns an integer tensor ({out.dtype}), which has no gradient",
                            where=name, hint="return the float logits and apply argmax outside the model")
    if loss_fn is None:
        loss = out
        what = "the model's output (loss='model')"
    else:
        if target is None:
            raise TrainingError(f"loss for {name} needs a target tensor", hint="pass the target as `y`")
        try:
            loss = loss_fn(out, target)
        except Exception as exc:  # noqa: BLE001
            raise TrainingError(f"the loss fails on {name}'s output {tuple(out.shape)} and target "
                                f"{tuple(target.shape)}: {type(exc).__name__}: {exc}", where=name,
                                hint="cross_entropy wants integer class indices of shape (batch,); "
                                     "mse wants a target shaped like the output") from None
        what = "the loss"
    if not isinstance(loss, torch.Tensor) or loss.dim() != 0 or not loss.is_floating_point():
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise TrainingError(f"{what} of {name} is not a scalar (shape {shape}); backward needs one number",
                            where=name, hint="reduce it (mean or sum), e.g. reduction='mean'")
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.is_floating_point()]
    if not loss.requires_grad:
        raise TrainingError(f"{what} of {name} does not depend on any parameter that requires grad", where=name,
                            hint="check that the loss is computed from the model's output, not a detached copy")
    grads = torch.autograd.grad(loss, [p for _, p in trainable], allow_unused=True)
    return frozenset(n for (n, _), g in zip(trainable, grads) if g is None)
