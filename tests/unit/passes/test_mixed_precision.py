"""mixed-precision (issue 10): policy tables, casts, weights cast once, range guard, tolerance, options.

Golden IR before/after on small built graphs for the cpu and cuda tables; numbers against
the input graph within the declared tolerance; the stats the pass reports.  The zoo and
training graphs are in ``test_mixed_precision_zoo.py``.
"""
from __future__ import annotations

import re
import warnings

import pytest
import torch
from torch import nn

from mlcomp.analysis.ranges import ErrorGrowth, calibrate, declared_tolerance, error_growth
from mlcomp.base.errors import PipelineSpecError, VerificationError
from mlcomp.frontend.loading import load_model
from mlcomp.hardware.probe import host_precision_speeds
from mlcomp.hardware.spec import HardwareSpec
from mlcomp.ir import Precision
from mlcomp.ir.builder import GraphBuilder
from mlcomp.ir.interpreter import Interpreter
from mlcomp.ir.node import PrecisionReason
from mlcomp.ir.ops import PARAM, aten
from mlcomp.passes.precision.mixed import MixedPrecision, MixedPrecisionWarning
from mlcomp.passes.precision.policy import DeviceKind, PolicyName, Rule, policy_table, rule_for
from mlcomp.pipeline import Pipeline, run_pipeline
from mlcomp.pipeline.pass_base import PassContext
from tests.helpers.graphs import linear_softmax_exp as tiny

TO_COPY = aten("_to_copy")




BEFORE = """graph tiny(%x: f32[2, 8]) {
  %fc.weight: f32[4, 8] = param   # fc
  %fc.bias: f32[4] = param   # fc
  %t: f32[8, 4] = aten.t.default(%fc.weight)   # fc
  %addmm: f32[2, 4] = aten.addmm.default(%fc.bias, %x, %t)   # fc
  %_softmax: f32[2, 4] = aten._softmax.default(%addmm, -1, False)   # act
  %exp: f32[2, 4] = aten.exp.default(%_softmax)   # act
  return (%exp,)
}"""

AFTER_CPU = """graph tiny(%x: f32[2, 8]) {
  %fc.weight: bf16[4, 8] = param   # fc
  %fc.bias: bf16[4] = param   # fc
  %t: bf16[8, 4] = aten.t.default(%fc.weight)   # fc {precision=bf16, precision_reason=policy}
  %x_bf16: bf16[2, 8] = aten._to_copy.default(%x, dtype=bf16)   # {precision=bf16}
  %addmm: bf16[2, 4] = aten.addmm.default(%fc.bias, %x_bf16, %t)   # fc {precision=bf16, precision_reason=policy}
  %_softmax: bf16[2, 4] = aten._softmax.default(%addmm, -1, False)   # act {precision=bf16, precision_reason=policy}
  %_softmax_f32: f32[2, 4] = aten._to_copy.default(%_softmax, dtype=f32)   # act {precision=fp32}
  %exp: f32[2, 4] = aten.exp.default(%_softmax_f32)   # act {precision=fp32, precision_reason=policy}
  return (%exp,)
}"""

AFTER_CUDA = """graph tiny(%x: f32[2, 8]) {
  %fc.weight: bf16[4, 8] = param   # fc
  %fc.bias: bf16[4] = param   # fc
  %t: bf16[8, 4] = aten.t.default(%fc.weight)   # fc {precision=bf16, precision_reason=policy}
  %x_bf16: bf16[2, 8] = aten._to_copy.default(%x, dtype=bf16)   # {precision=bf16}
  %addmm: bf16[2, 4] = aten.addmm.default(%fc.bias, %x_bf16, %t)   # fc {precision=bf16, precision_reason=policy}
  %addmm_f32: f32[2, 4] = aten._to_copy.default(%addmm, dtype=f32)   # fc {precision=fp32}
  %_softmax: f32[2, 4] = aten._softmax.default(%addmm_f32, -1, False)   # act {precision=fp32, precision_reason=policy}
  %exp: f32[2, 4] = aten.exp.default(%_softmax)   # act {precision=fp32, precision_reason=policy}
  return (%exp,)
}"""


@pytest.mark.parametrize("device, golden", [("cpu", AFTER_CPU), ("cuda", AFTER_CUDA)])
def test_policy_tables_golden_ir(device, golden):
    g = tiny()
    assert g.format() == BEFORE
    out, report = run_pipeline(g, f"mixed-precision{{dtype=bf16 device={device}}}", verify=True)
    assert out.format() == golden
    stats = report.records[0].stats
    assert stats["dtype"] == "bf16" and stats["casts_inserted"] == 2 and stats["weight_casts"] == 0
    assert stats["param_bytes_before"] == 144 and stats["param_bytes_after"] == 72   # weights halved, once
    assert stats["declared_tolerance"] == declared_tolerance(out).rtol and stats["warnings"] == []
    assert report.records[0].max_error <= stats["declared_tolerance"]           # numbers vs the input graph


