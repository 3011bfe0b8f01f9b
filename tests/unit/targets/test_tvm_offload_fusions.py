"""The larger rewrites of TVM's kernel offload (issue 14): attention → SDPA, epilogues, layer norm.

Three ways: the Relax IR before/after (which ops became which packed calls, in order), numbers
against eager PyTorch (1e-5), and the counts the build reports (``stats["kernels"]``).
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.tvm

tvm_backend = pytest.importorskip("mlcomp.targets.tvm.build")

from tests.unit.targets.test_tvm_kernels import _render  # noqa: E402  (the shared Relax renderer)


class TinyEncoder(nn.Module):
    """One post-norm encoder layer (attention, residual add + layer norm, relu FFN) and a gelu/sigmoid head."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True)
        self.head = nn.Sequential(nn.Linear(8, 6), nn.GELU(), nn.Linear(6, 3), nn.Sigmoid())

    def forward(self, x):
        return self.head(self.enc(x))


class TinyLeNet(nn.Module):
    """conv + bias + sigmoid + avg-pool, then linear + gelu: LeNet's shape in miniature."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(1, 2, 3)
        self.fc = nn.Linear(2 * 3 * 3, 4)

    def forward(self, x):
        y = nn.functional.avg_pool2d(torch.sigmoid(self.conv(x)), 2)
        return nn.functional.gelu(self.fc(y.flatten(1)))


_OPS = ("matmul", "softmax", "layer_norm", "relu", "gelu", "sigmoid", "call_pure_packed", "add")


def _relax(model, x, capture: bool = True):
    """``model`` as Relax the way the tvm target sees it: mlcomp capture (core ATen), generated module, prepared."""
    import tvm
    from tvm.relax.frontend.torch import from_exported_program

    from mlcomp.frontend.loading import load_model
    from mlcomp.runtime.codegen import to_fx

    module = to_fx(load_model(model, example_inputs=(x,)).capture()).eval() if capture else model
    mod = from_exported_program(torch.export.export(module, (x,)), keep_params_as_input=False,
                                unwrap_unit_return_tuple=True)
    return module, tvm_backend.prepare(mod, tvm.target.Target("llvm"))


def _model(cls, *shape):
    torch.manual_seed(0)
    return cls().eval(), torch.randn(*shape)


@pytest.fixture(scope="module")
def encoder():
    from mlcomp.targets.tvm.offload.rewrite import ALL_FUSIONS, Fusion, offload

    model, x = _model(TinyEncoder, 2, 5, 8)
    module, mod = _relax(model, x)
    # the layout chains around the calls (Fusion.VIEWS) have their own tests: tests/unit/targets/test_tvm_views.py
    after, report = offload(mod, ALL_FUSIONS - {Fusion.VIEWS})
    plain, _ = offload(mod, frozenset())
    return model, x, module, mod, after, report, plain


_ENCODER_BEFORE = """\
lv4 = relax.matmul(lv2, const[5x8x24])
lv5 = relax.add(lv4, const[24])
lv29 = relax.matmul(lv26, lv28)
lv31 = relax.nn.softmax(lv30)
lv44 = relax.matmul(lv41, lv43)
lv51 = relax.matmul(lv49, const[8x8])
lv52 = relax.add(const[8], lv51)
lv55 = relax.add(x, lv54)
lv56 = relax.nn.layer_norm(lv55, const[8], const[8])
lv59 = relax.matmul(lv57, const[8x16])
lv60 = relax.add(const[16], lv59)
lv62 = relax.nn.relu(lv61)
lv65 = relax.matmul(lv63, const[16x8])
lv66 = relax.add(const[8], lv65)
lv68 = relax.add(lv56, lv67)
lv69 = relax.nn.layer_norm(lv68, const[8], const[8])
lv72 = relax.matmul(lv70, const[8x6])
lv73 = relax.add(const[6], lv72)
lv75 = relax.nn.gelu(lv74)
lv78 = relax.matmul(lv76, const[6x3])
lv79 = relax.add(const[3], lv78)
gv = relax.sigmoid(lv80)"""

# the in-projection is a batched matmul by the weight expanded over the 5 positions: one linear again
_ENCODER_AFTER = """\
lv5 = relax.call_pure_packed(mlcomp.torch.linear, lv2, const[24x8], const[24])
lv44 = relax.call_pure_packed(mlcomp.torch.attention, lv26, lv3, lv43)
lv52 = relax.call_pure_packed(mlcomp.torch.linear, lv49, const[8x8], const[8])
lv56 = relax.call_pure_packed(mlcomp.torch.add_layer_norm, x, lv54, const[8], const[8], 1e-05)
lv60 = relax.call_pure_packed(mlcomp.torch.linear, lv57, const[16x8], const[16])
lv62 = relax.nn.relu(lv61)
lv66 = relax.call_pure_packed(mlcomp.torch.linear, lv63, const[8x16], const[8])
lv69 = relax.call_pure_packed(mlcomp.torch.add_layer_norm, lv56, lv67, const[8], const[8], 1e-05)
lv = relax.call_pure_packed(mlcomp.torch.linear_gelu, lv70, const[6x8], const[6])
lv = relax.call_pure_packed(mlcomp.torch.linear_sigmoid, lv76, const[3x6], const[3])"""


def _ops(func) -> str:
    return "\n".join(line for line in _render(func) if any(op in line for op in _OPS))


def test_encoder_golden_ir(encoder):
    """softmax attention → one SDPA call; residual add + layer norm → add_layer_norm; gelu and sigmoid
    after a linear → the linear's own call (relu stays in TVM); nothing of the score chain is left."""
    _, _, _, before, after, _, plain = encoder
    assert _ops(before["main"]) == _ENCODER_BEFORE
    assert _ops(after["main"]) == _ENCODER_AFTER
    text = "\n".join(_render(after["main"]))
    assert "softmax" not in text and "relax.where" not in text and "layer_norm(" not in text
    # the key goes in scaled but not transposed (k_t's transpose and the kernel's transpose back cancel)
    assert "= relax.multiply(lv20, const[])" in text and "relax.permute_dims(lv20" not in text
    # without the fusions: the plain offload (two matmuls, softmax, layer norms and activations in Relax)
    names = "\n".join(_render(plain["main"]))
    assert "softmax" in names and "attention" not in names and "linear_gelu" not in names


