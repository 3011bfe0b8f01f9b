"""Capture: PyTorch model → mlcomp :class:`~mlcomp.ir.graph.Graph`.

Every source ends in the same IR at the level of core ATen (``convolution``,
``addmm``, ``_native_batch_norm_legit_no_training``, ``bmm``…):

* ``nn.Module`` + example inputs via ``torch.export`` (default): for inference
  one trace straight to core ATen (:mod:`mlcomp.frontend.one_trace`), else
  ``torch.export`` then ``run_decompositions()`` (``graph.capture_trace`` says which, and why);
* ``nn.Module`` via ``torch.fx.symbolic_trace`` (``method="fx"``), lowered to
  ATen with ``make_fx`` over ``functional_call`` so parameters keep their names;
* a TorchScript archive, converted to an ExportedProgram without running any
  Python code from the file;
* an ExportedProgram (``.pt2``), shapes taken from it.

The graph owns its constants: parameters and buffers are copied once at
capture, so a pass that rewrites weights in place never touches the user's
module (``graph.constants`` is copy-on-write between ``Graph.copy()`` siblings).

Data-dependent Python control flow is never specialised silently: capture
fails with :class:`CaptureError` naming the source line and suggesting
``torch.cond``.

The model runs eagerly only when tracing it fails, to tell a wrong input shape
(:class:`InputSpecError`) from a limit of export (or to initialise lazy modules).
"""
from __future__ import annotations

import enum
import itertools
import re
from typing import Any, Callable, Mapping, Sequence

import torch
from torch import nn
from torch.nn.parameter import is_lazy

from mlcomp.base.errors import CaptureError, InputSpecError
from mlcomp.base.quiet import quiet_torch
from mlcomp.frontend.cache_outputs import flat_caches
from mlcomp.frontend.decompose import Decomposition, DecompositionFailed, decompose
from mlcomp.frontend.dynamic import export_dims, name_symbols, note_symbol, parse_dynamic, widen_examples
from mlcomp.frontend.model_faults import (
    check_arguments,
    check_graph_mutation,
    check_no_mutation,
    check_outputs,
    check_signature,
    forward_location,
    parameter_names,
)
from mlcomp.frontend.one_trace import ONE_TRACE, one_trace_program
from mlcomp.frontend.provenance import (
    explain_export_failure,
    first_line,
    identifier,
    origin_of,
    output_names,
    user_frame,
)
from mlcomp.ir import Graph, Mode, Node, Origin, Ref, TensorMeta, dtype_name, map_refs
from mlcomp.ir.ops import INPUT, OUTPUT, Op


class CaptureMethod(enum.Enum):
    EXPORT = "export"
    FX = "fx"


def capture_module(module: nn.Module, example_inputs: Sequence[torch.Tensor], *,
                   method: CaptureMethod = CaptureMethod.EXPORT, dynamic: Any = None,
                   training: bool = False, name: str | None = None,
                   decompositions: Mapping[Any, Callable[..., Any]] | None = None) -> Graph:
    """Capture an ``nn.Module`` called on ``example_inputs`` (``decompositions``: see :func:`capture_exported`).

    ``dynamic``: which sizes stay symbolic (:func:`mlcomp.frontend.dynamic.parse_dynamic`: ``"batch,seq"``,
    ``"batch=1..64"``, ``True`` for the batch); the graph's symbols take the names given there.
    """
    example_inputs = tuple(example_inputs)
    name = name or type(module).__name__
    module = module.train(training)
    check_signature(module, name)
    check_arguments(module, example_inputs, name)
    if method is CaptureMethod.FX:
        return _capture_fx(module, example_inputs, name=name, training=training)
    dims = parse_dynamic(dynamic)
    example_inputs = widen_examples(dims, example_inputs)    # export fixes a size-1 dimension: traced at 2
    dynamic_shapes = export_dims(dims, example_inputs, name) if dims else None
    with flat_caches():     # a returned transformers cache flattens to its tensors (scoped registration)
        graph, trace = (None, "two traces: training") if training else \
            _one_trace(module, example_inputs, dynamic_shapes, name, decompositions)
        if graph is not None:
            return name_symbols(graph, dims)
        ep = _export(module, example_inputs, dynamic_shapes, name)
        if not training:
            check_outputs(ep.graph, module, name)
            check_no_mutation(ep, name)
        try:
            graph = capture_exported(ep, name=name, training=training, decompositions=decompositions)
            graph.capture_trace = trace
            return name_symbols(graph, dims)
        except CaptureError as first:
            if training or dims:
                raise
            # run_decompositions has gaps; tracing the exported module at the dispatcher level
            # decomposes the same ops another way
            flat = ep.module()
            names = {t.data_ptr(): n for n, t in list(flat.named_parameters()) + list(flat.named_buffers())}
            try:
                graph = capture_traced(flat, example_inputs, name=name, constant_names=names)
                graph.capture_trace = f"{trace}; lowered by a dispatcher-level trace"
                return graph
            except CaptureError:
                raise first from None


