"""Small GEMMs stay TVM code when this host measures them faster there than a torch call.

On tiny transformers (HF BERT/ViT/GPT-2 with hidden 64 at batch 2) each GEMM is a few µs of
arithmetic: a packed call into torch (``tvm.offload.rewrite``) then costs more than the product, between
the VM's call (argument conversion, the Python body, the result handed back) and torch's
dispatch and output allocation.  A register-tiled TVM kernel needs none of that.  Which GEMMs are
small enough is not assumed: :func:`gemm_calls` lists the offloaded ``linear``/``matmul`` calls of a
build, the backend compiles each distinct one both ways into one probe module and times them on
this host with the build's thread count (:func:`measure_gemms`: per call
:func:`~mlcomp.targets.tvm.offload.probe_timing.judge`, batched samples decided by
:func:`mlcomp.hardware.decide.decide`, the torch call the default, a wild ratio re-measured), and
:func:`kept_calls` keeps in TVM the ones a sign test decided take under :data:`KEEP_RATIO` of the
torch call's time.  A deterministic build probes nothing: every GEMM stays a torch call.
:func:`keep_in_tvm` turns those calls back into Relax, where ``SmallMatmul``
(:func:`mlcomp.targets.tvm.schedules.small_matmul_rule`) schedules them, in the probe module as in
the build (both serial: a build that calls torch or kept a probed GEMM adds no parallel loop)::

    before:  lv9 = R.call_pure_packed("mlcomp.torch.linear", lv7, <w [64, 64] as [N, K]>, <b [64]>, ty_args=…)
    after:   lv = R.matmul(lv7, <w as [K, N]>);  lv9 = R.add(lv, <b>)        # fused_matmul_add, TVM code

    SmallMatmul (i by 4 rows, j by two 8-lane vectors, k serial; epilogue at the tile):
             for i0, j0:  for k:  for i1 in T.unroll(4):  for j1 in T.vectorized(16):  C[i, j] += A[i, k] * B[k, j]
                          for i1, j1 in T.grid(4, 16):  out[i, j] = C[i, j] + b[j]

Large products run faster in torch's blocked GEMM, so products above :data:`PROBE_MAX_MACS`
are not probed (a bound on the probe's compile time).  A ``linear_gelu`` is a candidate too: its
gelu becomes TOPI's vectorised ``fast_erf`` (:mod:`mlcomp.targets.tvm.fast_math`) fused into the
GEMM's epilogue.  So is a (residual add +) layer norm (``add_layer_norm``), back as
``R.nn.layer_norm(R.add(a, b), …)``: a small model whose every such call stays TVM code never wakes
torch's thread pool (on busy cores a multi-threaded torch kernel waits for its other threads).
"""
from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from mlcomp.hardware.probe import vector_bits as host_vector_bits
from mlcomp.hardware.decide import Decision
from mlcomp.hardware.noise import Load, LoadWatch
from mlcomp.hardware.threads import threads as torch_threads
from mlcomp.targets.tvm.offload.chains import (
    bindings_of,
    kernel_name,
    rebuild,
    static_shape,
    ty_of,
)
from mlcomp.targets.tvm.offload.policy import rule
from mlcomp.targets.tvm.offload.probe_timing import KEEP_RATIO, PROBE_TIMING, judge

__all__ = [
    "KEEP_RATIO",
    "PROBE_MAX_MACS",
    "PROBE_TIMING",
    "GemmCall",
    "SmallGemmReport",
    "gemm_calls",
    "keep_in_tvm",
    "kept_calls",
    "keep_small_gemms",
    "measure_gemms",
    "patch_convs",
    "probe_module",
]

_LINEAR = "mlcomp.torch.linear"
_LINEAR_GELU = "mlcomp.torch.linear_gelu"
_MATMUL = "mlcomp.torch.matmul"
_KINDS = {_LINEAR: "linear", _LINEAR_GELU: "linear_gelu", _MATMUL: "matmul"}
# (residual add +) layer norm: a torch call whose kernel is a few µs; as TVM code it needs no thread pool
_NORMS = {"mlcomp.torch.layer_norm": "layer_norm", "mlcomp.torch.add_layer_norm": "add_layer_norm",
          "mlcomp.torch.add_layer_norm_reuse": "add_layer_norm"}
