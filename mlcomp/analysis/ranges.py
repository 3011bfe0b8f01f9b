"""Value ranges from a calibration run, and the error low precision implies.

Three questions the mixed-precision pass and verification ask about a graph:

* :func:`calibrate` — what range does each node's value take?  The graph runs on
  example inputs (or a user's calibration set) and every float value's largest
  magnitude and its share of tiny non-zero elements are recorded, one node at a
  time (values are freed as soon as their last reader ran)::

      >>> from mlcomp.ir.builder import GraphBuilder
      >>> from mlcomp.ir.ops import aten
      >>> b = GraphBuilder("big")
      >>> graph = b.output(b.call(aten("mul.Tensor"), b.input("x", (4,)), 1e5, name="scale"))
      >>> r = calibrate(graph, [(torch.tensor([0.5, -0.8125, 0.0, 0.25]),)])["scale"]
      >>> r.absmax, r.overflows(torch.float16), r.flushes(torch.float16)
      (81250.0, True, False)

* :func:`declared_tolerance` — how far may a graph computing in bf16/fp16 drift
  from fp32?  Each rounding to a low dtype adds a relative error of at most the
  unit roundoff ``u`` (bf16 ``2^-8``, fp16 ``2^-11``); independent roundings add up
  like a random walk, so after ``k`` of them on the longest path the expected
  relative error is about ``u·sqrt(k)``.  The declared tolerance is
  ``SAFETY·u·sqrt(k)`` (never below the fp32 default): before, a bf16 resnet18
  (max rel error 9.6e-3 against fp32) was checked against fp32's 1e-4 and failed;
  after, against 4.6e-2 (``k`` = 62).  On the zoo the measured error is 3-17x
  below the declared one.

* :func:`error_growth` — when a low-precision graph fails verification, which node
  made the error grow most?  Every node's relative error against the fp32
  reference minus the largest error among its inputs; the first node to diverge is
  no help in a graph where every node differs a little.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch

from mlcomp.ir import Graph, Node, TensorMeta, map_refs
from mlcomp.ir.ops import INPUT, OUTPUT, PARAM, Category, category
from mlcomp.ir.quant import DEQUANTIZE, DYNAMIC_QUANTIZE, QUANTIZE

__all__ = ["ValueRange", "calibrate", "Tolerance", "declared_tolerance", "declared_at", "UNIT_ROUNDOFF", "SAFETY",
           "ErrorGrowth", "error_growth", "LOW_DTYPES"]

LOW_DTYPES = (torch.bfloat16, torch.float16)
UNIT_ROUNDOFF: Mapping[torch.dtype, float] = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11,
                                              # an int8 grid's half step is 2^-9..2^-8 of the range; the int8
                                              # weight rounds as much again and random-weight layers amplify it
                                              # (measured 2^-7..2^-6 per layer on small conv/linear stacks)
                                              torch.uint8: 2.0 ** -6, torch.int8: 2.0 ** -6}
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.uint8: "uint8", torch.int8: "int8"}
SAFETY = 1.5            # declared = SAFETY * u * sqrt(k); zoo errors in bf16 stay 3-17x below it
FP32_FLOOR = 1e-4       # never tighter than the fp32 default
TINY_SHARE = 0.01       # a node "flushes to zero" when over 1% of its non-zero values would


@dataclass(frozen=True)
class ValueRange:
    """What one node's values looked like over the calibration samples."""

    absmax: float               # largest |v| (inf when a value was not finite)
    nonzero: int                # non-zero elements seen
    tiny: int                   # non-zero elements below fp16's smallest normal (subnormal or 0 in fp16)

    def overflows(self, dtype: torch.dtype) -> bool:
        """Some value is larger than ``dtype``'s largest finite number."""
        return self.absmax > torch.finfo(dtype).max

    def flushes(self, dtype: torch.dtype) -> bool:
        """Over 1% of the non-zero values fall below ``dtype``'s smallest normal number, where they lose
        precision and, below half the smallest subnormal, flush to zero (only fp16 lacks the range)."""
        if dtype != torch.float16 or not self.nonzero:
            return False
        return self.tiny / self.nonzero > TINY_SHARE

    def merge(self, other: "ValueRange") -> "ValueRange":
        return ValueRange(max(self.absmax, other.absmax), self.nonzero + other.nonzero, self.tiny + other.tiny)


_FP16_TINY = 2.0 ** -14      # fp16's smallest normal: below it, precision drains away, then to 0


def _range_of(t: torch.Tensor) -> ValueRange:
    a = t.detach().abs().float()
    if a.numel() == 0:
        return ValueRange(0.0, 0, 0)
    finite = bool(torch.isfinite(a).all())
    nz = a != 0
    return ValueRange(float(a.max()) if finite else math.inf, int(nz.sum()), int((nz & (a < _FP16_TINY)).sum()))


def calibrate(graph: Graph, samples: Iterable[Sequence[torch.Tensor]]) -> dict[str, ValueRange]:
    """Each float node's :class:`ValueRange` over ``samples`` (each a tuple of graph inputs)."""
    ranges: dict[str, ValueRange] = {}
    nodes = graph.nodes()
    readers = {n.name: graph.num_users(n.name) for n in nodes}
    for sample in samples:
        sample = (sample,) if isinstance(sample, torch.Tensor) else tuple(sample)
        feed = dict(zip((n.name for n in graph.input_nodes), sample))
        env: dict[str, Any] = {}
        left = dict(readers)
        with torch.no_grad():
            for node in nodes:
                if node.op == OUTPUT:
                    continue
                if node.op == INPUT:
                    value = feed[node.name]
                elif node.op == PARAM:
                    value = graph.constants[node.name]
                else:
                    args = map_refs(node.inputs, lambda r: env[r.name])
                    kwargs = map_refs(dict(node.attrs), lambda r: env[r.name])
                    value = node.op.resolve()(*args, **kwargs)
                if isinstance(value, torch.Tensor) and value.is_floating_point():
                    r = _range_of(value)
                    ranges[node.name] = ranges[node.name].merge(r) if node.name in ranges else r
                env[node.name] = value
                for src in node.input_names():
                    left[src] -= 1
                    if left[src] == 0:
                        env.pop(src, None)
    return ranges