def _one_trace(module: nn.Module, inputs: tuple[torch.Tensor, ...], dynamic_shapes: Any, name: str,
               decompositions: Mapping[Any, Callable[..., Any]] | None) -> tuple[Graph | None, str]:
    """``(IR from one trace straight to core ATen, ONE_TRACE)``, or ``(None, why two traces must run)``."""
    ep, trace = one_trace_program(module, inputs, dynamic_shapes, decompositions)
    if ep is None:
        return None, trace
    check_outputs(ep.graph, module, name)
    try:
        graph = _graph_of(ep, Decomposition(), name=name, training=False)
    except CaptureError as exc:     # the two-trace path has a dispatcher-level fallback
        return None, f"two traces: {first_line(exc)}"
    graph.capture_trace = ONE_TRACE
    return graph, ONE_TRACE


def capture_exported(ep: "torch.export.ExportedProgram", *, name: str = "graph", training: bool = False,
                     decompositions: Mapping[Any, Callable[..., Any]] | None = None) -> Graph:
    """Convert an ExportedProgram (any dialect) to the IR at core-ATen level.

    ``decompositions`` (op overload → function) go over torch's default table. Ops whose
    decomposition fails stay undecomposed (:mod:`mlcomp.frontend.decompose`);
    ``graph.kept_ops`` says which and why.
    """
    with quiet_torch():
        try:
            ep, lowering = decompose(ep, decompositions)
        except DecompositionFailed as failed:
            exc = failed.cause
            frames = re.findall(r'File "([^"]+)", line (\d+), in \w+\n\s*(.+)', str(exc))
            where = f"{frames[-1][0]}:{frames[-1][1]} ({frames[-1][2].strip()})" if frames else None
            raise CaptureError(f"torch.export captured {name} but its program cannot be lowered to core "
                               f"ATen, even keeping every op kind undecomposed: {first_line(exc)}", where=where,
                               hint="this is a gap in torch's decompositions, not in your model; try "
                                    "--capture fx, or rewrite the line named (e.g. .view → .reshape)") from None
    return _graph_of(ep, lowering, name=name, training=training)


def _graph_of(ep: "torch.export.ExportedProgram", lowering: Decomposition, *, name: str, training: bool
              ) -> Graph:
    """The IR of a program at core ATen; its parameters and buffers keep their module paths."""
    sig, state = ep.graph_signature, dict(ep.state_dict)
    state.update(getattr(ep, "constants", {}) or {})
    constant_of: dict[str, str] = {}
    for spec in sig.input_specs:
        if spec.target is not None and spec.kind.name != "USER_INPUT":
            constant_of[spec.arg.name] = spec.target
    graph = from_fx(ep.graph_module.graph, name=name, training=training,
                    constant_of=constant_of, tensors=state)
    graph.kept_ops.update(lowering.kept)
    return graph


def _export(module: nn.Module, inputs: tuple[torch.Tensor, ...], dynamic_shapes: Any,
            name: str) -> "torch.export.ExportedProgram":
    """``torch.export`` of ``module``; the model runs eagerly only if that fails.

    The eager run tells an input mistake (:class:`InputSpecError`) from a limit of
    export, and initialises lazy modules (``nn.LazyLinear``), after which export is
    tried once more.  A model that exports never runs here: before, every capture
    paid one eager forward first (and, in training mode, updated BatchNorm's
    running statistics of the user's module).
    """
    lazy = any(is_lazy(t) for t in itertools.chain(module.parameters(), module.buffers()))
    for attempt in range(2):
        with quiet_torch():
            try:
                return torch.export.export(module, inputs, dynamic_shapes=dynamic_shapes)
            except Exception as exc:  # noqa: BLE001 - converted to a user error below
                failure = exc
        _check_runs(module, inputs, name)
        if attempt or not lazy:
            break
    raise explain_export_failure(failure, name) from None


