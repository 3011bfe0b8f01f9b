"""Compiled training steps: their own compile path and artifact, above the targets they reuse.

* ``step`` — :func:`compile_training` and :class:`TrainingArtifact` (generated torch code + an optimizer);
* ``check`` — comparing a compiled step with eager (gradients, steps);
* ``optim`` — optimizer specs (``sgd{lr=0.05 momentum=0.9}``);
* ``loss_scaling`` — loss-scale specs, the backward-seed rewrite and the running scaler.
"""
from __future__ import annotations

from mlcomp.training.step import TrainingArtifact, compile_training

__all__ = ["TrainingArtifact", "compile_training"]
