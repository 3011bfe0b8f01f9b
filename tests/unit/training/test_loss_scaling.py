"""Dynamic loss scaling: the spec, the seed rewrite on joint graphs, skip/backoff/growth, fp16 underflow."""
from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from mlcomp.frontend.joint import LossKind, capture_joint
from mlcomp.ir.builder import GraphBuilder
from mlcomp.ir.ops import INPUT, aten
from mlcomp.training.loss_scaling import (
    LOSS_SCALE_INPUT,
    LossScaleError,
    LossScaleMode,
    LossScaler,
    LossScaleSpec,
    find_backward_seed,
)
from mlcomp.training.step import compile_training


def test_spec_parse_forms():
    assert LossScaleSpec.parse("dynamic") == LossScaleSpec()
    assert LossScaleSpec().init == 2.0 ** 16 and LossScaleSpec().interval == 2000
    assert not LossScaleSpec.parse("none").active
    assert LossScaleSpec.parse("1024") == LossScaleSpec(LossScaleMode.STATIC, init=1024.0)
    assert LossScaleSpec.parse(8) == LossScaleSpec(LossScaleMode.STATIC, init=8.0)
    spec = LossScaleSpec.parse("dynamic{init=1024 growth=4, interval=3}")
    assert (spec.init, spec.growth, spec.backoff, spec.interval) == (1024.0, 4.0, 0.5, 3)
    assert LossScaleSpec.parse(spec.text()) == spec
    assert LossScaleSpec.parse("static{scale=64}").init == 64.0
    torch_names = LossScaleSpec.parse("dynamic{init=65536 growth_interval=2000}")   # GradScaler's name
    assert torch_names == LossScaleSpec() and LossScaleSpec.parse("DYNAMIC{interval=7}").interval == 7


@pytest.mark.parametrize("text, needle", [     # read by the spec grammar: column, option list, suggestion
    ("dynamik", "unknown loss-scale mode 'dynamik'; did you mean 'dynamic'?"),
    ("dynamic{init=abc}", "option 'init' of loss-scale mode 'dynamic' expects float"),
    ("dynamic{grow=2}", "loss-scale mode 'dynamic' has no option 'grow'; did you mean 'growth'?"),
    ("dynamic{interval=2.5}", "option 'interval' of loss-scale mode 'dynamic' expects int"),
    ("dynamic{backoff=2}", "'backoff' of loss-scale mode 'dynamic' must be in (0, 1), got 2.0"),
    ("dynamic{backoff=0}", "'backoff' of loss-scale mode 'dynamic' must be in (0, 1), got 0.0"),
    ("dynamic{growth=1}", "'growth' of loss-scale mode 'dynamic' must be greater than 1, got 1.0"),
    ("dynamic{init=inf}", "'init' of loss-scale mode 'dynamic' must be in (0, inf), got inf"),
    ("static{scale=0}", "'scale' of loss-scale mode 'static' must be in (0, inf), got 0.0. for example static"),
    ("-4", "positive finite"),
    ("inf", "positive finite"),
    ("{}", "expected a loss-scale mode name, found '{'"),
    ("dynamic,none", "names 2 loss-scale modes"),
])
def test_spec_malformed(text, needle):
    with pytest.raises(LossScaleError) as info:
        LossScaleSpec.parse(text)
    msg = str(info.value)
    assert needle in msg and ("for example " in msg or "write dynamic" in msg)      # and what to write


def test_seed_missing_is_explained():
    b = GraphBuilder("infer")
    graph = b.output(b.call(aten("relu"), b.input("x", (2, 3))))
    with pytest.raises(LossScaleError, match="no backward seed"):
        find_backward_seed(graph)
    with pytest.raises(LossScaleError, match="no backward seed"):      # the seed rewrite's own tests: tests/unit/passes
        compile_training(graph, loss_scale="dynamic")


def test_scaled_step_matches_unscaled(mlp_joint):
    _, x, y, graph = mlp_joint
    plain = compile_training(graph, optimizer="sgd{lr=0.1}", loss_scale="none")
    scaled = compile_training(graph, optimizer="sgd{lr=0.1}", loss_scale="dynamic")
    assert plain.loss_scaler is None and scaled.graph.input_nodes[-1].name == LOSS_SCALE_INPUT
    _, g_plain = plain.gradients(x, y)
    _, g_scaled = scaled.gradients(x, y)
    for name in g_plain:
        torch.testing.assert_close(g_scaled[name], g_plain[name], rtol=1e-6, atol=0)
    for _ in range(3):
        plain.step(x, y), scaled.step(x, y)
    for key, value in plain.state_dict().items():
        torch.testing.assert_close(scaled.state_dict()[key], value, rtol=1e-6, atol=1e-7)
    assert scaled.stats()["loss_scaling"]["skipped_steps"] == []


