"""int8 on OpenVINO: ``quantize``'s pairs as the ops its PyTorch frontend turns into ``FakeQuantize``.

OpenVINO's FX decoder translates PyTorch's decomposed quantization ops
(``quantized_decomposed.quantize_per_tensor`` and friends, what PT2E writes) into
``FakeQuantize`` layers; the CPU plugin's low-precision transformations then move
the convolutions and matrix products between them to u8 activations × i8 weights.
:func:`qdq_for_frontend` rewrites the generated FX module's
``mlcomp.quantize_linear``/``mlcomp.dequantize_linear`` calls into those ops::

    input_q  = quantize_linear(input, input_scale, input_zero, 1)           # 0-d scale: per tensor
    input_dq = dequantize_linear(input_q, input_scale, input_zero, 1)
    w_dq     = dequantize_linear(w_int8, w_scale, w_zero, 0)                # int8 constant, per channel
    b_dq     = dequantize_linear(b_int32, b_scale, b_zero, 0)               # int32 bias
  becomes
    input_q  = quantize_per_tensor(input, 0.0123, 17, 0, 255, torch.uint8)
    input_dq = dequantize_per_tensor(input_q, 0.0123, 17, 0, 255, torch.uint8)
    w_dq     = dequantize_per_channel(quantize_per_channel(w_f32, w_scale, w_zero, 0, -128, 127, torch.int8), ...)
    b_dq     = b_f32                                                        # folded: float bias

A weight goes over as its dequantized float values with a quantize/dequantize pair
(the frontend types a dequantize of an int8 constant as int8); quantizing those
values again gives back the same integers, so nothing changes numerically.  An int32
bias is folded into a float constant: the plugin adds it after the integer product.

:func:`int8_layers` reads what ran from the plugin's executed graph
(``compiled.get_runtime_model()``): each compute layer's kind (:func:`~mlcomp.targets.openvino.layers.layer_kind`:
an attention the plugin fused into one ``Subgraph`` is ``Attention``) and ``runtimePrecision``.
"""
from __future__ import annotations

from collections import Counter
from typing import Any

import torch
from torch import fx

from mlcomp.ir.quant import QUANT_RANGES, dequantize_linear, quantize_linear
from mlcomp.targets.base import TargetCompileError
from mlcomp.targets.int8 import Int8Record
from mlcomp.targets.openvino.layers import COMPUTE_LAYERS, INT8_PRECISIONS, executed_layers

__all__ = ["qdq_for_frontend", "int8_layers"]


def _qd() -> Any:
    import torch.ao.quantization.fx._decomposed  # noqa: F401 - registers torch.ops.quantized_decomposed

    return torch.ops.quantized_decomposed


def _constant(module: fx.GraphModule, node: Any) -> torch.Tensor | None:
    return getattr(module, node.target) if isinstance(node, fx.Node) and node.op == "get_attr" else None


def _set_constant(module: fx.GraphModule, before: fx.Node, name: str, value: torch.Tensor) -> fx.Node:
    module.register_buffer(name, value)
    with module.graph.inserting_before(before):
        return module.graph.get_attr(name)


