"""IR graph → ONNX ``ModelProto`` by mlcomp itself: the ``onnxruntime`` target's export.

torch.onnx translates through onnxscript's torchlib, whose import is slow, and the
export builds an ``ExportedProgram`` by fake-tensor propagation, translates it and runs
onnxscript's optimizer.  The IR already knows every shape and dtype, so :func:`emit_model`
writes the ONNX nodes straight from it with ``onnx.helper``, one table entry per IR op
(:data:`RULES`: ``onnx.emit_ops``, ``onnx.emit_shapes``, ``onnx.emit_nn``)::

    before (IR, mlp after -O2)                               after (ONNX)
      %permute = aten.permute.default(%0.weight, [1, 0])       initializer 0.weight [256, 512]
      %addmm = aten.addmm.default(%0.bias, %input, %permute)   addmm = Gemm(input, 0.weight, 0.bias), transB=1
      %relu = aten.relu.default(%addmm)                        relu = Relu(addmm)
      return (%addmm_2,)                                       output addmm_2

Values keep the IR's names (inputs as :func:`~mlcomp.runtime.codegen.to_fx` names its
placeholders, which is what torch.onnx called them), parameters become initializers under their
IR names, literal shapes and scalars become initializers named after the node that reads
them.  Nodes no graph output needs (a ``permute`` folded into ``Gemm``) are dropped.  Where the
emitter does not match ATen exactly it declines with a reason instead of emitting: an op
outside the table, a symbolic size it cannot compute (``onnx.emit_sizes``), an argument a rule does
not cover (a ``ceil_mode`` pool).  bf16/fp16 values are written in their own precision like any other
dtype (bf16 constants as ``ml_dtypes.bfloat16``); which of those nodes ONNX Runtime runs in fp32 is
``onnx.precision``'s choice, made on the emitted model.  The caller then
exports as before.  One pass over the nodes: O(n).
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

import numpy as np
import torch

from mlcomp.ir import Graph, Mode, Node, Ref, TensorMeta
from mlcomp.ir.dtypes import dtype_name, onnx_elem_type
from mlcomp.ir.ops import GETITEM, INPUT, OUTPUT, PARAM, Namespace, Op
from mlcomp.runtime.codegen import attribute_name
from mlcomp.targets.onnx.emit_nn import NN_RULES
from mlcomp.targets.onnx.emit_ops import OPS_RULES, Decline
from mlcomp.targets.onnx.emit_shapes import SHAPE_RULES
from mlcomp.targets.onnx.emit_sizes import SIZE_RULES, dim_params, size_args

__all__ = ["MIN_OPSET", "RULES", "Decline", "Emitted", "Emitter", "as_numpy", "emit_model", "emittable"]

MIN_OPSET = 18          # ReduceMean/ReduceMax take their axes as an input from 18 on
IR_VERSION = 10         # what onnxruntime ≥ 1.18 reads; opset 20 needs ≥ 9
RULES = {**OPS_RULES, **SHAPE_RULES, **NN_RULES, **SIZE_RULES}     # IR op -> rule(emitter, node, bound arguments)


@dataclass(frozen=True)
class Emitted:
    """The emitted model, or why the emitter declined (``model is None``)."""

    model: Any = None          # onnx.ModelProto
    declined: str | None = None


def as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """``tensor`` as a numpy array ONNX's ``numpy_helper`` writes; bf16, which numpy lacks, as
    ``ml_dtypes.bfloat16`` (the bits unchanged)::

        >>> as_numpy(torch.tensor([1.5], dtype=torch.bfloat16)).dtype.name
        'bfloat16'
    """
    tensor = tensor.detach().cpu()
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.contiguous().view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def emittable(op: Op) -> bool:
    """Whether the emitter's table has a rule for ``op`` (a node may still be declined for its arguments)."""
    return op in RULES or op == GETITEM


