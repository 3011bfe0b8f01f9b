"""Training-mode randomness a static training step cannot hold, refused before capture.

A compiled training step is one graph run for every batch.  Random numbers *inside*
that graph (dropout masks) are drawn afresh on each run, as in eager.  Two kinds of
training-time randomness are not tensors in the graph, and a capture would keep one
draw for every step:

- **random structure**: the forward decides in Python, from a random number, whether
  to run a layer (LayerDrop: ``if torch.rand([]) < layerdrop: skip``);
- **random constants**: the forward draws a mask with NumPy or ``random`` (SpecAugment's
  time and feature masks), which the trace records as a constant tensor.

Both are switched by configuration attributes of ``transformers`` models, listed in
:data:`RANDOM_IN_TRAINING` (attribute, what it does, the attribute that must also be
on); :func:`check_static_training` raises :class:`~mlcomp.frontend.losses.TrainingError`
naming each one that is on, with the assignment that turns it off::

    >>> from types import SimpleNamespace
    >>> m = nn.Linear(2, 2)
    >>> m.config = SimpleNamespace(layerdrop=0.1)
    >>> try:
    ...     check_static_training(m, "Encoder")
    ... except TrainingError as err:
    ...     print(err.hint)
    set model.config.layerdrop = 0.0 to compile the training step without it (or compile with randomness='off', \
which does so for the compile only), or train Encoder eagerly

Asked for (``randomness="off"``: :func:`randomness_off`), the step is instead captured and
verified with those settings at 0 -- the same step as with ``model.config.layerdrop = 0.0``,
without the user having to change the model: the settings are restored when the compile ends,
and the step says which it left out (``verification["randomness_off"]``)::

    >>> with randomness_off(m, "Encoder") as off:
    ...     m.config.layerdrop, off
    (0.0, ['config.layerdrop=0.1 skips whole layers at random, decided in Python (LayerDrop)'])
    >>> m.config.layerdrop
    0.1
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

from torch import nn

from mlcomp.base.errors import OptionError
from mlcomp.frontend.losses import TrainingError

__all__ = ["RANDOMNESS", "RANDOM_IN_TRAINING", "check_static_training", "random_settings", "randomness_off"]

RANDOMNESS = ("refuse", "off")      # what a training compile does with the settings below

# config attribute -> (what it does in training mode, the switch it needs on ("" = none))
RANDOM_IN_TRAINING: dict[str, tuple[str, str]] = {
    "layerdrop": ("skips whole layers at random, decided in Python (LayerDrop)", ""),
    "encoder_layerdrop": ("skips whole encoder layers at random, decided in Python (LayerDrop)", ""),
    "decoder_layerdrop": ("skips whole decoder layers at random, decided in Python (LayerDrop)", ""),
    "mask_time_prob": ("masks random time steps drawn with NumPy (SpecAugment)", "apply_spec_augment"),
    "mask_feature_prob": ("masks random feature channels drawn with NumPy (SpecAugment)", "apply_spec_augment"),
}


def _settings_on(model: nn.Module) -> list[tuple[Any, str, float, str]]:
    """``(config, attribute, value, what it does)`` for each setting of :data:`RANDOM_IN_TRAINING` that is
    on in a ``config`` of ``model`` or of one of its submodules (each config read once)."""
    seen: set[int] = set()
    found: list[tuple[Any, str, float, str]] = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or id(config) in seen:
            continue
        seen.add(id(config))
        for attr, (what, switch) in RANDOM_IN_TRAINING.items():
            value = getattr(config, attr, None)
            if isinstance(value, (int, float)) and value > 0 and (not switch or getattr(config, switch, False)):
                found.append((config, attr, value, what))
    return found


def random_settings(model: nn.Module) -> list[tuple[str, float, str]]:
    """``(attribute, value, what it does)`` for each setting of :data:`RANDOM_IN_TRAINING` that is on."""
    found: dict[str, tuple[str, float, str]] = {}
    for _, attr, value, what in _settings_on(model):
        found.setdefault(attr, (attr, float(value), what))
    return list(found.values())


@contextlib.contextmanager
def randomness_off(model: nn.Module, name: str, randomness: str = "off") -> Iterator[list[str]]:
    """Inside, the settings of :data:`RANDOM_IN_TRAINING` are 0 on ``model``'s configs (``randomness="off"``),
    restored on the way out; yields what was switched off.  ``"refuse"``: nothing is changed and a model
    with such a setting on is refused (:func:`check_static_training`)."""
    if randomness not in RANDOMNESS:
        raise OptionError(f"randomness={randomness!r} is not one of {', '.join(RANDOMNESS)}",
                          hint="randomness='off' trains without LayerDrop/SpecAugment; 'refuse' (default) refuses "
                               "a model that has them on")
    if randomness == "refuse":
        check_static_training(model, name)
        yield []
        return
    found = _settings_on(model)
    notes = [f"config.{attr}={value:g} {what}" for attr, value, what in random_settings(model)]
    try:
        for config, attr, _, _ in found:
            setattr(config, attr, 0.0)
        yield notes
    finally:
        for config, attr, value, _ in found:
            setattr(config, attr, value)


def check_static_training(model: nn.Module, name: str) -> None:
    """Raise :class:`TrainingError` if ``model`` in training mode draws randomness a static step would freeze."""
    settings = random_settings(model)
    if not settings:
        return
    listed = "; ".join(f"config.{attr}={value:g} {what}" for attr, value, what in settings)
    fix = " and ".join(f"model.config.{attr} = 0.0" for attr, _, _ in settings)
    raise TrainingError(
        f"{name} in training mode {listed}. A compiled training step is one static graph, so it would repeat "
        "the same draw on every step instead of a new one, and its gradients would not be eager's",
        where=name, hint=f"set {fix} to compile the training step without it (or compile with randomness='off', "
                         f"which does so for the compile only), or train {name} eagerly")