def test_policy_table_rules_by_device():
    cpu, cuda = (policy_table(PolicyName.DEFAULT, d) for d in DeviceKind)
    assert rule_for(cpu, aten("convolution"))[0] is rule_for(cuda, aten("convolution"))[0] is Rule.LOWER
    assert rule_for(cpu, aten("_softmax"))[0] is Rule.FOLLOW and rule_for(cuda, aten("_softmax"))[0] is Rule.WIDEN
    for op in ("exp", "log", "pow.Tensor_Scalar", "sum.dim_IntList", "nll_loss_forward", "_log_softmax"):
        assert rule_for(cpu, aten(op))[0] is Rule.KEEP_FP32, op
    assert rule_for(cpu, aten("relu"))[0] is Rule.FOLLOW and rule_for(cpu, aten("view"))[0] is Rule.FOLLOW
    assert rule_for(cpu, aten("some_unknown_op"))[0] is Rule.KEEP_FP32
    only = policy_table(PolicyName.COMPUTE_ONLY, DeviceKind.CPU)
    assert rule_for(only, aten("relu"))[0] is Rule.KEEP_FP32 and rule_for(only, aten("mm"))[0] is Rule.LOWER
    assert rule_for(only, aten("permute"))[0] is Rule.FOLLOW


def test_compute_only_casts_around_products():
    out, report = run_pipeline(tiny(), "mixed-precision{dtype=bf16 policy=compute-only}", verify=True)
    assert out.node("_softmax").ann.precision is Precision.FP32
    assert out.node("addmm").ann.precision is Precision.BF16


def test_cast_pairs_cancel_in_cleanup():
    """A model that upcasts its bf16 input: the pass asks for bf16 again; cleanup cancels the exact pair."""
    b = GraphBuilder("pair")
    x = b.input("x", (2, 8), torch.bfloat16)
    up = b.call(TO_COPY, x, dtype=torch.float32)
    w = b.param("fc.weight", torch.randn(8, 4))
    g = b.output(b.call(aten("exp"), b.call(aten("mm"), up, w)))
    out, _ = run_pipeline(g, "mixed-precision{dtype=bf16}")
    casts = [n for n in out.nodes(TO_COPY)]
    assert [n.name for n in casts] == ["_to_copy", "_to_copy_bf16", "mm_f32"]
    clean, report = run_pipeline(out, "cleanup", verify=True)
    assert clean.node("mm").inputs[0].name == "x"             # bf16 → f32 → bf16 is gone
    assert [n.name for n in clean.nodes(TO_COPY)] == ["mm_f32"]
    assert report.records[0].children[0].stats["casts_removed"] >= 1


