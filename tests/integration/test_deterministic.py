"""``deterministic=True``: two compiles of one model write byte-identical artifact folders.

Every file of the two folders is compared by sha256 (the manifest included: no timestamps, durations,
absolute paths or cache records; TorchScript archives with their process counters renumbered), and
every measured choice is recorded as a fixed rule in the manifest's ``decisions``.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

import mlcomp
from mlcomp.runtime.artifact import Artifact

FAST = ["mlp", "lenet"]
HEAVY = ["gru", "resnet18", "transformer", "mobilenet"]


def _digests(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _twice(model: str, target: str, tmp_path: Path, **options) -> tuple[dict[str, str], dict[str, str], Path]:
    folders = []
    for i in range(2):
        art = mlcomp.compile(model, target=target, pipeline="-O2", deterministic=True, threads=1, **options)
        folders.append(art.save(tmp_path / f"{model}-{target}-{i}"))
    return _digests(folders[0]), _digests(folders[1]), folders[1]


def _check(model: str, target: str, tmp_path: Path) -> None:
    _check_folders(*_twice(model, target, tmp_path), f"{model} on {target}")


def _check_folders(first: dict[str, str], second: dict[str, str], folder: Path, what: str) -> None:
    assert first == second, f"{what}: differs in " + ", ".join(
        k for k in sorted(set(first) | set(second)) if first.get(k) != second.get(k))
    manifest = json.loads((folder / "manifest.json").read_text())
    assert "created" not in manifest and not any(k.endswith("seconds") for k in manifest)
    assert all(d["verdict"] != "decided" and d["rounds"] == 0 for d in manifest["decisions"])
    again = Artifact.load(folder)
    assert again.verify(record=False).passed


def test_two_deterministic_cpu_compiles_are_byte_identical(tmp_path):
    _check("lenet", "cpu", tmp_path)          # mlp on cpu: through the CLI below


@pytest.mark.slow
@pytest.mark.parametrize("model", HEAVY)
def test_two_deterministic_cpu_compiles_of_larger_models_are_byte_identical(model, tmp_path):
    _check(model, "cpu", tmp_path)


@pytest.mark.ort
@pytest.mark.parametrize("model", ["mlp", "lenet", pytest.param("resnet18", marks=pytest.mark.slow),
                                   pytest.param("transformer", marks=pytest.mark.slow)])
def test_two_deterministic_onnxruntime_compiles_are_byte_identical(model, tmp_path):
    pytest.importorskip("onnxruntime")
    _check(model, "onnxruntime", tmp_path)


@pytest.mark.tvm
def test_two_deterministic_tvm_compiles_are_byte_identical(tmp_path):
    """``model.so`` is the same bytes (weights baked in, no build path or time in it); ``meta.json`` carries
    no durations and no path."""
    pytest.importorskip("tvm")
    _check("mlp", "tvm", tmp_path)
    meta = (tmp_path / "mlp-tvm-1" / "meta.json").read_text()
    assert "seconds" not in meta and str(tmp_path) not in meta


@pytest.mark.tvm
@pytest.mark.slow
@pytest.mark.parametrize("model", ["lenet", *HEAVY])
def test_two_deterministic_tvm_compiles_of_larger_models_are_byte_identical(model, tmp_path):
    pytest.importorskip("tvm")
    _check(model, "tvm", tmp_path)


def test_deterministic_cpu_keeps_the_plain_trace_by_its_fixed_rule(tmp_path):
    art = mlcomp.compile("lenet", target="cpu", deterministic=True)      # convolutions: normally timed
    (decision,) = art.decisions
    assert (decision["choice"], decision["verdict"], decision["made_by"]) == ("plain", "fixed", "target cpu")
    assert decision["why"].startswith("fixed rule (deterministic): the plain frozen trace")
    assert art.runtime.optimize is False


def test_deterministic_mixed_precision_auto_keeps_fp32_unmeasured(tmp_path):
    art = mlcomp.compile("mlp", target="cpu", pipeline="mixed-precision{dtype=auto}", deterministic=True)
    passes = [d for d in art.decisions if d["made_by"].startswith("pass")]
    assert [(d["choice"], d["verdict"]) for d in passes] == [("fp32", "fixed")]
    assert art.manifest["pipeline_report"]["passes"][0]["stats"]["dtype"] == "fp32"


def test_deterministic_auto_picks_the_first_verified_candidate_untimed():
    art = mlcomp.compile("mlp", target="auto", candidates=["cpu", "onnxruntime"], deterministic=True)
    assert art.target == "cpu"
    auto = [d for d in art.decisions if d["made_by"] == "auto"]
    assert [(d["choice"], d["verdict"]) for d in auto] == [("cpu", "fixed")]
    assert art.manifest["auto"]["timing"]["timed_in"].startswith("not timed")
    assert art.manifest["auto"]["timing"]["processes"] == 0           # no timing process is started


@pytest.mark.ort
def test_two_deterministic_auto_compiles_are_byte_identical(tmp_path):
    first, second, folder = _twice("mlp", "auto", tmp_path, candidates=["cpu", "onnxruntime"])
    _check_folders(first, second, folder, "mlp on auto")


def test_cli_deterministic_flag_writes_identical_folders(tmp_path):
    from click.testing import CliRunner

    from mlcomp.cli.main import main

    folders = [tmp_path / "a", tmp_path / "b"]
    for folder in folders:
        result = CliRunner().invoke(main, ["compile", "mlp", "--deterministic", "--no-cache", "--threads", "1",
                                           "-o", str(folder)])
        assert result.exit_code == 0, result.output
        assert "decision (target cpu)" in result.output
    _check_folders(_digests(folders[0]), _digests(folders[1]), folders[1], "mlp on cpu (the CLI)")
