"""Every CUDA path a user reaches from the CLI, run on a GPU (marker ``cuda``; skipped without one).

Each test is one ``mlcomp compile`` (in process, through click) as a user would type it, checked
by its exit status, the verification it prints and the artifact it leaves:

    mlcomp compile transformer --target cuda -p "-O2,mixed-precision{dtype=fp16}"   # fp16 on the GPU
    mlcomp compile resnet18 --target cuda -p "place{devices=[cuda:0,cpu]}"           # GPU + host, one process
    mlcomp compile mlp --target cuda --train --steps 3                                # training step on the GPU
    mlcomp compile mlp --target auto                                                  # cuda among the candidates

Without a GPU only the ``fp32_math`` test runs (it needs none).
"""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

import mlcomp
from mlcomp.cli.main import main
from mlcomp.targets.torch.cuda import TF32_RTOL, fp32_math


def _compile(tmp_path, *args: str) -> tuple[str, dict]:
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["compile", *args, "-o", str(out), "--json"])
    assert result.exit_code == 0, result.output
    return result.output, json.loads((out / "manifest.json").read_text())


def test_fp32_math_is_scoped():
    before = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = True
    try:
        with fp32_math():
            assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
        assert torch.backends.cudnn.allow_tf32
        torch.backends.cudnn.allow_tf32 = False
        with fp32_math(tf32=True):
            assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        assert not torch.backends.cudnn.allow_tf32
        with pytest.raises(ZeroDivisionError), fp32_math():
            1 / 0
        assert not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


@pytest.mark.cuda
def test_resnet_on_cuda_matches_fp32_eager_at_the_default_tolerance(tmp_path):
    """cuDNN would use TF32 for fp32 convolutions by default (~1e-3 relative); the artifact must not."""
    output, manifest = _compile(tmp_path, "resnet18", "--target", "cuda", "-O3", "--batch", "4")
    assert manifest["verification"]["passed"] and manifest["verification"]["max_rel"] <= 1e-4, output


@pytest.mark.cuda
def test_tf32_is_asked_for_and_declares_its_tolerance(tmp_path):
    output, manifest = _compile(tmp_path, "resnet18", "--target", "cuda", "--tf32", "--batch", "4")
    assert manifest["options"]["tf32"] and manifest["declared_tolerance"] == TF32_RTOL, output
    assert manifest["verification"]["passed"] and manifest["verification"]["outputs"][0]["rtol"] == TF32_RTOL
    art = mlcomp.load(tmp_path / "out")
    assert art.runtime.tf32 and art.verify(record=False).passed


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_mixed_precision_on_cuda(tmp_path, dtype):
    output, manifest = _compile(tmp_path, "transformer", "--target", "cuda",
                                "-p", f"-O2,mixed-precision{{dtype={dtype}}}")
    assert manifest["verification"]["passed"], output
    assert f"dtype={dtype}" in manifest["pipeline"]
    art = mlcomp.load(tmp_path / "out")
    assert art.verify(record=False).passed


@pytest.mark.cuda
def test_place_on_gpu_and_cpu_runs_on_the_cuda_target(tmp_path):
    output, manifest = _compile(tmp_path, "resnet18", "--target", "cuda", "-p", "place{devices=[cuda:0,cpu]}")
    assert manifest["verification"]["passed"], output
    art = mlcomp.load(tmp_path / "out")
    assert art.runtime.graph is None      # host nodes: no CUDA graph
    assert art.verify(record=False).passed


@pytest.mark.cuda
def test_training_step_on_cuda(tmp_path):
    output, _ = _compile(tmp_path, "mlp", "--target", "cuda", "--train", "--steps", "3")
    again = mlcomp.load(tmp_path / "out")
    assert again.device.startswith("cuda") and again.verification["steps"]["worst_rel"] <= 1e-5, output
    assert again.verification["reload"]["passed"]


@pytest.mark.cuda
def test_fp16_training_with_loss_scaling_on_cuda(tmp_path):
    output, _ = _compile(tmp_path, "mlp", "--target", "cuda", "--train", "-p", "mixed-precision{dtype=fp16}",
                         "--loss-scale", "dynamic", "--steps", "3")
    again = mlcomp.load(tmp_path / "out")
    assert again.loss_scaler is not None and again.verification["steps"]["passed"], output


@pytest.mark.cuda
def test_auto_considers_cuda(tmp_path):
    output, manifest = _compile(tmp_path, "mlp", "--target", "auto")
    cuda = [c for c in manifest["auto"]["candidates"] if c["target"] == "cuda"]
    assert len(cuda) == 1 and cuda[0]["verified"] and cuda[0]["median_ms"] > 0, output
