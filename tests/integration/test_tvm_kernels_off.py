"""``--target "tvm{kernels=off}"``: a pure TVM build from ``compile`` — every op TVM code (``--explain``), the
numbers eager's, a saved module that needs TVM alone."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from mlcomp.cli.main import main
from mlcomp.models import ZOO
from mlcomp.runtime.artifact import Artifact

pytest.importorskip("tvm")
pytestmark = pytest.mark.tvm


def _compile_pure(model: str, out) -> list[str]:
    result = CliRunner().invoke(main, ["compile", model, "--target", "tvm{kernels=off}", "--explain", "-o", str(out)])
    assert result.exit_code == 0, result.output
    return result.output.splitlines()


def _check_pure(model: str, out, heavy: int) -> None:
    lines = _compile_pure(model, out)
    rows = [line[len("tvm: "):] for line in lines if line.startswith("tvm: ")]
    start = next(i for i, r in enumerate(rows) if r.split()[:2] == ["op", "shape"])
    end = next(i for i, r in enumerate(rows) if r.startswith("other ops"))
    ops = rows[start + 1:end]
    assert len(ops) == heavy and all(r.split()[-3:] == ["TVM", "code", "pure-tvm"] for r in ops), rows
    assert f"0 op(s) in torch kernels, {heavy} heavy op(s) as TVM code" in "\n".join(rows)
    assert not any("torch kernel " in r for r in rows)          # no row runs in a torch kernel
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["target"], manifest["target_spec"]) == ("tvm", "tvm{kernels=off}")
    assert manifest["runtime_info"]["offload"]["in_torch"] == 0 and manifest["runtime_info"]["kernels"]["kernels"] == {}
    meta = json.loads((out / "meta.json").read_text())
    assert meta["needs"] == ["apache-tvm"] and not (out / "kernels.py").exists()
    # the numbers: eager's on fresh inputs, within fp32 rounding
    art, z = Artifact.load(out), ZOO[model]
    module, x = z.build().eval(), z.example_inputs(1)
    torch.manual_seed(1)
    x = tuple(torch.randn_like(t) if t.is_floating_point() else t for t in x)
    with torch.no_grad():
        want = module(*x)
    got = art(*x)
    got = got[0] if isinstance(got, tuple) else got
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5), (got - want).abs().max()


def test_lenet_convolutions_and_linears_compile_as_pure_tvm_and_match_eager(tmp_path):
    _check_pure("lenet", tmp_path / "lenet", heavy=5)


@pytest.mark.slow
def test_mlp_compiles_as_pure_tvm_and_matches_eager(tmp_path):
    _check_pure("mlp", tmp_path / "mlp", heavy=3)


def test_a_misspelt_target_option_is_refused_before_capture(tmp_path):
    result = CliRunner().invoke(main, ["compile", "mlp", "--target", "tvm{kernels=of}", "-o", str(tmp_path / "a")])
    assert result.exit_code == 2, result.output
    assert "option 'kernels' of target 'tvm' expects one of auto|on|off, got 'of'" in result.output
    assert "Traceback" not in result.output and not (tmp_path / "a").exists()