def test_encoder_report_counts(encoder):
    _, _, _, _, _, report, _ = encoder
    counts = {name: v["count"] for name, v in report.to_json()["kernels"].items()}
    assert counts == {"mlcomp.torch.add_layer_norm": 2, "mlcomp.torch.attention": 1, "mlcomp.torch.linear": 4,
                      "mlcomp.torch.linear_gelu": 1,
                      "mlcomp.torch.linear_sigmoid": 1}
    assert any(line.startswith("attention ×1 → torch ") for line in report.lines())
    assert any(line.startswith("linear+gelu ×1 → torch ") for line in report.lines())


def test_encoder_numbers_and_stats_against_eager(encoder):
    from mlcomp.targets.tvm.offload.rewrite import ALL_FUSIONS, Fusion

    model, x, module, *_ = encoder
    built = tvm_backend.build(module, (x,), tvm_backend.BuildConfig(fusions=ALL_FUSIONS - {Fusion.VIEWS}, small_gemms=False))
    with torch.no_grad():
        torch.testing.assert_close(built(x)[0], model(x), rtol=1e-5, atol=1e-5)
    kernels = built.stats["kernels"]["kernels"]
    assert kernels["mlcomp.torch.attention"]["count"] == 1 and kernels["mlcomp.torch.add_layer_norm"]["count"] == 2


