"""How ``mixed-precision`` chooses its dtype: from the target's facts and the host's, never a probe.

The choice reads only ``PassContext``: ``ctx.target`` (a
:class:`~mlcomp.pipeline.target_facts.TargetFacts`: which low precisions the target
builds, how, and which CPU features make them pay), ``ctx.host_precision`` (the
host's measured matrix-product speeds and CPU features) and ``ctx.hardware`` (a
spec sheet).  With ``dtype=auto`` on a CPU:

=================================  ========================================================
target declares for bf16           auto picks bf16 when
=================================  ========================================================
nothing                            never (fp32, "target X builds no bf16")
``needs`` CPU features (openvino,  the host has one of them (``avx512_bf16``, ``amx_bf16``)
tvm, onnxruntime)
no ``needs`` (torch cpu)           the spec sheet's bf16 peak is 1.1x fp32's, else torch's
                                   bf16 matmul was measured faster than fp32 (ratio < 0.9)
=================================  ========================================================

An explicit ``dtype=bf16``/``fp16`` that the target does not build is refused
(:func:`refusal`, before capture through ``check_target_facts``).  A target that
builds a dtype in hint mode (OpenVINO) gets the graph unchanged with each node's
precision recorded (:func:`annotate`); its runtime sets the precision hint::

    >>> from mlcomp.hardware.probe import PrecisionSpeeds
    >>> ctx = PassContext(target=TargetFacts("tvm", (LowPrecision(torch.bfloat16, needs=("avx512_bf16",)),)),
    ...                   host_precision=PrecisionSpeeds("cpu", (64, 256, 256), {"fp32": 1.0, "bf16": 0.5},
    ...                                                  ("avx512f",)))
    >>> choose("auto", DeviceKind.CPU, ctx)[2]
    'auto: fp32 for target tvm: its bf16 kernels need avx512_bf16, which this CPU lacks'
"""
from __future__ import annotations

import torch

from mlcomp.hardware.decide import Decision
from mlcomp.ir import Graph, Precision, refs_in
from mlcomp.ir.node import PrecisionReason
from mlcomp.ir.ops import PARAM
from mlcomp.passes.precision.policy import DeviceKind, Rule
from mlcomp.pipeline.pass_base import PassContext
from mlcomp.base.errors import PipelineSpecError
from mlcomp.pipeline.target_facts import LowMode, LowPrecision, TargetFacts

__all__ = ["LOW_DTYPES", "SLOW_FP16", "DETERMINISTIC_RULE", "annotate", "auto_decision", "choose", "refusal",
           "refused"]

LOW_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16"}
_PRECISION = {torch.float32: Precision.FP32, torch.bfloat16: Precision.BF16, torch.float16: Precision.FP16}
SLOW_FP16 = 2.0     # fp16 matmul this many times the fp32 time on a CPU: a note
DETERMINISTIC_RULE = "fp32 (deterministic compile: nothing measured, no spec sheet given)"


def choose(asked: str, device: DeviceKind, ctx: PassContext
           ) -> tuple[torch.dtype | None, LowPrecision | None, str, list[str]]:
    """(low dtype or None, how the target builds it, why, notes) for option ``dtype=asked``."""
    facts = ctx.target or TargetFacts(device.value)      # no target given: torch's own kernels
    if asked == "fp32":
        return None, None, "dtype=fp32: the graph stays fp32", []
    low = LOW_DTYPES.get(asked)
    if low is not None:                                  # asked for: built if the target can
        support = facts.support(low)
        if support is None:
            raise refused(facts, low)
        return low, support, f"dtype={_NAMES[low]} (asked for){_how(facts, support)}", _slow_note(low, device, ctx)
    low = torch.float16 if device is DeviceKind.CUDA else torch.bfloat16
    support = facts.support(low)
    if support is None:
        return None, None, f"auto: fp32, target {facts.name} builds no {_NAMES[low]}", []
    if device is DeviceKind.CUDA:
        return low, support, "auto: fp16 on CUDA (tensor cores; the range guard keeps overflowing nodes fp32)", []
    pays, why = _pays(support, ctx)
    return (low if pays else None), support, \
        f"auto: {_NAMES[low] if pays else 'fp32'} for target {facts.name}{_how(facts, support)}: {why}", []


def auto_decision(asked: str, device: DeviceKind, ctx: PassContext, low: torch.dtype | None,
                  why: str) -> Decision | None:
    """The manifest's record of a ``dtype=auto`` choice: the host probe's own :class:`Decision` where the
    choice followed a measurement (paired rounds, sign test), else a fixed rule saying ``why``."""
    if asked != "auto":
        return None
    name = "fp16" if device is DeviceKind.CUDA else "bf16"
    chosen = _NAMES.get(low, "fp32")
    speeds = ctx.host_precision
    support = (ctx.target or TargetFacts(device.value)).support(LOW_DTYPES[name])
    measured = (device is DeviceKind.CPU and support is not None and not support.needs    # what _pays timed
                and not (ctx.hardware is not None and name in ctx.hardware.peak_flops)
                and speeds is not None and name in speeds.decisions)
    if measured:
        return speeds.decisions[name]
    return Decision.fixed(f"mixed-precision dtype=auto on {device.value}: {name} or fp32?", ("fp32", name), chosen,
                          why, deterministic=ctx.deterministic)


