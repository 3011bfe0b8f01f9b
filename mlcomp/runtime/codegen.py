"""Shared torch code generation: IR :class:`~mlcomp.ir.graph.Graph` → ``torch.fx.GraphModule``.

Every target starts here.  The CPU/CUDA targets trace the generated module
with TorchScript; ONNX Runtime and TVM re-export it (``torch.onnx.export(...,
dynamo=True)`` / ``torch.export``); ``--fallback eager`` runs it as is.

    >>> import torch
    >>> from mlcomp.ir.builder import linear_relu_graph
    >>> graph = linear_relu_graph()              # relu(x @ W.T + b), x f32[2, 8]
    >>> x = torch.randn(2, 8)
    >>> gm = to_fx(graph)                     # a GraphModule, eval mode
    >>> outs = gm(x)                          # always a tuple of outputs
    >>> [o.shape for o in outs]
    [torch.Size([2, 4])]
    >>> param_names(gm)["p_0_weight"]
    '0.weight'

What the generated code looks like (``print(gm.code)``)::

    def forward(self, x):
        p_0_weight = self.p_0_weight
        permute = torch.ops.aten.permute.default(p_0_weight, [1, 0])
        addmm = torch.ops.aten.addmm.default(p_0_bias, x, permute)
        ...
        return (addmm_2,)

* every compute node becomes one ``call_function`` on its op's callable: the
  ATen overload, a Python ``operator`` function (symbolic sizes) or the torch
  implementation of an mlcomp composite op;
* parameters and buffers are registered on the module (buffers in inference,
  ``nn.Parameter`` for trainable floats in training mode) under attribute names
  derived from their dotted module paths; :func:`param_names` maps them back;
* ``Node.ann.device`` (set by placement) is honoured: a value produced on one
  device and read by a node placed on another is copied once, and a parameter
  whose readers all sit on one device is stored there.
"""
from __future__ import annotations

import keyword
import operator
import re
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any

import torch
from torch import fx, nn

from mlcomp.ir import Graph, Mode, Node, Ref, TensorMeta, map_refs
from mlcomp.ir.composites import fused_body, is_fused
from mlcomp.ir.ops import GETITEM, INPUT, OUTPUT, PARAM

__all__ = ["to_fx", "param_names", "attribute_name", "node_callable"]

_NAMES_ATTR = "_mlcomp_param_names"
_RESERVED = set(dir(nn.Module())) | {"forward", "graph", "code", "meta"}


def attribute_name(dotted: str, taken: set[str]) -> str:
    """A valid, unused Python attribute name for a dotted parameter path.

    ``layer1.0.conv1.weight`` → ``layer1_0_conv1_weight``; a leading digit or a
    clash with an ``nn.Module`` attribute or keyword gets a ``p_`` prefix, and
    repeats get ``_1``, ``_2``… suffixes.
    """
    base = re.sub(r"\W", "_", dotted) or "p"
    if base[0].isdigit() or base in _RESERVED or keyword.iskeyword(base) or base.startswith("_"):
        base = "p_" + base.lstrip("_")
    name, i = base, 1
    while name in taken:
        name, i = f"{base}_{i}", i + 1
    taken.add(name)
    return name


def node_callable(node: Node) -> Any:
    """The torch callable a compute node turns into (ATen overload, operator.*, composite impl)."""
    if node.op == GETITEM:
        return operator.getitem
    return node.op.resolve()


def param_names(gm: nn.Module) -> dict[str, str]:
    """Attribute name → dotted IR parameter name for a module made by :func:`to_fx`."""
    return dict(getattr(gm, _NAMES_ATTR, {}))


