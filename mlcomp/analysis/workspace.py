"""Scratch memory a kernel allocates and frees inside one call, measured per node.

Liveness (:mod:`mlcomp.analysis.liveness`) counts the tensors a graph's values
hold.  Some kernels also allocate scratch that lives only during their own call
and that no value of the graph shows: CPU convolution unfolds its input into
im2col columns (the weight gradient of LeNet's first convolution at batch 32
takes 1.6 MB of columns for a 2 KB result), oneDNN reorders weights and
activations into blocked layouts.  An allocator-level measurement sees them, so
a prediction that is to agree with it has to count them at that step::

    graph lenet_step                                 step bytes, liveness only   with workspace
      %convolution_backward = aten.convolution_backward(...)        848 KB          2.49 MB
      ...                                                          peak 2.05 MB    peak 2.49 MB

    ws = op_workspaces(graph)                    # {'convolution_backward': 1642600, ...}
    liveness(graph, workspace=ws).peak_bytes

:func:`op_workspaces` runs each node whose op is in :data:`WORKSPACE_OPS` once,
alone, on seeded random inputs of its input metas, under the allocator's events
(:class:`~mlcomp.hardware.peak_memory.PeakMemory`, ``MemorySource.ALLOCATOR`` on
CPU, the caching allocator's peak on CUDA), after one unmeasured warm-up call;
the workspace is the call's peak above its own outputs.  Nodes with the same op,
input metas and literal arguments share one measurement (``cache``, owned by the
caller), so a graph costs one call per distinct convolution shape, O(n) lookups.
The list comes from running every zoo model's training step under the same
events op by op: the ops above hold scratch (convolution up to 9.4 MB at
resnet18 b32, batch-norm backward 1 MB, CPU flash attention backward 4.3 MB);
every other op allocated exactly its outputs, so it is not run.
"""
from __future__ import annotations

from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from mlcomp.analysis.liveness import value_bytes
from mlcomp.hardware.peak_memory import MemorySource, PeakMemory
from mlcomp.ir import Graph, Node, Ref, TensorMeta, map_refs
from mlcomp.ir.ops import Namespace

__all__ = ["WORKSPACE_OPS", "op_workspaces", "workspace_key"]

# ATen ops (any overload) whose kernels allocate scratch beyond their outputs
WORKSPACE_OPS = frozenset({"convolution", "convolution_backward", "_convolution", "mkldnn_convolution",
                           "_slow_conv2d_forward", "_slow_conv2d_backward", "native_batch_norm_backward",
                           "_scaled_dot_product_flash_attention_for_cpu",
                           "_scaled_dot_product_flash_attention_for_cpu_backward"})


def workspace_key(graph: Graph, node: Node) -> tuple[Any, ...]:
    """What a kernel's scratch depends on: the op, its input metas and its literal arguments."""
    def meta(r: Ref) -> str:          # a value by its meta, not its name
        return str(graph.node(r.name).meta)

    attrs = sorted(map_refs(dict(node.attrs), meta).items())
    return (str(node.op), repr(map_refs(node.inputs, meta)), repr(attrs))


def _tensor(meta: TensorMeta, symbols: Mapping[str, int], gen: torch.Generator, device: str) -> torch.Tensor:
    shape = meta.concrete_shape(symbols)
    if meta.dtype.is_floating_point:
        return torch.randn(shape, generator=gen).to(meta.dtype).to(device)
    return torch.zeros(shape, dtype=meta.dtype, device=device)


def _measure(graph: Graph, node: Node, device: str) -> int:
    gen = torch.Generator().manual_seed(0)
    values: dict[str, Any] = {}
    for s in node.input_names():
        meta = graph.node(s).meta
        values[s] = _tensor(meta, graph.symbols, gen, device) if isinstance(meta, TensorMeta) else meta
    fn = node.op.resolve()
    args = map_refs(node.inputs, lambda r: values[r.name])
    kwargs = map_refs(dict(node.attrs), lambda r: values[r.name])
    with torch.no_grad():
        out = fn(*args, **kwargs)       # warm-up: first-call allocations (kernel caches) are not scratch
        del out
        with PeakMemory(device, source=MemorySource.ALLOCATOR) as mem:
            out = fn(*args, **kwargs)
        del out
    assert mem.reading is not None
    return max(0, mem.reading.growth - value_bytes(graph, node))


def op_workspaces(graph: Graph, *, device: str = "cpu",
                  cache: MutableMapping[tuple[Any, ...], int] | None = None) -> dict[str, int]:
    """Node → scratch bytes its kernel holds during its call (nodes without scratch are left out)."""
    memo: MutableMapping[tuple[Any, ...], int] = {} if cache is None else cache
    out: dict[str, int] = {}
    for node in graph.call_nodes():
        if node.op.namespace is not Namespace.ATEN or node.op.name not in WORKSPACE_OPS:
            continue
        key = workspace_key(graph, node) + (device,)
        if key not in memo:
            memo[key] = _measure(graph, node, device)
        if memo[key]:
            out[node.name] = memo[key]
    return out