def test_lenet_bias_and_activation_go_into_the_torch_calls():
    from mlcomp.targets.tvm.offload.rewrite import offload

    model, x = _model(TinyLeNet, 3, 1, 8, 8)
    module, mod = _relax(model, x)
    after, report = offload(mod)
    assert _render(mod["main"]) == [
        "lv = relax.nn.conv2d(x, const[2x1x3x3])", "lv2 = relax.add(lv, const[1x2x1x1])", "lv3 = relax.sigmoid(lv2)",
        "lv4 = relax.nn.avg_pool2d(lv3)", "lv5 = relax.reshape(lv4, shape)", "lv7 = relax.matmul(lv5, const[18x4])",
        "lv8 = relax.add(const[4], lv7)", "gv = relax.nn.gelu(lv8)"]
    assert _render(after["main"]) == [
        "lv3 = relax.call_pure_packed(mlcomp.torch.conv2d_sigmoid, x, const[2x1x3x3], const[2], "
        "1, 1, 0, 0, 0, 0, 1, 1, 1)",
        "lv4 = relax.nn.avg_pool2d(lv3)", "lv5 = relax.reshape(lv4, shape)",
        "gv = relax.call_pure_packed(mlcomp.torch.linear_gelu, lv5, const[4x18], const[4])"]
    built = tvm_backend.build(module, (x,), tvm_backend.BuildConfig(small_gemms=False))     # the probe may keep small GEMMs in TVM
    with torch.no_grad():
        torch.testing.assert_close(built(x)[0], model(x), rtol=1e-5, atol=1e-5)
    assert {k: v["count"] for k, v in built.stats["kernels"]["kernels"].items()} == {
        "mlcomp.torch.conv2d_sigmoid": 1, "mlcomp.torch.linear_gelu": 1}
    assert report.to_json()["kernels"]["mlcomp.torch.conv2d_sigmoid"]["op"] == "conv2d+sigmoid"


class PreActivationReadTwice(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        y = self.fc(x)
        return torch.sigmoid(y) + y


def test_activation_stays_in_tvm_when_the_linear_output_has_another_reader():
    """Folding sigmoid into the linear would compute the linear twice: the rewrite declines."""
    from mlcomp.targets.tvm.offload.rewrite import offload

    model, x = _model(PreActivationReadTwice, 2, 4)
    _, mod = _relax(model, x, capture=False)
    after, _ = offload(mod)
    assert _ops(after["main"]).splitlines() == [
        "lv2 = relax.call_pure_packed(mlcomp.torch.linear, x, const[4x4], const[4])",
        "lv3 = relax.sigmoid(lv2)", "gv = relax.add(lv3, lv2)"]


def test_attention_kernel_and_activations_against_torch():
    from mlcomp.targets.tvm.kernels import KERNELS, Activation

    torch.manual_seed(0)
    q, k, v = torch.randn(3, 5, 4), torch.randn(3, 6, 4), torch.randn(3, 6, 7)
    out = KERNELS["mlcomp.torch.attention"].fn(q, k, v)
    torch.testing.assert_close(out, torch.softmax(q @ k.transpose(1, 2), -1) @ v, rtol=1e-5, atol=1e-6)
    y = torch.randn(10)
    expect = {Activation.SIGMOID: torch.sigmoid(y),
              Activation.GELU: nn.functional.gelu(y), Activation.GELU_TANH: nn.functional.gelu(y, approximate="tanh")}
    for act, want in expect.items():
        torch.testing.assert_close(act.apply(y.clone()), want)


class LinearRelu(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 1024)

    def forward(self, x):
        return torch.relu(self.fc(x))


def test_relu_joins_a_large_linear_only():
    """relu after a linear of ≥ RELU_MIN_ELEMENTS outputs runs in place in torch (linear_relu); a small one
    stays a TVM loop, as relu after a conv does."""
    from mlcomp.targets.tvm.offload.epilogues import RELU_MIN_ELEMENTS
    from mlcomp.targets.tvm.offload.rewrite import offload

    lines = {}
    for rows in (1024, 8):
        model, x = _model(LinearRelu, rows, 16)
        module, mod = _relax(model, x, capture=False)
        after, report = offload(mod)
        lines[rows] = _ops(after["main"]).splitlines()
        if rows * 1024 >= RELU_MIN_ELEMENTS:
            built = tvm_backend.build(module, (x,))
            with torch.no_grad():
                torch.testing.assert_close(built(x)[0], model(x), rtol=1e-5, atol=1e-5)
            # 1024 x 16 x 1024 multiply-adds: the build then packs it (policy row linear-packed), relu still fused
            assert {k: v["count"] for k, v in built.stats["kernels"]["kernels"].items()} == {
                "mlcomp.torch.linear_packed_relu": 1}
            assert built.stats["linears_packed"] == {"mlcomp.torch.linear_relu": 1}
    assert lines == {1024: ["gv = relax.call_pure_packed(mlcomp.torch.linear_relu, x, const[1024x16], const[1024])"],
                     8: ["lv2 = relax.call_pure_packed(mlcomp.torch.linear, x, const[1024x16], const[1024])",
                         "gv = relax.nn.relu(lv2)"]}
