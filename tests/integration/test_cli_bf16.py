"""bf16 from the CLI on tvm and openvino: built and verified, never a backend-internal error.

OpenVINO gets an fp32 graph and computes in bf16 through its precision hint where the CPU has
bf16 instructions; whether this host has them is read from the host's own probe values.
"""
from __future__ import annotations

import pytest
from click.testing import CliRunner

import mlcomp
from mlcomp.cli.main import main
from mlcomp.hardware.probe import host_precision_speeds

BF16 = "mixed-precision{dtype=bf16}"


def invoke(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)


@pytest.mark.openvino
def test_bf16_on_openvino_is_an_fp32_graph_with_the_precision_hint(tmp_path):
    result = invoke("compile", "mlp", "--batch", "2", "-t", "openvino", "-p", BF16, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "reloaded from disk: passed" in result.output
    art = mlcomp.load(tmp_path / "out")
    precision = art.runtime.precision
    native = bool({"avx512_bf16", "amx_bf16"} & set(host_precision_speeds().cpu_flags))
    assert precision["requested"] == "bf16" and precision["hint"] == ("bf16" if native else "f32")
    assert all(spec.dtype.is_floating_point for spec in art.inputs)


@pytest.mark.tvm
def test_bf16_on_tvm_builds_and_verifies(tmp_path):
    result = invoke("compile", "mlp", "--batch", "2", "-t", "tvm", "-p", BF16, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "reloaded from disk: passed" in result.output and "mixed-precision" in result.output


@pytest.mark.slow
@pytest.mark.parametrize("target", [pytest.param("tvm", marks=pytest.mark.tvm),
                                    pytest.param("openvino", marks=pytest.mark.openvino)])
@pytest.mark.parametrize("name", ["bert", "vit", "gru-tagger"])
def test_bf16_transformers_encoders_build(target, name):
    from mlcomp.models.third_party import build_third_party

    model, inputs = build_third_party(name, batch=2)
    art = mlcomp.compile(model, inputs, target=target, pipeline=BF16)     # verified against eager, or raises
    assert art.target == target
