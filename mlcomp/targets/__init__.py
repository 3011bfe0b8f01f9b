"""mlcomp targets: lower an IR graph to something that runs, save it, load it back.

    >>> from mlcomp.targets import get_target, available_targets, CompileOptions
    >>> available_targets()
    {'cpu': None, 'cuda': 'no CUDA device (torch.cuda.is_available() is False)', ...}
    >>> art = get_target("cpu").compile(graph, CompileOptions())
    >>> art.save("out/model"); Artifact.load("out/model")

Target modules (``cpu``, ``cuda``, ``onnxruntime``, ``tvm``) are imported only
when asked for, and import their heavy backends lazily inside functions.
"""
from __future__ import annotations

from mlcomp.targets.artifact import Artifact, TensorSpec
from mlcomp.targets.base import CompileOptions, Fallback, Target, TargetName, available_targets, get_target

__all__ = ["Artifact", "TensorSpec", "CompileOptions", "Fallback", "Target", "TargetName",
           "available_targets", "get_target"]
