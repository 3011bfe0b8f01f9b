"""Constant folding: compute at compile time whatever does not depend on the inputs.

Three kinds of values fold:

* shape arithmetic — ``sym_size`` of a static dimension and ``operator.*`` on
  numbers become literals in the nodes that read them;
* tensors made from literals (``full``, ``arange``, ``zeros``…);
* in inference graphs, subgraphs that only read parameters: the transposed
  weight every ``nn.Linear`` produces is stored once, already transposed::

    before                                                   after
    %0.weight: f32[256, 512] = param                         %permute: f32[512, 256] = param   # 0
    %permute = aten.permute.default(%0.weight, [1, 0])
    %addmm = aten.addmm.default(%0.bias, %x, %permute)       %addmm = aten.addmm.default(%0.bias, %x, %permute)

A broadcast (``expand``) to more elements than it reads never folds: it is a view
at run time (a runtime folds it when it loads the model, in memory), and folded it
would store its constant once per batch row, and a linear's weight broadcast over a
batch (``bmm`` against ``expand(permute(w))``) would no longer be a weight that
``quantize`` folds to int8 or an exporter writes as a ``Gemm``.  What reads it stays
too (a token-type embedding looked up with ids broadcast over the batch).

A folded value keeps the name of the node that computed it.  In training graphs
parameters are what is being learnt, so nothing that reads one is folded.  Nor is a node
captured from a module the target converts whole from its own weights
(``PassContext.target.whole_modules``: ``nn.GRU`` on openvino, one ``GRUSequence``).
"""
from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from mlcomp.passes import patterns as P

from mlcomp.ir import Graph, Mode, Node, Ref, TensorMeta, map_refs, refs_in
from mlcomp.ir.builder import remove_dead, rename
from mlcomp.ir.ops import GETITEM, PARAM, Namespace
from mlcomp.pipeline.pass_base import Pass, PassContext, PassResult, option


