"""``mlcomp compile --dynamic NAME=MIN..MAX``: the ranges reach the artifact, are verified at their ends, and
bad ranges are refused in one paragraph."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import mlcomp
from mlcomp.base.errors import InputSpecError
from mlcomp.cli.main import main


def invoke(*args):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_dynamic_ranges_are_verified_at_their_ends_and_kept_in_the_manifest(tmp_path):
    result = invoke("compile", "mlp", "--batch", "2", "--dynamic", "batch=1..16", "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "verified at sizes batch=2 (passed), batch=1 (passed), batch=8 (passed), batch=16 (passed)" \
        in result.output
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["ranges"] == {"batch": [1, 16]} and manifest["inputs"][0]["shape"] == ["batch", 512]
    art = mlcomp.load(tmp_path / "out")
    assert art(torch.randn(16, 512)).shape == (16, 2)
    with pytest.raises(InputSpecError, match="outside the range 1..16"):
        art(torch.randn(17, 512))


@pytest.mark.parametrize("spec, says", [("batch=16..1", "size range 16..1 is empty"),
                                        ("width=1..4", "does not know which dimension 'width' is")])
def test_bad_dynamic_ranges_are_one_paragraph_errors(tmp_path, spec, says):
    result = invoke("compile", "mlp", "--dynamic", spec, "-o", tmp_path / "out")
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert says in result.output
    assert not (tmp_path / "out").exists()