PROBE_MAX_MACS = rule("small-gemm").max_size   # policy row small-gemm: larger products are left to torch unprobed (the probe's compile time)
DETERMINISTIC_RULE = "deterministic build: nothing probed, every offloaded GEMM stays a torch call"


@dataclass(frozen=True, order=True)
class GemmCall:
    """One offloaded call the probe may keep in TVM, by kind and argument shapes: ``linear`` (``a`` by a
    constant ``[K, N]`` weight plus a bias), ``linear_gelu`` (then exact gelu), ``matmul`` (two activations,
    Relax's broadcasting ``matmul``), or a last-axis ``layer_norm`` / ``add_layer_norm`` of ``a``."""

    kind: str                     # "linear", "linear_gelu", "matmul"; "layer_norm", "add_layer_norm"
    a: tuple[int, ...]
    b: tuple[int, ...]            # linear: (K, N), the weight as Relax multiplies by it; norms: (N,)
    eps: float = 0.0              # norms' epsilon

    @property
    def m(self) -> int:
        return self.a[-2] if len(self.a) > 1 else 1

    @property
    def n(self) -> int:
        return self.b[-1]

    @property
    def norm(self) -> bool:
        return self.kind in ("layer_norm", "add_layer_norm")

    @property
    def macs(self) -> int:
        """Multiply-adds of a product; a norm's element count."""
        if self.norm:
            return math.prod(self.a)
        rows = 1
        for d in (self.a[:-2] if self.kind == "matmul" else self.a[:-1]):
            rows *= d
        if self.kind == "matmul":
            rows *= self.m
        return rows * self.a[-1] * self.n

    def describe(self) -> str:
        if self.norm:
            return f"{self.kind} {'x'.join(map(str, self.a))}"
        return f"{self.kind} {'x'.join(map(str, self.a))} @ {'x'.join(map(str, self.b))}"


def gemm_calls(func: Any, vector_lanes: int) -> dict[Any, GemmCall]:
    """The bindings of ``func`` that call torch's plain ``linear``/``linear_gelu``/``matmul`` or (add +)
    layer norm and could be TVM code instead: float32, static shapes, a product's N a multiple of
    ``vector_lanes`` or at most two vectors wide (the kernel's vector loop), at most
    :data:`PROBE_MAX_MACS` multiply-adds (a norm: elements).  O(bindings)."""
    out: dict[Any, GemmCall] = {}
    bound, _, _ = bindings_of(func)
    for var, value in bound.items():
        name = kernel_name(value)
        if name in _NORMS:
            norm = _norm_call(_NORMS[name], value)
            if norm is not None and norm.macs <= PROBE_MAX_MACS:
                out[var] = norm
            continue
        if name not in _KINDS:
            continue
        args = value.args[1:]
        shapes = [static_shape(a) for a in args[:2]]
        if None in shapes or any(str(ty_of(a).dtype) != "float32" for a in args[:2]) or len(shapes[1]) < 2:
            continue
        if name != _MATMUL:
            if len(args) < 3 or not hasattr(args[1], "value") or static_shape(args[2]) != (shapes[1][0],):
                continue
            call = GemmCall(_KINDS[name], shapes[0], (shapes[1][1], shapes[1][0]))
        else:
            if len(shapes[0]) < 2:
                continue
            call = GemmCall("matmul", shapes[0], shapes[1])
        # the call's Relax types must be the product's (a views rewrite may type an argument by its memory)
        if call.a[-1] != call.b[-2] or static_shape(value) != _out_shape(call):
            continue
        if (call.n % vector_lanes == 0 or call.n <= 2 * vector_lanes) and call.macs <= PROBE_MAX_MACS:
            out[var] = call
    return out


