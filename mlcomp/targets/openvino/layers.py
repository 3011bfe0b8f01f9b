"""The layers OpenVINO's CPU plugin runs, by kind: the one classification of its executed graph.

``compiled.get_runtime_model()`` has one op per layer the plugin runs; its ``rt_info`` gives the
``layerType``, the ``runtimePrecision`` and ``originalLayersNames`` (the converted ops fused into it).
A ``Subgraph`` is a snippet the plugin tokenized: either a chain of element-wise ops or, where it holds
a softmax, a whole attention (``Q·Kᵀ``, softmax, ``P·V`` as one kernel: the plugin tokenizes softmax
only into attention subgraphs).  :func:`layer_kind` names the second ``Attention``, so every reader
(int8 counts, executed-graph diffs, the anchors' kernel goal) counts an attention as a compute kernel
and only the first as element-wise::

    >>> layer_kind({"layerType": "Subgraph", "originalLayersNames": "Multiply_7,Add_9,Softmax_10,sdpa"})
    'Attention'
    >>> layer_kind({"layerType": "Subgraph", "originalLayersNames": "add_1/aten.add.Tensor/Add"})
    'Subgraph'
    >>> [family(k) for k in ("Attention", "Subgraph", "Transpose", "Reshape", "Softmax")]
    ['compute', 'element-wise', 'layout', 'view', None]

``rt_info`` values are OpenVINO ``OVAny`` objects (``.astype(str)``) or plain strings (the doctest).
"""
from __future__ import annotations

from collections.abc import Iterator
from typing import Any

__all__ = ["ATTENTION", "COMPUTE_LAYERS", "INT8_PRECISIONS", "NOT_KERNELS", "layer_kind", "family",
           "executed_layers"]

ATTENTION = "Attention"       # a Subgraph the plugin tokenized from a whole attention
INT8_PRECISIONS = frozenset({"u8", "i8"})
# entries of the runtime model that are no kernels
NOT_KERNELS = frozenset({"Const", "Input", "Output", "Parameter", "Result"})
# the layer types that multiply: the ones int8 is for
COMPUTE_LAYERS = frozenset({"Convolution", "GroupConvolution", "Deconvolution", "FullyConnected", "MatMul", ATTENTION})
# kernel families: element-wise snippets, data movement, views the plugin runs in place; None: its own kind
_FAMILY = {**dict.fromkeys(COMPUTE_LAYERS, "compute"),
           **dict.fromkeys(("Eltwise", "Subgraph"), "element-wise"),
           **dict.fromkeys(("Reorder", "Transpose", "StridedSlice", "Split", "Concatenation", "Gather",
                            "GatherElements", "Broadcast"), "layout"),
           **dict.fromkeys(("Reshape", "Squeeze", "Unsqueeze"), "view")}


def _text(value: Any) -> str:
    return value if isinstance(value, str) else value.astype(str)


def layer_kind(info: Any) -> str:
    """The kind of one executed layer from its ``rt_info``: its ``layerType``, ``Attention`` for a softmax Subgraph."""
    kind = _text(info["layerType"])
    if kind == "Subgraph" and "Softmax" in _text(info["originalLayersNames"]):
        return ATTENTION
    return kind


def family(kind: str) -> str | None:
    """``compute``, ``element-wise``, ``layout`` or ``view`` for a layer kind; ``None`` for any other kind."""
    return _FAMILY.get(kind)


def executed_layers(compiled: Any) -> Iterator[tuple[str, str]]:
    """``(kind, runtime precision)`` of each kernel an OpenVINO ``CompiledModel`` runs (constants and I/O left out)."""
    for op in compiled.get_runtime_model().get_ops():
        info = op.get_rt_info()
        kind = layer_kind(info)
        if kind not in NOT_KERNELS:
            yield kind, _text(info["runtimePrecision"])
