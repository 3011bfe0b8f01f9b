"""Which targets can run a training step: capabilities checked before anything is captured or built."""
from __future__ import annotations

import dataclasses
from typing import Any

from mlcomp.base.errors import TargetUnavailableError, UnsupportedOpError
from mlcomp.ir import Mode
from mlcomp.targets.base import TARGETS, get_target, target_name
from mlcomp.targets.capabilities import Capabilities

__all__ = ["TrainingCapabilityError", "check_training_target", "training_capabilities", "training_targets"]


class TrainingCapabilityError(UnsupportedOpError):
    """The chosen target cannot run training graphs."""


def training_capabilities(target: Any) -> Capabilities | None:
    """The target's capabilities when they include training graphs (cpu, cuda: ``TORCH_CPU`` /
    ``TORCH_CUDA`` in :mod:`mlcomp.targets.capabilities`); ``None``: it cannot train."""
    caps = getattr(target, "capabilities", None)
    if caps is None or Mode.TRAINING not in caps.modes:
        return None
    return dataclasses.replace(caps, multi_device=False, placement_devices=None)  # the step ignores placement


def training_targets() -> list[str]:
    """Names of the registered targets whose capabilities include training graphs."""
    return [n for n in TARGETS.names() if training_capabilities(get_target(n)) is not None]


def check_training_target(name: str) -> Any:
    """The target object for ``name``; :class:`TrainingCapabilityError` if it cannot train (checked
    before anything is captured or written)."""
    target = get_target(target_name(name))
    if training_capabilities(target) is None:
        caps = getattr(target, "capabilities", None)
        declared = f" (it declares: {caps.describe()})" if caps is not None else ""
        raise TrainingCapabilityError(
            f"target {target.name} cannot compile training graphs: it compiles inference graphs only, "
            f"with no backward pass or parameter update{declared}",
            hint=f"compile with --train for one of: {', '.join(training_targets())}; then export the trained "
                 f"weights and compile for {target.name} without --train")
    reason = target.available()
    if reason:
        raise TargetUnavailableError(f"target {target.name} is not available: {reason}",
                                     hint="see `mlcomp targets` for the targets this machine can use")
    return target
