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


pytestmark = pytest.mark.usefixtures("fresh_dynamo")   # tests/conftest.py


def compiled(model, **options):
    """``model`` through the backend for ``target`` (``cpu`` unless given: these tests are about the backend,
    not about its choice of target, which tests/integration/test_torch_compile_dynamic.py covers)."""
    report = mb.BackendReport()
    options.setdefault("target", "cpu")
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
    on_cpu, cpu_report = compiled(model, target="cpu", pipeline="-O1")
    on_ort, ort_report = compiled(copy.deepcopy(model), target="onnxruntime", pipeline="cleanup")
    x = torch.randn(3, 8)
    with torch.no_grad():
        torch.testing.assert_close(on_cpu(x), model(x))
        torch.testing.assert_close(on_ort(x), model(x), rtol=1e-5, atol=1e-5)
        on_cpu(x)
    assert {(p.ran_on, p.pipeline) for p in cpu_report.partitions} == {("mlcomp:cpu", "cleanup")}
    assert {(p.ran_on, p.pipeline) for p in ort_report.partitions} == {("mlcomp:onnxruntime", "cleanup")}


def test_precision_option_appends_mixed_precision():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8)).eval()
    fast, report = compiled(model, pipeline="-O1", precision="bf16")
    x = torch.randn(4, 64)
    with torch.no_grad():
        error = (fast(x) - model(x)).abs().max().item()
    (part,) = report.partitions
    assert part.ran_on == "mlcomp:cpu" and "mixed-precision{dtype=bf16}" in part.pipeline
    assert 0 < error < 0.05          # bf16 products: not eager's bits, within mixed precision's bound


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


@pytest.mark.parametrize("target", ["cpu", pytest.param("onnxruntime", marks=pytest.mark.ort)])
def test_batch_sweep_compiles_at_most_twice(target):
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4)).eval()
    fast, report = compiled(model, pipeline="-O1", target=target)
    with torch.no_grad():
        for batch in range(1, 21):
            x = torch.randn(batch, 16)
            torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-5)
    assert report.graphs == 2
    assert [p.ran_on for p in report.partitions] == [f"mlcomp:{target}"] * 2


class TinyTransformer(nn.Module):
    """Attention over the sequence (heads split by reshape), layer norm, feed-forward: sizes batch and seq."""

    def __init__(self):
        super().__init__()
        self.embed, self.qkv, self.proj = nn.Linear(16, 32), nn.Linear(32, 96), nn.Linear(32, 32)
        self.norm, self.ffn, self.head = nn.LayerNorm(32), nn.Sequential(nn.Linear(32, 64), nn.GELU(),
                                                                         nn.Linear(64, 32)), nn.Linear(32, 4)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.embed(x)
        q, k, v = self.qkv(h).reshape(b, t, 3, 4, 8).permute(2, 0, 3, 1, 4)
        a = nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(b, t, 32)
        h = self.norm(h + self.proj(a))
        return self.head(h + self.ffn(h)).softmax(-1)


SWEEP = list(zip([1, 2, 3, 4, 5, 6, 7, 8, 2, 3, 4, 5, 6, 7, 3, 2, 5, 4, 8, 6], range(3, 43, 2)))   # 20 distinct


@pytest.mark.parametrize("target", ["cpu", pytest.param("onnxruntime", marks=pytest.mark.ort)])
def test_batch_and_sequence_sweep_of_a_transformer_compiles_twice(target):
    torch.manual_seed(0)
    model = TinyTransformer().eval()
    fast, report = compiled(model, target=target)
    with torch.no_grad():
        for batch, seq in SWEEP:
            x = torch.randn(batch, seq, 16)
            torch.testing.assert_close(fast(x), model(x), rtol=1e-4, atol=1e-5)
    # the first call's sizes, then one graph with batch and seq symbolic serves the other 19
    assert report.graphs == 2, report.table()
    assert [p.ran_on for p in report.partitions] == [f"mlcomp:{target}"] * 2, report.table()


def test_weight_edited_after_compile_is_seen():
    model = nn.Sequential(nn.Linear(4, 4)).eval()
    fast, _ = compiled(model)
    x = torch.randn(2, 4)
    with torch.no_grad():
        fast(x)
        model[0].weight.mul_(2)
        torch.testing.assert_close(fast(x), model(x))


