"""The backend's target for an inference graph when the call names none: a rule on where its FLOPs are.

Compiling several targets and timing them (``target="auto"``) costs a multiple of one compile, so
without a named target the backend compiles one, chosen by :data:`RULES`: the share of the graph's
heavy FLOPs (the IR's compute ops: convolutions, matrix products, attention) in each op family, first rule that holds
wins, else :data:`DEFAULT`.  A rule's target that is not installed here is skipped.

The rules come from measurements of the backend against inductor (``benchmarks/torch_compile.py``):
around convolutions ONNX Runtime fuses the activation and pooling that the cpu target (TorchScript,
eager's kernels one by one) runs as separate calls; on GEMM and attention graphs the cpu target's
kernels are the ones inductor calls too.

    >>> from mlcomp.ir.builder import linear_relu_graph
    >>> pick_target(linear_relu_graph())
    ('cpu', 'matmul 100% of heavy FLOPs: cpu (rule)')
"""
from __future__ import annotations

from typing import Callable

from mlcomp.analysis.cost import node_flops
from mlcomp.ir import Graph
from mlcomp.ir.ops import Category, category_names

__all__ = ["DEFAULT", "FAMILIES", "RULES", "flop_shares", "pick_target"]

# the heavy ops are the IR's COMPUTE category (mlcomp.ir.ops); a name's first matching part gives its
# family, else matmul (mm, addmm, bmm, attention…); batch norm (COMPUTE there: it takes an epilogue) is light
KINDS = (("conv", "convolution"), ("batch_norm", None))
FAMILIES = {name: family for name in category_names(Category.COMPUTE)
            if (family := next((f for part, f in KINDS if part in name), "matmul")) is not None}
# (family, least share of the heavy FLOPs, target): first that holds wins
RULES = (("convolution", 0.5, "onnxruntime"),)
DEFAULT = "cpu"


def flop_shares(graph: Graph) -> dict[str, float]:
    """Each family's share of the heavy FLOPs of ``graph`` (empty when it has none)."""
    totals: dict[str, int] = {}
    for node in graph.call_nodes():
        family = FAMILIES.get(node.op.name)
        if family is not None:
            totals[family] = totals.get(family, 0) + node_flops(graph, node)
    whole = sum(totals.values())
    return {f: n / whole for f, n in totals.items()} if whole else {}


def pick_target(graph: Graph, available: Callable[[str], bool] = lambda name: True) -> tuple[str, str]:
    """``(target, why)`` for ``graph`` by :data:`RULES`; ``available(name)`` says whether a target is installed."""
    shares = flop_shares(graph)
    top = max(shares.items(), key=lambda kv: kv[1], default=None)
    said = f"{top[0]} {top[1]:.0%} of heavy FLOPs" if top else "no heavy ops"
    for family, least, target in RULES:
        if shares.get(family, 0.0) >= least and available(target):
            return target, f"{said}: {target} (rule)"
    return DEFAULT, f"{said}: {DEFAULT} (rule)"
