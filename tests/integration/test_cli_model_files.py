"""The CLI on model files: ``--train`` on a ``.pt2`` and a TorchScript ``.pt``, ``--dynamic-batch`` on a
``.pt2``, a ``.pt2`` saved with a dynamic batch on every target; the user's files never change."""
from __future__ import annotations

import hashlib
import json
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

import mlcomp
from mlcomp.cli.main import main


def invoke(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=True)


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextmanager
def unchanged(*paths: Path):
    """The files' bytes are the same after the block (the user's model is never modified)."""
    before = {p: _digest(p) for p in paths}
    yield
    assert {p: _digest(p) for p in paths} == before


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The zoo MLP (batch 4) as an ExportedProgram, a TorchScript archive and a dynamic-batch program."""
    folder = tmp_path_factory.mktemp("model-files")
    made = {"pt2": ("pt2", ()), "pt": ("torchscript", ()), "dyn.pt2": ("pt2", ("--dynamic-batch",))}
    out = {}
    for suffix, (fmt, extra) in made.items():
        path = folder / f"mlp.{suffix}"
        result = invoke("models", "save", "mlp", "--format", fmt, "--batch", "4", "-o", path, *extra)
        assert result.exit_code == 0, result.output
        out[suffix] = path
    assert "batch dynamic" in result.output
    return out


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def test_train_on_an_exported_program_with_remat(files, tmp_path):
    with unchanged(files["pt2"]):
        result = invoke("compile", files["pt2"], "--train", "--loss", "mse", "--optimizer", "adam{lr=1e-3}",
                        "-p", "remat{saved=0.8}", "--steps", "2", "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "captured mlp for training" in result.output and "pipeline remat{saved=0.8}: 44 -> 49 nodes" in result.output
    assert "gradients vs eager autograd: worst 0.0e+00 relative" in result.output
    assert "2 steps compiled vs eager (adam" in result.output
    assert _manifest(tmp_path / "out")["verification"]["loss_fn"] == "mse"


def test_train_on_a_torchscript_archive(files, tmp_path):
    with unchanged(files["pt"]):
        result = invoke("compile", files["pt"], "--train", "--loss", "mse", "--steps", "2", "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "gradients vs eager autograd: worst 0.0e+00 relative" in result.output
    art = mlcomp.load(tmp_path / "out")           # the step trains the archive's six tensors as parameters
    assert sorted(art.params) == ["0.bias", "0.weight", "2.bias", "2.weight", "4.bias", "4.weight"]


@pytest.mark.parametrize("target", ["cpu", pytest.param("onnxruntime", marks=pytest.mark.ort)])
def test_dynamic_batch_on_a_static_exported_program(files, tmp_path, target):
    with unchanged(files["pt2"]):
        result = invoke("compile", files["pt2"], "--dynamic-batch", "-t", target, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    art = mlcomp.load(tmp_path / "out")
    program = torch.export.load(str(files["pt2"])).module()          # runs batches of 4 only
    x = torch.randn(7, 512, generator=torch.Generator().manual_seed(0))   # not the file's batch of 4
    expected = torch.cat([program(x[:4]), program(x[3:])[1:]])      # the MLP's rows are independent
    torch.testing.assert_close(art(x), expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("target", ["cpu", pytest.param("onnxruntime", marks=pytest.mark.ort),
                                    pytest.param("openvino", marks=pytest.mark.openvino),
                                    pytest.param("tvm", marks=pytest.mark.tvm)])
def test_a_program_saved_with_a_dynamic_batch_compiles_on_every_target(files, tmp_path, target):
    with unchanged(files["dyn.pt2"]):
        result = invoke("compile", files["dyn.pt2"], "-t", target, "-o", tmp_path / "out")
    assert result.exit_code == 0, result.output
    assert "reloaded from disk: passed" in result.output
    assert [s["shape"] for s in _manifest(tmp_path / "out")["inputs"]] == [[4, 512]]   # at its example batch


def test_dynamic_batch_on_a_static_shape_target_is_refused_up_front(files, tmp_path):
    result = invoke("compile", files["dyn.pt2"], "--dynamic-batch", "-t", "distributed", "-o", tmp_path / "out")
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert "target distributed cannot compile mlp_dyn: (1) symbolic sizes: target distributed compiles static shapes" \
        in result.output
    assert not (tmp_path / "out").exists()


class FixedBatch(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.reshape(4, 2, 8).sum(1)         # the batch of 4 is a constant of the program


def test_dynamic_batch_on_a_program_that_fixes_its_batch_is_refused(tmp_path):
    path = tmp_path / "fixed.pt2"
    torch.export.save(torch.export.export(FixedBatch(), (torch.randn(4, 16),)), str(path))
    with unchanged(path):
        result = invoke("compile", path, "--dynamic-batch", "-o", tmp_path / "out")
    assert result.exit_code != 0 and "Traceback" not in result.output
    assert ("--dynamic-batch: the program in " + str(path) + " was exported with a static batch (4) and its ops "
            "fix that size") in " ".join(result.output.split())
    assert "mlcomp models save NAME --format pt2 --dynamic-batch" in result.output
