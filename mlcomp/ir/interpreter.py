"""The reference interpreter: runs a :class:`~mlcomp.ir.graph.Graph` with torch ops.

Every verification in mlcomp compares against either the eager model or this
interpreter.  It is differentiable (it only calls torch ops), so training-mode
graphs run forward and backward through it::

    >>> from mlcomp.ir.builder import GraphBuilder
    >>> from mlcomp.ir.ops import aten
    >>> b = GraphBuilder("g")
    >>> graph = b.output(b.call(aten("relu"), b.call(aten("neg"), b.input("x", (3,)))))
    >>> x = torch.tensor([1.0, -2.0, 3.0])
    >>> Interpreter(graph).run(x)                # the graph's outputs, as a tuple
    (tensor([0., 2., 0.]),)
    >>> env = Interpreter(graph).run_all(x)      # every node's value, by name
    >>> env["neg"]
    tensor([-1.,  2., -3.])

``after`` maps node names to ``fn(args, value) -> value``, called with the node's evaluated
positional arguments once it has run; what it returns is the node's value from then on (a
verifier observes or replaces one node's result this way)::

    >>> Interpreter(graph, after={"neg": lambda args, v: v.abs()}).run(x)
    (tensor([1., 2., 3.]),)
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import torch

from mlcomp.base.errors import InputSpecError
from mlcomp.ir import Graph, Node, Ref, TensorMeta, map_refs
from mlcomp.ir.ops import INPUT, OUTPUT, PARAM


class Interpreter:
    def __init__(self, graph: Graph, *, check_inputs: bool = True,
                 after: dict[str, Callable[[tuple[Any, ...], Any], Any]] | None = None) -> None:
        self.graph = graph
        self.check_inputs = check_inputs
        self.after = dict(after or {})
        self._plan: list[tuple[Node, Callable[..., Any] | None]] = []
        for node in graph.nodes():
            fn = None if node.op in (INPUT, PARAM, OUTPUT) else node.op.resolve()
            self._plan.append((node, fn))

    def run(self, *inputs: torch.Tensor) -> tuple[Any, ...]:
        """The graph's outputs, always as a tuple."""
        env = self._execute(inputs, keep_all=False)
        return env["__output__"]

    def run_all(self, *inputs: torch.Tensor) -> dict[str, Any]:
        """Every node's value by node name (for --verify to find the first divergence)."""
        return self._execute(inputs, keep_all=True)

    def _execute(self, inputs: Sequence[torch.Tensor], *, keep_all: bool) -> dict[str, Any]:
        in_nodes = self.graph.input_nodes
        if len(inputs) != len(in_nodes):
            raise InputSpecError(
                f"the graph takes {len(in_nodes)} input(s) "
                f"({', '.join(f'{n.name}: {n.meta}' for n in in_nodes)}) but got {len(inputs)}",
                hint="pass one tensor per model input")
        env: dict[str, Any] = {}
        if self.check_inputs:
            for node, value in zip(in_nodes, inputs):
                check_input(node, value)
        feed = {n.name: v for n, v in zip(in_nodes, inputs)}
        remaining = {} if keep_all else _use_counts(self.graph)
        for node, fn in self._plan:
            if node.op == INPUT:
                env[node.name] = feed[node.name]
            elif node.op == PARAM:
                env[node.name] = self.graph.constants[node.name]
            elif node.op == OUTPUT:
                env["__output__"] = tuple(map_refs(node.inputs[0] if len(node.inputs) == 1 else node.inputs,
                                                   lambda r: env[r.name]))
            else:
                args = map_refs(node.inputs, lambda r: env[r.name])
                kwargs = map_refs(dict(node.attrs), lambda r: env[r.name])
                env[node.name] = fn(*args, **kwargs)
                if node.name in self.after:
                    env[node.name] = self.after[node.name](args, env[node.name])
                if not keep_all:
                    for src in node.input_names():
                        remaining[src] -= 1
                        if remaining[src] == 0 and self.graph.node(src).op not in (PARAM,):
                            env.pop(src, None)  # free activations as soon as possible
        return env


def _use_counts(graph: Graph) -> dict[str, int]:
    return {n.name: len(graph.users(n.name)) for n in graph.nodes()}


def check_input(node: Node, value: Any) -> None:
    """Raise :class:`InputSpecError` if ``value`` does not fit input ``node``'s meta."""
    meta = node.meta
    if not isinstance(meta, TensorMeta):
        return
    if not isinstance(value, torch.Tensor):
        raise InputSpecError(f"input {node.name} must be a tensor {meta}, got {type(value).__name__}")
    if value.dim() != len(meta.shape) or any(
            isinstance(d, int) and d != s for d, s in zip(meta.shape, value.shape)):
        raise InputSpecError(
            f"input {node.name} has shape {list(value.shape)} but the model was captured for {meta}",
            hint="pass a tensor of that shape, or capture again with --input-shape "
                 "(and --dynamic batch,seq for variable sizes)")
    if value.dtype != meta.dtype:
        raise InputSpecError(f"input {node.name} has dtype {value.dtype} but the model expects {meta}",
                             hint=f"convert it with .to({meta.dtype})")


def evaluate(graph: Graph, *inputs: torch.Tensor) -> tuple[Any, ...]:
    """Shorthand for ``Interpreter(graph).run(*inputs)``."""
    return Interpreter(graph).run(*inputs)


__all__ = ["Interpreter", "evaluate", "check_input", "Ref"]