class Emitter:
    """What the rules write into: ONNX nodes, initializers and the IR value → ONNX name map."""

    def __init__(self, graph: Graph, opset: int) -> None:
        import onnx
        from onnx import helper, numpy_helper

        self.onnx, self.helper, self.numpy_helper = onnx, helper, numpy_helper
        self.graph, self.opset = graph, opset
        self.nodes: list[Any] = []
        self.inits: dict[str, Any] = {}
        self.names: dict[str, str] = {}           # IR value -> ONNX value
        self.taken: set[str] = set()
        self._consts: dict[tuple[Any, ...], str] = {}
        self._casts: dict[tuple[str, int], str] = {}
        self._items: dict[tuple[str, int], str] = {}  # (tuple producer, index) -> its getitem's name
        self.produced: dict[str, tuple[str, list[str], dict[str, Any]]] = {}   # value -> (op type, inputs, attrs)
        self._shapes: dict[str, tuple[int, ...]] = {}  # ONNX value -> static shape, where the IR gives one
        self._sizes: dict[str, str] = {}          # symbolic size expression -> its 1-element int64 tensor

    # -- names -------------------------------------------------------------------------------
    def fresh(self, hint: str) -> str:
        name, i = hint, 1
        while name in self.taken:
            name, i = f"{hint}_{i}", i + 1
        self.taken.add(name)
        return name

    def claim(self, ir_name: str) -> str:
        """The ONNX name of an IR value: its own name unless taken."""
        if ir_name not in self.names:
            self.names[ir_name] = self.fresh(ir_name)
            meta = self.graph.node(ir_name).meta if ir_name in self.graph else None
            if isinstance(meta, TensorMeta):
                self._shapes[self.names[ir_name]] = tuple(meta.shape)
        return self.names[ir_name]

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The static shape of an emitted ONNX value that is an IR value (``None`` for helpers)."""
        return self._shapes.get(name)

    def outs(self, node: Node, count: int, *, optional: bool = False) -> list[str]:
        """Output names of a tuple node: the getitem's name where one reads index i, else a fresh one
        (``optional``: ``""`` for an output nothing reads, trailing ones left off)."""
        names = [self.claim(self._items[(node.name, i)]) if (node.name, i) in self._items
                 else "" if optional else self.fresh(f"{node.name}/{i}") for i in range(count)]
        while optional and len(names) > 1 and not names[-1]:
            names.pop()
        return [n or self.fresh(f"{node.name}/{i}") if i == 0 else n for i, n in enumerate(names)]

    # -- values ------------------------------------------------------------------------------
    def node_of(self, ref: Ref) -> Node:
        return self.graph.node(ref.name)

    def meta(self, value: Any) -> TensorMeta:
        meta = self.graph.node(value.name).meta
        if not isinstance(meta, TensorMeta):
            raise Decline(f"%{value.name} is not a single tensor")
        return meta

    def constant(self, ref: Ref) -> torch.Tensor | None:
        """The tensor of a PARAM input, else ``None``."""
        node = self.node_of(ref)
        return self.graph.constants[node.name] if node.op == PARAM else None

    def value(self, v: Any, dtype: torch.dtype | None = None, hint: str = "scalar") -> str:
        """The ONNX name of ``v`` (a Ref, or a Python scalar made a constant), cast to ``dtype`` if given."""
        if v is None:
            return ""
        if not isinstance(v, Ref):
            if not isinstance(v, (bool, int, float)):
                raise Decline(f"argument {v!r} is neither a tensor nor a scalar")
            if dtype is None:
                raise Decline(f"scalar {v!r} has no dtype to take")
            return self.const(np.array(v), dtype, hint)
        node = self.node_of(v)
        if node.op == PARAM and v.name not in self.names:
            name = self.claim(v.name)
            self.inits[name] = self.numpy_helper.from_array(as_numpy(self.graph.constants[v.name]), name)
        name = self.names.get(v.name)
        if name is None:
            raise Decline(f"%{v.name} is read before it is computed")
        if dtype is not None and self.meta(v).dtype != dtype:
            return self.cast(name, dtype)
        return name

    def cast(self, name: str, dtype: torch.dtype) -> str:
        key = (name, onnx_elem_type(dtype))
        if key not in self._casts:
            self._casts[key] = self.add("Cast", [name], hint=f"{name}/{dtype_name(dtype)}", to=key[1])
        return self._casts[key]

    def const(self, array: Any, dtype: torch.dtype, hint: str) -> str:
        """An initializer holding ``array`` as ``dtype``; equal constants are one initializer."""
        data = as_numpy(torch.as_tensor(np.asarray(array)).to(dtype))
        key = (dtype, data.shape, data.tobytes())
        if key not in self._consts:
            name = self.fresh(hint)
            self.inits[name] = self.numpy_helper.from_array(data, name)
            self._consts[key] = name
        return self._consts[key]

    def ints(self, values: Any, hint: str) -> str:
        return self.const(np.asarray(list(values), dtype=np.int64), torch.int64, hint)

    def size_cache(self, expr: str, build: Any) -> str:
        """The tensor of the symbolic size ``expr``, built once (``build()``) per model."""
        if expr not in self._sizes:
            self._sizes[expr] = build()
        return self._sizes[expr]

    # -- nodes -------------------------------------------------------------------------------
    def add(self, op_type: str, inputs: list[str], *, out: str | None = None, hint: str | None = None,
            **attrs: Any) -> str:
        """One single-output ONNX node; its output is ``out`` (the IR value it computes) or a fresh name."""
        name = self.claim(out) if out is not None else self.fresh(hint or op_type.lower())
        self.nodes.append(self.helper.make_node(op_type, inputs, [name], name=f"node_{name}", **attrs))
        self.produced[name] = (op_type, list(inputs), attrs)
        return name

    def add_multi(self, op_type: str, inputs: list[str], outputs: list[str], **attrs: Any) -> list[str]:
        self.nodes.append(self.helper.make_node(op_type, inputs, outputs, name=f"node_{outputs[0]}", **attrs))
        return outputs

    def alias(self, node: Node, source: str) -> None:
        """``node``'s value is ``source`` (no ONNX node: a later reader uses ``source``)."""
        self.names[node.name] = source

    def source_of(self, name: str, op_type: str) -> tuple[list[str], dict[str, Any]] | None:
        """``(inputs, attrs)`` of the ONNX node of type ``op_type`` that computed ``name``, else ``None``."""
        made = self.produced.get(name)
        return (made[1], made[2]) if made is not None and made[0] == op_type else None


