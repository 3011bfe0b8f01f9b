"""quantize's bias correction on a tiny conv net: which layers take a shift, and the shift each takes, by hand."""
from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from mlcomp.frontend.loading import load_model
from mlcomp.ir import Graph
from mlcomp.ir.ops import aten
from mlcomp.passes.quantize.bias import MIN_ROWS
from mlcomp.pipeline import run_pipeline


class TinyConv(nn.Module):
    """conv → relu → global pool → classifier: the classifier reads a mean of ReLU outputs (never negative), so
    its weight's rounding moves its outputs' means."""

    def __init__(self) -> None:
        super().__init__()
        self.conv, self.fc = nn.Conv2d(3, 8, 3, padding=1), nn.Linear(8, 5)

    def forward(self, x):
        return self.fc(F.adaptive_avg_pool2d(F.relu(self.conv(x)), 1).flatten(1))


def _data(batch: int, seed: int) -> torch.Tensor:
    return torch.randn(batch, 3, 6, 6, generator=torch.Generator().manual_seed(seed)) + 0.5


@pytest.fixture(scope="module")
def tiny():
    """The float graph through quantize with and without bias correction: calibrated on a batch of 32, one
    held-back batch; ``(model, x, runs, graph)``."""
    torch.manual_seed(0)
    model = TinyConv().eval()
    x, held = _data(32, 1), _data(32, 2)
    g = load_model(model, example_inputs=(x,)).capture()
    runs = {on: run_pipeline(g, f"quantize{{bias_correction={on} held_back=1}}", example_inputs=(x,),
                             calibration_data=[(x,), (held,)]) for on in ("true", "false")}
    return model, x, runs, g


def _fake_quant(x: torch.Tensor, graph: Graph, layer, index: int) -> torch.Tensor:
    """``x`` rounded on the uint8 grid of the pair the layer's input ``index`` reads."""
    dq = graph.node(layer.inputs[index].name)
    scale, zero = (graph.constants[dq.inputs[i].name] for i in (1, 2))
    return (torch.clamp(torch.round(x / scale) + zero.float(), 0, 255) - zero.float()) * scale


def _int8(graph: Graph, prefix: str, bias_int32: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The layer's int8 weight and int32 bias as floats, and the bias's scale."""
    w = graph.constants[f"{prefix}.weight.int8"].float()
    ws = graph.constants[f"{prefix}.weight.scale"].reshape(-1, *[1] * (w.dim() - 1))
    bs = graph.constants[f"{prefix}.bias.scale"]
    return w * ws, bias_int32.double() * bs, bs


def test_each_layer_takes_the_mean_of_its_own_rounding_computed_by_hand(tiny):
    """Δ = mean over rows of (W·x + b − (Ŵ·x̂ + b̂)), x the float input: the int32 bias moves by Δ / its scale."""
    model, x, runs, _ = tiny
    (on, _), (off, _) = runs["true"], runs["false"]
    conv, fc = off.nodes(aten("convolution"))[0], off.nodes(aten("addmm"))[0]
    with torch.no_grad():
        w, b, bs = _int8(off, "conv", off.constants["conv.bias.int32"])
        want = F.conv2d(x, model.conv.weight, model.conv.bias, padding=1)
        got = F.conv2d(_fake_quant(x, off, conv, 0), w, b.float(), padding=1)
        shifts = {"conv": ((want - got).double().mean((0, 2, 3)), bs)}
        h = F.adaptive_avg_pool2d(F.relu(want), 1).flatten(1)
        w, b, bs = _int8(off, "fc", off.constants["fc.bias.int32"])
        got = _fake_quant(h, off, fc, 1) @ w.T + b.float()
        shifts["fc"] = ((model.fc(h) - got).double().mean(0), bs)
    for prefix, (delta, scale) in shifts.items():
        before, after = off.constants[f"{prefix}.bias.int32"], on.constants[f"{prefix}.bias.int32"]
        expected = torch.round(before.double() + delta / scale.double())
        assert (after.double() - expected).abs().max() <= 1, (prefix, after, expected)
        assert (after != before).any(), prefix                        # a real shift, not a rounding of zero
    assert on.format() == off.format()                               # only the int32 biases' values change


def test_the_pass_reports_the_shifts_and_the_metric_improves(tiny):
    _, _, runs, _ = tiny
    st_on, st_off = runs["true"][1].stats("quantize"), runs["false"][1].stats("quantize")
    assert st_on["biases_corrected"] == 2 and st_off["biases_corrected"] == 0
    assert sorted(r["op"] for r in st_on["layers"] if r.get("bias_shift", 0) > 0) == ["aten.addmm.default", "aten.convolution.default"]
    assert all("bias_shift" not in r for r in st_off["layers"])
    for kind in ("calibration", "held_back"):
        assert st_on[kind]["mean_rel"] < st_off[kind]["mean_rel"], (kind, st_on[kind], st_off[kind])
        assert st_on[kind]["max_rel"] < 0.05 and st_on[kind]["top1"] == 1.0


def test_fewer_examples_than_the_rule_keep_every_bias_more_samples_of_them_correct_all():
    """One batch of 8: the convolution's 8·6·6 rows are 8 examples (< MIN_ROWS): every layer keeps its bias, with
    the reason; four such batches are 32 examples: both layers corrected."""
    torch.manual_seed(0)
    model = TinyConv().eval()
    batches = [(_data(8, s),) for s in range(4)]
    g = load_model(model, example_inputs=batches[0]).capture()
    one = run_pipeline(g, "quantize", example_inputs=batches[0])[1].stats("quantize")
    four = run_pipeline(g, "quantize", example_inputs=batches[0], calibration_data=batches)[1].stats("quantize")
    assert one["biases_corrected"] == 0 and four["biases_corrected"] == 2
    why = f"fewer than {MIN_ROWS} calibration examples (samples × batch) to measure a shift over"
    assert {r["op"]: r["bias_kept"] for r in one["layers"] if "bias_kept" in r} == {
        "aten.convolution.default": why, "aten.addmm.default": f"fewer than {MIN_ROWS} rows per channel to measure "
                                                                "a shift on"}


def test_a_layers_shift_does_not_depend_on_the_layers_before_it(tiny):
    """The classifier's correction is its own rounding only: the same int32 bias whether the convolution before
    it computes in int8 or is kept float."""
    _, x, runs, g = tiny
    conv_float, report = run_pipeline(g, "quantize{exclude=[conv]}", example_inputs=(x,))
    assert report.stats("quantize")["biases_corrected"] == 1
    assert torch.equal(conv_float.constants["fc.bias.int32"], runs["true"][0].constants["fc.bias.int32"])