class _Rewriter:
    """Rewrites one module's pairs; per-channel zero points become one int64 constant per scale."""

    def __init__(self, module: fx.GraphModule) -> None:
        self.module, self.graph, self.qd = module, module.graph, _qd()
        self.zeros: dict[str, fx.Node] = {}
        self.grids: dict[fx.Node, tuple[torch.Tensor, torch.Tensor]] = {}   # quantize call -> its scale, zero

    def node(self, node: fx.Node) -> None:
        """One quantize/dequantize call as the frontend's ops (see the module docstring)."""
        src, scale, zero, axis = (list(node.args) + [1])[:4]
        s, z = _constant(self.module, scale), _constant(self.module, zero)
        if s is None or z is None:
            raise TargetCompileError(
                f"{node.name}: the scale and zero point of a quantize/dequantize pair must be constants for "
                f"OpenVINO's FakeQuantize", where=f"node {node.name}",
                hint="quantize writes them as constants; compile the graph quantize wrote, unedited")
        const = _constant(self.module, src)
        if node.target is dequantize_linear and const is not None:
            folded = _set_constant(self.module, node, f"{node.name}_f32", dequantize_linear(const, s, z, axis))
            if z.dtype == torch.int32:            # bias: added in float after the integer product
                node.replace_all_uses_with(folded)
                self.graph.erase_node(node)
                return
            with self.graph.inserting_before(node):
                src = self.graph.call_function(*self.call(True, folded, scale, z, s, axis))
        if node.target is quantize_linear:
            self.grids[node] = (s, z)
        elif src in self.grids and not _same_grid(self.grids[src], (s, z)):
            self.regrid(node, self.grids[src], (s, z))
            return
        node.target, node.args = self.call(node.target is quantize_linear, src, scale, z, s, axis)
        node.kwargs = {}

    def regrid(self, node: fx.Node, written: tuple[torch.Tensor, torch.Tensor],
               read: tuple[torch.Tensor, torch.Tensor]) -> None:
        """A dequantize on another grid than its quantize's: the frontend's dequantize takes the quantize's
        scale and zero point, so the change of grid follows it as float arithmetic on the dequantized value:
        ``(q − z₂)·s₂ = ((q − z₁)·s₁)·(s₂/s₁) + (z₁ − z₂)·s₂``."""
        (s1, z1), (s2, z2) = written, read
        if s1.dim() or s2.dim():
            raise TargetCompileError(
                f"{node.name}: a per-channel dequantize reads values quantized on another grid, which OpenVINO's "
                f"FakeQuantize cannot express", where=f"node {node.name}",
                hint="compile the graph quantize wrote, unedited, or use --target onnxruntime")
        src = node.args[0]
        node.target, node.args = self.call(False, src, node.args[1], z1, s1, 1)
        node.kwargs = {}
        with self.graph.inserting_after(node):
            out = self.graph.call_function(torch.ops.aten.mul.Tensor, (node, float(s2) / float(s1)))
        last = out
        if int(z1) != int(z2):
            with self.graph.inserting_after(out):
                last = self.graph.call_function(torch.ops.aten.add.Tensor, (out, (int(z1) - int(z2)) * float(s2)))
        node.replace_all_uses_with(last, delete_user_cb=lambda user: user is not out)

    def call(self, quantize: bool, src: Any, scale: fx.Node, z: torch.Tensor, s: torch.Tensor,
             axis: int) -> tuple[Any, tuple[Any, ...]]:
        """``(op, args)`` of the per-tensor (0-d scale: plain numbers) or per-channel form."""
        lo, hi = QUANT_RANGES[z.dtype]
        qd = self.qd
        if s.dim() == 0:
            op = qd.quantize_per_tensor if quantize else qd.dequantize_per_tensor
            return op.default, (src, float(s), int(z), lo, hi, z.dtype)
        op = qd.quantize_per_channel if quantize else qd.dequantize_per_channel
        return op.default, (src, scale, self.zero_points(scale, z), axis, lo, hi, z.dtype)

    def zero_points(self, scale: fx.Node, z: torch.Tensor) -> fx.Node:
        """``z`` as int64 (what the decomposed per-channel ops take), one constant per scale."""
        if scale.name not in self.zeros:
            name = f"{scale.target}_zp64"
            self.module.register_buffer(name, z.to(torch.int64))
            with self.graph.inserting_after(scale):
                self.zeros[scale.name] = self.graph.get_attr(name)
        return self.zeros[scale.name]


def _same_grid(a: tuple[torch.Tensor, torch.Tensor], b: tuple[torch.Tensor, torch.Tensor]) -> bool:
    return a[0].shape == b[0].shape and torch.equal(a[0], b[0]) and torch.equal(a[1].to(torch.int64),
                                                                             b[1].to(torch.int64))


def qdq_for_frontend(module: fx.GraphModule) -> fx.GraphModule:
    """``module`` with every quantize/dequantize call rewritten for OpenVINO (in place; returned); O(n)."""
    calls = [n for n in module.graph.nodes
             if n.op == "call_function" and n.target in (quantize_linear, dequantize_linear)]
    if not calls:
        return module
    rewriter = _Rewriter(module)
    for node in calls:
        rewriter.node(node)
    module.graph.eliminate_dead_code()
    module.graph.lint()
    module.recompile()
    return module


def int8_layers(compiled: Any) -> Int8Record:
    """The compute layers the CPU plugin runs in u8/i8 and in float, by layer kind (its executed graph)."""
    int8: Counter = Counter()
    floating: Counter = Counter()
    for kind, precision in executed_layers(compiled):
        if kind in COMPUTE_LAYERS:
            (int8 if precision in INT8_PRECISIONS else floating)[kind] += 1
    return Int8Record("openvino runtime model", dict(sorted(int8.items())), dict(sorted(floating.items())))
