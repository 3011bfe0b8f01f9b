"""Artifact folders: manifest, save/load, fresh process, damage, versions, input checks, atomicity;
and the verification module they rely on."""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch
from mlcomp.targets import CompileOptions, get_target
from mlcomp.runtime.artifact import FORMAT_VERSION, Artifact

import mlcomp
from mlcomp.analysis.verify import compare, tolerance_for
from mlcomp.base.errors import ArtifactError, InputSpecError, VerificationError
from tests.helpers.targets import REPO


@pytest.fixture(scope="module")
def mlp_artifact(tmp_path_factory):
    art = mlcomp.compile("mlp", target="cpu", batch=2)
    folder = tmp_path_factory.mktemp("art") / "mlp"
    art.save(folder)
    return art, folder


def _copy(folder, tmp_path):
    import shutil

    dest = tmp_path / "copy"
    shutil.copytree(folder, dest)
    return dest


def test_manifest_describes_the_artifact(mlp_artifact):
    art, folder = mlp_artifact
    m = json.loads((folder / "manifest.json").read_text())
    assert m["format"] == "mlcomp-artifact" and m["format_version"] == FORMAT_VERSION
    assert m["mlcomp_version"] == mlcomp.__version__
    assert {"torch", "onnxruntime", "tvm", "python"} <= set(m["versions"])
    assert m["target"] == "cpu" and m["runtime"] == "torchscript"
    assert m["inputs"] == [{"name": "input", "shape": [2, 512], "dtype": "f32"}]
    assert m["outputs"][0]["shape"] == [2, 2]
    assert m["verification"]["passed"] and m["verification"]["max_rel"] <= 1e-4
    assert {e["path"] for e in m["payload"]} == {"model.pt", "reference.pt"}
    assert all(len(e["sha256"]) == 64 for e in m["payload"])
    assert m["pipeline"] is None and m["compile_seconds"] > 0


# a fresh process (~5 CPU-s): the fast suite loads, runs and verifies the cpu artifacts of mlp and the other zoo
# models in one fresh process in tests/unit/targets/test_cpu.py::test_fresh_process_reload_and_plain_torch_jit_load
@pytest.mark.slow
def test_load_in_a_fresh_process(mlp_artifact):
    _, folder = mlp_artifact
    code = ("import mlcomp, torch; a = mlcomp.load(r'%s', verify=True); "
            "x = torch.randn(2, 512); print('OK', tuple(a(x).shape), a.target)") % folder
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "OK (2, 2) cpu" in proc.stdout


def test_round_trip_gives_identical_outputs(mlp_artifact):
    art, folder = mlp_artifact
    again = mlcomp.load(folder)
    x = torch.randn(2, 512)
    assert torch.equal(art(x), again(x))
    assert again.verify(record=False).passed