def _check_runs(module: nn.Module, inputs: tuple[torch.Tensor, ...], name: str) -> None:
    """Run the model once eagerly so a shape mistake is reported as such, not as a capture failure."""
    try:
        with torch.no_grad(), quiet_torch():
            module(*inputs)
    except Exception as exc:  # noqa: BLE001 - any failure here is about the inputs or the model
        shapes = ", ".join(f"{'x'.join(map(str, t.shape))}:{dtype_name(t.dtype)}"
                           for t in inputs if isinstance(t, torch.Tensor))
        raise InputSpecError(
            f"{name} fails on example inputs of shape {shapes}: {type(exc).__name__}: {first_line(exc)}",
            where=user_frame(exc),
            hint="check --input-shape (one per model input, e.g. --input-shape 1x3x32x32:f32)") from None


def _capture_fx(module: nn.Module, inputs: tuple[torch.Tensor, ...], *, name: str, training: bool) -> Graph:
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    try:
        gm = torch.fx.symbolic_trace(module)
    except Exception as exc:  # noqa: BLE001
        _check_runs(module, inputs, name)
        raise CaptureError(
            f"torch.fx.symbolic_trace could not trace {name}: {first_line(exc)}",
            where=user_frame(exc),
            hint="data-dependent Python control flow cannot be traced symbolically; rewrite the branch "
                 "with torch.cond or torch.where, or use the default --capture export") from None
    params = dict(gm.named_parameters())
    params.update(dict(gm.named_buffers()))
    names = list(params)

    def fn(p: dict[str, torch.Tensor], *xs: torch.Tensor) -> Any:
        return torch.func.functional_call(gm, p, xs)

    failure = None
    with quiet_torch():
        try:
            traced = make_fx(fn, decomposition_table=core_aten_decompositions())(params, *inputs)
        except Exception as exc:  # noqa: BLE001
            failure = exc
    if failure is not None:
        _check_runs(module, inputs, name)
        raise explain_export_failure(failure, name) from None
    placeholders = [n for n in traced.graph.nodes if n.op == "placeholder"]
    constant_of = {ph.name: names[i] for i, ph in enumerate(placeholders[:len(names)])}
    if not training:
        check_outputs(traced.graph, module, name)
        users = placeholders[len(names):]
        owner = {p.name: f"input {n}" for p, n in zip(users, parameter_names(module, len(users)))}
        check_graph_mutation(traced.graph, {**{p: f"tensor {n}" for p, n in constant_of.items()}, **owner},
                             name, where=forward_location(module))
    return from_fx(traced.graph, name=name, training=training, constant_of=constant_of,
                    tensors=dict(params))


def capture_traced(fn: Any, inputs: tuple[torch.Tensor, ...], *, name: str,
                   constant_names: dict[int, str]) -> Graph:
    """Dispatcher-level trace of any callable (e.g. a ScriptModule) with ``make_fx``.

    Tensors the callable closes over become constants; ``constant_names`` maps a
    tensor's ``data_ptr()`` to its module path so they keep their names.
    """
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    with quiet_torch():
        try:
            traced = make_fx(lambda *xs: fn(*xs), decomposition_table=core_aten_decompositions())(*inputs)
        except Exception as exc:  # noqa: BLE001
            raise explain_export_failure(exc, name) from None
    return from_fx(traced.graph, name=name, training=False, constant_of={}, tensors={},
                    constant_names=constant_names)


# ---------------------------------------------------------------------------
# FX graph → IR


