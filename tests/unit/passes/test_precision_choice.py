"""``mixed-precision{dtype=auto}`` decides per target from fake hardware profiles, never this CPU's flags.

Each profile is a :class:`~mlcomp.hardware.probe.PrecisionSpeeds` (matmul seconds per dtype and
the CPU features) handed to the pass in ``PassContext.host_precision``; each target's facts are
the ones its capabilities declare (``Target.facts()``).
"""
from __future__ import annotations

import pytest
import torch

from mlcomp.base.errors import PipelineSpecError
from mlcomp.hardware.probe import PrecisionSpeeds
from mlcomp.ir import Precision
from mlcomp.ir.node import PrecisionReason
from mlcomp.ir.ops import aten
from mlcomp.passes.precision.mixed import MixedPrecision
from mlcomp.passes.precision.policy import DeviceKind
from mlcomp.pipeline import Pipeline
from mlcomp.pipeline.pass_base import PassContext
from tests.helpers.graphs import linear_softmax_exp as tiny
from mlcomp.pipeline.target_facts import LowMode, LowPrecision, TargetFacts
from mlcomp.targets import get_target

SHAPE = (64, 256, 256)
# fake machines: bf16/fp16 matmul time relative to fp32 (1.0) and the CPU's low-precision features
PROFILES = {
    "avx2": PrecisionSpeeds("cpu", SHAPE, {"fp32": 1.0, "bf16": 40.0, "fp16": 45.0}, ("f16c",)),
    "avx512": PrecisionSpeeds("cpu", SHAPE, {"fp32": 1.0, "bf16": 3.0, "fp16": 30.0},
                              ("avx512bw", "avx512f", "avx512_vnni")),
    "avx512-bf16": PrecisionSpeeds("cpu", SHAPE, {"fp32": 1.0, "bf16": 0.55, "fp16": 30.0},
                                   ("avx512_bf16", "avx512f", "avx512_vnni")),
    "amx": PrecisionSpeeds("cpu", SHAPE, {"fp32": 1.0, "bf16": 0.12, "fp16": 0.12},
                           ("amx_bf16", "amx_fp16", "amx_tile", "avx512_bf16", "avx512_fp16", "avx512f")),
}
# target -> the dtype auto picks on each profile (avx2, avx512, avx512-bf16, amx)
EXPECTED = {
    "cpu": ("fp32", "fp32", "bf16", "bf16"),          # torch's kernels: the measured speed decides
    "onnxruntime": ("fp32", "fp32", "bf16", "bf16"),  # native bf16 instructions needed
    "openvino": ("fp32", "fp32", "bf16", "bf16"),     # the CPU plugin's bf16 needs avx512_bf16/amx_bf16
    "tvm": ("fp32", "fp32", "bf16", "bf16"),
}




@pytest.mark.parametrize("target", sorted(EXPECTED))
def test_auto_picks_per_target_and_profile(target):
    facts = get_target(target).facts()
    for profile, want in zip(PROFILES, EXPECTED[target]):
        result = MixedPrecision().run(tiny(), PassContext(target=facts, host_precision=PROFILES[profile]))
        assert result.stats["dtype"] == want, (target, profile, result.stats["choice"])
        assert result.stats["choice"].startswith(f"auto: {want} for target {target}")
        assert result.changed == (want != "fp32")


def test_the_reason_names_what_decided():
    tvm = get_target("tvm").facts()
    said = MixedPrecision().run(tiny(), PassContext(target=tvm, host_precision=PROFILES["avx512"])).stats["choice"]
    assert said == "auto: fp32 for target tvm: its bf16 kernels need avx512_bf16 or amx_bf16, which this CPU lacks"
    ov = get_target("openvino").facts()
    said = MixedPrecision().run(tiny(), PassContext(target=ov, host_precision=PROFILES["amx"])).stats["choice"]
    assert said == ("auto: bf16 for target openvino via openvino's precision hint over the fp32 graph: "
                    "the CPU has avx512_bf16, amx_bf16")
    cpu = get_target("cpu").facts()
    said = MixedPrecision().run(tiny(), PassContext(target=cpu, host_precision=PROFILES["avx512"])).stats["choice"]
    assert said.startswith("auto: fp32 for target cpu: bf16 is not faster on this CPU: 64x256@256x256 matmul")