@pytest.mark.parametrize("damage, message", [
    ("truncate", "does not match its checksum"),
    ("delete", "payload file model.pt is missing"),
    ("manifest-json", "not valid JSON"),
    ("manifest-missing", "its manifest.json is missing"),
    ("not-artifact", "is another tool.s"),
])
def test_damaged_folder_is_an_artifact_error(mlp_artifact, tmp_path, damage, message):
    folder = _copy(mlp_artifact[1], tmp_path)
    if damage == "truncate":
        data = (folder / "model.pt").read_bytes()
        (folder / "model.pt").write_bytes(data[: len(data) // 2])
    elif damage == "delete":
        (folder / "model.pt").unlink()
    elif damage == "manifest-json":
        (folder / "manifest.json").write_text("{not json")
    elif damage == "manifest-missing":
        (folder / "manifest.json").unlink()
    else:
        (folder / "manifest.json").write_text(json.dumps({"format": "something-else"}))
    with pytest.raises(ArtifactError, match=message) as err:
        Artifact.load(folder)
    assert "compile it again" in str(err.value) or "compile one" in str(err.value)


def test_manifest_from_another_format_version(mlp_artifact, tmp_path):
    folder = _copy(mlp_artifact[1], tmp_path)
    manifest = json.loads((folder / "manifest.json").read_text())
    manifest.update(format_version=FORMAT_VERSION + 1, mlcomp_version="9.9.0")
    (folder / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(ArtifactError) as err:
        Artifact.load(folder)
    text = str(err.value)
    assert "mlcomp 9.9.0" in text and f"format {FORMAT_VERSION + 1}" in text
    assert "compile the model again" in text


def test_missing_folder(tmp_path):
    with pytest.raises(ArtifactError, match="there is no artifact"):
        Artifact.load(tmp_path / "nowhere")


@pytest.mark.parametrize("bad, message", [
    ((torch.randn(3, 512),), r"input input has shape \[3, 512\] but the artifact was compiled for input: f32\[2, 512\]"),
    ((torch.randn(2, 512).double(),), "has dtype f64"),
    ((torch.randn(2, 512), torch.randn(2, 512)), "takes 1 input"),
    ((torch.randn(2, 512, 1),), r"has shape \[2, 512, 1\]"),
])
def test_wrong_inputs_are_input_spec_errors(mlp_artifact, bad, message):
    with pytest.raises(InputSpecError, match=message):
        mlp_artifact[0](*bad)


def test_nothing_half_written_when_saving_fails(mlp_artifact, tmp_path, monkeypatch):
    art, folder = mlp_artifact
    target = tmp_path / "out"

    def explode(directory):
        (directory / "model.pt").write_bytes(b"partial")
        raise RuntimeError("disk full")

    monkeypatch.setattr(art.runtime, "save", explode)
    with pytest.raises(RuntimeError, match="disk full"):
        art.save(target)
    assert list(tmp_path.iterdir()) == []                      # no folder, no temporary left over
    existing = _copy(folder, tmp_path)
    with pytest.raises(RuntimeError):
        art.save(existing)
    assert Artifact.load(existing).verify(record=False).passed  # the old artifact is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy"]


def test_verification_failure_names_the_output(captured):
    module, inputs, graph = captured("mlp")
    art = get_target("cpu").compile(graph, CompileOptions(optimize=False))
    real = art.runtime

    class Skewed:
        kind = real.kind

        def __call__(self, *xs):
            return tuple(o * 1.01 for o in real(*xs))

    art.runtime = Skewed()
    with torch.no_grad():
        expected = module(*inputs)
    with pytest.raises(VerificationError) as err:
        art.verify(inputs, (expected,))
    text = str(err.value)
    assert "output 0 (addmm_2: f32[2, 2])" in text and "exceeds the tolerance 1e-04" in text
    assert "--tolerance" in text
    assert art.verify(inputs, (expected,), tolerance=0.05).passed


def test_compare_tolerances_and_structure():
    a = torch.tensor([1.0, 2.0, 4.0])
    assert compare(a, a + 1e-5).passed
    assert not compare(a, a + 1e-3).passed
    assert compare(a, a + 1e-3, tolerance=1e-3).passed
    assert tolerance_for(torch.bfloat16) > tolerance_for(torch.float16) > tolerance_for(torch.float32)
    b = a.bfloat16()
    assert compare(b, (a * 1.004).bfloat16()).passed                    # within bf16 rounding
    assert compare(torch.tensor([1, 2]), torch.tensor([1, 3])).worst.note.startswith("1 element")
    nan = torch.tensor([1.0, math.nan])
    assert not compare(nan, nan.clone()).passed                          # NaN never verifies (issue 15)
    assert "NaN/inf" in compare(nan, torch.tensor([1.0, 0.0])).worst.note
    assert "shape" in compare(a, a[:2]).worst.note
    r = compare((a, a), (a,))
    assert not r.passed and "1 output(s) where eager returns 2" in r.note
    nested = compare({"y": a, "z": (a, a)}, [a, a, a + 1e-7])
    assert nested.passed and len(nested.outputs) == 3


@pytest.mark.ort
def test_api_compile_module_with_pipeline_and_fallback():
    from tests.data.spectral import build

    module, inputs = build()
    art = mlcomp.compile(module, inputs, target="onnxruntime", pipeline="-O2", fallback="eager", threads=1)
    assert art.manifest["pipeline"] == "cleanup{fold_params=false},split-projections,cleanup{fold_params=false}"   # -O2 adapted to onnxruntime
    assert art.verification["passed"] and art.verification["max_rel"] <= 1e-4
    assert "torch (eager)" in [r["runs_on"] for r in art.manifest["fallback_regions"]]
    with pytest.raises(mlcomp.MlcompError, match="unknown compile option"):
        mlcomp.compile(module, inputs, target="cpu", tune_trails=3)