def to_fx(graph: Graph, *, device: str | torch.device | None = None,
          honour_placement: bool = True, scriptable: bool = False,
          after: Mapping[str, Sequence[tuple[Callable[..., None], str | Sequence[str]]]] | None = None,
          drop_outputs: Collection[int] = ()) -> fx.GraphModule:
    """Generate a ``GraphModule`` computing ``graph``; its ``forward`` returns a tuple.

    ``device`` moves every constant there (default: where they are).  With
    ``honour_placement`` nodes annotated with ``ann.device`` run on that device.
    The module is in eval mode for inference graphs and train mode for training
    graphs (trainable floats are then ``nn.Parameter`` s).  ``scriptable`` emits
    code ``torch.jit.script`` accepts (op packets resolved by schema instead of
    overloads, ``x.size(d)`` for symbolic sizes): the way to keep dynamic sizes
    in TorchScript, where tracing would bake them in.

    ``after`` (IR node → ``(fn, value)`` pairs, ``value`` one IR value or several) emits
    ``fn(value, ...)`` right after that node, for effects such as a parameter's update; ``drop_outputs`` returns ``None``
    at those output positions, so the value dies at its last reader (the call)
    instead of living to the end of the graph.
    """
    training = graph.mode is Mode.TRAINING
    default_dev = _norm(device)
    root = nn.Module()
    fxg = fx.Graph()
    env: dict[str, fx.Node] = {}
    where: dict[str, str | None] = {}        # device each value lives on (None = default)
    taken: set[str] = set()
    names: dict[str, str] = {}

    placement = _placements(graph) if honour_placement else {}
    placed = bool(placement) or (honour_placement and any(n.ann.device for n in graph.call_nodes()))
    home = default_dev or ("cpu" if placed else None)   # where unannotated values live
    for node in graph.nodes():
        if node.op == INPUT:
            ph = fxg.placeholder(attribute_name(node.name, taken))
            ph.meta["mlcomp_meta"] = node.meta
            env[node.name], where[node.name] = ph, home
        elif node.op == PARAM:
            attr = attribute_name(node.name, taken)
            names[attr] = node.name
            dev = placement.get(node.name) or default_dev
            tensor = graph.constants[node.name].detach()
            if dev is not None:
                tensor = tensor.to(dev)
            if training and tensor.is_floating_point() and graph.constants[node.name].requires_grad:
                root.register_parameter(attr, nn.Parameter(tensor, requires_grad=True))
            else:
                root.register_buffer(attr, tensor)
            env[node.name], where[node.name] = fxg.get_attr(attr), dev or home
        elif node.op == OUTPUT:
            value = node.inputs[0] if len(node.inputs) == 1 else node.inputs
            outs = map_refs(value, lambda r: env[r.name])
            outs = tuple(outs) if isinstance(outs, (list, tuple)) else (outs,)
            fxg.output(tuple(None if i in drop_outputs else o for i, o in enumerate(outs)))
        elif node.op == GETITEM and isinstance(env[node.input_names()[0]], tuple):   # an inlined fused body
            env[node.name] = env[node.input_names()[0]][node.inputs[1]]
            where[node.name] = where.get(node.input_names()[0])
        elif node.op == GETITEM:   # picks from a tuple: stays where its producer is
            args = map_refs(node.inputs, lambda r: env[r.name])
            env[node.name] = fxg.call_function(operator.getitem, tuple(args),
                                               name=attribute_name(node.name, taken))
            where[node.name] = where.get(node.input_names()[0])
        else:
            want = (_norm(node.ann.device) if honour_placement else None) or home
            move = lambda r: _on(fxg, env, where, r, want)  # noqa: E731 - tensors only: see where[]
            args, kwargs = map_refs(node.inputs, move), map_refs(dict(node.attrs), move)
            if scriptable and is_fused(node.op):   # TorchScript cannot call a fused kernel: inline its body
                env[node.name] = _inline_fused(fxg, node, args, taken)
            else:
                kind, fn = _scriptable(node) if scriptable else ("call_function", node_callable(node))
                env[node.name] = fxg.create_node(kind, fn, tuple(args), kwargs, name=attribute_name(node.name, taken))
                env[node.name].meta["mlcomp_origin"] = node.origin
            # sizes and other scalars live nowhere in particular: never copied between devices
            where[node.name] = want if isinstance(node.meta, (TensorMeta, tuple)) else None
        for fn, values in (after or {}).get(node.name, ()):
            fxg.call_function(fn, tuple(env[v] for v in ((values,) if isinstance(values, str) else values)))
    fxg.lint()
    gm = fx.GraphModule(root, fxg, class_name=f"{graph.name}_module")
    setattr(gm, _NAMES_ATTR, names)
    gm.train(training)
    return gm


def _inline_fused(fxg: fx.Graph, node: Node, args: Any, taken: set[str]) -> Any:
    """The body of fused ``node`` emitted op by op (scriptable); its output node, or a tuple of them."""
    body = fused_body(node.op)
    local: dict[str, Any] = {n.name: a for n, a in zip(body.input_nodes, args)}
    for inner in body.call_nodes():
        inner_args = map_refs(inner.inputs, lambda r: local[r.name])
        if inner.op == GETITEM and isinstance(inner_args[0], tuple):
            local[inner.name] = inner_args[0][inner.inputs[1]]
            continue
        if is_fused(inner.op):
            local[inner.name] = _inline_fused(fxg, inner, inner_args, taken)
            continue
        kind, fn = _scriptable(inner)
        local[inner.name] = fxg.create_node(kind, fn, tuple(inner_args),
                                            map_refs(dict(inner.attrs), lambda r: local[r.name]),
                                            name=attribute_name(f"{node.name}_{inner.name}", taken))
    outs = [local[r.name] for r in body.output_refs]
    return outs[0] if len(outs) == 1 else tuple(outs)


def _scriptable(node: Node) -> tuple[str, Any]:
    """``(fx op kind, target)`` that TorchScript's compiler understands for ``node``."""
    fn = node_callable(node)
    if fn is torch.ops.aten.sym_size.int:
        return "call_method", "size"
    if isinstance(fn, torch._ops.OpOverload):
        return "call_function", fn.overloadpacket
    return "call_function", fn


def _on(fxg: fx.Graph, env: dict[str, fx.Node], where: dict[str, str | None], ref: Ref,
        want: str | None) -> fx.Node:
    """``env[ref]``, copied to device ``want`` (once per value and device) if it lives elsewhere."""
    have = where.get(ref.name)
    if want is None or have is None or have == want:
        return env[ref.name]
    key = f"{ref.name}@{want}"
    if key not in env:
        env[key] = fxg.call_function(torch.ops.aten._to_copy.default, (env[ref.name],),
                                     {"device": torch.device(want)})
        where[key] = want
    return env[key]


def _norm(device: str | torch.device | None) -> str | None:
    """Canonical device text: ``"cuda"`` → ``"cuda:0"``, ``"cpu"`` stays."""
    if device is None:
        return None
    d = torch.device(device)
    if d.type != "cpu" and d.index is None:
        d = torch.device(d.type, 0)
    return str(d)


def _placements(graph: Graph) -> dict[str, str]:
    """Device of each parameter whose readers are all placed on the same device."""
    out: dict[str, str] = {}
    for node in graph.nodes(PARAM):
        devices = {_norm(u.ann.device) for u in graph.users(node.name)}
        if len(devices) == 1 and None not in devices:
            out[node.name] = devices.pop()
    return out


def input_metas(graph: Graph) -> list[TensorMeta]:
    """The graph's input metas, in order (helper for targets building example inputs)."""
    return [n.tensor_meta for n in graph.input_nodes]