def _check(graph: Graph, opset: int) -> str | None:
    """Why the emitter cannot take ``graph`` as a whole, or ``None``."""
    if graph.mode is not Mode.INFERENCE:
        return "the graph is a training graph"
    if opset < MIN_OPSET:
        return f"opset {opset} is below {MIN_OPSET}, the emitter's lowest"
    missing: dict[str, None] = {}
    for node in graph.nodes():
        if node.op not in (INPUT, PARAM, OUTPUT) and not emittable(node.op):
            missing.setdefault(str(node.op), None)
    if missing:
        return "no emitter rule for " + ", ".join(sorted(missing))
    return None


def emit_model(graph: Graph, opset: int = 20) -> Emitted:
    """``graph`` as an ONNX model at ``opset``, or why not (see the module docstring)."""
    reason = _check(graph, opset)
    if reason is not None:
        return Emitted(declined=reason)
    em = Emitter(graph, opset)
    try:
        return Emitted(model=_emit(em, graph))
    except Decline as exc:
        return Emitted(declined=str(exc))
    except Exception as exc:  # noqa: BLE001 - a rule's own bug: torch.onnx exports instead, the record says why
        return Emitted(declined=f"the emitter failed ({type(exc).__name__}: {exc})")


def _emit(em: Emitter, graph: Graph) -> Any:
    helper = em.helper
    inputs = []
    taken: set[str] = set()
    for node in graph.input_nodes:            # to_fx's placeholder names: what torch.onnx called them
        name = attribute_name(node.name, taken)
        em.taken.add(name)
        em.names[node.name] = name
        meta = node.tensor_meta
        em._shapes[name] = tuple(meta.shape)
        inputs.append(helper.make_tensor_value_info(name, onnx_elem_type(meta.dtype), dim_params(meta.shape)))
    for node in graph.nodes(GETITEM):
        producer, index = node.inputs
        em._items.setdefault((producer.name, index), node.name)
    for node in graph.nodes():
        if node.op in (INPUT, PARAM, OUTPUT):
            continue
        if node.op == GETITEM:
            producer, index = node.inputs
            key = (producer.name, index)
            if em._items[key] != node.name:          # a second getitem of the same element
                em.alias(node, em.names[em._items[key]])
            elif node.name not in em.names:
                raise Decline(f"%{node.name} reads element {index} of %{producer.name}, which is not emitted")
            continue
        rule = RULES[node.op]
        try:
            rule(em, node, size_args(node) if node.op.namespace is Namespace.OPERATOR else bind(node))
        except Decline as exc:
            raise Decline(f"%{node.name} ({node.op}): {exc}") from None
        if isinstance(node.meta, TensorMeta) and node.name not in em.names:
            raise Decline(f"%{node.name} ({node.op}): the rule wrote no value")
    outputs, out_names = [], []
    renames: dict[str, str] = {}
    for ref in graph.output_refs:
        if not isinstance(ref, Ref):
            raise Decline(f"the graph returns a literal ({ref!r})")
        name = em.value(ref)
        if name in out_names or name in renames or name in em.inits or any(i.name == name for i in inputs):
            name = em.add("Identity", [name], hint=f"{ref.name}/out")
        elif name != ref.name and name in em.produced and ref.name not in em.taken:
            renames[name] = name = ref.name      # an alias (a no-op view): the output keeps the IR's name
        meta = em.meta(ref)
        out_names.append(name)
        outputs.append(helper.make_tensor_value_info(name, onnx_elem_type(meta.dtype), dim_params(meta.shape)))
    _rename(em.nodes, renames)
    nodes, inits = _live(em.nodes, em.inits, out_names)
    body = helper.make_graph(nodes, graph.name or "main_graph", inputs, outputs, initializer=inits)
    domains = sorted({n.domain for n in nodes if n.domain})        # ORT's contrib ops: com.microsoft, version 1
    return helper.make_model(body, opset_imports=[helper.make_opsetid("", em.opset)]
                             + [helper.make_opsetid(d, 1) for d in domains],
                             producer_name="mlcomp", ir_version=IR_VERSION)


