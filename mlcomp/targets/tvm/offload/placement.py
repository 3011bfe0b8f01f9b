"""Per op of a built TVM module: where it runs (a torch kernel or TVM code) and the policy rule that put it there.

:func:`placements` reads the Relax module after the offload (and the small-GEMM probe) and names,
for each heavy op (conv2d, matmul/linear, attention, layer norm, a mean in torch), the packed torch
kernel it calls or that it stayed TVM code, with the :mod:`~mlcomp.targets.tvm.offload.policy` row
that decided it; the other ops are counted per op name.  :class:`Placements` goes into the build's
stats (``stats["offload"]``), the artifact manifest (``runtime_info.offload``) and ``--explain``::

    op                 shape          runs in                            rule
    conv2d+add+relu    1x56x56x64     torch kernel conv2d_cl_add_relu    conv2d-packed
    linear             1x1000         torch kernel linear                linear
    other ops -> TVM code (default): add x1, max_pool2d x1, mean x1, permute_dims x1

One walk over the bindings: O(n).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from mlcomp.targets.tvm.offload.policy import RULES, HostFacts, Runs, decide, rule

__all__ = ["Placement", "Placements", "placements"]

_PREFIX = "mlcomp.torch."
# kernel name (after the prefix, before epilogue/view suffixes) -> the rule that sends the op there
_KERNEL_RULES = (("conv_transpose2d", "conv2d-transpose"), ("conv2d_cl", "conv2d-packed"), ("conv2d", "conv2d"), ("linear", "linear"), ("matmul", "matmul"),
                 ("attention", "attention"), ("add_layer_norm", "layer-norm"), ("layer_norm", "layer-norm"),
                 ("mean", "mean"))
# Relax ops listed one by one when TVM runs them (the rest are counted per name)
_HEAVY = {"relax.nn.conv2d": "conv2d", "relax.nn.conv1d": "conv1d", "relax.nn.conv2d_transpose": "conv2d_transpose",
          "relax.matmul": "matmul", "relax.nn.layer_norm": "layer_norm"}
_KEY_AT = 11    # a channels-last conv's PACKED_WEIGHTS key: after x, w, b, other and 7 ints (0: not packed)


@dataclass(frozen=True)
class Placement:
    """One heavy op: its kind, output shape, where it runs (kernel name when in torch) and the rule."""

    op: str
    shape: str
    runs: Runs
    rule: str
    kernel: str | None = None
    also: tuple[str, ...] = ()      # further rules folded into the same call (views, relu-after-linear)

    def to_json(self) -> dict[str, Any]:
        return {"op": self.op, "shape": self.shape, "runs": self.runs.value, "kernel": self.kernel,
                "rule": self.rule, **({"also": list(self.also)} if self.also else {})}


@dataclass
class Placements:
    """Every heavy op's :class:`Placement`, the other ops counted by name, and the host facts used."""

    host: HostFacts
    ops: list[Placement] = field(default_factory=list)
    other: Counter = field(default_factory=Counter)

    def count(self, runs: Runs) -> int:
        return sum(1 for p in self.ops if p.runs is runs)

    def to_json(self) -> dict[str, Any]:
        used = {p.rule for p in self.ops} | {a for p in self.ops for a in p.also} | ({"default"} if self.other else set())
        if not self.host.kernels and self.other:
            used.add("pure-tvm")
        return {"host": self.host.to_json(), "ops": [p.to_json() for p in self.ops],
                "other_ops": dict(sorted(self.other.items())),
                "rules": {r.name: r.to_json() for r in RULES if r.name in used},
                "in_torch": self.count(Runs.TORCH), "in_tvm": self.count(Runs.TVM)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "Placements":
        host = HostFacts(**data["host"])
        ops = [Placement(o["op"], o["shape"], Runs(o["runs"]), o["rule"], o.get("kernel"), tuple(o.get("also", ())))
               for o in data.get("ops", [])]
        return cls(host, ops, Counter(data.get("other_ops", {})))

    def lines(self) -> list[str]:
        """The ``--explain`` table: one line per heavy op, then the other ops, then the rules used."""
        rows = [(p.op, p.shape, p.runs.value + (f" {p.kernel}" if p.kernel else ""),
                 p.rule + "".join(f" +{a}" for a in p.also)) for p in self.ops]
        widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(("op", "shape", "runs in"))]
        fmt = lambda r: "  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[3]   # noqa: E731
        out = [fmt(("op", "shape", "runs in", "rule"))] + [fmt(r) for r in rows]
        if self.other:
            why = "pure-tvm" if not self.host.kernels else "default"
            out.append(f"other ops -> TVM code ({why}): " + ", ".join(f"{k} x{n}" for k, n in sorted(self.other.items())))
        out.append(f"{self.count(Runs.TORCH)} op(s) in torch kernels, {self.count(Runs.TVM)} heavy op(s) as TVM code "
                   f"(host: {', '.join(sorted(self.host.features))}, {self.host.vector_bits}-bit vectors)")
        for name in sorted({p.rule for p in self.ops} | {a for p in self.ops for a in p.also}):
            out.append(f"rule {name}: {rule(name).reason}" + (f" [{rule(name).bounds()}]" if rule(name).bounds() else ""))
        return out


