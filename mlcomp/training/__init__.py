"""Compiled training steps: their own compile path and artifact, above the targets they reuse.

* ``step`` — :func:`compile_training` and :class:`TrainingArtifact` (generated torch code + an optimizer);
* ``check`` — comparing a compiled step with eager (gradients, steps);
* ``loss_scaling`` — loss-scale specs and the running scaler (the seed rewrite is the ``loss-scale`` pass).

Optimizer specs are :mod:`mlcomp.runtime.optim` (distributed ranks step them too).
"""
from __future__ import annotations

from mlcomp.training.step import TrainingArtifact, compile_training

__all__ = ["TrainingArtifact", "compile_training"]
