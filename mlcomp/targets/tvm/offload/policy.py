"""Where each op of a TVM build runs: one table of rules, read by the rewrites, ``--explain`` and the manifest.

On CPU a default TVM build is a TVM-built Relax VM module whose heavy ops call torch's own kernels
(oneDNN/MKL convolutions and GEMMs, SDPA attention, layer norms) through packed functions; TVM
compiles and runs the glue between them (pooling, elementwise ops, layout copies it keeps).  Every
such choice is one :class:`Rule` of :data:`RULES`: the op it is about, the dtype it applies to, the
size bounds (elements or multiply-adds), the host facts it needs, where the op then runs and why.
The rewrites (:mod:`~mlcomp.targets.tvm.offload.rewrite`, ``conv_packed``, ``epilogues``, ``views``,
``gemm``) and the schedules read their thresholds from it (:func:`rule`); the build records, per
op, the rule that placed it (:mod:`~mlcomp.targets.tvm.offload.placement`).

Host facts come from :class:`HostFacts` (probed, or made by hand), so the same table answers for a
fake machine:

    >>> decide("conv2d", HostFacts(device="cpu")).runs.value
    'torch kernel'
    >>> decide("conv2d", HostFacts(device="cpu", kernels=False)).name
    'pure-tvm'
    >>> decide("matmul", HostFacts(device="cuda")).name
    'cuda'
    >>> decide("mean", HostFacts(), size=1 << 10).name      # too small for a torch call
    'default'
    >>> rule("mean").min_size
    131072

The first row that matches wins (:func:`decide`); :data:`REWRITE_ORDER` is the order in which the
offload applies its rewrites.  Nothing here imports TVM or torch.
"""
from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

__all__ = ["ALL_FUSIONS", "Fusion", "HostFacts", "REWRITE_ORDER", "RULES", "Rule", "Runs", "decide", "rule",
           "table_lines"]


class Runs(Enum):
    TORCH = "torch kernel"      # a packed call into torch's kernel, inside the TVM-built module
    TVM = "TVM code"            # legalized, fused and scheduled by TVM


class Fusion(Enum):
    """Rewrites beyond the plain conv2d/matmul/linear offload that the offload may apply."""

    ATTENTION = "attention"       # decomposed softmax attention → torch's scaled_dot_product_attention
    EPILOGUE = "epilogue"         # conv bias add, activation after a conv/linear → into its torch call
    LAYER_NORM = "layer_norm"     # (residual add +) layer norm → F.layer_norm
    PACKED_CONV = "packed_conv"   # NHWC conv (+ bias, residual add, act) → prepacked oneDNN (conv_packed)
    VIEWS = "views"               # layout chains around a torch call → strided views in, a torch copy out
    MEAN = "mean"                 # a large mean of a torch call's result → torch.mean
    PATCHES = "patches"           # small stride = kernel conv (ViT patches) → patch copy + linear (gemm)


ALL_FUSIONS = frozenset(Fusion)

# the offload's steps in order: attention first (it needs the raw matmuls), convs packed before the plain conv
# rewrite (1-d convs made height-1 conv2d just before it: they run unpacked), epilogues/norms/means after the
# kernels exist, the views last (they wrap kernel calls)
REWRITE_ORDER: tuple[str, ...] = ("attention", "packed_conv", "patches", "conv1d", "conv2d", "conv2d_transpose", "linear",
                                  "matmul", "epilogue", "layer_norm", "mean", "views")


