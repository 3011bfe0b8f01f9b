"""Per-op placement of a TVM build (torch kernel or TVM code, and the policy rule): what ``--explain``, the
build's stats and the artifact manifest (``runtime_info.offload``) say."""
from __future__ import annotations

import json

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.tvm

tvm_backend = pytest.importorskip("mlcomp.targets.tvm.build")

from mlcomp.targets.tvm.config import BuildConfig  # noqa: E402
from mlcomp.targets.tvm.offload.placement import Placements, placements  # noqa: E402
from mlcomp.targets.tvm.offload.policy import HostFacts, Runs  # noqa: E402
from tests.unit.targets.test_tvm_offload_fusions import TinyEncoder, _relax  # noqa: E402


class _ConvNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 8 * 8, 10)

    def forward(self, x):
        y = torch.relu(self.conv2(torch.relu(self.conv1(x))))
        return self.fc(y.flatten(1))


def _ops(offload: dict, runs: str) -> list[tuple[str, str]]:
    return [(o["op"].split("+")[0].split(" ")[0], o["rule"]) for o in offload["ops"] if o["runs"] == runs]


@pytest.fixture(scope="module")
def convnet():
    torch.manual_seed(0)
    model, x = _ConvNet().eval(), torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        ref = model(x)
    return model, x, ref


def test_small_convs_and_the_linear_run_in_torch_kernels(convnet):
    model, x, ref = convnet
    built = tvm_backend.build(model, (x,), BuildConfig(small_gemms=False))
    offload = built.stats["offload"]
    # convs of ~0.1 M MACs on average: under conv2d-packed's bound, so NCHW F.conv2d (rule conv2d)
    assert _ops(offload, "torch kernel") == [("conv2d", "conv2d"), ("conv2d", "conv2d"), ("linear", "linear")]
    assert offload["in_tvm"] == 0 and offload["host"]["kernels"] is True
    assert set(offload["rules"]) >= {"conv2d", "linear"}
    assert built.stats["conv_layout"]["layout"] == "NCHW"
    torch.testing.assert_close(built(x)[0], ref, rtol=1e-4, atol=1e-5)


def test_deterministic_build_places_by_the_table_alone(convnet):
    """No probe runs: the small classifier GEMM stays the torch call the table names (rule linear)."""
    model, x, ref = convnet
    built = tvm_backend.build(model, (x,), BuildConfig(deterministic=True))
    assert _ops(built.stats["offload"], "torch kernel") == [("conv2d", "conv2d"), ("conv2d", "conv2d"),
                                                            ("linear", "linear")]
    assert "small-gemm" not in built.stats["offload"]["rules"]
    torch.testing.assert_close(built(x)[0], ref, rtol=1e-4, atol=1e-5)


def test_kernels_off_is_a_pure_tvm_build(convnet):
    model, x, ref = convnet
    built = tvm_backend.build(model, (x,), BuildConfig(kernels=False))
    offload = built.stats["offload"]
    assert offload["in_torch"] == 0 and built.stats["kernels"]["kernels"] == {}
    assert _ops(offload, "TVM code") == [("conv2d", "pure-tvm"), ("conv2d", "pure-tvm"), ("matmul", "pure-tvm")]
    assert built.stats["schedules"]["parallel"] is True          # no torch pool to share the cores with
    lines = Placements.from_json(offload).lines()
    assert all("TVM code" in line and line.endswith("pure-tvm") for line in lines[1:4])
    assert "0 op(s) in torch kernels, 3 heavy op(s) as TVM code" in "\n".join(lines)
    assert any(line.startswith("other ops -> TVM code (pure-tvm)") for line in lines)
    torch.testing.assert_close(built(x)[0], ref, rtol=1e-4, atol=1e-5)


def test_placements_follow_the_fake_host():
    """The same Relax module read on a CUDA host and a kernels=off host: every heavy op TVM code, by the host's rule."""
    _, mod = _relax(_ConvNet().eval(), torch.randn(2, 3, 8, 8))
    cuda = placements(mod, HostFacts(device="cuda", kernels=False)).to_json()
    cuda_kernels = placements(mod, HostFacts(device="cuda", kernels=True)).to_json()
    assert {o["rule"] for o in cuda["ops"]} == {"pure-tvm"}
    assert {o["rule"] for o in cuda_kernels["ops"]} == {"cuda"} and cuda_kernels["in_torch"] == 0
    assert [o["op"] for o in cuda["ops"]] == ["conv2d", "conv2d", "matmul"]


def test_no_fused_onednn_keeps_convs_nchw():
    from mlcomp.targets.tvm.offload.conv_packed import channels_last_reason

    big = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1)).eval()
    _, mod = _relax(big, torch.randn(1, 64, 32, 32), capture=False)
    assert channels_last_reason(mod, HostFacts(packed_conv=True)) is None
    assert "no oneDNN fused convolution" in channels_last_reason(mod, HostFacts(packed_conv=False))


def test_encoder_attention_and_layer_norms_run_in_torch():
    torch.manual_seed(0)
    model, x = TinyEncoder().eval(), torch.randn(2, 5, 8)
    built = tvm_backend.build(model, (x,), BuildConfig(small_gemms=False))
    torch_ops = _ops(built.stats["offload"], "torch kernel")
    assert ("attention", "attention") in torch_ops
    assert ("add", "layer-norm") in torch_ops                       # the residual add rides in the norm call
    assert all(rule != "default" for _, rule in torch_ops)
    with torch.no_grad():
        torch.testing.assert_close(built(x)[0], model(x), rtol=1e-4, atol=1e-5)


def test_manifest_records_the_placements_and_explain_prints_them(convnet, tmp_path):
    from mlcomp.frontend.loading import load_model
    from mlcomp.targets import CompileOptions, get_target

    model, x, _ = convnet
    art = get_target("tvm").compile(load_model(model, example_inputs=(x,)).capture(), CompileOptions())
    art.save(tmp_path / "art")
    manifest = json.loads((tmp_path / "art" / "manifest.json").read_text())
    offload = manifest["runtime_info"]["offload"]
    assert offload == json.loads(json.dumps(art.runtime.stats["offload"]))
    assert [o["op"].split("+")[0] for o in offload["ops"]][:2] == ["conv2d", "conv2d"]
    assert all(o["runs"] in (Runs.TORCH.value, Runs.TVM.value) and o["rule"] in offload["rules"]
               for o in offload["ops"])
    lines = art.runtime.explain_lines()
    assert lines[0].split() == ["op", "shape", "runs", "in", "rule"]
    assert sum("torch kernel conv2d" in line for line in lines) == 2
    assert any(line.startswith("rule conv2d: F.conv2d") for line in lines)


def test_target_description_says_where_heavy_ops_run():
    from mlcomp.targets import get_target

    text = get_target("tvm").description
    assert "torch's oneDNN/MKL kernels" in text and "inside the TVM-built module" in text and "--explain" in text
