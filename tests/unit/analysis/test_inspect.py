"""`mlcomp inspect`: histogram, parameters, FLOPs, intensity, parallelism."""
from __future__ import annotations

import json

import torch
from click.testing import CliRunner

from mlcomp.analysis.inspect import inspect_graph
from mlcomp.cli.main import main
from mlcomp.frontend.loading import load_model


class TwoBranches(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a = torch.nn.Linear(16, 16)
        self.b = torch.nn.Linear(16, 16)

    def forward(self, x):
        return torch.relu(self.a(x)) + torch.sigmoid(self.b(x))


def test_report_fields_on_mlp(captured):
    _, _, graph = captured("mlp")
    r = inspect_graph(graph)
    assert r.params == 512 * 256 + 256 + 256 * 128 + 128 + 128 * 2 + 2
    assert r.param_bytes == 4 * r.params
    assert r.op_histogram["aten.addmm.default"] == 3
    assert r.flops == 2 * 2 * (512 * 256 + 256 * 128 + 128 * 2)   # batch 2, 2 FLOPs per MAC
    assert 0 < r.intensity < 10
    # analysis.liveness in graph order: addmm [2, 256] and its relu are the largest pair alive at once
    assert r.peak_activation_bytes == 2 * (2 * 256 * 4)
    assert r.to_json()["peak_activation_bytes"] == r.peak_activation_bytes
    text = r.format()
    assert "aten.addmm.default" in text and "parallelism profile" in text
    assert "peak activations 4.00 KiB" in text


def test_parallelism_profile_sees_independent_branches():
    x = torch.randn(4, 16)
    graph = load_model(TwoBranches(), example_inputs=(x,)).capture()
    r = inspect_graph(graph)
    assert r.max_width >= 2                      # the two Linear branches run side by side
    assert len(r.critical_path) < r.nodes        # not a chain


def test_cli_json_and_dot(tmp_path):
    dot = tmp_path / "g.dot"
    res = CliRunner().invoke(main, ["inspect", "lenet", "--json", "--dot", str(dot)])
    assert res.exit_code == 0, res.output
    data = json.loads(res.output)
    assert data["op_histogram"]["aten.convolution.default"] == 2
    assert data["parallelism"]["critical_path_length"] >= 1
    assert data["flops"] == sum(row["flops"] for row in data["per_node"])
    assert isinstance(data["peak_activation_bytes"], int) and data["peak_activation_bytes"] > 0
    assert dot.read_text().startswith("digraph")


def test_cli_text_report():
    res = CliRunner().invoke(main, ["inspect", "mlp", "--ir"])
    assert res.exit_code == 0, res.output
    assert "graph" in res.output and "op histogram" in res.output and "FLOPs" in res.output
