"""IR module → ONNX without re-tracing it: the ``onnxruntime`` target's fast export path.

``torch.onnx.export(module, inputs, dynamo=True)`` builds onnxscript's whole
torchlib registry (~1000 functions whose source it parses), runs
``torch.export`` on a module that already is core ATen, and decomposes it
again.  :func:`export_model` instead builds the ``ExportedProgram`` straight
from the generated module (placeholders for buffers and inputs, ``meta["val"]``
from fake-tensor propagation, no tracing), registers only the torchlib
functions its ops need, and hands it to torch.onnx's translation step::

    torch.onnx.export(dynamo=True)                         export_model(gm, inputs)
      from_torchlib()            ~1000 functions parsed      registry of the graph's ~15 ops
      torch.export(gm)           trace the whole module      ExportedProgram from gm's nodes
      run_decompositions         trace it again              only ops torchlib lacks, per node
      type promotion, translate, optimize                    same
    resnet18 (ONNX nodes)        48                          48, same ops and value names
    record                       -                           ExportRecord("direct")

The ``onnxruntime`` target first tries mlcomp's own emitter (:mod:`mlcomp.targets.onnx.emit`,
``ExportRecord("mlcomp")``), which needs neither; this path runs where the emitter declines.

The private torch.onnx names it uses are pinned in :data:`mlcomp.targets.onnx.torchlib.PINNED`;
when one is missing or the direct path raises, :func:`export_model` runs the public
exporter and the record says why.  Which ops torchlib translates, and the registry of only
the graph's ops, are :mod:`mlcomp.targets.onnx.torchlib`.
"""
from __future__ import annotations

import importlib
import operator
from dataclasses import dataclass
from typing import Any

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.export import graph_signature as sig
from torch.export.exported_program import ModuleCallEntry, ModuleCallSignature
from torch.fx.experimental.proxy_tensor import make_fx
from torch.fx.experimental.symbolic_shapes import (
    DimDynamic,
    ShapeEnv,
    StatelessSymbolicContext,
)
from torch.fx.passes.fake_tensor_prop import FakeTensorProp
from torch.utils import _pytree as pytree

from mlcomp.targets.onnx.torchlib import Translatable, graph_registry, missing_private_api, pinned, translatable

__all__ = ["MLCOMP", "DIRECT", "PUBLIC", "ExportRecord", "direct_program", "export_model"]

MLCOMP, DIRECT, PUBLIC = "mlcomp", "direct", "torch.onnx"
DEFAULT_OPSET = 20      # torch.onnx.export's default (torch.onnx._constants.ONNX_DEFAULT_OPSET)


@dataclass(frozen=True)
class ExportRecord:
    """Which exporter produced the model: ``"mlcomp"`` (:mod:`mlcomp.targets.onnx.emit`), ``"direct"`` or
    ``"torch.onnx"``; why torch.onnx ran (``reason``) and why the emitter declined (``declined``)."""

    path: str
    reason: str | None = None
    declined: str | None = None

    def to_stats(self) -> dict[str, Any]:
        out: dict[str, Any] = {"onnx_export": self.path}
        if self.reason:
            out["onnx_export_reason"] = self.reason
        if self.declined:
            out["onnx_emitter_declined"] = self.declined
        return out

    def line(self) -> str:
        if self.path == MLCOMP:
            return "ONNX export: mlcomp's emitter (ONNX nodes written from the IR, no torch.onnx)"
        why = f"; mlcomp's emitter declined: {self.declined}" if self.declined else ""
        if self.path == DIRECT:
            return f"ONNX export: direct (ExportedProgram built from the IR, registry of its ops only){why}"
        return f"ONNX export: torch.onnx.export(dynamo=True), because {self.reason}{why}"


