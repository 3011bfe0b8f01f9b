"""``torch.compile(model, backend="mlcomp")``: eager's numbers, options per call, partitions, recompiles, training."""
from __future__ import annotations

import copy
import tomllib
from pathlib import Path

import pytest
import torch
from torch import nn

from mlcomp import models
from mlcomp.base.errors import OptionError
from mlcomp.dynamo import backend as mb
from mlcomp.dynamo.report import TORCH

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    mb.register()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def compiled(model, **options):
    report = mb.BackendReport()
    return torch.compile(model, backend="mlcomp", options={"report": report, **options}), report


def test_entry_point_and_registration_name_the_backend():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    spec = project["project"]["entry-points"]["torch_dynamo_backends"]["mlcomp"]
    module, _, attr = spec.partition(":")
    assert getattr(__import__(module, fromlist=[attr]), attr) is mb.mlcomp_backend
    from torch._dynamo.backends.registry import lookup_backend
    assert lookup_backend("mlcomp") is mb.mlcomp_backend


def test_zoo_model_matches_eager_and_runs_in_mlcomp():
    zoo = models.get("mlp")
    model = zoo.build().eval()
    fast, report = compiled(model, pipeline="-O2")
    (x,) = zoo.example_inputs(2)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-5)
    assert report.graphs == 1
    assert [p.ran_on for p in report.partitions] == ["mlcomp:cpu"]
    assert "mlcomp:cpu" in report.table()


def test_two_compiles_keep_their_own_options():
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
    on_cpu, cpu_report = compiled(model, target="cpu")
    on_ort, ort_report = compiled(copy.deepcopy(model), target="onnxruntime")
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(on_cpu(x), model(x))
        torch.testing.assert_close(on_ort(x), model(x), rtol=1e-5, atol=1e-5)
        on_cpu(x)
    assert {p.ran_on for p in cpu_report.partitions} == {"mlcomp:cpu"}
    assert {p.ran_on for p in ort_report.partitions} == {"mlcomp:onnxruntime"}


def test_unknown_option_is_named():
    with pytest.raises(OptionError, match="treads"):
        mb.mlcomp_backend(torch.fx.symbolic_trace(nn.ReLU()), [torch.randn(2)], options={"treads": 2})


class Breaks(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 4)

    def forward(self, x):
        h = torch.relu(self.a(x))
        print("a graph break")
        return self.b(h).sigmoid()


def test_graph_break_gives_two_verified_partitions(capsys):
    model = Breaks().eval()
    fast, report = compiled(model)
    x = torch.randn(2, 8)
    with torch.no_grad():
        torch.testing.assert_close(fast(x), model(x))
    assert report.graphs == 2
    assert [(p.graph, p.ran_on) for p in report.partitions] == [("graph0", "mlcomp:cpu"), ("graph1", "mlcomp:cpu")]
    assert "a graph break" in capsys.readouterr().out


class Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 8)

    def forward(self, x):
        h = self.a(x)
        h = torch.cond(h.sum() > 0, lambda t: t.relu(), lambda t: t.tanh(), (h,))
        return h * 2


def test_op_outside_the_ir_runs_in_torch_and_the_rest_in_mlcomp():
    model = Branches().eval()
    fast, report = compiled(model)
    with torch.no_grad():
        for x in (torch.randn(2, 8), -torch.ones(2, 8) * 50):
            torch.testing.assert_close(fast(x), model(x))
    in_torch = [p for p in report.partitions if p.ran_on == TORCH]
    assert [p.name for p in in_torch] == ["cond"] and "not an op of mlcomp's IR" in in_torch[0].reason
    assert sum(p.ran_on == "mlcomp:cpu" for p in report.partitions) >= 2


def test_batch_sweep_compiles_at_most_twice():
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).eval()
    fast, report = compiled(model, pipeline="-O1")
    with torch.no_grad():
        for batch in range(1, 21):
            x = torch.randn(batch, 16)
            torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-5)
    assert report.graphs == 2
    assert all(p.ran_on == "mlcomp:cpu" for p in report.partitions)


def test_weight_edited_after_compile_is_seen():
    model = nn.Sequential(nn.Linear(4, 4)).eval()
    fast, _ = compiled(model)
    x = torch.randn(2, 4)
    with torch.no_grad():
        fast(x)
        model[0].weight.mul_(2)
        torch.testing.assert_close(fast(x), model(x))


def test_five_training_steps_match_eager():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    fast, report = compiled(model)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference))
    for _ in range(5):
        x, y = torch.randn(4, 8), torch.randn(4, 4)
        for net, o in ((fast, opt), (reference, ref_opt)):
            o.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            o.step()
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert {p.graph for p in report.partitions} == {"graph0.forward", "graph0.backward"}
    assert all(p.ran_on == "mlcomp:cpu" for p in report.partitions)