class Loud(nn.Module):
    """fc1's activations reach ~1e5 (> fp16's 65504); they are scaled back before fc2."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(8, 8), nn.Linear(8, 4)
        with torch.no_grad():
            self.fc1.weight.mul_(2e5)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(x)) * 1e-5)


def test_range_guard_keeps_overflowing_nodes_fp32():
    with torch.random.fork_rng():
        torch.manual_seed(0)
        module = Loud().eval()
    x = (torch.randn(4, 8, generator=torch.Generator().manual_seed(0)),)
    g = load_model(module, example_inputs=x).capture()
    ranges = calibrate(g, [x])
    assert ranges["addmm"].absmax > 65504 and ranges["addmm"].overflows(torch.float16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MixedPrecisionWarning)       # fp16 on a CPU: measured slow
        out, report = run_pipeline(g, "mixed-precision{dtype=fp16}", example_inputs=x, verify=True)
    stats = report.records[0].stats
    assert out.node("addmm").ann.precision is Precision.FP32
    assert out.node("addmm").ann.precision_reason is PrecisionReason.OVERFLOW
    assert set(stats["range_guard"]) == {"permute", "addmm", "relu"}          # fc1.weight itself is > 65504
    assert stats["range_guard"]["addmm"].startswith("fc1 (aten.addmm.default; overflow: its values reach")
    assert out.node("mul").ann.precision is Precision.FP32                 # follows its fp32 input
    assert out.node("addmm_1").ann.precision is Precision.FP16             # fc2 reads values in range
    y = Interpreter(out).run(*x)[0]
    assert torch.isfinite(y).all()
    with torch.no_grad():                     # what the guard avoided: fc1's values in fp16 are inf
        assert torch.isinf(module.fc1(x[0]).half()).any()


def test_declared_tolerance_and_growth_name_the_culprit():
    """(h + 1000) - 1000 in bf16: the cancellation in %sub turns 0.2% into 90%; verify names it, not %mm."""
    b = GraphBuilder("catastrophic")
    x = b.input("x", (4, 8))
    h = b.call(aten("mm"), x, b.param("w", torch.eye(8)))
    g = b.output(b.call(aten("sub.Tensor"), b.call(aten("add.Tensor"), h, 1000.0), 1000.0))
    with pytest.raises(VerificationError, match=r"The error grows most at %sub \(aten.sub.Tensor, computed in bf16\)"):
        run_pipeline(g, "mixed-precision{dtype=bf16}", verify=True)


def test_error_growth_picks_the_largest_jump():
    b = GraphBuilder("chain")
    x = b.input("x", (4,))
    a = b.call(aten("relu"), x)
    c = b.call(aten("neg"), a)
    g = b.output(b.call(aten("abs"), c))
    ref = {"x": torch.ones(4), "relu": torch.ones(4), "neg": -torch.ones(4), "abs": torch.ones(4)}
    got = {"x": torch.ones(4), "relu": torch.full((4,), 1.01), "neg": torch.full((4,), -1.5),
           "abs": torch.full((4,), 1.5)}
    found = error_growth(g, ref, got)
    assert found == ErrorGrowth("neg", pytest.approx(0.5), pytest.approx(0.01))


def spec(bf16: float) -> HardwareSpec:
    return HardwareSpec("test CPU", {"fp32": 100e9, "bf16": bf16}, 20e9)


def test_auto_decides_from_the_hardware():
    g = tiny()
    slow = MixedPrecision().run(g.copy(), PassContext(hardware=spec(10e9)))
    assert not slow.changed and slow.stats["dtype"] == "fp32"
    assert slow.stats["choice"].startswith("auto: fp32 for target cpu: from the hardware spec test CPU: bf16 peak 10")
    fast = MixedPrecision().run(g.copy(), PassContext(hardware=spec(400e9)))
    assert fast.changed and fast.stats["dtype"] == "bf16" and "bf16 peak 400" in fast.stats["choice"]
    cuda = MixedPrecision(device=DeviceKind.CUDA).run(g.copy(), PassContext())
    assert cuda.stats["dtype"] == "fp16" and cuda.stats["choice"].startswith("auto: fp16 on CUDA")


def test_auto_decides_from_the_hosts_probe_values():
    """No spec given: run_pipeline hands the pass the host's probe values (the pass never probes)."""
    speeds = host_precision_speeds()
    _, report = run_pipeline(tiny(), "mixed-precision")
    stats = report.records[0].stats
    native = speeds.ratio("bf16") < 0.9
    assert stats["dtype"] == ("bf16" if native else "fp32")
    assert ("measured faster" if native else "bf16 is not faster on this CPU") in stats["choice"]
    assert "matmul on cpu" in stats["choice"] and "x the fp32 time" in stats["choice"]
    bare = MixedPrecision().run(tiny(), PassContext())          # no facts at all: fp32, and says why
    assert not bare.changed and "no measured speeds were given" in bare.stats["choice"]


@pytest.mark.parametrize("machine, native", [("avx2", False), ("avx512", False), ("avx512-bf16", True),
                                             ("amx", True)])
def test_auto_decides_from_the_probe_of_each_machine(fake_hardware, machine, native):
    fake_hardware(machine)
    result = MixedPrecision().run(tiny(), PassContext(host_precision=host_precision_speeds()))
    assert result.stats["dtype"] == ("bf16" if native else "fp32") and result.changed == native
    assert ("measured faster" if native else "bf16 is not faster on this CPU") in result.stats["choice"]


def test_deny_by_module_and_op_and_a_pattern_that_matches_nothing():
    with pytest.warns(MixedPrecisionWarning, match=r"deny pattern 'encoder.layers.3.\*' matched no node"):
        out, report = run_pipeline(tiny(), "mixed-precision{dtype=bf16 deny=[fc, encoder.layers.3.*]}")
    assert out.node("addmm").ann.precision_reason is PrecisionReason.DENIED
    assert out.node("addmm").ann.precision is Precision.FP32
    assert report.records[0].stats["warnings"] == ["deny pattern 'encoder.layers.3.*' matched no node"]
    out, _ = run_pipeline(tiny(), "mixed-precision{dtype=bf16 allow=exp}")
    assert out.node("exp").ann.precision is Precision.BF16
    assert out.node("exp").ann.precision_reason is PrecisionReason.ALLOWED