def test_a_gpu_profile_picks_fp16():
    result = MixedPrecision(device=DeviceKind.CUDA).run(tiny(), PassContext(target=get_target("cpu").facts()))
    assert result.stats["dtype"] == "fp16" and result.stats["choice"].startswith("auto: fp16 on CUDA")


def test_openvino_bf16_is_an_fp32_graph_with_the_precision_recorded():
    """Hint mode: no casts, every value stays fp32; the lowered ops carry bf16 for the runtime's hint."""
    graph = tiny()
    before = graph.format()
    ctx = PassContext(target=get_target("openvino").facts(), host_precision=PROFILES["avx512-bf16"])
    result = MixedPrecision().run(graph, ctx)
    out = result.graph
    assert result.stats["mode"] == "hint" and result.stats["nodes"] == {"bf16": 3, "fp32": 1}
    assert not out.nodes(aten("_to_copy")) and len(out) == len(tiny())
    assert all(n.tensor_meta.dtype == torch.float32 for n in out.call_nodes())
    assert [(n.name, n.ann.precision) for n in out.call_nodes()] == [
        ("t", Precision.BF16), ("addmm", Precision.BF16), ("_softmax", Precision.BF16), ("exp", Precision.FP32)]
    assert before.replace(" ", "") != out.format().replace(" ", "")     # annotations only


def test_explicit_dtype_a_target_does_not_build_is_refused_before_capture():
    bf16_only = TargetFacts("fake", (LowPrecision(torch.bfloat16),))
    with pytest.raises(PipelineSpecError) as err:
        Pipeline.parse("cleanup,mixed-precision{dtype=fp16}").check_target("fake", facts=bf16_only)
    assert "mixed-precision{dtype=fp16}: target fake cannot build fp16 graphs (low precisions it builds: bf16)" \
        in err.value.message
    assert err.value.hint.startswith("use mixed-precision{dtype=bf16} or mixed-precision{dtype=auto}")
    none = TargetFacts("bare", ())
    with pytest.raises(PipelineSpecError, match=r"target bare cannot build bf16 graphs \(low precisions it builds: "
                                                r"none\)"):
        MixedPrecision(dtype="bf16").run(tiny(), PassContext(target=none))
    Pipeline.parse("mixed-precision{dtype=bf16}").check_target("fake", facts=bf16_only)   # built: no error
    auto = MixedPrecision().run(tiny(), PassContext(target=none, host_precision=PROFILES["amx"]))
    assert not auto.changed and auto.stats["choice"] == "auto: fp32, target bare builds no bf16"


def test_ops_a_target_computes_only_in_fp32_stay_fp32():
    facts = TargetFacts("fake", (LowPrecision(torch.bfloat16, fp32_ops=frozenset({"_softmax"})),))
    out = MixedPrecision(dtype="bf16").run(tiny(), PassContext(target=facts)).graph
    softmax = out.node("_softmax")
    assert softmax.ann.precision is Precision.FP32 and softmax.ann.precision_reason is PrecisionReason.TARGET
    assert softmax.tensor_meta.dtype == torch.float32 and softmax.inputs[0].name == "addmm_f32"   # fp32 math
    assert out.node("addmm").ann.precision is Precision.BF16


def test_without_facts_auto_stays_fp32_and_says_why():
    result = MixedPrecision().run(tiny(), PassContext())
    assert not result.changed
    assert result.stats["choice"] == ("auto: fp32 for target cpu: no measured speeds were given "
                                      "(PassContext.host_precision)")
    hint = TargetFacts("ov", (LowPrecision(torch.bfloat16, LowMode.HINT, needs=("amx_bf16",)),))
    said = MixedPrecision().run(tiny(), PassContext(target=hint)).stats["choice"]
    assert said.endswith("no CPU features were given (PassContext.host_precision)")
