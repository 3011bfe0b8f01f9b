"""A UNet's pieces in a TVM build: transposed convolutions in torch's kernel, a BatchNorm behind a conv's
bias folded into the conv, in both conv layouts (NCHW and channels-last packed)."""
from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.tvm

tvm_backend = pytest.importorskip("mlcomp.targets.tvm.build")

from mlcomp.targets.tvm.config import BuildConfig  # noqa: E402
from mlcomp.targets.tvm.offload import conv_packed  # noqa: E402
from mlcomp.targets.tvm.offload.affine import fold_affine  # noqa: E402
from tests.unit.targets.test_tvm_kernels import _render  # noqa: E402


def _block(i: int, o: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(i, o, 3, padding=1), nn.BatchNorm2d(o), nn.ReLU())


class TinyUNet(nn.Module):
    """conv(+bias)+BN+relu blocks, a max-pool down, a ConvTranspose2d up and a skip concat."""

    def __init__(self) -> None:
        super().__init__()
        self.down, self.mid = _block(3, 8), _block(8, 16)
        self.up = nn.ConvTranspose2d(16, 8, 2, stride=2)
        self.out = _block(16, 8)

    def forward(self, x):
        a = self.down(x)
        return self.out(torch.cat([self.up(self.mid(nn.functional.max_pool2d(a, 2))), a], 1))


@pytest.fixture(scope="module")
def unet():
    torch.manual_seed(0)
    model = TinyUNet().eval()
    for m in model.modules():        # a BatchNorm that is not the identity
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-1, 1), m.running_var.uniform_(0.5, 2), m.weight.data.uniform_(0.5, 2)
    x = torch.randn(1, 3, 16, 16)
    with torch.no_grad():
        return model, x, model(x)


def _placed(built) -> list[tuple[str, str, str]]:
    return [(o["op"].split(" ")[0], o["runs"], o["rule"]) for o in built.stats["offload"]["ops"]]


@pytest.mark.parametrize("channels_last", [False, True], ids=["nchw", "packed-nhwc"])
def test_conv_transpose_runs_in_torch_and_batchnorm_folds(unet, channels_last, monkeypatch):
    model, x, ref = unet
    if channels_last:   # the tiny convs are under the packing bound: lower it so the NHWC path is taken
        monkeypatch.setattr(conv_packed, "MIN_MEAN_CONV_MACS", 0)
    built = tvm_backend.build(model, (x,), BuildConfig(deterministic=True))
    assert built.stats["conv_layout"]["layout"] == ("NHWC" if channels_last else "NCHW")
    placed = _placed(built)
    assert ("conv2d_transpose", "torch kernel", "conv2d-transpose") in placed
    assert all(runs == "torch kernel" for _, runs, _ in placed), placed
    other = built.stats["offload"]["other_ops"]
    # each BatchNorm (behind a conv's bias) went into its conv: no per-channel arithmetic is left
    assert not {"subtract", "divide", "multiply"} & set(other), other
    assert "conv2d_transpose" not in other
    if channels_last:   # bias and relu rode into the packed calls
        assert [op for op, _, _ in placed].count("conv2d+relu") == 3
    torch.testing.assert_close(built(x)[0], ref, rtol=1e-4, atol=1e-4)


def test_fold_affine_leaves_one_conv_and_one_add():
    import tvm
    from tvm.relax.frontend.torch import from_exported_program

    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(2, 4, 3), nn.BatchNorm2d(4)).eval()
    model[1].running_var.fill_(4.0)
    x = torch.randn(1, 2, 6, 6)
    mod = from_exported_program(torch.export.export(model, (x,)), keep_params_as_input=False,
                                unwrap_unit_return_tuple=True)
    with tvm.target.Target("llvm"):
        seq = tvm.transform.Sequential([tvm.relax.transform.DecomposeOpsForInference(),
                                        tvm.relax.transform.FoldConstant()])
        before = seq(mod)["main"]
    ops = lambda lines: [line.split(" = ")[1].split("(")[0].rsplit(".", 1)[-1] for line in lines]   # noqa: E731
    assert ops(_render(before)) == ["conv2d", "add", "subtract", "divide", "multiply", "add"]
    after = fold_affine(before)
    assert ops(_render(after)) == ["conv2d", "add"]
    built = tvm_backend.build(model, (x,), BuildConfig(deterministic=True))
    with torch.no_grad():
        torch.testing.assert_close(built(x)[0], model(x), rtol=1e-5, atol=1e-5)