class CountsCalls(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("calls", torch.zeros(1))
        self.a = nn.Linear(4, 4)

    def forward(self, x):
        self.calls.add_(1)
        return self.a(x) + self.calls


def test_graph_that_writes_its_buffer_runs_in_torch():
    model, twin = CountsCalls().eval(), CountsCalls().eval()
    twin.load_state_dict(model.state_dict())
    fast, report = compiled(model)
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(fast(x), twin(x))
    assert model.calls.item() == 3
    (part,) = report.partitions
    assert part.ran_on == TORCH and "writes into its input" in part.reason and "calls" in part.reason


def test_explain_prints_where_each_partition_ran(capsys):
    fast = torch.compile(Branches().eval(), backend="mlcomp", options={"explain": True, "target": "cpu"})
    with torch.no_grad():
        fast(torch.randn(2, 8))
    out = capsys.readouterr().out
    assert "mlcomp backend, graph0:" in out and "mlcomp:cpu" in out and "not an op of mlcomp's IR" in out


def test_dynamic_compile_serves_every_batch_and_hits_the_cache(tmp_path):
    model = nn.Sequential(nn.Linear(16, 8), nn.Tanh()).eval()
    with torch.no_grad():
        for expected, batches in (("stored", (3, 5, 11)), ("hit", (7, 2))):   # first sizes differ: same class
            torch._dynamo.reset()
            report = mb.BackendReport()
            fast = torch.compile(model, backend="mlcomp", dynamic=True,
                                 options={"report": report, "cache": str(tmp_path), "target": "cpu"})
            for batch in batches:
                x = torch.randn(batch, 16)
                torch.testing.assert_close(fast(x), model(x))
            assert report.graphs == 1
            assert [p.cache for p in report.partitions] == [expected]


CHILD = """
import sys, torch
from torch import nn
from mlcomp.dynamo import backend as mb
mb.register()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 2)).eval()
report = mb.BackendReport()
fast = torch.compile(model, backend="mlcomp", options={"report": report, "cache": sys.argv[1], "target": "cpu"})
with torch.no_grad():
    for batch in (2, 3, 9):
        x = torch.randn(batch, 16)
        torch.testing.assert_close(fast(x), model(x))
print("CACHE", ",".join(p.cache for p in report.partitions))
"""


@pytest.mark.slow
def test_second_process_hits_the_cache(tmp_path):
    import os
    import subprocess
    import sys

    seen = []
    for _ in range(2):
        proc = subprocess.run([sys.executable, "-c", CHILD, str(tmp_path)], capture_output=True, text=True,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)), timeout=600)
        assert proc.returncode == 0, proc.stderr[-2000:]
        seen.append(next(ln for ln in proc.stdout.splitlines() if ln.startswith("CACHE")))
    assert seen == ["CACHE stored,stored", "CACHE hit,hit"]


@pytest.mark.slow
@pytest.mark.parametrize("name", list(models.ZOO))
def test_every_zoo_model_matches_eager_over_two_batches(name):
    zoo = models.get(name)
    model = zoo.build().eval()
    fast, report = compiled(model)
    with torch.no_grad():
        for batch in (2, 3):
            inputs = zoo.example_inputs(batch)
            torch.testing.assert_close(fast(*inputs), model(*inputs), rtol=1e-4, atol=1e-4)
    assert report.graphs <= 2
    assert any(p.ran_on == "mlcomp:cpu" for p in report.partitions), report.table()


@pytest.mark.slow
def test_bert_sequence_sweep_compiles_at_most_twice():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=64, vocab_size=100, max_position_embeddings=128)
    bert = transformers.BertModel(config).eval()
    fast, report = compiled(bert, pipeline="-O1")
    with torch.no_grad():
        for seq in range(8, 128, 6):
            ids = torch.randint(0, 100, (2, seq))
            torch.testing.assert_close(fast(input_ids=ids).last_hidden_state, bert(input_ids=ids).last_hidden_state,
                                       rtol=1e-4, atol=1e-4)
    assert report.graphs == 2
    assert all(p.ran_on == "mlcomp:cpu" for p in report.partitions), report.table()


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        self.body, self.left, self.right = nn.Linear(6, 6), nn.Linear(6, 2), nn.Linear(6, 3)

    def forward(self, x):
        h = self.body(x).relu()
        return self.left(h), self.right(h).softmax(-1)


def test_model_with_two_outputs_returns_both():
    model = TwoHeads().eval()
    fast, report = compiled(model)
    x = torch.randn(5, 6)
    with torch.no_grad():
        got, want = fast(x), model(x)
    assert isinstance(got, tuple) and len(got) == 2
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w)
    assert [p.ran_on for p in report.partitions] == ["mlcomp:cpu"]