@pytest.mark.parametrize("machine, slow", [("avx2", True), ("avx512-bf16", True), ("amx", False)])
def test_fp16_on_a_slow_cpu_warns_from_the_probe(fake_hardware, machine, slow):
    fake_hardware(machine)
    speeds = host_precision_speeds()
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        result = MixedPrecision(dtype="fp16").run(tiny(), PassContext(host_precision=speeds))
    said = [str(w.message) for w in seen if issubclass(w.category, MixedPrecisionWarning)]
    assert bool(said) == slow and result.stats["dtype"] == "fp16"
    if slow:
        assert "fp16 on this CPU is" in said[0] and "slower than fp32" in said[0] and "dtype=auto" in said[0]


def test_bad_options():
    with pytest.raises(PipelineSpecError, match=r"option 'dtype' of pass 'mixed-precision' expects one of "
                                                r"bf16\|fp16\|auto\|fp32, got 'int8'"):
        Pipeline.parse("mixed-precision{dtype=int8}")
    with pytest.raises(PipelineSpecError, match="expects one of default|compute-only"):
        Pipeline.parse("mixed-precision{policy=fast}")
    with pytest.raises(PipelineSpecError, match=r"expects one of bf16\|fp16\|auto\|fp32, got 'int8'"):
        MixedPrecision(dtype="int8")                              # Python construction: the same message


def test_keep_io_false_lowers_inputs_and_outputs():
    out, _ = run_pipeline(tiny(), "mixed-precision{dtype=bf16 keep_io=false}")
    assert out.node("x").tensor_meta.dtype == torch.bfloat16
    assert out.node(out.output_refs[0].name).tensor_meta.dtype == torch.float32   # exp stays fp32 by policy
    assert not any(n.inputs[0].name == "x" for n in out.nodes(TO_COPY))


def test_no_weight_casts_at_run_time_and_unused_fp32_copies_dropped():
    out, _ = run_pipeline(tiny(), "mixed-precision{dtype=bf16}")
    assert not any(out.node(n.inputs[0].name).op == PARAM for n in out.nodes(TO_COPY))
    assert all(out.constants[n.name].dtype == torch.bfloat16 for n in out.nodes(PARAM))
    assert sorted(out.constants) == ["fc.bias", "fc.weight"]


def test_calibration_set_merges_samples():
    """The range guard reads the calibration set: one sample out of fp16's range is enough."""
    g = tiny()
    small, large = (torch.ones(2, 8),), (torch.full((2, 8), 1e5),)
    one, both = calibrate(g, [small]), calibrate(g, [small, large])
    assert both["x"].absmax == 1e5 and both["x"].nonzero == 32 and one["x"].absmax == 1.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", MixedPrecisionWarning)
        calm = MixedPrecision(dtype="fp16").run(g.copy(), PassContext(calibration_data=(small,)))
        loud = MixedPrecision(dtype="fp16").run(g.copy(), PassContext(calibration_data=(small, large)))
    assert calm.stats["range_guard"] == {}
    assert list(loud.stats["range_guard"]) == ["addmm"]
    assert loud.stats["range_guard"]["addmm"].startswith("fc (aten.addmm.default; overflow: its values reach")


class NearTie(nn.Module):
    """A top-1 router whose two best logits differ by 2**-10 (bf16 rounds them equal); experts scale by 1, 2, 3."""

    def __init__(self) -> None:
        super().__init__()
        self.router = nn.Linear(4, 3, bias=False)
        self.experts = nn.Parameter(torch.stack([torch.eye(4) * (e + 1) for e in range(3)]))
        with torch.no_grad():
            self.router.weight.zero_()
            self.router.weight[:, 0] = torch.tensor([1.0, 1.0 + 2 ** -10, 0.5])

    def forward(self, x):
        top, idx = self.router(x).softmax(-1).topk(1, dim=-1)
        return torch.bmm(x.unsqueeze(1), self.experts[idx[:, 0]]).squeeze(1) * top


def test_values_a_selection_ranks_keep_fp32():
    """The router's product stays fp32 (reason ``selection``), so topk picks eager's expert; the experts' bmm is bf16."""
    from mlcomp.frontend.capture import capture_module

    model, x = NearTie().eval(), torch.tensor([[1.0, 0.5, -0.25, 2.0], [1.0, 0.0, 0.0, 0.0]])
    out, _ = run_pipeline(capture_module(model, (x,)), "mixed-precision{dtype=bf16}")
    products = {n.op.name: n.ann for n in out.call_nodes() if n.op.name in ("mm", "bmm")}
    assert products["mm"].precision is Precision.FP32 and products["mm"].precision_reason is PrecisionReason.SELECTION
    assert products["bmm"].precision is Precision.BF16
    (got,) = Interpreter(out).run(x)
    torch.testing.assert_close(got, model(x), rtol=1e-2, atol=1e-2)          # expert 2 (scale 2), as eager
