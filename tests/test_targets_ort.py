"""The onnxruntime target: every zoo model, plain-ORT reload, call overhead, support checks."""
from __future__ import annotations

import statistics
import time

import pytest
import torch
from mlcomp.targets import CompileOptions, Fallback, get_target
from torch import nn

from mlcomp.base.errors import UnsupportedOpError
from mlcomp.frontend.loading import load_model
from tests.targets_common import FP32_RTOL, ZOO_NAMES, compile_zoo, fresh_process_check

pytestmark = pytest.mark.ort


@pytest.fixture(scope="module")
def built(captured, tmp_path_factory):
    return compile_zoo("onnxruntime", captured, tmp_path_factory.mktemp("ort"))


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_zoo_compiles_and_verifies(built, name):
    b = built[name]
    assert b.max_rel <= FP32_RTOL
    assert (b.directory / "model.onnx").is_file()
    assert b.artifact.manifest["versions"]["onnxruntime"]


def test_fresh_process_reload_and_plain_onnxruntime(built):
    report = fresh_process_check([b.directory for b in built.values()], plain="onnx")
    assert set(report) == set(ZOO_NAMES)
    for name, r in report.items():
        assert r["passed"] and r["target"] == "onnxruntime", name
        assert r["mlcomp_rel"] <= FP32_RTOL and r["plain_rel"] <= FP32_RTOL, (name, r)


def test_session_is_fully_optimised_with_thread_option(captured):
    import onnxruntime as ort

    _, inputs, graph = captured("mlp")
    art = get_target("onnxruntime").compile(graph, CompileOptions(threads=1))
    opts = art.runtime.session.get_session_options()
    assert opts.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert opts.intra_op_num_threads == 1
    assert art.runtime.session.get_providers()[0] == "CPUExecutionProvider"


def test_call_overhead_is_no_worse_than_calling_the_session_directly(captured):
    """The artifact (spec check + C++ run + from_numpy) against ``session.run`` with numpy feeds.

    One intra-op thread on both sides, so a busy machine cannot stall a worker thread of one
    and not the other; rounds are interleaved so load changes hit both alike.
    """
    _, (x,), graph = captured("mlp")
    art = get_target("onnxruntime").compile(graph, CompileOptions(threads=1))
    session = art.runtime.session
    name = session.get_inputs()[0].name

    def direct():
        return session.run(None, {name: x.numpy()})

    def ours():
        return art(x)

    times = {direct: [], ours: []}
    for fn in times:
        for _ in range(50):
            fn()
    for _ in range(30):
        for fn, acc in times.items():
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            acc.append((time.perf_counter() - t0) / 20)
    t_direct, t_ours = statistics.median(times[direct]), statistics.median(times[ours])
    assert t_ours <= 1.10 * t_direct + 5e-6, (t_ours, t_direct)


class TopK(nn.Module):
    """kthvalue has a torch kernel but no ONNX translation (and no decomposition)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        y = torch.relu(self.fc(x))
        return y - torch.kthvalue(y, 3, dim=-1, keepdim=True).values


def test_op_without_onnx_translation_is_reported_and_falls_back():
    module, x = TopK().eval(), torch.randn(4, 16)
    graph = load_model(module, example_inputs=(x,)).capture()
    assert get_target("cpu").unsupported(graph) == {}
    with pytest.raises(UnsupportedOpError, match="kthvalue") as err:
        get_target("onnxruntime").compile(graph, CompileOptions())
    assert "no ONNX translation" in str(err.value)
    art = get_target("onnxruntime").compile(graph, CompileOptions(fallback=Fallback.EAGER))
    assert [r["runs_on"] for r in art.manifest["fallback_regions"]] == \
        ["onnxruntime", "torch (eager)", "onnxruntime"]
    with torch.no_grad():
        assert torch.allclose(art(x), module(x), atol=1e-5)


def test_export_onnx_reloads_in_plain_onnxruntime(tmp_path):
    import onnxruntime as ort

    from mlcomp.api import export

    path, result = export("lenet", tmp_path / "lenet.onnx", format="onnx")
    assert result.passed and path.is_file()
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    assert session.get_inputs()[0].shape == [1, 1, 28, 28]
