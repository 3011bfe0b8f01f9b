"""``quantize``'s weight bits: 7 (±63) where the CPU's int8 dot product saturates (x86 without VNNI/AMX), else 8.

On such a CPU ``vpmaddubsw`` adds two u8 × s8 products in int16: ``2 · 255 · 127`` overflows it, and ONNX
Runtime's and OpenVINO's int8 linears return wrong sums (max rel error 0.14–0.25 on a small conv net on an AVX2
EPYC, 0.015 with 7-bit weights).  The rule reads the CPU's flags (fake profiles here), the option overrides it,
and the choice is in the stats and the decisions.
"""
from __future__ import annotations

import pytest
import torch

from mlcomp.hardware.probe import CpuInfo, int8_dot_saturates
from mlcomp.ir.quant import DEQUANTIZE
from mlcomp.pipeline import run_pipeline
from mlcomp.pipeline.target_facts import TargetFacts
from tests.helpers.captures import conv_linear


def _quantized(spec: str = "quantize", target: str = "onnxruntime"):
    model, x, g = conv_linear()
    out, report = run_pipeline(g, f"fold-constants,{spec}", example_inputs=(x,), target=TargetFacts(target))
    return out, report.records[-1].stats


def _int8_weights(graph) -> list[torch.Tensor]:
    """The int8 constants that the weights' dequantize nodes read."""
    found = []
    for node in graph.call_nodes():
        if node.op == DEQUANTIZE and node.inputs[0].name in graph.constants:
            q = graph.constants[node.inputs[0].name]
            if q.dtype == torch.int8 and q.dim() > 1:
                found.append(q)
    return found


@pytest.mark.parametrize("profile,bits", [("avx2", 7), ("avx512", 8), ("amx", 8)])
def test_weights_take_seven_bits_only_where_the_int8_dot_product_saturates(fake_hardware, profile, bits):
    fake_hardware(profile)
    out, stats = _quantized()
    weights = _int8_weights(out)
    assert len(weights) == 2                                     # the conv's and the linear's
    top = (1 << (bits - 1)) - 1                                  # 63 or 127: each channel's largest weight on it
    assert all(int(w.abs().max()) == top for w in weights), [int(w.abs().max()) for w in weights]
    assert stats["weight_bits"] == bits
    (decision,) = stats["decisions"]
    assert decision["question"] == "quantize: bits of the int8 weights" and decision["choice"] == str(bits)
    assert ("VNNI" in decision["why"]) and (("overflow" in decision["why"]) == (bits == 7))


def test_the_option_overrides_the_cpu(fake_hardware):
    fake_hardware("avx2")
    out, stats = _quantized("quantize{weight_bits=8}")
    assert max(int(w.abs().max()) for w in _int8_weights(out)) == 127 and stats["weight_bits"] == 8
    assert "weight_bits=8" in stats["decisions"][0]["why"]
    fake_hardware("amx")
    out, stats = _quantized("quantize{weight_bits=7}", target="openvino")
    assert max(int(w.abs().max()) for w in _int8_weights(out)) == 63 and stats["weight_bits"] == 7


def test_seven_bit_weights_stay_within_the_declared_tolerance_of_eager(fake_hardware):
    """The graph with 7-bit weights, run by the interpreter (exact integer sums), against eager PyTorch."""
    from mlcomp.ir.interpreter import Interpreter
    fake_hardware("avx2")
    model, x, _ = conv_linear()
    out, stats = _quantized()
    (got,) = Interpreter(out).run(x)
    with torch.no_grad():
        ref = model(x)
    rel = float((got - ref).abs().max() / ref.abs().max())
    assert 0 < rel <= stats["declared_tolerance"], rel


def test_the_rule_reads_the_flags():
    assert int8_dot_saturates(CpuInfo("AMD EPYC", frozenset({"sse2", "avx", "avx2"})))
    assert not int8_dot_saturates(CpuInfo("Xeon", frozenset({"sse2", "avx2", "avx512f", "avx512_vnni"})))
    assert not int8_dot_saturates(CpuInfo("Alder Lake", frozenset({"sse2", "avx2", "avx_vnni"})))
    assert not int8_dot_saturates(CpuInfo("", frozenset()))      # nothing known: the 8-bit default