def _fake_input(mode: Any, tensor: torch.Tensor, dynamic: dict[int, Any] | None) -> torch.Tensor:
    if not dynamic:
        return mode.from_tensor(tensor, static_shapes=True)
    dims = [DimDynamic.DYNAMIC if i in dynamic else DimDynamic.STATIC for i in range(tensor.dim())]
    context = StatelessSymbolicContext(dynamic_sizes=dims, constraint_sizes=[None] * tensor.dim())
    return mode.from_tensor(tensor, symbolic_context=context)


def direct_program(gm: torch.nn.Module, inputs: tuple[torch.Tensor, ...],
                   dynamic_shapes: tuple[dict[int, Any], ...] | None = None,
                   opset: int = DEFAULT_OPSET) -> torch.export.ExportedProgram:
    """The ``ExportedProgram`` torch.onnx would translate for a module of ATen calls (``torch.export``,
    then the decompositions torchlib needs), built without tracing the module: buffers/parameters lifted
    to placeholders, fake-tensor metas propagated, nodes named as the trace would name them."""
    params, buffers = dict(gm.named_parameters()), dict(gm.named_buffers())
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    specs: list[Any] = []
    lifted: dict[str, fx.Node] = {}
    for attr in list(params) + list(buffers):
        kind = sig.InputKind.PARAMETER if attr in params else sig.InputKind.BUFFER
        ph = graph.placeholder(("p_" if attr in params else "b_") + attr.replace(".", "_").lower())
        lifted[attr] = ph
        specs.append(sig.InputSpec(kind, sig.TensorArgument(ph.name), attr,
                                   persistent=None if attr in params else True))
    for node in gm.graph.nodes:
        if node.op == "placeholder":
            env[node] = graph.placeholder(node.target)
            env[node].name = node.target      # the argument's name, as torch.export calls it (``input``)
            specs.append(sig.InputSpec(sig.InputKind.USER_INPUT, sig.TensorArgument(env[node].name), None))
        elif node.op == "get_attr":
            env[node] = lifted[node.target]
        elif node.op in ("call_function", "output"):
            for value in pytree.tree_leaves((node.args, node.kwargs)):
                if isinstance(value, torch.Tensor):
                    raise TypeError(f"{node.name} has a tensor literal argument (torch.export would lift it)")
            env[node] = graph.node_copy(node, env.__getitem__)
        else:
            raise ValueError(f"unexpected FX node {node.op} {node.target}")
    root = torch.nn.Module()
    for attr, value in params.items():
        root.register_parameter(attr, value)
    for attr, value in buffers.items():
        root.register_buffer(attr, value)
    program_gm = fx.GraphModule(root, graph)

    mode = FakeTensorMode(shape_env=ShapeEnv(specialize_zero_one=False), allow_non_fake_inputs=False)
    dyn = dynamic_shapes or (None,) * len(inputs)
    fakes = [mode.from_tensor(t, static_shapes=True) for t in list(params.values()) + list(buffers.values())]
    fakes += [_fake_input(mode, t, d) for t, d in zip(inputs, dyn)]
    with mode:
        FakeTensorProp(program_gm, mode).propagate_dont_convert_inputs(*fakes)
    missing = [n for n in graph.nodes if n.op == "call_function" and n.target is not operator.getitem
               and (not translatable(n.target, opset) or _implicit(n.target))]
    if missing:   # torch.export / torch.onnx decompose these first: so do we, node by node
        _decompose(program_gm, missing, opset, mode)
    program_gm = fx.GraphModule(root, _traced_names(graph))
    outputs = list(next(n for n in reversed(program_gm.graph.nodes) if n.op == "output").args[0])
    out_specs = [sig.OutputSpec(sig.OutputKind.USER_OUTPUT, sig.TensorArgument(o.name), None) for o in outputs]
    shape_env = mode.shape_env
    ranges = {sym: shape_env.var_to_range[sym] for sym in shape_env.var_to_range}
    in_spec = pytree.tree_flatten((tuple(inputs), {}))[1]
    out_spec = pytree.tree_flatten(tuple(outputs))[1]
    call_graph = [ModuleCallEntry("", ModuleCallSignature(inputs=[], outputs=[], in_spec=in_spec,
                                                          out_spec=out_spec))]
    return torch.export.ExportedProgram(root=program_gm, graph=program_gm.graph,
                                        graph_signature=sig.ExportGraphSignature(specs, out_specs),
                                        state_dict={**params, **buffers}, range_constraints=ranges,
                                        module_call_graph=call_graph, example_inputs=(tuple(inputs), {}))


