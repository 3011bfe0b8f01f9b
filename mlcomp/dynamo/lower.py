"""A Dynamo graph lowered to core ATen: functional, decomposed, with symbolic sizes where Dynamo made them.

Dynamo hands a backend a torch-level ``fx.GraphModule`` (``torch._C._nn.linear``,
``F.relu``, method calls) whose placeholders are the model's parameters and buffers, the
user's tensors and, for dynamic graphs, the ``SymInt`` sizes Dynamo made symbolic::

    l_fn_modules_0_parameters_weight_, l_fn_modules_0_parameters_bias_, s33, l_args_0_
    input_1 = torch._C._nn.linear(l_args_0_, weight, bias)   # l_args_0_: FakeTensor (s33, 8)

:func:`lower` traces it again with ``make_fx`` over ``functionalize`` and torch's core-ATen
decompositions, under Dynamo's own fake mode, so each size stays symbolic exactly where
Dynamo made it so.  Size placeholders are not inputs of the lowered graph: each is read
from the first tensor dimension that carries the same symbol (:class:`SizeSlots`), so the
lowered graph takes tensors only, as mlcomp's IR does::

    arg0_1 (weight), arg1_1 (bias), arg3_1 (x: s33 x 8)
    t = aten.permute(arg0_1, [1, 0]); addmm = aten.addmm(arg1_1, arg3_1, t); relu = aten.relu(addmm)
"""
from __future__ import annotations

import copy
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

from mlcomp.base.errors import CaptureError
from mlcomp.frontend.provenance import first_line

__all__ = ["Lowered", "SizeSlots", "lower", "parameter_slots", "concrete"]

PARAM_MARKS = ("._parameters[", "._buffers[", "_parameters_", "_buffers_")


def parameter_slots(gm: torch.fx.GraphModule) -> dict[int, str]:
    """Placeholder index → module path of each parameter or buffer Dynamo lifted as an input.

    Dynamo names a lifted parameter by where it came from (``L['self']._modules['fc']._parameters['weight']``);
    the module path is rebuilt from the bracketed keys (``fc.weight``).
    """
    out: dict[int, str] = {}
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        arg = node.meta.get("grapharg")
        where = arg.source.name if arg is not None and hasattr(arg.source, "name") else node.target
        where = where() if callable(where) else str(where)
        if any(mark in where for mark in PARAM_MARKS):
            keys = [k for k in _bracketed(where) if k not in ("_modules", "_parameters", "_buffers")]
            out[i] = ".".join(keys[1:]) if len(keys) > 1 else (keys[0] if keys else node.name)
    return out


def _bracketed(text: str) -> list[str]:
    return re.findall(r"\['([^']+)'\]", text)


@dataclass(frozen=True)
class SizeSlots:
    """Where each ``SymInt`` placeholder's value is read: ``(placeholder index, tensor index, dim)``."""

    slots: tuple[tuple[int, int, int], ...]

    @classmethod
    def of(cls, fakes: Sequence[Any]) -> "SizeSlots":
        where: dict[str, tuple[int, int]] = {}
        for t_index, value in enumerate(fakes):
            if isinstance(value, torch.Tensor):
                for dim, size in enumerate(value.shape):
                    if isinstance(size, torch.SymInt):
                        where.setdefault(str(size), (t_index, dim))
        slots = []
        for i, value in enumerate(fakes):
            if isinstance(value, torch.SymInt):
                found = where.get(str(value))
                if found is None:
                    raise CaptureError(f"size input {value} of the Dynamo graph is no tensor's dimension; mlcomp "
                                       f"compiles graphs whose inputs are tensors",
                                       hint="this graph runs in torch; mark the size static or pass it as a tensor")
                slots.append((i, *found))
            elif not isinstance(value, torch.Tensor):
                raise CaptureError(f"input {i} of the Dynamo graph is a {type(value).__name__}, not a tensor",
                                   hint="this graph runs in torch")
        return cls(tuple(slots))

    def fill(self, tensors: Sequence[Any], count: int) -> list[Any]:
        """The full argument list of the Dynamo graph from its tensor arguments (sizes read from them)."""
        out: list[Any] = [None] * count
        sizes = {s[0] for s in self.slots}
        it = iter(tensors)
        for i in range(count):
            if i not in sizes:
                out[i] = next(it)
        for i, t_index, dim in self.slots:
            out[i] = out[t_index].shape[dim]
        return out

    def tensor_indices(self, count: int) -> list[int]:
        sizes = {s[0] for s in self.slots}
        return [i for i in range(count) if i not in sizes]


def concrete(value: Any) -> Any:
    """A real value for an example input: a ``SymInt`` becomes its hint (the size of this call)."""
    if isinstance(value, torch.SymInt):
        return int(value.node.hint) if value.node.has_hint() else int(value)
    return value


