"""The backend over changing sizes and without a named target: one graph per sweep, named sizes, its own pick."""
from __future__ import annotations

import pytest
import torch
from torch import nn

from mlcomp.dynamo import backend as mb
from mlcomp.dynamo.options import INFERENCE_CANDIDATES

pytestmark = pytest.mark.usefixtures("fresh_dynamo")   # tests/conftest.py


def small_convnet():
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.Sigmoid(), nn.AvgPool2d(2), nn.Flatten(),
                         nn.Linear(4 * 4 * 4, 3)).eval()


def test_unbacked_batch_serves_twenty_batches_with_one_graph():
    """``mark_unbacked``: no 0/1 specialisation and no guard from the convolution's backend at batch 16."""
    model = small_convnet()
    report = mb.BackendReport()
    fast = torch.compile(model, backend="mlcomp", options={"report": report, "target": "cpu"})
    first = torch.randn(8, 1, 8, 8)
    torch._dynamo.decorators.mark_unbacked(first, 0)
    with torch.no_grad():
        torch.testing.assert_close(fast(first), model(first))
        for batch in range(1, 21):
            x = torch.randn(batch, 1, 8, 8)
            torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-5)
    assert report.graphs == 1, report.table()
    (part,) = report.partitions
    assert part.ran_on == "mlcomp:cpu" and set(part.sizes) == {"batch"}, report.table()


class Encoder(nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.norm, self.head = nn.Linear(16, 48), nn.LayerNorm(16), nn.Linear(16, 4)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return self.head(self.norm(x + nn.functional.scaled_dot_product_attention(q, k, v)))


def test_sizes_are_named_after_their_dimension_in_the_report_and_the_manifest(capsys):
    model = Encoder().eval()
    report = mb.BackendReport()
    fast = torch.compile(model, backend="mlcomp", options={"target": "cpu", "explain": True, "report": report,
                                                           "dynamic": "batch=1..64,seq=1..256"})
    first = torch.randn(3, 10, 16)
    torch._dynamo.decorators.mark_unbacked(first, [0, 1])
    with torch.no_grad():
        fast(first)
        for batch, seq in ((1, 7), (5, 33), (64, 256)):
            x = torch.randn(batch, seq, 16)
            torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-5)
    out = capsys.readouterr().out
    assert "batch 1..64, seq 1..256" in out and "u0" not in out and "s0" not in out, out
    (part,) = report.partitions
    assert part.sizes == {"batch": [1, 64], "seq": [1, 256]}        # the artifact manifest's ranges


@pytest.mark.slow
@pytest.mark.ort
def test_auto_keeps_the_fastest_verified_candidate_and_the_cache_keeps_it(tmp_path):
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 4)).eval()
    x = torch.randn(4, 16)
    seen = []
    for _ in range(2):
        torch._dynamo.reset()
        report = mb.BackendReport()
        fast = torch.compile(model, backend="mlcomp", options={"report": report, "cache": str(tmp_path),
                                                               "target": "auto"})
        with torch.no_grad():
            torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-5)
        (part,) = report.partitions
        seen.append((part.ran_on, part.cache, part.picked))
    (ran_on, first_cache, note), (again, second_cache, _) = seen
    picked = ran_on.split(":")[1]
    assert picked in INFERENCE_CANDIDATES and again == ran_on
    assert note.startswith(f"auto: {picked} ") and all(name in note for name in INFERENCE_CANDIDATES)
    assert (first_cache, second_cache) == ("stored", "hit")


@pytest.mark.ort
def test_without_a_target_the_rule_sends_convolutions_to_onnxruntime_and_gemms_to_cpu():
    convnet, mlp = small_convnet(), nn.Sequential(nn.Linear(8, 8), nn.Tanh()).eval()
    for model, x, target, family in ((convnet, torch.randn(2, 1, 8, 8), "onnxruntime", "convolution"),
                                     (mlp, torch.randn(2, 8), "cpu", "matmul")):
        torch._dynamo.reset()
        report = mb.BackendReport()
        fast = torch.compile(model, backend="mlcomp", options={"report": report})
        with torch.no_grad():
            torch.testing.assert_close(fast(x), model(x), rtol=1e-5, atol=1e-5)
        (part,) = report.partitions
        assert part.ran_on == f"mlcomp:{target}", report.table()
        assert part.picked.startswith(family) and part.picked.endswith(f": {target} (rule)")