def _traced_names(graph: fx.Graph) -> fx.Graph:
    """A copy of ``graph`` whose nodes are named as a trace names them, so the ONNX value names are
    torch.onnx's: an ATen call after its op (``addmm_1``, ``_to_copy``), and a multi-output op followed
    at once by one ``getitem`` per output (unused ones are dropped again, their names stay taken)."""
    out = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    items: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "placeholder":
            env[node] = out.placeholder(node.target)
            env[node].name = node.name
            env[node].meta = dict(node.meta)
        elif node.op == "call_function" and node.target is operator.getitem and node.args[0] in items:
            env[node] = items[node.args[0]][node.args[1]]
        elif node.op == "call_function":
            name = node.target.overloadpacket.__name__ if isinstance(node.target, torch._ops.OpOverload) \
                else None
            env[node] = out.create_node("call_function", node.target, fx.map_arg(node.args, env.__getitem__),
                                        fx.map_arg(node.kwargs, env.__getitem__), name=name)
            env[node].meta = dict(node.meta)
            val = node.meta.get("val")
            if isinstance(val, (tuple, list)) and node.target is not operator.getitem:
                items[node] = [out.call_function(operator.getitem, (env[node], i)) for i in range(len(val))]
                for i, item in enumerate(items[node]):
                    item.meta["val"] = val[i]
        else:
            env[node] = out.node_copy(node, env.__getitem__)
    for made in items.values():
        for item in made:
            if not item.users:
                out.erase_node(item)
    return out


def _implicit(target: Any) -> bool:
    """A view op torch.export's functionalisation decomposes on its own (a CompositeImplicitAutograd kernel
    returning an alias: ``reshape`` → ``view``); other such ops (``gru.input``) it keeps."""
    return isinstance(target, torch._ops.OpOverload) and \
        any(r.alias_info is not None for r in target._schema.returns) and \
        torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "CompositeImplicitAutograd")


def _decompose(gm: fx.GraphModule, nodes: list[fx.Node], opset: int, mode: Any) -> None:
    """Replace each of ``nodes`` (ops torchlib lacks) by its decomposition, in place, as torch.onnx's
    ``run_decompositions`` would (same table: torch's minus what torchlib translates), traced per node."""
    table = pinned("torch.onnx._internal.exporter._decomp",
                    "create_onnx_friendly_decomposition_table")(Translatable(opset))
    for node in nodes:
        if node.target not in table and not _implicit(node.target):
            raise ValueError(f"torch has no decomposition of {node.target}")
        flat, spec = pytree.tree_flatten((node.args, node.kwargs))
        slots = [i for i, a in enumerate(flat) if isinstance(a, fx.Node)]
        vals = [flat[i].meta["val"] for i in slots]

        def call(*values: Any, _node: fx.Node = node, _flat: list = flat, _spec: Any = spec,
                 _slots: list = slots) -> Any:
            filled = list(_flat)
            for i, v in zip(_slots, values):
                filled[i] = v
            args, kwargs = pytree.tree_unflatten(filled, _spec)
            return _node.target(*args, **kwargs)
        with mode:
            sub = make_fx(call, decomposition_table=table, tracing_mode="real")(*vals)
        for sn in sub.graph.nodes:      # a size the trace did not follow would be baked into the graph
            if any(isinstance(v, torch.SymInt) for v in pytree.tree_leaves((sn.args, sn.kwargs))):
                raise ValueError(f"the decomposition of {node.target} reads a symbolic size it does not trace")
        result = _inline(gm, node, sub, [flat[i] for i in slots])
        if not isinstance(result, fx.Node):
            raise TypeError(f"the decomposition of {node.target} returns {type(result).__name__}")
        node.replace_all_uses_with(result)
        gm.graph.erase_node(node)
    gm.recompile()


