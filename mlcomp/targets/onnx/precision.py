"""Low-precision ONNX on ONNX Runtime: keep in fp32 the nodes ORT has no bf16/fp16 kernel for.

A mixed-precision graph exports to ONNX with its casts as ``Cast`` nodes and its
weights as bf16/fp16 initializers.  ORT's CPU execution provider has few
low-precision kernels (ORT 1.23: no bf16 ``Gemm``, ``MatMul``, ``Relu``,
``Softmax``; fp16 ones are silently wrapped in casts by ORT itself), and a
session on such a model fails with ``NOT_IMPLEMENTED``.  Instead of a hand-kept
list, :class:`KernelTable` asks ORT's own kernel registry
(``onnxruntime.capi._pybind_state.get_all_opkernel_def``) whether the provider
registers a kernel for the op, its opset and the dtype bound to each type
constraint (from the op's ONNX schema); ops without an ONNX schema (contrib
domains) are probed with a one-node session.  Answers are cached per
(domain, op, opset, dtypes).

:func:`keep_unsupported_fp32` rewrites each node without a kernel to run in fp32::

    before:  Y(bf16) = Gemm(A(bf16), W(bf16 initializer), B(bf16 initializer))
    after:   A_f32 = Cast(A, to=FLOAT)                    # or A's fp32 source when A = Cast(x, to=BFLOAT16)
             Y_f32 = Gemm(A_f32, W_f32, B_f32)            # W_f32, B_f32: fp32 initializers made once
             Y(bf16) = Cast(Y_f32, to=BFLOAT16)           # dropped when nothing reads it

Consecutive fp32 nodes read each other's fp32 values directly (no cast round
trip), casts nobody reads and initializers nobody reads are removed.  Every
kept node is reported (:class:`KeptFp32`) so the artifact can say what did not
run in low precision.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

__all__ = ["LOW_PRECISION", "KeptFp32", "KernelTable", "keep_unsupported_fp32", "summarize"]

# onnx.TensorProto element types → the dtype names of mlcomp.ir.dtypes
LOW_PRECISION = {10: "f16", 16: "bf16"}       # FLOAT16, BFLOAT16
_FLOAT = 1
_TENSOR_TYPE = {10: "tensor(float16)", 16: "tensor(bfloat16)"}


@dataclass(frozen=True)
class KeptFp32:
    """One ONNX node the provider cannot run in low precision, run in fp32 instead."""

    node: str
    op_type: str
    dtype: str
    reason: str

    def to_json(self) -> dict[str, str]:
        return {"node": self.node, "op": self.op_type, "dtype": self.dtype, "reason": self.reason}


class KernelTable:
    """Which ops an ORT execution provider runs in a low-precision dtype, asked of ORT and cached."""

    def __init__(self, provider: str = "CPUExecutionProvider") -> None:
        self.provider = provider
        self._defs: dict[tuple[str, str], list[tuple[int, int, dict[str, list[str]]]]] | None = None
        self._cache: dict[tuple[Any, ...], str | None] = {}

    def _kernels(self) -> dict[tuple[str, str], list[tuple[int, int, dict[str, list[str]]]]]:
        if self._defs is None:
            from onnxruntime.capi import _pybind_state

            defs: dict[tuple[str, str], list[tuple[int, int, dict[str, list[str]]]]] = {}
            for k in _pybind_state.get_all_opkernel_def():
                if k.provider == self.provider:
                    lo, hi = k.version_range
                    defs.setdefault((k.domain, k.op_name), []).append((lo, hi, dict(k.type_constraints)))
            self._defs = defs
        return self._defs

    def reason(self, node: Any, opset: int, types: dict[str, int]) -> str | None:
        """Why the provider cannot run ``node`` with these tensor types (``None``: it can)."""
        low = {name: t for name, t in types.items() if t in LOW_PRECISION}
        if not low:
            return None
        schema = _schema(node.op_type, opset, node.domain)
        if schema is None:
            key = (node.domain, node.op_type, opset, tuple(sorted(types.items())), "probe")
            if key not in self._cache:
                self._cache[key] = _probe_session(node, opset, types, self.provider)
            return self._cache[key]
        bound: dict[str, int] = {}
        for formals, actuals in ((schema.inputs, node.input), (schema.outputs, node.output)):
            for i, name in enumerate(actuals):
                if name in low and formals:
                    formal = formals[min(i, len(formals) - 1)]
                    bound[formal.type_str] = low[name]
        key = (node.domain, node.op_type, opset, tuple(sorted(bound.items())))
        if key not in self._cache:
            self._cache[key] = self._lookup(node.domain, node.op_type, opset, bound)
        return self._cache[key]

    def _lookup(self, domain: str, op_type: str, opset: int, bound: dict[str, int]) -> str | None:
        candidates = [c for lo, hi, c in self._kernels().get((domain, op_type), []) if lo <= opset <= hi]
        wanted = ", ".join(f"{LOW_PRECISION[t]} for {name}" for name, t in sorted(bound.items()))
        if not candidates:
            return f"ORT's {self.provider} has no {op_type} kernel for opset {opset}"
        for constraints in candidates:
            if all(_TENSOR_TYPE[t] in constraints.get(name, [_TENSOR_TYPE[t]]) for name, t in bound.items()):
                return None
        return f"ORT's {self.provider} registers no {op_type}(opset {opset}) kernel with {wanted}"


def _schema(op_type: str, opset: int, domain: str) -> Any:
    import onnx

    try:
        return onnx.defs.get_schema(op_type, opset, domain)
    except onnx.defs.SchemaError:
        return None


def _probe_session(node: Any, opset: int, types: dict[str, int], provider: str) -> str | None:
    """Build a one-node model with ``node``'s types and attributes; the session says if it runs."""
    import onnxruntime as ort
    from onnx import helper

    inputs = [helper.make_tensor_value_info(n, types[n], None) for n in node.input if n in types]
    outputs = [helper.make_tensor_value_info(n, types[n], None) for n in node.output if n in types]
    imports = [helper.make_opsetid(node.domain, opset)]
    if node.domain:
        imports.append(helper.make_opsetid("", 18))
    model = helper.make_model(helper.make_graph([node], "probe", inputs, outputs), opset_imports=imports)
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    so.log_severity_level = 4
    try:
        ort.InferenceSession(model.SerializeToString(), so, providers=[provider])
    except Exception as exc:  # noqa: BLE001 - the answer is the message
        lines = [ln for ln in str(exc).splitlines() if ln.strip()]
        return f"a one-node {node.op_type} session fails on {provider}: {lines[0] if lines else type(exc).__name__}"
    return None


