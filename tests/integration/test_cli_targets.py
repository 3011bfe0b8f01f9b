"""``mlcomp compile / run / export / targets``: outputs, files, exit codes, no tracebacks."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch
from click.testing import CliRunner

from mlcomp.cli.main import main
from tests.helpers.targets import REPO, SPECTRAL


def invoke(*args: str):
    result = CliRunner().invoke(main, list(args), catch_exceptions=True)
    assert "Traceback" not in result.output
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


@pytest.fixture(scope="module")
def mlp_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "mlp-cpu"
    result = invoke("compile", "mlp", "--target", "cpu", "-o", str(out), "--batch", "2", "--threads", "1")
    assert result.exit_code == 0, result.output
    return out, result.output


def test_compile_prints_verification_and_compile_time(mlp_dir):
    out, text = mlp_dir
    assert "captured mlp" in text and "compiled for cpu in" in text
    assert "verified against eager: passed" in text and "reloaded from disk: passed" in text
    assert (out / "manifest.json").is_file() and (out / "model.pt").is_file()
    assert json.loads((out / "manifest.json").read_text())["options"]["threads"] == 1


def test_run_with_input_file_and_output(mlp_dir, tmp_path):
    out, _ = mlp_dir
    x = np.random.default_rng(0).standard_normal((2, 512)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    result = invoke("run", str(out), "--input", str(tmp_path / "x.npy"), "--output", str(tmp_path / "y.npz"))
    assert result.exit_code == 0, result.output
    assert "  output: [2, 2] float32" in result.output          # the model's output, not the op (addmm_2)
    y = np.load(tmp_path / "y.npz")["output"]
    eager = torch.jit.load(str(out / "model.pt"))(torch.from_numpy(x))[0]
    assert np.allclose(y, eager.numpy(), atol=1e-6)


def test_run_random_inputs_and_verify(mlp_dir):
    out, _ = mlp_dir
    result = invoke("run", str(out))
    assert result.exit_code == 0 and "random inputs from the input spec" in result.output
    result = invoke("run", str(out), "--verify")
    assert result.exit_code == 0 and "verified against stored eager outputs: passed" in result.output


def test_run_wrong_shape_is_a_clear_error(mlp_dir, tmp_path):
    out, _ = mlp_dir
    np.save(tmp_path / "bad.npy", np.zeros((3, 7), np.float32))
    result = invoke("run", str(out), "--input", str(tmp_path / "bad.npy"))
    assert result.exit_code == 2
    assert "error: input input has shape [3, 7] but the artifact was compiled for input: f32[2, 512]" \
        in result.output


def test_run_damaged_artifact(mlp_dir, tmp_path):
    import shutil

    bad = tmp_path / "bad"
    shutil.copytree(mlp_dir[0], bad)
    (bad / "model.pt").write_bytes(b"junk")
    result = invoke("run", str(bad))
    assert result.exit_code == 2 and "is damaged" in result.output


def test_unsupported_op_fails_then_fallback_succeeds(tmp_path):
    result = invoke("compile", SPECTRAL, "--target", "onnxruntime", "-o", str(tmp_path / "a"))
    assert result.exit_code == 2
    assert "error: target onnxruntime cannot" in result.output and "--fallback eager" in result.output
    assert not (tmp_path / "a").exists()
    result = invoke("compile", SPECTRAL, "--target", "onnxruntime", "--fallback", "eager",
                    "-o", str(tmp_path / "b"))
    assert result.exit_code == 0, result.output
    assert "fallback: region 1 (2 nodes: aten._fft_r2c.default, aten.abs.default) runs in torch (eager)" \
        in result.output
    assert (tmp_path / "b" / "part0" / "model.onnx").is_file()


def test_compile_with_pipeline_records_its_spec(tmp_path):
    result = invoke("compile", "lenet", "--target", "onnxruntime", "-p", "-O2", "-o", str(tmp_path / "l"))
    assert result.exit_code == 0, result.output
    manifest = json.loads((tmp_path / "l" / "manifest.json").read_text())
    assert manifest["pipeline"] == "cleanup{fold_params=false},split-projections,cleanup{fold_params=false}"   # -O2 adapted to onnxruntime
    assert manifest["verification"]["passed"]


@pytest.mark.parametrize("fmt, name", [("torchscript", "m.pt"), ("pt2", "m.pt2"), ("onnx", "m.onnx")])
def test_export_formats_reload_with_plain_tools(tmp_path, fmt, name):
    path = tmp_path / name
    result = invoke("export", "mlp", "--format", fmt, "-o", str(path))
    assert result.exit_code == 0, result.output
    assert "reloaded with the plain tool and verified: passed" in result.output
    assert "(worst output, " in result.output                  # the model's output name, not addmm_2
    # the default -O2 adapts to the format's runtime, as compile adapts it to a target
    assert ("dropped fuse (fusion): onnxruntime fuses kernels itself" in result.output) == (fmt == "onnx")
    x = torch.randn(1, 512)
    if fmt == "torchscript":
        out = torch.jit.load(str(path))(x)[0]
    elif fmt == "pt2":
        out = torch.export.load(str(path)).module()(x)[0]
    else:
        import onnxruntime as ort

        session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
        out = torch.from_numpy(session.run(None, {session.get_inputs()[0].name: x.numpy()})[0])
    assert out.shape == (1, 2)


def test_exported_torchscript_can_be_compiled_again(tmp_path):
    path = tmp_path / "lenet.pt"
    assert invoke("export", "lenet", "--format", "torchscript", "-o", str(path)).exit_code == 0
    result = invoke("compile", str(path), "--target", "cpu", "-o", str(tmp_path / "again"))
    assert result.exit_code == 0, result.output   # the input spec travels inside the archive


def test_targets_lists_all_with_reasons():
    result = invoke("targets")
    assert result.exit_code == 0
    for name in ("cpu", "cuda", "onnxruntime", "tvm"):
        assert name in result.output
    if not torch.cuda.is_available():
        assert "unavailable: no CUDA device" in result.output


def test_unknown_target_suggests_a_name(tmp_path):
    result = invoke("compile", "mlp", "--target", "onnxruntim", "-o", str(tmp_path / "x"))
    assert result.exit_code == 2 and "did you mean 'onnxruntime'" in result.output


def test_user_errors_exit_without_traceback_in_a_real_process(tmp_path):
    """A real process: exit code and stderr as a user sees them."""
    cmd = [sys.executable, "-m", "mlcomp", "compile", SPECTRAL, "--target", "cpu",
           "-o", str(tmp_path / "x")]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.startswith("error: target cpu cannot") and "--fallback eager" in proc.stderr
    assert "\n" not in proc.stderr.strip()                 # one paragraph
    assert "Traceback" not in proc.stderr + proc.stdout


def test_force_replaces_only_an_earlier_mlcomp_output(tmp_path):
    """Issue 15: an earlier artifact is replaced with --force only; the new one reloads and verifies."""
    out = tmp_path / "art"
    assert invoke("compile", "mlp", "--target", "cpu", "-o", str(out)).exit_code == 0
    marker = json.loads((out / ".mlcomp").read_text())
    assert marker["written_by"] == "mlcomp" and marker["kind"] == "artifact"
    first = (out / "manifest.json").read_text()
    again = invoke("compile", "mlp", "--target", "cpu", "-o", str(out))
    assert again.exit_code == 2 and "holds an earlier mlcomp output" in again.output and "--force" in again.output
    assert (out / "manifest.json").read_text() == first
    forced = invoke("compile", "mlp", "--target", "cpu", "--batch", "3", "-o", str(out), "--force")
    assert forced.exit_code == 0, forced.output
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["inputs"][0]["shape"] == [3, 512] and manifest["verification"]["passed"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["art"]          # no temporary or .old left
    assert invoke("run", str(out), "--verify").exit_code == 0


def test_empty_existing_folder_is_used(tmp_path):
    target = tmp_path / "empty"
    target.mkdir()
    result = invoke("compile", "mlp", "--target", "cpu", "-o", str(target))
    assert result.exit_code == 0 and (target / "manifest.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty"]


def test_api_refuses_user_folders(tmp_path):
    import mlcomp
    import mlcomp.api
    from mlcomp.base.errors import OptionError, OutputPathError

    user = tmp_path / "user"
    user.mkdir()
    (user / "notes.txt").write_text("mine")
    art = mlcomp.compile("mlp", target="cpu")
    with pytest.raises(OutputPathError, match="not written by mlcomp"):
        art.save(user)
    with pytest.raises(OutputPathError, match="existing folder"):
        mlcomp.api.export("mlp", user, format="onnx")
    with pytest.raises(OptionError, match="not a usable tolerance"):
        mlcomp.api.export("mlp", tmp_path / "m.onnx", format="onnx", tolerance=float("nan"))
    assert [p.name for p in user.iterdir()] == ["notes.txt"] and (user / "notes.txt").read_text() == "mine"
    art.save(tmp_path / "a")
    art.save(tmp_path / "a")                        # the API replaces its own earlier output
    assert mlcomp.load(tmp_path / "a", verify=True).verification["passed"]


def test_models_list_json():
    from mlcomp.models import ZOO

    result = invoke("models", "list", "--json")
    assert result.exit_code == 0
    rows = json.loads(result.output)
    assert [r["name"] for r in rows] == list(ZOO)
    assert rows[0]["input_shape"][0] == 1 and all(r["summary"] for r in rows)


def test_report_force_replaces_an_earlier_report(tmp_path):
    out = tmp_path / "rep"
    fast = ["report", "mlp", "-o", str(out), "--targets", "eager", "--batch", "1", "--budget", "0.005",
            "--min-repeats", "1", "--warmup", "1"]
    assert invoke(*fast).exit_code == 0
    assert json.loads((out / ".mlcomp").read_text())["kind"] == "report"
    refused = invoke(*fast)
    assert refused.exit_code == 2 and "holds an earlier mlcomp output" in refused.output
    assert invoke(*fast, "--force").exit_code == 0 and (out / "index.html").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["rep"]
