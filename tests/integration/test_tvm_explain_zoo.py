"""``mlcomp compile --target tvm --explain`` on the zoo ResNet-18 and transformer: every heavy op with where it ran
(a torch kernel or TVM code) and the policy rule; the same placements in the saved manifest."""
from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from mlcomp.cli.main import main

pytest.importorskip("tvm")
pytestmark = [pytest.mark.tvm, pytest.mark.slow]


def _explain(model: str, out) -> tuple[list[str], dict]:
    result = CliRunner().invoke(main, ["compile", model, "--target", "tvm", "--explain", "-o", str(out)],
                                catch_exceptions=True)
    assert result.exit_code == 0, result.output
    rows = [line[len("tvm: "):] for line in result.output.splitlines() if line.startswith("tvm: ")]
    manifest = json.loads((out / "manifest.json").read_text())
    return rows, manifest["runtime_info"]["offload"]


def _table(rows: list[str]) -> list[list[str]]:
    """The per-op rows of the explain table (op, shape, runs in …, rule), split on runs of spaces."""
    start = next(i for i, r in enumerate(rows) if r.split()[:2] == ["op", "shape"])
    end = next(i for i, r in enumerate(rows) if r.startswith("other ops") or " op(s) in torch kernels" in r)
    return [[c for c in r.split("  ") if c.strip()] for r in rows[start + 1:end]]


def test_resnet18_convolutions_run_in_torch_kernels(tmp_path):
    rows, offload = _explain("resnet18", tmp_path / "r18")
    table = _table(rows)
    convs = [r for r in table if r[0].startswith("conv2d")]
    assert len(convs) == 20
    assert all(r[2].strip().startswith("torch kernel conv2d_cl") for r in convs)
    assert {r[3].strip() for r in convs} == {"conv2d-packed", "conv2d-1x1-unpacked"}   # the 3 downsample 1x1s
    assert sum(r[3].strip() == "conv2d-1x1-unpacked" for r in convs) == 3
    assert any(r.startswith("convolutions NHWC") for r in rows)
    assert offload["in_torch"] >= 20 and len(offload["ops"]) == len(table)
    assert [o["rule"] for o in offload["ops"] if o["op"].startswith("conv2d")] == [r[3].strip() for r in convs]


def test_transformer_attention_and_linears_run_in_torch_kernels(tmp_path):
    rows, offload = _explain("transformer", tmp_path / "tr")
    table = _table(rows)
    attention = [r for r in table if r[0].startswith("attention")]
    assert len(attention) == 4 and all(r[2].strip() == "torch kernel attention_views" for r in attention)
    assert all(r[3].strip() == "attention +views" for r in attention)
    linears = [r for r in table if r[0].startswith("linear")]
    big = [r for r in linears if r[1].strip() in ("128x768", "128x1024")]      # in-projections and FFN up
    assert len(big) == 8 and all(r[2].strip().startswith("torch kernel linear") for r in big)
    # over the policy's bound (16.7 M multiply-adds) on oneDNN with packed weights, FFN up's relu in the GEMM
    assert all(r[2].strip().startswith("torch kernel linear_packed") and r[3].strip().startswith("linear-packed") for r in big)
    assert sum(r[2].strip() == "torch kernel linear_packed_relu" for r in big) == 4
    # a layer norm is a torch call or, where the build-time probe timed it faster, TVM code (rule small-gemm)
    norms = [o for o in offload["ops"] if "layer_norm" in o["op"]]
    assert len(norms) == 8 and all(o["rule"] in ("layer-norm", "small-gemm") for o in norms)
    assert all((o["runs"] == "TVM code") == (o["rule"] == "small-gemm") for o in norms)