def _types(model: Any) -> dict[str, int]:
    import onnx

    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    out = {t.name: t.data_type for t in g.initializer}
    for vi in list(g.input) + list(g.value_info) + list(g.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            out[vi.name] = vi.type.tensor_type.elem_type
    return out


def _opset(model: Any, domain: str) -> int:
    for imp in model.opset_import:
        if imp.domain == domain or (domain in ("", "ai.onnx") and imp.domain in ("", "ai.onnx")):
            return imp.version
    return 1


def keep_unsupported_fp32(model: Any, kernels: KernelTable) -> tuple[Any, list[KeptFp32]]:
    """A copy of ``model`` whose nodes without a low-precision kernel run in fp32; one pass, O(nodes)."""
    import onnx
    from onnx import helper, numpy_helper

    types = _types(model)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    inits = {t.name: t for t in g.initializer}
    f32_of: dict[str, str] = {}      # low-precision value -> the fp32 value it was rounded from / computes
    kept: list[KeptFp32] = []
    nodes: list[Any] = []
    for node in g.node:
        if node.op_type == "Cast" and node.domain in ("", "ai.onnx") and types.get(node.output[0]) in LOW_PRECISION \
                and types.get(node.input[0]) == _FLOAT:
            f32_of[node.output[0]] = node.input[0]
        io = {n: types[n] for n in list(node.input) + list(node.output) if n and n in types}
        reason = None
        # only nodes that read a low-precision tensor can be widened by casting their inputs; nodes
        # that make one from attributes (Constant, ConstantOfShape) or hold subgraphs are left as they are
        if any(types.get(n) in LOW_PRECISION for n in node.input) \
                and not any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS) for a in node.attribute) \
                and not any(a.name in ("to", "dtype") for a in node.attribute):
            reason = kernels.reason(node, _opset(out, node.domain), io)
        if reason is None:
            nodes.append(node)
            continue
        low = next(t for t in io.values() if t in LOW_PRECISION)
        kept.append(KeptFp32(node.name or node.output[0], node.op_type, LOW_PRECISION[low], reason))
        for i, name in enumerate(node.input):
            if types.get(name) not in LOW_PRECISION:
                continue
            if name not in f32_of:
                wide = f"{name}__f32"
                if name in inits:
                    array = numpy_helper.to_array(inits[name]).astype("float32")
                    g.initializer.append(numpy_helper.from_array(array, wide))
                else:
                    nodes.append(helper.make_node("Cast", [name], [wide], to=_FLOAT, name=f"{wide}_cast"))
                f32_of[name] = wide
            node.input[i] = f32_of[name]
        narrow = []
        for i, name in enumerate(node.output):
            if types.get(name) in LOW_PRECISION:
                wide = f"{name}__f32"
                node.output[i] = wide
                narrow.append(helper.make_node("Cast", [wide], [name], to=types[name], name=f"{name}_narrow"))
                f32_of[name] = wide
        nodes.append(node)
        nodes.extend(narrow)
    _replace_nodes(g, _drop_dead(nodes, {o.name for o in g.output}))
    used = {n for node in g.node for n in node.input} | {o.name for o in g.output}
    keep = [t for t in g.initializer if t.name in used]
    del g.initializer[:]
    g.initializer.extend(keep)
    return out, kept


def _drop_dead(nodes: list[Any], outputs: set[str]) -> list[Any]:
    """Remove Cast nodes nobody reads (last to first, so chains go too)."""
    readers = Counter(n for node in nodes for n in node.input)
    alive = []
    for node in reversed(nodes):
        if node.op_type == "Cast" and not any(readers[o] or o in outputs for o in node.output):
            for n in node.input:
                readers[n] -= 1
            continue
        alive.append(node)
    return alive[::-1]


def _replace_nodes(graph: Any, nodes: list[Any]) -> None:
    copies = []
    for node in nodes:
        c = type(node)()
        c.CopyFrom(node)
        copies.append(c)
    del graph.node[:]
    graph.node.extend(copies)


def summarize(kept: list[KeptFp32]) -> dict[str, Any]:
    """``{"kept_fp32": n, "by_op": {op: count}, "nodes": [...]}`` for manifests and reports."""
    by_op = Counter(k.op_type for k in kept)
    return {"kept_fp32": len(kept), "by_op": dict(sorted(by_op.items())), "nodes": [k.to_json() for k in kept]}