# ---------------------------------------------------------------------------
# Declared tolerance


@dataclass(frozen=True)
class Tolerance:
    """The relative error a low-precision graph is declared to stay within, and why."""

    rtol: float
    dtype: torch.dtype
    roundings: int              # k: low-precision roundings on the longest path to an output

    def explain(self) -> str:
        name = _DTYPE_NAMES[self.dtype]
        return (f"{self.rtol:.1e} = {SAFETY:g} x u({name}) {UNIT_ROUNDOFF[self.dtype]:.1e} x "
                f"sqrt({self.roundings} roundings on the longest path)")


def _rounds(node: Node) -> torch.dtype | None:
    """The low dtype ``node`` rounds its result to, or None (fp32, or exact data movement).
    A low-precision constant counts: it is an fp32 weight rounded once."""
    if (node.op.is_structural and node.op != PARAM) or category(node.op) is Category.INJECTIVE:
        return None
    if node.op == QUANTIZE:         # rounding to an int8 grid; its dequantize is exact
        return node.tensor_meta.dtype
    if node.op == DYNAMIC_QUANTIZE:    # rounding to a uint8 grid measured on the call
        return torch.uint8
    if node.op == DEQUANTIZE:
        return None
    for meta in node.meta if isinstance(node.meta, tuple) else (node.meta,):
        if isinstance(meta, TensorMeta) and meta.dtype.is_floating_point:
            return meta.dtype if meta.dtype in LOW_DTYPES else None
    return None


def _depths(graph: Graph) -> tuple[dict[str, int], torch.dtype | None]:
    """Low-precision roundings on the longest path to each node, and the lowest dtype rounded to."""
    depth: dict[str, int] = {}
    lowest: torch.dtype | None = None
    for node in graph.nodes():
        before = max((depth.get(s, 0) for s in node.input_names()), default=0)
        dtype = _rounds(node)
        if dtype is not None and (lowest is None or UNIT_ROUNDOFF[dtype] > UNIT_ROUNDOFF[lowest]):
            lowest = dtype
        depth[node.name] = before + (dtype is not None)
    return depth, lowest


def _tolerance(lowest: torch.dtype, k: int) -> Tolerance:
    k = max(1, k)
    rtol = max(FP32_FLOOR, SAFETY * UNIT_ROUNDOFF[lowest] * math.sqrt(k))
    return Tolerance(float(f"{rtol:.2g}"), lowest, k)


def declared_tolerance(graph: Graph) -> Tolerance | None:
    """The tolerance the graph's low-precision nodes imply (None: everything computes in fp32). O(n)."""
    depth, lowest = _depths(graph)
    if lowest is None:
        return None
    return _tolerance(lowest, max((depth.get(r.name, 0) for r in graph.output_refs), default=1))


def declared_at(graph: Graph, names: Iterable[str]) -> dict[str, Tolerance]:
    """The tolerance declared for each named node's value, from the roundings on the longest path to
    it; a value no rounding reaches is left out (it is exact). One pass: O(n)."""
    depth, lowest = _depths(graph)
    if lowest is None:
        return {}
    return {name: _tolerance(lowest, depth[name]) for name in names if depth.get(name, 0) > 0}


# ---------------------------------------------------------------------------
# Where the error grows


@dataclass(frozen=True)
class ErrorGrowth:
    node: str
    error: float         # the node's relative error against the reference
    inherited: float     # the largest relative error among its inputs

    def sentence(self, graph: Graph) -> str:
        n = graph.node(self.node)
        prec = f", computed in {n.ann.precision.value}" if n.ann.precision is not None else ""
        return (f"The error grows most at %{n.name} ({n.op}{prec}) from module {n.origin}: its relative "
                f"error is {self.error:.3g} while its inputs carry at most {self.inherited:.3g}")


def _rel(expected: Any, actual: Any) -> float | None:
    if not (isinstance(expected, torch.Tensor) and isinstance(actual, torch.Tensor)):
        return None
    if expected.shape != actual.shape or not expected.is_floating_point() or not actual.is_floating_point():
        return None
    e, a = expected.detach().double(), actual.detach().double()
    if e.numel() == 0:
        return 0.0
    scale = float(e.abs().max())
    diff = float((a - e).abs().max())
    if not math.isfinite(diff):
        return math.inf
    return diff / scale if scale > 0 else diff


def error_growth(graph: Graph, reference: Mapping[str, Any], values: Mapping[str, Any]) -> ErrorGrowth | None:
    """The node whose relative error exceeds its inputs' by most (values by node name)."""
    err: dict[str, float] = {}
    best: ErrorGrowth | None = None
    for node in graph.nodes():
        if node.op in (INPUT, OUTPUT):
            continue
        inherited = max((err.get(s, 0.0) for s in node.input_names()), default=0.0)
        own = _rel(reference.get(node.name), values.get(node.name)) if node.name in reference else None
        err[node.name] = inherited if own is None else own
        if own is None or node.op == PARAM:
            continue
        if best is None or own - inherited > best.error - best.inherited:
            best = ErrorGrowth(node.name, own, inherited)
    return best