def from_fx(fx_graph: torch.fx.Graph, *, name: str, training: bool,
             constant_of: dict[str, str], tensors: dict[str, torch.Tensor],
             constant_names: dict[int, str] | None = None) -> Graph:
    graph = Graph(identifier(name), mode=Mode.TRAINING if training else Mode.INFERENCE)
    own = _OwnCopies()
    rename: dict[str, str] = {}
    unsupported: list[str] = []
    for fx_node in fx_graph.nodes:
        if fx_node.op == "placeholder":
            target = constant_of.get(fx_node.name)
            if target is not None:
                value = own(tensors[target])
                if training and value.is_floating_point():
                    value = value.requires_grad_(True) if value.is_leaf else value
                graph.add_constant(target, value, origin=Origin(target.rpartition(".")[0]))
                rename[fx_node.name] = target
            else:
                meta = _meta_of(fx_node, graph)
                graph.add(Node(fx_node.name, INPUT, meta=meta))
                rename[fx_node.name] = fx_node.name
            continue
        if fx_node.op == "get_attr":  # make_fx lifts tensor constants as attributes
            source = getattr(fx_graph.owning_module, fx_node.target)
            known = (constant_names or {}).get(source.data_ptr()) if source.numel() else None
            value = own(source)
            cname = graph.fresh_name(known or f"_const.{fx_node.target}")
            graph.add_constant(cname, value, origin=Origin(cname.rpartition(".")[0]) if known else None)
            rename[fx_node.name] = cname
            continue
        args = _convert_args(fx_node.args, rename)
        if fx_node.op == "output":
            graph.add(Node("output", OUTPUT, inputs=(tuple(_flatten_outputs(args)),)))
            continue
        if fx_node.op != "call_function":
            unsupported.append(f"{fx_node.op} {fx_node.target}")
            continue
        if fx_node.target is torch.ops.aten._assert_tensor_metadata.default:
            continue   # export's check of a value's dtype/shape, which the IR's metas already state
        target, fx_args = _normalise(fx_node.target, args)
        try:
            op = Op.from_torch(target)
        except KeyError as exc:
            unsupported.append(f"{exc.args[0]} (node {fx_node.name}, {origin_of(fx_node)})")
            continue
        args = fx_args
        kwargs = _convert_args(dict(fx_node.kwargs), rename)
        node_name = graph.fresh_name(fx_node.name)
        rename[fx_node.name] = node_name
        graph.add(Node(node_name, op, inputs=tuple(args), attrs=kwargs,
                       meta=_meta_of(fx_node, graph), origin=origin_of(fx_node)))
    if unsupported:
        raise CaptureError("the captured graph uses operations mlcomp's IR cannot represent: "
                           + "; ".join(unsupported),
                           hint="register a decomposition for them or keep them out of the compiled region")
    return graph


def _normalise(target: Any, args: list[Any] | tuple[Any, ...]) -> tuple[Any, Any]:
    """TorchScript's private spellings of core ops, rewritten to the core op (same value).

    A TorchScript archive traced at the dispatcher keeps ``aten._convolution``
    (input, weight, bias, stride, padding, dilation, transposed, output_padding,
    groups, benchmark, deterministic, cudnn_enabled, allow_tf32); the last four
    only pick a backend kernel, so it is ``aten.convolution`` of the first nine.
    No exporter translates ``_convolution`` (ONNX, TVM), so without this a
    TorchScript model with convolutions reached only the torch targets.
    """
    if target is torch.ops.aten._convolution.default and len(args) >= 9:
        return torch.ops.aten.convolution.default, tuple(args[:9])
    return target, args


class _OwnCopies:
    """The graph's own copy of each user tensor (one copy per tensor, so tied weights stay tied).

    A pass that rewrites a weight in place must never change the user's module,
    so no constant of a captured graph shares storage with it.
    """

    def __init__(self) -> None:
        self._done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def __call__(self, tensor: torch.Tensor) -> torch.Tensor:
        hit = self._done.get(id(tensor))
        if hit is not None and hit[0] is tensor:
            return hit[1]
        copy = tensor.detach().clone()
        self._done[id(tensor)] = (tensor, copy)   # keeps ``tensor`` alive so its id stays unique
        return copy


def _flatten_outputs(args: Any) -> list[Any]:
    out: list[Any] = []
    for a in args if isinstance(args, (list, tuple)) else (args,):
        if isinstance(a, (list, tuple)):
            out.extend(_flatten_outputs(a))
        else:
            out.append(a)
    return out


def _convert_args(value: Any, rename: dict[str, str]) -> Any:
    if isinstance(value, torch.fx.Node):
        return Ref(rename[value.name])
    if isinstance(value, tuple):
        return tuple(_convert_args(v, rename) for v in value)
    if isinstance(value, list):
        return [_convert_args(v, rename) for v in value]
    if isinstance(value, dict):
        return {k: _convert_args(v, rename) for k, v in value.items()}
    if isinstance(value, torch.SymInt):  # pragma: no cover - only inside shapes of dynamic graphs
        return str(value)
    return value


def _meta_of(fx_node: torch.fx.Node, graph: Graph) -> Any:
    val = fx_node.meta.get("val", fx_node.meta.get("example_value"))

    def conv(v: Any) -> Any:
        if isinstance(v, torch.Tensor):
            shape = tuple(note_symbol(graph, d) if isinstance(d, torch.SymInt) else int(d) for d in v.shape)
            return TensorMeta(shape, v.dtype, "cpu" if v.device.type in ("cpu", "meta") else str(v.device))
        if isinstance(v, (list, tuple)):
            return tuple(conv(x) for x in v)
        if isinstance(v, torch.SymInt):
            note_symbol(graph, v)
        return None

    return conv(val)


__all__ = ["CaptureMethod", "capture_module", "capture_exported", "map_refs", "output_names"]