def _inline(gm: fx.GraphModule, node: fx.Node, sub: fx.GraphModule, args: list[fx.Node]) -> Any:
    """Copy ``sub``'s nodes before ``node`` (its placeholders read ``args``); what its output returns."""
    env: dict[fx.Node, Any] = {}
    ins = iter(args)
    result: Any = None
    with gm.graph.inserting_before(node):
        for sn in sub.graph.nodes:
            if sn.op == "placeholder":
                env[sn] = next(ins)
            elif sn.op == "output":
                result = fx.map_arg(sn.args[0], lambda a: env[a])
            elif sn.op == "call_function":
                env[sn] = gm.graph.node_copy(sn, lambda a: env[a])
            else:
                raise ValueError(f"the decomposition of {node.target} reads {sn.op} {sn.target}")
    return result


def _direct(gm: fx.GraphModule, inputs: tuple[torch.Tensor, ...], opset: int,
            dynamic_shapes: Any) -> Any:
    """The ONNX ``ModelProto`` by the direct path (raises where it cannot run)."""
    torchlib_opset = pinned("torch.onnx._internal.exporter._constants", "TORCHLIB_OPSET")
    registry_opset = max(opset, torchlib_opset)
    program = direct_program(gm, inputs, dynamic_shapes, registry_opset)
    gm_out = program.graph_module
    passes = importlib.import_module("torch.onnx._internal.exporter._fx_passes")
    with torch.fx.experimental._config.patch(backed_size_oblivious=True):  # as torch.onnx does
        passes.insert_type_promotion_nodes(gm_out)
        program._graph_module = passes.remove_assertion_nodes(gm_out)
    targets = {n.target for n in program.graph.nodes if n.op == "call_function"}
    registry = graph_registry(targets, registry_opset)
    to_onnx = pinned("torch.onnx._internal.exporter._core", "_exported_program_to_onnx_program")
    onnx_program = to_onnx(program, registry=registry)
    apis = pinned("torch.onnx._internal._lazy_import", "onnxscript_apis")
    onnx_program.model = apis.convert_version(onnx_program.model, opset)
    onnx_program.optimize()
    return onnx_program.model_proto


def _public(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], opset: int | None,
            dynamic_shapes: Any) -> Any:
    program = torch.onnx.export(module, inputs, dynamo=True, opset_version=opset,
                                dynamic_shapes=dynamic_shapes, verbose=False, optimize=True)
    return program.model_proto


def export_model(module: torch.nn.Module, inputs: tuple[torch.Tensor, ...], *, opset: int | None = None,
                 dynamic_shapes: Any = None, direct: bool = True) -> tuple[Any, ExportRecord]:
    """``(onnx.ModelProto, record)``: the direct path when it can run (a :func:`to_fx`-style
    ``GraphModule`` of ATen calls), else ``torch.onnx.export``.

    A failure of the public exporter propagates (the caller turns it into a user error).
    """
    reason = "it was asked for (direct=False)" if not direct else missing_private_api()
    if reason is None:
        try:
            return _direct(module, inputs, opset or DEFAULT_OPSET, dynamic_shapes), ExportRecord(DIRECT)
        except Exception as exc:  # noqa: BLE001 - any failure of the private path falls back, recorded
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            reason = f"the direct path failed ({type(exc).__name__}: {first})"
    return _public(module, inputs, opset, dynamic_shapes), ExportRecord(PUBLIC, reason)