def _norm_call(kind: str, value: Any) -> GemmCall | None:
    """The :class:`GemmCall` of a (residual add +) layer-norm call, when float32 and static."""
    args = value.args[1:]
    inputs = args[:2] if kind == "add_layer_norm" else args[:1]
    shapes = {static_shape(a) for a in inputs} | {static_shape(value)}
    if len(shapes) != 1 or None in shapes or not _float32(*inputs, *args[-3:-1]):
        return None
    shape = shapes.pop()
    if static_shape(args[-3]) != shape[-1:] or static_shape(args[-2]) != shape[-1:]:
        return None
    return GemmCall(kind, shape, shape[-1:], float(args[-1].value))


def patch_convs(func: Any) -> Any:
    """Each small float32 NCHW conv2d whose stride equals its kernel (no padding, dilation or groups: ViT's
    patch embedding) as the GEMM it is: non-overlapping patches (a TVM copy) by the ``[O, C·kh·kw]``
    weight in ``mlcomp.torch.linear``, which the probe may then keep as TVM code.  Only products of at most :data:`PROBE_MAX_MACS` multiply-adds.  O(n)."""
    import numpy as np
    from tvm import relax
    from tvm.relax.dpl import is_const, is_op, rewrite_call, wildcard

    def rewrite(call: Any, _m: Any) -> Any:
        x, w = call.args
        a, xs, ws = call.attrs, static_shape(x), static_shape(w)
        if xs is None or ws is None or not hasattr(w, "value") or len(xs) != 4 or not _float32(call, x, w):
            return call
        (b, c, h, wd), (o, _, kh, kw) = xs, ws
        plain = (str(a.data_layout), str(a.kernel_layout), str(a.out_layout) or "NCHW") == ("NCHW", "OIHW", "NCHW")
        if not plain or [int(v) for v in a.strides] != [kh, kw] or any(int(v) for v in a.padding) \
                or any(int(v) != 1 for v in a.dilation) or int(a.groups) != 1 or h % kh or wd % kw:
            return call
        rows = b * (h // kh) * (wd // kw)
        if rows * c * kh * kw * o > PROBE_MAX_MACS:
            return call
        patches = relax.op.reshape(relax.op.permute_dims(relax.op.reshape(x, (b, c, h // kh, kh, wd // kw, kw)),
                                                         [0, 2, 4, 1, 3, 5]), (rows, c * kh * kw))
        weight = relax.const(np.ascontiguousarray(np.from_dlpack(w.value).reshape(o, c * kh * kw)))
        zero = relax.const(np.zeros((o,), dtype="float32"))
        out = relax.call_pure_packed(_LINEAR, patches, weight, zero,
                                     ty_args=relax.TensorType((rows, o), "float32"))
        return relax.op.permute_dims(relax.op.reshape(out, (b, h // kh, wd // kw, o)), [0, 3, 1, 2])

    return rewrite_call(is_op("relax.nn.conv2d")(wildcard(), is_const()), rewrite, func)


def _float32(*exprs: Any) -> bool:
    return all(str(ty_of(e).dtype) == "float32" for e in exprs)


def kept_calls(decisions: Mapping[GemmCall, Decision]) -> frozenset[GemmCall]:
    """The calls to keep as TVM code: those whose decision chose ``tvm`` over the torch call."""
    return frozenset(c for c, d in decisions.items() if d.choice == "tvm")


def keep_in_tvm(func: Any, calls: Mapping[Any, GemmCall], chosen: frozenset[GemmCall]) -> Any:
    """``func`` with the bindings of ``calls`` whose call is in ``chosen`` back as Relax ``matmul`` (+ ``add``)."""
    import numpy as np
    from tvm import relax

    new = {}
    bound, _, _ = bindings_of(func)
    for var, call in calls.items():
        if call not in chosen:
            continue
        args = bound[var].args[1:]
        if call.norm:
            x = relax.op.add(args[0], args[1]) if call.kind == "add_layer_norm" else args[0]
            new[var] = relax.op.nn.layer_norm(x, args[-3], args[-2], axes=[-1], epsilon=call.eps)
        elif call.kind != "matmul":
            weight = relax.const(np.ascontiguousarray(np.from_dlpack(args[1].value).T))   # [N, K] -> [K, N]
            new[var] = relax.op.add(relax.op.matmul(args[0], weight), args[2])
            if call.kind == "linear_gelu":
                new[var] = relax.op.nn.gelu(new[var])
        else:
            new[var] = relax.op.matmul(args[0], args[1])
    return rebuild(func, new)


def probe_module(calls: list[GemmCall], seed: int = 0) -> Any:
    """A Relax module with, per call ``i``, ``tvm_i`` (the product as Relax) and ``torch_i`` (the packed call
    the offload made), on random constants of the call's shapes: what :func:`measure_gemms` times."""
    import numpy as np
    import tvm
    from tvm import relax

    rng = np.random.default_rng(seed)
    bb = relax.BlockBuilder()
    for i, call in enumerate(calls):
        out_ty = relax.TensorType(_out_shape(call), "float32")
        for variant in ("tvm", "torch"):
            a = relax.Var("a", relax.TensorType(call.a, "float32"))
            second = call.kind in ("matmul", "add_layer_norm")
            params = [a, relax.Var("b", relax.TensorType(call.a if call.norm else call.b, "float32"))] if second \
                else [a]
            with bb.function(f"{variant}_{i}", params):
                with bb.dataflow():
                    if call.norm:
                        gamma, beta = (relax.const(rng.standard_normal(call.b, dtype=np.float32)) for _ in "gb")
                        y = (relax.op.nn.layer_norm(relax.op.add(*params) if second else a, gamma, beta, axes=[-1],
                                                    epsilon=call.eps) if variant == "tvm" else
                             relax.call_pure_packed(f"mlcomp.torch.{call.kind}", *params, gamma, beta,
                                                    relax.prim_value(call.eps), ty_args=out_ty))
                    elif call.kind != "matmul":
                        w = rng.standard_normal(call.b, dtype=np.float32)
                        bias = relax.const(rng.standard_normal((call.n,), dtype=np.float32))
                        y = (relax.op.add(relax.op.matmul(a, relax.const(w)), bias) if variant == "tvm" else
                             relax.call_pure_packed(f"mlcomp.torch.{call.kind}", a,
                                                    relax.const(np.ascontiguousarray(w.T)), bias, ty_args=out_ty))
                        if variant == "tvm" and call.kind == "linear_gelu":
                            y = relax.op.nn.gelu(bb.emit(y))
                    else:
                        y = (relax.op.matmul(*params) if variant == "tvm" else
                             relax.call_pure_packed(_MATMUL, *params, ty_args=out_ty))
                    out = bb.emit_output(y)
                bb.emit_func_output(out)
    return tvm.IRModule(dict(bb.get().functions))


def _out_shape(call: GemmCall) -> tuple[int, ...]:
    if call.norm:
        return call.a
    if call.kind != "matmul":
        return (*call.a[:-1], call.n)
    lead = max(call.a[:-2], call.b[:-2], key=len)   # Relax broadcasts the leading axes; equal ranks here
    return (*lead, call.m, call.n)


def measure_gemms(calls: list[GemmCall], executable: Any,
                  judge: Callable[[GemmCall, Callable, Callable], Decision],
                  seed: int = 0) -> dict[GemmCall, Decision]:
    """A :class:`~mlcomp.hardware.decide.Decision` per call, by ``judge(call, tvm_fn, torch_fn)`` on the
    compiled :func:`probe_module` ``executable`` (a VM per probe, random float32 inputs)."""
    import torch
    import tvm
    from tvm import relax

    vm = relax.VirtualMachine(executable, tvm.cpu(0))
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for i, call in enumerate(calls):
        args = [torch.randn(call.a, generator=gen)]
        if call.kind in ("matmul", "add_layer_norm"):
            args.append(torch.randn(call.a if call.norm else call.b, generator=gen))
        fn_tvm, fn_torch = vm[f"tvm_{i}"], vm[f"torch_{i}"]
        out[call] = judge(call, lambda f=fn_tvm, a=args: f(*a), lambda f=fn_torch, a=args: f(*a))
    return out


@dataclass
class SmallGemmReport:
    """What the probe measured and decided, for ``stats["small_gemms"]``."""

    decisions: dict
    chosen: frozenset
    seconds: float
    load: Load | None = None       # what other processes did while the probe ran

    def to_json(self) -> dict[str, Any]:
        rows = [{"call": c.describe(), "macs": c.macs, "tvm_us": round(d.medians.get("tvm", 0.0) * 1e6, 2),
                 "torch_us": round(d.medians.get("torch", 0.0) * 1e6, 2),
                 "runs_in": "tvm" if c in self.chosen else "torch", "why": d.why}
                for c, d in sorted(self.decisions.items())]
        return {"rule": f"TVM code where a sign test decided it takes < {KEEP_RATIO} x the torch call (probed up "
                        f"to {PROBE_MAX_MACS} MACs)",
                "probe": rows, "kept_in_tvm": sum(1 for c in self.decisions if c in self.chosen),
                "probe_seconds": round(self.seconds, 2),
                "probe_load": self.load.to_json() if self.load is not None else None,
                "decisions": [d.to_json() for _, d in sorted(self.decisions.items())]}


def keep_small_gemms(mod: Any, report: Any, stats: dict, threads: int | None,
                     compile_probe: Callable[[Any], Any], deterministic: bool = False) -> Any:
    """``mod`` with the offloaded GEMMs this host runs faster as TVM code turned back into Relax.

    Each distinct candidate (:func:`gemm_calls`) goes both ways into one :func:`probe_module`, which
    ``compile_probe`` builds as the backend builds ``mod``; it is timed here with ``threads`` torch
    threads (set for the probe and put back).  ``report`` (the offload's ``OffloadReport``) and
    ``stats["small_gemms"]`` say what moved.  ``deterministic``: nothing is probed, every GEMM stays
    a torch call (``stats["small_gemms"]`` records that fixed rule).
    """
    from tvm import relax

    t0 = time.perf_counter()
    lanes = max(1, host_vector_bits() // 32)
    found = {gv: gemm_calls(f, lanes) for gv, f in mod.functions.items() if isinstance(f, relax.Function)}
    calls = sorted({c for per in found.values() for c in per.values()})
    if not calls:
        return mod
    if deterministic:
        stats["small_gemms"] = {"rule": DETERMINISTIC_RULE, "decisions": [Decision.fixed(
            "tvm: small GEMMs as TVM code or torch calls?", ("torch", "tvm"), "torch", DETERMINISTIC_RULE).to_json()]}
        return mod
    executable = compile_probe(probe_module(calls))
    watch = LoadWatch()
    watch.start()
    with torch_threads(threads):
        decisions = measure_gemms(calls, executable, _judge)
    load = watch.stop()
    chosen = kept_calls(decisions)
    for gv, per in found.items():
        bound, _, _ = bindings_of(mod[gv])
        for var, call in per.items():
            if call in chosen:
                name = kernel_name(bound[var])
                report.kernels[name] -= 1
                if report.kernels[name] <= 0:
                    del report.kernels[name]
                report.kept[call.kind, "small, measured faster as TVM code (tvm_gemm)"] += 1
        if any(c in chosen for c in per.values()):
            mod[gv] = keep_in_tvm(mod[gv], per, chosen)
    stats["small_gemms"] = SmallGemmReport(decisions, chosen, time.perf_counter() - t0, load).to_json()
    return mod


def _judge(call: GemmCall, tvm_fn: Callable[[], Any], torch_fn: Callable[[], Any]) -> Decision:
    """Whether one probed GEMM stays a torch call (the default) or becomes TVM code
    (:func:`~mlcomp.targets.tvm.offload.probe_timing.judge`: batched paired rounds, a few ms)."""
    return judge(f"tvm: {call.describe()} as TVM code or a torch call?", tvm_fn, torch_fn,
                 one_thread=lambda: torch_threads(1))