@dataclass
class Lowered:
    """The ATen graph of one Dynamo graph and how its placeholders map back to Dynamo's."""

    gm: torch.fx.GraphModule       # placeholders: the Dynamo graph's tensor inputs, in order
    sizes: SizeSlots
    tensor_indices: list[int]      # Dynamo placeholder index of each placeholder of ``gm``
    dynamic: bool                  # some size is symbolic
    written: tuple[int, ...] = ()  # placeholders of ``gm`` the Dynamo graph writes into; their new values
                                   # are ``gm``'s last outputs, in this order
    baked: tuple[tuple[int, float], ...] = ()   # (Dynamo placeholder index, value) of each scalar baked in

    def holds(self, args: Sequence[Any]) -> bool:
        """Whether this call's scalar inputs have the values baked into ``gm`` (else the Dynamo graph must run)."""
        return all(args[i].item() == value for i, value in self.baked)


def lower(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], *, writes: bool = False,
          table: Mapping[Any, Any] | None = None) -> Lowered:
    """Trace ``gm`` to functional core ATen under Dynamo's fake mode (sizes symbolic where Dynamo's are).

    ``table``: the decompositions (default torch's core-ATen table; the joint route keeps
    eager's fused kernels, :func:`mlcomp.frontend.joint.joint_decompositions`).
    ``writes``: an input the graph writes into in place (BatchNorm's running statistics) becomes
    an extra output holding its new value (:attr:`Lowered.written`); otherwise such a graph is refused.
    """
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    gm, baked = _bake_scalars(gm, example_inputs)
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    fakes = [n.meta.get("example_value", n.meta.get("val")) for n in placeholders]
    if len(fakes) != len(example_inputs) or any(f is None for f in fakes):
        raise CaptureError("the Dynamo graph carries no fake values for its inputs", hint="this graph runs in torch")
    sizes = SizeSlots.of(fakes)
    count = len(fakes)
    indices = sizes.tensor_indices(count)

    def run(*tensors: torch.Tensor) -> Any:
        return gm(*sizes.fill(tensors, count))

    args = [fakes[i] for i in indices]
    written: list[int] = []
    try:
        traced = make_fx(_functional(run, [placeholders[i].name for i in indices], written if writes else None),
                         decomposition_table=core_aten_decompositions() if table is None else table,
                         tracing_mode="symbolic")(*args)
    except CaptureError:
        raise
    except Exception as exc:  # noqa: BLE001 - any tracing failure sends the graph to torch
        raise CaptureError(f"the Dynamo graph cannot be traced to ATen: {type(exc).__name__}: {first_line(exc)}",
                           hint="this graph runs in torch") from None
    traced.graph.eliminate_dead_code()
    traced.recompile()
    return Lowered(traced, sizes, indices, dynamic=bool(sizes.slots), written=tuple(written), baked=baked)


def _bake_scalars(gm: torch.fx.GraphModule, example_inputs: Sequence[Any]
                  ) -> tuple[torch.fx.GraphModule, tuple[tuple[int, float], ...]]:
    """``gm`` with each scalar input that is only read by ``.item()`` replaced by its value in ``example_inputs``.

    Under ``dynamic=True`` Dynamo passes a module's float attributes (BatchNorm's ``momentum``
    and ``eps``) as 0-d tensors read by ``.item()``, which no trace to ATen can follow; the
    value is baked in and each call checks it (:meth:`Lowered.holds`).  ``gm`` itself is left as it is.
    """
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    scalars = [i for i, n in enumerate(placeholders)
               if isinstance(example_inputs[i], torch.Tensor) and example_inputs[i].dim() == 0 and n.users
               and all(u.op == "call_method" and u.target == "item" for u in n.users)]
    if not scalars:
        return gm, ()
    graph = copy.deepcopy(gm.graph)
    nodes = [n for n in graph.nodes if n.op == "placeholder"]
    baked = []
    for i in scalars:
        value = example_inputs[i].item()
        for user in list(nodes[i].users):
            user.replace_all_uses_with(value)
            graph.erase_node(user)
        baked.append((i, value))
    return torch.fx.GraphModule(gm, graph), tuple(baked)


def _functional(fn: Any, names: Sequence[str], written: list[int] | None = None) -> Any:
    """``fn`` traced through torch's Python functionalization (views and in-place ops become pure ops).

    Python-level functionalization keeps sizes symbolic (the C++ ``torch.func.functionalize``
    asks some composite ops for concrete sizes, which pins a dynamic size to its example).
    A graph that writes into one of its inputs is refused (its writes would be lost) unless
    ``written`` is a list: then the written inputs' indices go into it and their new values
    follow the graph's outputs.
    """
    from torch._subclasses.functional_tensor import FunctionalTensor, FunctionalTensorMode

    def inner(*args: Any) -> Any:
        exclude = torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(torch._C.DispatchKey.Functionalize))
        with exclude, FunctionalTensorMode():
            wrapped = [FunctionalTensor.to_functional(a) for a in args]
            out = fn(*wrapped)
            new: list[Any] = []
            for i, w in enumerate(wrapped):
                torch._sync(w)
                if not torch._functionalize_has_data_mutation(w.elem):
                    continue
                if written is None or not isinstance(out, (tuple, list)):
                    raise CaptureError(f"the Dynamo graph writes into its input {names[i]} in place",
                                       hint="this graph runs in torch")
                written.append(i)
                new.append(w)
            out = (*out, *new) if new else out
            return torch.utils._pytree.tree_map_only(FunctionalTensor, _unwrap, out)
    return inner


def _unwrap(t: Any) -> Any:
    torch._sync(t)
    return torch._from_functional_tensor(t.elem)