def _rename(nodes: list[Any], renames: dict[str, str]) -> None:
    """Rename values in place (inputs and outputs of every node): O(nodes) once, for output aliases."""
    if not renames:
        return
    for node in nodes:
        for field in (node.input, node.output):
            for i, value in enumerate(field):
                if value in renames:
                    field[i] = renames[value]


def _live(nodes: list[Any], inits: dict[str, Any], outputs: list[str]) -> tuple[list[Any], list[Any]]:
    """The nodes and initializers some output needs, in emission order (one backward sweep)."""
    needed = set(outputs)
    keep = []
    for node in reversed(nodes):
        if any(o in needed for o in node.output):
            keep.append(node)
            needed.update(i for i in node.input if i)
    return keep[::-1], [t for name, t in inits.items() if name in needed]


@lru_cache(maxsize=None)
def _schema(op: Op) -> Any:
    return op.resolve()._schema


def bind(node: Node) -> dict[str, Any]:
    """The node's arguments by schema name, defaults filled in (``aten.add.Tensor(x, 1)`` → self, other, alpha)."""
    declared = getattr(node.op.impl, "arguments", None) if node.op.is_composite else None
    if declared is not None:                  # a composite that names its arguments (mlcomp.ir.quant)
        return {**dict(zip(declared, node.inputs)), **node.attrs}
    if node.op.namespace is not Namespace.ATEN:
        raise Decline(f"{node.op} is not an ATen op")
    schema = _schema(node.op)
    out: dict[str, Any] = {}
    positional = list(node.inputs)
    for arg in schema.arguments:
        if positional and not arg.kwarg_only:
            out[arg.name] = positional.pop(0)
        elif arg.name in node.attrs:
            out[arg.name] = node.attrs[arg.name]
        elif arg.has_default_value():
            out[arg.name] = arg.default_value
        else:
            raise Decline(f"argument {arg.name} is missing")
    unknown = set(node.attrs) - {a.name for a in schema.arguments}
    if positional or unknown:
        raise Decline("arguments do not match the op's schema")
    return out