def refusal(facts: TargetFacts, low: torch.dtype) -> tuple[str, str]:
    """(message, hint) refusing ``low`` on a target that does not build it, naming the alternatives."""
    others = [lp for lp in facts.low_precision if lp.dtype != low]
    alt = f"mixed-precision{{dtype={_NAMES[others[0].dtype]}}} or " if others else ""
    return (f"mixed-precision{{dtype={_NAMES[low]}}}: target {facts.name} cannot build {_NAMES[low]} graphs "
            f"(low precisions it builds: {facts.low_names()})",
            f"use {alt}mixed-precision{{dtype=auto}} (auto picks what {facts.name} builds and what pays on this "
            f"host), or a target whose line in `mlcomp targets` lists {_NAMES[low]} under mixed precision")


def refused(facts: TargetFacts, low: torch.dtype) -> PipelineSpecError:
    message, hint = refusal(facts, low)
    return PipelineSpecError(message, hint=hint)


def _how(facts: TargetFacts, support: LowPrecision) -> str:
    return (f" via {facts.name}'s precision hint over the fp32 graph" if support.mode is LowMode.HINT else "")


def _pays(support: LowPrecision, ctx: PassContext) -> tuple[bool, str]:
    """Whether computing in ``support.dtype`` pays on the target, from the context's facts (never a probe)."""
    name = _NAMES[support.dtype]
    speeds = ctx.host_precision
    if ctx.deterministic and speeds is None and not (ctx.hardware and name in ctx.hardware.peak_flops):
        return False, DETERMINISTIC_RULE
    if support.needs:                 # the target's kernels need native instructions
        if speeds is None:
            return False, "no CPU features were given (PassContext.host_precision)"
        have = [f for f in support.needs if f in speeds.cpu_flags]
        if have:
            return True, f"the CPU has {', '.join(have)}"
        return False, f"its {name} kernels need {' or '.join(support.needs)}, which this CPU lacks"
    spec = ctx.hardware
    if spec is not None and name in spec.peak_flops:   # torch's kernels: a spec sheet or a measurement
        fp32, peak = spec.peak_flops.get("fp32", 0.0), spec.peak_flops[name]
        return peak > 1.1 * fp32, (f"from the hardware spec {spec.name}: {name} peak {peak / 1e9:.3g} GFLOP/s "
                                   f"vs fp32 {fp32 / 1e9:.3g} GFLOP/s")
    if speeds is None or name not in speeds.seconds:
        return False, "no measured speeds were given (PassContext.host_precision)"
    if speeds.faster(name):
        return True, f"measured faster than fp32: {speeds.describe(name)}"
    return False, f"{name} is not faster on this CPU: {speeds.describe(name)}"


def _slow_note(low: torch.dtype, device: DeviceKind, ctx: PassContext) -> list[str]:
    """fp16 asked for on a CPU measured much slower in it than in fp32: a note (it still runs, slowly)."""
    speeds = ctx.host_precision
    if low != torch.float16 or device is not DeviceKind.CPU or speeds is None or "fp16" not in speeds.seconds:
        return []
    if speeds.ratio("fp16") <= SLOW_FP16:
        return []
    return [f"fp16 on this CPU is {speeds.ratio('fp16'):.0f}x slower than fp32 ({speeds.describe('fp16')}); "
            "the graph runs in fp16 as asked, slowly. Use dtype=auto (or bf16 where the CPU has it)"]


def annotate(graph: Graph, plan: dict[str, tuple[Rule, PrecisionReason]], low: torch.dtype) -> dict[str, int]:
    """Hint mode: each planned node's precision recorded for the runtime, the graph's values left fp32.

    A lowered op is ``low``; a follower is ``low`` when every activation it reads is
    (weights do not vote, as in graph mode); the rest fp32.  Returns node counts per precision.
    """
    lowered: set[str] = set()
    for name in graph.order():
        if name not in plan:
            continue
        node = graph.node(name)
        rule, reason = plan[name]
        reads = [r.name for r in refs_in(node.inputs) if graph.node(r.name).op != PARAM]   # weights never vote
        is_low = rule is Rule.LOWER or (rule is Rule.FOLLOW and all(r in lowered for r in reads))
        if is_low:
            lowered.add(name)
        graph.replace(node.with_ann(precision=_PRECISION[low if is_low else torch.float32],
                                    precision_reason=reason))
    return {_PRECISION[low].value: len(lowered), Precision.FP32.value: len(plan) - len(lowered)}