def _kernel_rule(name: str, call: Any) -> tuple[str, tuple[str, ...]]:
    """(rule, further rules) of a torch kernel call."""
    short = name[len(_PREFIX):]
    packed = short.startswith("linear_packed")      # linear_packed_relu: linear_relu on a packed oneDNN weight
    short = short.replace("_packed", "", 1) if packed else short
    also = ("views",) if short.endswith("_views") else ()
    if short.startswith("linear_relu"):
        also = ("relu-after-linear", *also)
    elif any(a in short for a in ("_sigmoid", "_gelu")) and not short.startswith("conv2d_cl"):
        also = ("activation-epilogue", *also)
    base = "linear-packed" if packed else next(r for prefix, r in _KERNEL_RULES if short.startswith(prefix))
    if base == "conv2d-packed" and not also and len(call.args) > _KEY_AT + 1:
        key = getattr(call.args[_KEY_AT + 1], "value", None)
        if int(getattr(key, "value", key) or 0) == 0:
            base = "conv2d-1x1-unpacked"
    return base, also


def _tvm_rule(op: str, dtype: str, host: HostFacts, probed: bool) -> str:
    """The rule under which a heavy op stayed TVM code."""
    chosen = decide(op, host, dtype)
    if chosen.runs is Runs.TVM:
        return chosen.name
    if op in ("matmul", "layer_norm") and probed:
        return "small-gemm"
    return "default"


def placements(mod: Any, host: HostFacts, probed: bool = False) -> Placements:
    """Where each op of ``mod``'s Relax functions runs (see the module doc).

    ``probed``: the small-GEMM probe kept some products as TVM code (a float32 matmul or layer norm
    left in Relax by a build that calls torch's kernels was kept by it).
    """
    import tvm
    from tvm import relax

    from mlcomp.targets.tvm.kernels import KERNELS
    from mlcomp.targets.tvm.offload.chains import static_shape, ty_of

    out = Placements(host)

    def visit(expr: Any) -> None:
        if not isinstance(expr, relax.Call) or not isinstance(expr.op, tvm.ir.Op):
            return
        name, shape = expr.op.name, static_shape(expr)
        text = "x".join(map(str, shape)) if shape else "?"
        if name == "relax.call_pure_packed" and isinstance(expr.args[0], relax.ExternFunc) \
                and str(expr.args[0].global_symbol) in KERNELS:
            kernel = str(expr.args[0].global_symbol)
            base, also = _kernel_rule(kernel, expr)
            out.ops.append(Placement(KERNELS[kernel].op, text, Runs.TORCH, base, kernel[len(_PREFIX):], also))
        elif name in _HEAVY:
            dtype = str(getattr(ty_of(expr), "dtype", "float32"))
            out.ops.append(Placement(_HEAVY[name], text, Runs.TVM, _tvm_rule(_HEAVY[name], dtype, host, probed)))
        else:
            out.other[name.rsplit(".", 1)[-1]] += 1

    for func in mod.functions.values():
        if isinstance(func, relax.Function):
            relax.analysis.post_order_visit(func, visit)
    return out