def test_overflow_skips_and_halves_then_grows(mlp_joint):
    _, x, y, graph = mlp_joint
    art = compile_training(graph, optimizer="sgd{lr=0.1}", loss_scale="dynamic{init=1024 interval=3}")
    before = {k: v.clone() for k, v in art.state_dict().items()}
    bad = x.clone()
    bad[0, 0] = math.inf                      # an inf input: the first layer's weight gradient is inf/NaN
    art.step(bad, y)
    assert art.loss_scaler.scale == 512.0
    for k, v in art.state_dict().items():     # the update was skipped
        assert torch.equal(v, before[k]), k
    for _ in range(3):
        art.step(x, y)
    stats = art.stats()["loss_scaling"]
    assert stats["scale"] == 1024.0 and stats["skipped_steps"] == [0] and stats["steps"] == 4
    assert [c["scale"] for c in stats["scale_changes"]] == [512.0, 1024.0]
    assert "skipped" in stats["scale_changes"][0]["why"] and "3 clean" in stats["scale_changes"][1]["why"]
    assert not torch.equal(art.state_dict()["0.weight"], before["0.weight"])


def test_scaler_unscales_in_fp32_and_flags_nan():
    scaler = LossScaler(LossScaleSpec.parse("static{scale=4}"))
    grads, finite = scaler.unscale([torch.full((2,), 8.0, dtype=torch.float16), torch.ones(3)])
    assert finite and grads[0].dtype == torch.float32 and grads[0].tolist() == [2.0, 2.0]
    _, finite = scaler.unscale([torch.tensor([1.0, float("nan")])])
    assert not finite and not scaler.update(finite) and scaler.scale == 4.0 and scaler.skipped == [0]


class TinyGradients(nn.Module):
    """fp32 master weight, matmul in fp16, a loss so small its gradient underflows fp16 (2^-30 < 2^-24)."""

    def __init__(self, compute: torch.dtype = torch.float16) -> None:
        super().__init__()
        self.compute = compute
        self.weight = nn.Parameter(torch.linspace(-1, 1, 12).reshape(3, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = (x.to(self.compute) @ self.weight.to(self.compute).t()).float()
        return out.sum() * 2.0 ** -30


def test_fp16_underflow_without_scaling_and_recovery_with_it():
    model = TinyGradients()
    x = torch.linspace(-2, 2, 8).reshape(2, 4)
    graph = capture_joint(model, (x,), None, loss=LossKind.MODEL)
    assert any(n.meta.dtype == torch.float16 for n in graph.call_nodes() if hasattr(n.meta, "dtype"))
    reference = TinyGradients(torch.float32)            # the same step in fp32
    reference(x).backward()
    expected = reference.weight.grad
    assert expected.abs().min() > 0
    unscaled = compile_training(graph, loss_scale="none")
    _, g = unscaled.gradients(x)
    assert torch.count_nonzero(g["weight"]) == 0        # flushed to zero in fp16
    default = compile_training(graph)                    # fp16 in the graph: dynamic by default
    assert default.loss_scaler is not None and default.loss_scaler.scale == 2.0 ** 16
    _, g = default.gradients(x)
    assert g["weight"].dtype == torch.float32
    torch.testing.assert_close(g["weight"], expected, rtol=2e-3, atol=0)
    assert default.graph.nodes(INPUT)[-1].name == LOSS_SCALE_INPUT


def test_loss_scaled_artifact_saves_and_reloads_bit_for_bit(mlp_joint, tmp_path):
    from mlcomp.training.step import TrainingArtifact

    _, x, y, graph = mlp_joint
    art = compile_training(graph, optimizer="sgd{lr=0.1 momentum=0.9}", loss_scale="dynamic{init=1024 interval=2}")
    bad = x.clone()
    bad[0, 0] = math.inf
    for batch in (x, bad, x, x):              # one skipped step, then growth: a history to keep
        art.step(batch, y)
    history = art.stats()["loss_scaling"]
    assert history["skipped_steps"] == [1] and [c["scale"] for c in history["scale_changes"]] == [512.0, 1024.0]
    folder = art.save(tmp_path / "scaled", inputs=(x, y))
    again = TrainingArtifact.load(folder)     # load repeats the saved step and compares (check_step)
    assert again.verification["reload"]["worst_rel"] == 0.0 and again.verification["reload"]["loss_rel"] == 0.0
    assert again.stats()["loss_scaling"] == history and again.loss_scaler.clean == art.loss_scaler.clean
    for _ in range(3):                        # the next steps, bit for bit, scale growth included
        assert torch.equal(art.step(x, y), again.step(x, y))
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in art.state_dict().items())
    assert again.stats()["loss_scaling"] == art.stats()["loss_scaling"]
    assert again.loss_scaler.scale == art.loss_scaler.scale == 2048.0


def test_cli_loss_scale_flag(tmp_path):
    from click.testing import CliRunner

    from mlcomp.cli.main import main as cli

    out = tmp_path / "mlp-train"
    bad = CliRunner().invoke(cli, ["compile", "mlp", "--train", "--loss-scale", "dynamic{grow=2}", "-o", str(out)])
    assert bad.exit_code != 0 and "did you mean 'growth'" in bad.output and "Traceback" not in bad.output
    assert not out.exists()                   # refused before capture: nothing written
    ok = CliRunner().invoke(cli, ["compile", "mlp", "--train", "--steps", "2", "--loss-scale",
                                  "dynamic{init=65536 growth_interval=2000}", "-o", str(out)])
    assert ok.exit_code == 0, ok.output
    assert "loss scaling: dynamic{init=65536.0 growth=2.0 backoff=0.5 interval=2000}" in ok.output
    import json

    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["loss_scaling"]["spec"]["mode"] == "dynamic" and manifest["loss_scaling"]["scale"] == 65536.0
