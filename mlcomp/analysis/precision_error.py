"""Per-node error of a mixed-precision graph against its fp32 original, on the same inputs.

Both graphs run in the reference interpreter with every value kept.  Nodes are
matched by name (a rewrite that keeps a name keeps its value; a cast the pass
inserted, ``%x_bf16``, is matched to the value it casts).  For every matched
node two numbers are reported:

* ``error``: ``max |mixed - fp32|`` of the node's value, everything upstream
  included (how far the value has drifted when it gets here);
* ``introduced``: the node's own share: its op re-run in its precision on the
  *fp32* values of its inputs (rounded to the dtypes the mixed graph feeds it),
  against its fp32 value.  An fp32 node introduces nothing; a bf16 ``addmm``
  introduces the rounding of its inputs and of its bf16 result.

::

    rows = precision_errors(fp32_graph, bf16_graph, (x,))
    [(r.name, r.precision, f"{r.introduced:.1e}", f"{r.error:.1e}") for r in rows[:3]]
    [('input_bf16', 'bf16', '7.8e-03', '7.8e-03'), ('permute', 'bf16', '3.9e-03', '3.9e-03'),
     ('addmm', 'bf16', '2.4e-02', '2.6e-02')]
    by_op(rows)["aten.addmm.default"]["introduced"]
    0.031

One run of each graph plus one op per node: O(n) ops; memory holds every value
of both runs, so this is for reports on example-sized inputs, not a hot path.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from mlcomp.ir import Graph, Node, TensorMeta, map_refs
from mlcomp.ir.dtypes import dtype_name
from mlcomp.ir.interpreter import Interpreter
from mlcomp.ir.ops import OUTPUT

__all__ = ["NodePrecisionError", "by_op", "precision_errors"]

_CASTS = frozenset({"_to_copy", "convert_element_type"})     # aten._to_copy, prims.convert_element_type


@dataclass(frozen=True)
class NodePrecisionError:
    """How much one node of the mixed graph differs from fp32."""

    name: str
    op: str
    module: str
    precision: str          # dtype the mixed graph computes the node's value in ("bf16", "f32", ...)
    reason: str             # why (the pass's annotation), "" when it recorded none
    introduced: float       # max |op in its precision on fp32 inputs - fp32 value|
    error: float            # max |mixed value - fp32 value|
    scale: float            # max |fp32 value|

    @property
    def rel_error(self) -> float:
        return self.error / self.scale if self.scale > 0 else self.error

    def to_json(self) -> dict[str, Any]:
        return {"node": self.name, "op": self.op, "module": self.module, "precision": self.precision,
                "reason": self.reason, "introduced": self.introduced, "error": self.error, "scale": self.scale}


def _max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    if a.numel() == 0:
        return 0.0
    return float((a.detach().double() - b.detach().double()).abs().max())


def _reason(node: Node) -> str:
    reason = getattr(node.ann, "precision_reason", None)
    return "" if reason is None else str(getattr(reason, "value", reason))


def precision_errors(reference: Graph, mixed: Graph, inputs: Sequence[torch.Tensor]) -> list[NodePrecisionError]:
    """One row per float node of ``mixed`` with an fp32 counterpart in ``reference``, in graph order."""
    with torch.no_grad():
        ref_env = Interpreter(reference).run_all(*inputs)
        mix_env = Interpreter(mixed).run_all(*inputs)
        truth: dict[str, torch.Tensor] = {}      # the fp32 value of each mixed node, where one is known

        def fp32_of(name: str) -> torch.Tensor | None:
            if name in truth:
                return truth[name]
            value = ref_env.get(name) if name in reference else None
            node = mixed.node(name)
            if value is None and node.op.name in _CASTS and node.input_names():
                value = fp32_of(node.input_names()[0])
            if isinstance(value, torch.Tensor):
                truth[name] = value
            return value if isinstance(value, torch.Tensor) else None

        rows: list[NodePrecisionError] = []
        for node in mixed.nodes():
            if node.op.is_structural or node.op == OUTPUT or not isinstance(node.meta, TensorMeta) \
                    or not node.meta.dtype.is_floating_point:
                continue
            exact = fp32_of(node.name)
            value = mix_env.get(node.name)
            if exact is None or not isinstance(value, torch.Tensor) or exact.shape != value.shape:
                continue
            introduced = _introduced(mixed, node, mix_env, fp32_of, exact)
            rows.append(NodePrecisionError(
                node.name, str(node.op), node.origin.module_path, dtype_name(node.meta.dtype), _reason(node),
                introduced, _max_abs(value, exact), float(exact.detach().abs().max()) if exact.numel() else 0.0))
    return rows


def _introduced(mixed: Graph, node: Node, mix_env: dict[str, Any], fp32_of: Any, exact: torch.Tensor) -> float:
    """The node's op on the fp32 values of its inputs, each rounded to the dtype the mixed graph feeds."""
    missing = False

    def arg(ref: Any) -> Any:
        nonlocal missing
        fed = mix_env.get(ref.name)
        clean = fp32_of(ref.name)
        if clean is None or not isinstance(fed, torch.Tensor):
            missing = missing or not isinstance(fed, torch.Tensor) or fed.is_floating_point()
            return fed
        return clean.to(fed.dtype) if fed.is_floating_point() else fed

    args = map_refs(node.inputs, arg)
    kwargs = map_refs(dict(node.attrs), arg)
    if missing:
        return float("nan")
    out = node.op.resolve()(*args, **kwargs)
    return _max_abs(out, exact) if isinstance(out, torch.Tensor) and out.shape == exact.shape else float("nan")


def by_op(rows: Sequence[NodePrecisionError]) -> dict[str, dict[str, Any]]:
    """Per op kind: node count, precisions used, the largest introduced and accumulated errors."""
    out: dict[str, dict[str, Any]] = {}
    for r in rows:
        entry = out.setdefault(r.op, {"nodes": 0, "precisions": [], "introduced": 0.0, "error": 0.0})
        entry["nodes"] += 1
        if r.precision not in entry["precisions"]:
            entry["precisions"].append(r.precision)
        if r.introduced == r.introduced:     # not NaN
            entry["introduced"] = max(entry["introduced"], r.introduced)
        entry["error"] = max(entry["error"], r.error)
    return out