@dataclass(frozen=True)
class FoldConstants(Pass):
    """Evaluate nodes that depend only on constants; store tensors as parameters, numbers as literals."""

    name: ClassVar[str] = "fold-constants"
    max_bytes: int = option(1 << 20, "largest folded tensor allowed to be bigger than the constants it reads",
                            ge=0)
    params: bool = option(True, "fold subgraphs of parameters (inference graphs only)")

    def run(self, graph: Graph, ctx: PassContext) -> PassResult:
        values: dict[str, Any] = {}        # name -> constant value (tensor, number, tuple)
        sources: dict[str, int] = {}       # name -> bytes of the parameters the value derives from
        folded: list[str] = []
        fold_params = self.params and graph.mode is Mode.INFERENCE
        whole = ctx.target.whole_modules if ctx.target is not None else frozenset()
        for node in graph.nodes():
            if node.op == PARAM:
                if fold_params:
                    values[node.name] = graph.constants[node.name]
                    sources[node.name] = graph.constants[node.name].nbytes
                continue
            if node.origin.module_type in whole:   # the target converts this module whole, from its weights
                continue
            value = self._evaluate(graph, node, values)
            if value is _NO:
                continue
            values[node.name] = value
            sources[node.name] = sum(sources.get(r, 0) for r in node.input_names())
            folded.append(node.name)
        stats = {"nodes_folded": 0, "constants_created": 0, "literals_inlined": 0}
        outputs = _outputs(graph)
        state: dict[str, str] = {}              # folded node -> "make" | "inner" | "skip"
        for name in reversed(folded):
            needed = name in outputs or any(state.get(u.name, "skip") == "skip" for u in graph.users(name))
            value = values[name]
            if not needed:
                state[name] = "inner"           # every reader folds too: no constant needed
            elif isinstance(value, torch.Tensor):
                state[name] = "make" if value.nbytes <= max(self.max_bytes, sources[name]) else "skip"
            else:
                state[name] = "make" if _literal(value) and name not in outputs else "skip"
        shared: set[int] | None = None          # storages of the graph's constants, built once
        for name in folded:
            if state[name] != "make":
                continue
            node, value = graph.node(name), values[name]
            if isinstance(value, torch.Tensor):
                if shared is None:
                    shared = {t.untyped_storage().data_ptr() for t in graph.constants.values()}
                _to_constant(graph, node, value, shared)
                stats["constants_created"] += 1
            else:
                for user in graph.users(name):
                    swap = lambda r, n=name, v=value: v if r.name == n else r  # noqa: E731
                    graph.replace(user.with_(inputs=map_refs(user.inputs, swap),
                                             attrs=map_refs(dict(user.attrs), swap)))
                stats["literals_inlined"] += 1
            stats["nodes_folded"] += 1
        remove_dead(graph, [n for n in folded if n in graph])
        changed = stats["nodes_folded"] > 0
        return PassResult(graph, changed, stats)

    def _evaluate(self, graph: Graph, node: Node, values: dict[str, Any]) -> Any:
        if node.op == P.SYM_SIZE:                  # size of a static dimension
            meta = P.meta_of(graph, node.inputs[0])
            dim = node.inputs[1]
            if meta is not None and isinstance(dim, int) and isinstance(meta.shape[dim], int):
                return meta.shape[dim]
            return _NO
        if not P.is_pure(node.op) or node.op.is_composite:
            return _NO
        refs = node.input_names()
        if any(r not in values for r in refs):
            return _NO
        if isinstance(node.meta, TensorMeta) and node.meta.is_dynamic:
            return _NO
        if node.op == P.EXPAND and _grows(graph, node):
            return _NO                          # a broadcast: a view at run time, B copies once folded
        if not refs and node.op.namespace is not Namespace.OPERATOR and node.op != GETITEM:
            meta = node.meta
            if not isinstance(meta, TensorMeta) or meta.nbytes(graph.symbols) > self.max_bytes:
                return _NO                      # e.g. a huge zeros(...): cheaper to make at run time
        fn = operator.getitem if node.op == GETITEM else node.op.resolve()
        args = map_refs(node.inputs, lambda r: values[r.name])
        kwargs = map_refs(dict(node.attrs), lambda r: values[r.name])
        try:
            with torch.no_grad():
                return fn(*args, **kwargs)
        except Exception:  # noqa: BLE001 - a node that cannot run at compile time stays
            return _NO


class _Missing:
    pass


_NO = _Missing()


def _outputs(graph: Graph) -> set[str]:
    return {r.name for r in refs_in(graph.output_node.inputs)}


def _grows(graph: Graph, node: Node) -> bool:
    """Whether ``node``'s output has more elements than its first input (unknown sizes: it does)."""
    src = P.meta_of(graph, node.inputs[0])
    if not isinstance(node.meta, TensorMeta) or src is None:
        return True
    return src.is_dynamic or node.meta.numel() > src.numel()


def _literal(value: Any) -> bool:
    if isinstance(value, (bool, int, float)):
        return True
    return isinstance(value, (list, tuple)) and all(isinstance(v, (bool, int, float)) for v in value)


def _to_constant(graph: Graph, node: Node, value: torch.Tensor, shared: set[int]) -> None:
    """Replace ``node`` by a parameter holding ``value``, under the same name.

    ``shared`` holds the storage pointers of the graph's constants (kept up to date here).
    """
    tensor = value.detach().contiguous()
    if tensor.untyped_storage().data_ptr() in shared:
        tensor = tensor.clone()             # own storage: never alias (and keep alive) another parameter
    shared.add(tensor.untyped_storage().data_ptr())
    tmp = graph.add_constant(graph.fresh_name(f"{node.name}__const"), tensor, origin=node.origin)
    graph.replace_all_uses(node.name, Ref(tmp.name))
    graph.erase(node.name)
    rename(graph, tmp.name, node.name)