@dataclass(frozen=True)
class HostFacts:
    """What the policy needs to know about the machine and the build.

    ``device``: ``cpu`` or ``cuda``; ``vector_bits``: SIMD register width; ``packed_conv``: torch has
    oneDNN's fused convolution (``mkldnn._convolution_pointwise``); ``kernels``: the build may call
    torch's kernels at all (``False``: pure TVM); ``packed_linear``: oneDNN's linear on a packed weight
    (``mkldnn._linear_pointwise``).
    """

    device: str = "cpu"
    vector_bits: int = 256
    packed_conv: bool = True
    kernels: bool = True
    packed_linear: bool = True

    @classmethod
    def probe(cls, device: str, kernels: bool | None = None) -> "HostFacts":
        """This machine's facts (``kernels=None``: the default, torch's kernels on CPU only)."""
        from mlcomp.hardware.probe import vector_bits
        from mlcomp.targets.tvm.kernels import packed_conv_available, packed_linear_available

        return cls(device=device, vector_bits=vector_bits(), packed_conv=packed_conv_available(),
                   kernels=device == "cpu" if kernels is None else bool(kernels),
                   packed_linear=packed_linear_available())

    @property
    def features(self) -> frozenset[str]:
        """The facts as names the rules' ``needs`` are written in."""
        return frozenset({self.device, "kernels" if self.kernels else "no-kernels",
                          *(["packed-conv"] if self.packed_conv else []),
                          *(["packed-linear"] if self.packed_linear else [])})

    @property
    def lanes(self) -> int:
        """float32 lanes of a vector register."""
        return max(1, self.vector_bits // 32)

    def to_json(self) -> dict[str, Any]:
        return {"device": self.device, "vector_bits": self.vector_bits, "packed_conv": self.packed_conv,
                "kernels": self.kernels, "packed_linear": self.packed_linear}


@dataclass(frozen=True)
class Rule:
    """One row: ``op`` (``*``: any) of ``dtype`` (``*``: any; ``~float32``: anything but float32) with a size
    in ``[min_size, max_size]`` (``unit``), on a host with every fact in ``needs``, runs in ``runs``."""

    name: str
    op: str
    runs: Runs
    reason: str
    dtype: str = "float32"
    needs: frozenset[str] = frozenset()
    min_size: int = 0
    max_size: int | None = None
    unit: str = "elements"
    fusion: Fusion | None = None
    ratio: float | None = None      # a measured rule: TVM must take at most this share of torch's time

    def matches(self, op: str, host: HostFacts, dtype: str = "float32", size: int | None = None) -> bool:
        if self.op not in ("*", op) or not self.needs <= host.features:
            return False
        if self.dtype != "*" and (dtype == self.dtype[1:] if self.dtype.startswith("~") else dtype != self.dtype):
            return False
        if size is not None and (size < self.min_size or (self.max_size is not None and size > self.max_size)):
            return False
        return True

    def bounds(self) -> str:
        """The size bounds as text (``>= 131072 elements``), empty when there are none."""
        parts = ([f">= {self.min_size}"] if self.min_size else []) + \
            ([f"<= {self.max_size}"] if self.max_size is not None else [])
        return f"{' and '.join(parts)} {self.unit}" if parts else ""

    def to_json(self) -> dict[str, Any]:
        return {"rule": self.name, "op": self.op, "dtype": self.dtype, "needs": sorted(self.needs),
                "size": self.bounds(), "runs": self.runs.value, "reason": self.reason,
                **({"ratio": self.ratio} if self.ratio is not None else {})}


_CPU = frozenset({"cpu", "kernels"})
_R = Rule
RULES: tuple[Rule, ...] = (
    _R("pure-tvm", "*", Runs.TVM, "kernels=off: a pure TVM build, every op is TVM code", "*",
       frozenset({"no-kernels"})),
    _R("cuda", "*", Runs.TVM, "on CUDA every op is TVM code (DLight GPU schedules)", "*", frozenset({"cuda"})),
    _R("low-precision", "*", Runs.TVM, "not float32: TVM's own dtype rules apply", "~float32"),
    _R("conv2d-1x1-unpacked", "conv2d_1x1", Runs.TORCH,
       "1x1 conv under the packing bound: F.conv2d on the channels-last view (the packed call's ~50 us fixed "
       "cost lost)", needs=_CPU | {"packed-conv"}, max_size=(1 << 23) - 1, unit="MACs",
       fusion=Fusion.PACKED_CONV),
    _R("conv2d-packed", "conv2d", Runs.TORCH,
       "channels-last prepacked oneDNN convolution, bias/residual/activation fused (module's convs average "
       "at least this many MACs)", needs=_CPU | {"packed-conv"}, min_size=1 << 23, unit="MACs (mean per conv)",
       fusion=Fusion.PACKED_CONV),
    _R("conv2d-patches", "conv2d_patches", Runs.TORCH,
       "stride = kernel conv (patch embedding): patch copy + F.linear, a small-GEMM probe candidate",
       needs=_CPU, max_size=1 << 22, unit="MACs", fusion=Fusion.PATCHES),
    _R("conv2d", "conv2d", Runs.TORCH, "F.conv2d (oneDNN), NCHW", needs=_CPU),
    _R("conv1d", "conv1d", Runs.TORCH,
       "as a conv2d over a height of 1: F.conv2d (oneDNN), NCW (TVM's legalized conv1d loop nest has no CPU "
       "schedule)", needs=_CPU),
    _R("conv2d-transpose", "conv2d_transpose", Runs.TORCH,
       "F.conv_transpose2d (oneDNN), bias in the call; NCHW or channels-last (TVM's legalized loop nest has no "
       "CPU schedule)", needs=_CPU),
    _R("small-gemm", "gemm_probe", Runs.TVM,
       "small GEMM / layer norm timed both ways at build time: TVM code where it took <= ratio x the torch call",
       needs=_CPU, max_size=1 << 22, unit="MACs", ratio=0.9),
    _R("linear-packed", "linear", Runs.TORCH,
       "oneDNN linear on a weight packed at build time, bias and activation in the GEMM (mkldnn._linear_pointwise): "
       "faster than torch.mm/addmm above this bound, slower under it (a fixed cost per call)",
       needs=_CPU | {"packed-linear"}, min_size=1 << 24, unit="MACs"),
    _R("linear", "linear", Runs.TORCH, "F.linear (MKL/oneDNN GEMM, bias in the GEMM)", needs=_CPU),
    _R("matmul", "matmul", Runs.TORCH, "torch.matmul (MKL/oneDNN GEMM; GEMV too: DLight's was 2-3x slower)",
       needs=_CPU),
    _R("attention", "attention", Runs.TORCH, "decomposed softmax attention -> scaled_dot_product_attention",
       needs=_CPU, fusion=Fusion.ATTENTION),
    _R("attention-gemms", "attention", Runs.TORCH,
       "at this many threads, attention over a packed q/k/v projection's heads runs eager's steps (one split "
       "pass, batched GEMMs, softmax): torch's flash kernel gains ~1.15x from 1 to 2 threads on the zoo "
       "transformer's heads, these steps 2x", needs=_CPU, min_size=2, unit="threads", fusion=Fusion.ATTENTION),
    _R("layer-norm", "layer_norm", Runs.TORCH, "(residual add +) last-axis layer norm -> F.layer_norm",
       needs=_CPU, fusion=Fusion.LAYER_NORM),
    _R("relu-after-linear", "relu", Runs.TORCH,
       "relu of a large linear, in place on torch's threads (TVM's serial relu writes a new buffer: ~3x torch's "
       "relu_ at this size, one thread)", needs=_CPU, min_size=1 << 17, fusion=Fusion.EPILOGUE),
    _R("activation-epilogue", "activation", Runs.TORCH,
       "sigmoid/gelu after a conv/linear kernel (and a conv's bias add) fused into its call", needs=_CPU,
       fusion=Fusion.EPILOGUE),
    _R("mean", "mean", Runs.TORCH, "large mean of a torch kernel's result -> torch.mean", needs=_CPU,
       min_size=1 << 17, fusion=Fusion.MEAN),
    _R("views", "view", Runs.TORCH,
       "layout chain next to a torch call: strided views in, one torch copy out (attention's views: any size)",
       needs=_CPU, min_size=1 << 17, fusion=Fusion.VIEWS),
    _R("parallel-loop", "loop", Runs.TVM,
       "TVM loop nest run parallel (only in a build that calls no torch kernel: torch's pool owns the cores)",
       "*", min_size=16384),
    _R("default", "*", Runs.TVM, "no rule sends it to torch: TVM legalizes, fuses and schedules it", "*"),
)
_BY_NAME = {r.name: r for r in RULES}


def rule(name: str) -> Rule:
    """The row called ``name`` (its thresholds are what the rewrites use)."""
    return _BY_NAME[name]


def decide(op: str, host: HostFacts, dtype: str = "float32", size: int | None = None) -> Rule:
    """The first row of :data:`RULES` for ``op`` of ``dtype`` and ``size`` on ``host``."""
    return next(r for r in RULES if r.matches(op, host, dtype, size))


def table_lines() -> list[str]:
    """:data:`RULES` as text, one row a line (``mlcomp targets`` and the docs)."""
    out = []
    for r in RULES:
        needs = ",".join(sorted(r.needs)) or "any host"
        size = f" {r.bounds()}" if r.bounds() else ""
        out.append(f"{r.name:<20} {r.op:<15} {r.dtype:<9} {needs:<24}{size} -> {r.runs.value}: {r.reason}")
    return out
