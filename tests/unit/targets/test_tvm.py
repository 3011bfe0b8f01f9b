"""The tvm target: every zoo model untuned, plain TVM-runtime reload, support checks, tuning reuse."""
from __future__ import annotations

import pytest
import torch
from mlcomp.targets import CompileOptions, Fallback, get_target
from mlcomp.runtime.artifact import Artifact
from mlcomp.targets.base import TargetCompileError
from torch import nn

from mlcomp.base.errors import UnsupportedOpError
from mlcomp.frontend.loading import load_model
from mlcomp.ir.ops import aten
from tests.helpers.targets import FP32_RTOL, ZOO_NAMES, compile_zoo, fresh_process_check

pytestmark = pytest.mark.tvm


@pytest.fixture(scope="module")
def built(captured, tmp_path_factory):
    return compile_zoo("tvm", captured, tmp_path_factory.mktemp("tvm"))


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_zoo_compiles_and_verifies(built, name):
    b = built[name]
    assert b.max_rel <= FP32_RTOL
    assert (b.directory / "model.so").is_file()
    info = b.artifact.manifest["runtime_info"]
    assert info["tuned"] is False and info["device"] == "cpu"


def test_fresh_process_reload_and_plain_tvm_runtime(built):
    """mlcomp.load, and TVM's own runtime plus the artifact's kernels.py (torch and tvm_ffi only)."""
    report = fresh_process_check([b.directory for b in built.values()], plain="tvm")
    assert set(report) == set(ZOO_NAMES)
    for name, r in report.items():
        assert r["passed"] and r["target"] == "tvm", name
        assert r["mlcomp_rel"] <= FP32_RTOL and r["plain_rel"] <= FP32_RTOL, (name, r)


def test_manifest_and_explain_say_which_op_runs_where(built):
    """resnet18: every conv2d (channels-last, epilogues fused: issue 14) and the classifier's linear in
    torch's kernels, nothing left unscheduled."""
    info = built["resnet18"].artifact.manifest["runtime_info"]
    kernels = {k: v["count"] for k, v in info["kernels"]["kernels"].items()}
    # the classifier's linear: a torch call, or TVM code where tvm_gemm's probe measured it faster
    linear = kernels.pop("mlcomp.torch.linear", 0) + sum(
        k["count"] for k in info["kernels"]["kept_in_tvm"] if k["op"] == "linear")
    assert kernels == {"mlcomp.torch.conv2d_cl": 3, "mlcomp.torch.conv2d_cl_add_relu": 8,
                       "mlcomp.torch.conv2d_cl_relu": 9} and linear == 1
    assert info["schedules"]["unscheduled"] == 0
    lines = built["resnet18"].artifact.runtime.explain_lines()
    assert lines[0].split() == ["op", "shape", "runs", "in", "rule"]
    convs = [ln for ln in lines if ln.startswith("conv2d")]
    assert len(convs) == 20 and all("torch kernel conv2d_cl" in ln for ln in convs)
    assert sum(ln.endswith("conv2d-1x1-unpacked") for ln in convs) == 3
    assert [o["rule"] for o in info["offload"]["ops"] if o["op"].startswith("conv2d")].count("conv2d-packed") == 17
    assert any(ln.startswith("TVM kernels: ") for ln in lines)


def test_supports_asks_the_importer():
    tvm = get_target("tvm")
    assert tvm.explain_op(aten("addmm")) is None
    assert tvm.explain_op(aten("_native_batch_norm_legit_no_training")) is None
    assert "no converter" in tvm.explain_op(aten("kthvalue"))


def test_the_support_check_reads_the_importers_table_without_importing_tvm(monkeypatch):
    """The op table is read from the installed importer's source: with the importer module made
    unimportable, the same keys as the importer's own ``create_convert_map``."""
    import sys

    from tvm.relax.frontend.torch.exported_program_translator import ExportedProgramImporter

    from mlcomp.targets.tvm.lowering import importer_ops

    want = frozenset(ExportedProgramImporter().create_convert_map())
    monkeypatch.setitem(sys.modules, ExportedProgramImporter.__module__, None)    # importing it now fails
    assert importer_ops.__wrapped__() == want


def test_low_precision_addmm_is_lowered_and_linear_reported():
    """TVM 0.27's importer computes addmm in float32 whatever its inputs: a bf16/fp16 addmm is lowered to
    mm + add before the build (issue 10); a low-precision linear (same importer problem) is refused up front."""
    from mlcomp.ir.builder import GraphBuilder
    from mlcomp.targets.tvm.target import lower_low_precision

    for dtype, low in ((torch.float16, True), (torch.bfloat16, True), (torch.float32, False)):
        b = GraphBuilder("lin")
        x = b.input("x", (2, 16), dtype)
        weight, bias = b.param("fc.weight", torch.randn(8, 16, dtype=dtype)), b.param("fc.bias", torch.randn(8, dtype=dtype))
        graph = b.output(b.call(aten("addmm"), bias, x, b.call(aten("permute"), weight, [1, 0])))
        assert get_target("tvm").unsupported(graph) == {}, dtype
        assert bool(lower_low_precision(graph).nodes(aten("mm"))) is low, dtype
        b = GraphBuilder("lin")
        x = b.input("x", (2, 16), dtype)
        weight, bias = b.param("fc.weight", torch.randn(8, 16, dtype=dtype)), b.param("fc.bias", torch.randn(8, dtype=dtype))
        graph = b.output(b.call(aten("linear"), x, weight, bias))
        bad = get_target("tvm").unsupported(graph)
        assert (list(bad) == ["linear"]) is low, (dtype, bad)
        if low:
            assert "computes linear in float32 whatever its inputs" in bad["linear"]


class Median(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return y - torch.kthvalue(y, 4, dim=-1, keepdim=True).values


def test_unknown_op_is_reported_then_falls_back_to_torch():
    module, x = Median().eval(), torch.randn(2, 8)
    graph = load_model(module, example_inputs=(x,)).capture()
    with pytest.raises(UnsupportedOpError, match="kthvalue"):
        get_target("tvm").compile(graph, CompileOptions())
    art = get_target("tvm").compile(graph, CompileOptions(fallback=Fallback.EAGER))
    assert "torch (eager)" in [r["runs_on"] for r in art.manifest["fallback_regions"]]
    with torch.no_grad():
        assert torch.allclose(art(x), module(x), atol=1e-5)


def test_backend_knobs_come_from_compile_options(captured, monkeypatch):
    """Timeouts, verbosity and worker torch reach the backend as options (no environment variable)."""
    from mlcomp.targets import LogLevel
    from mlcomp.targets.tvm import build as tvm_backend
    from mlcomp.targets.tvm.config import BuildConfig

    seen = {}

    def build(module, inputs, config, **kwargs):
        seen["config"] = config
        raise RuntimeError("stop after the options were seen")

    monkeypatch.setattr(tvm_backend, "build", build)
    _, _, graph = captured("mlp")
    opts = CompileOptions.make(tune_build_timeout=300, tune_run_timeout=20, log_level="debug",
                               tune_worker_torch=True)
    with pytest.raises(TargetCompileError, match="stop after the options were seen"):
        get_target("tvm").compile(graph, opts)
    assert seen["config"] == BuildConfig(device="cpu", tune_trials=0, work_dir=None, build_timeout=300.0,
                                         run_timeout=20.0, log_level=LogLevel.DEBUG, worker_torch=True,
                                         threads=None)


@pytest.mark.slow
def test_tuning_database_is_reused_across_compiles(tmp_path):
    module = nn.Sequential(nn.Linear(64, 64), nn.ReLU()).eval()
    x = torch.randn(4, 64)
    graph = load_model(module, example_inputs=(x,)).capture()
    opts = CompileOptions(tune_trials=4, work_dir=str(tmp_path / "db"))
    first = get_target("tvm").compile(graph, opts)
    assert first.runtime.tuned and first.runtime.stats["trials_run"] > 0
    second = get_target("tvm").compile(graph, opts)
    assert second.runtime.stats["trials_run"] == 0 and second.runtime.stats["db_reused"]
    with torch.no_grad():
        assert torch.allclose(second(x), module(x), atol=1e-5)
    second.save(tmp_path / "art")
    assert Artifact.load(tmp_path / "art").manifest["runtime_info"]["tuned"] is True
    # untuned compile pointed at the database: its records are used for what TVM runs, nothing is tuned;
    # the vendor kernels stay (or the GEMM became TVM code where tvm_gemm's probe measured it faster)
    # and the untuned build competed (issue 14)
    third = get_target("tvm").compile(graph, CompileOptions(work_dir=str(tmp_path / "db")))
    stats = third.runtime.stats
    assert third.runtime.tuned and stats["trials_run"] == 0
    assert stats["kernels"]["kernels"] or stats["small_gemms"]["kept_in_tvm"] == 1
    assert third.runtime.stats["tuning_decision"]["winner"] in ("tuned", "untuned")


@pytest.mark.slow
def test_a_second_model_with_the_same_linear_reuses_its_records(tmp_path):
    """Two models sharing Linear(32, 32)+ReLU at batch 2: the second tunes only its new task (the linears
    run in torch's kernels: TVM's tasks are the relu and the tanh)."""
    torch.manual_seed(0)
    a = nn.Sequential(nn.Linear(32, 32), nn.ReLU()).eval()
    b = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 8), nn.Tanh()).eval()
    x = torch.randn(2, 32)
    db = str(tmp_path / "shared-db")
    tvm = get_target("tvm")
    seen = []
    first = tvm.tune(load_model(a, example_inputs=(x,)).capture(), CompileOptions(tune_trials=4, work_dir=db),
                     progress=lambda done, total, msg: seen.append((done, total)))
    assert first.stats["tasks"] == 1 and first.stats["tasks_reused"] == [] and first.stats["trials_run"] == 4
    # next to torch's kernels the search space has no parallel loops: a relu's few distinct schedules can run
    # out before the budget, so progress ends at or below it; one bar over both searches (torch's kernels,
    # then TVM's own: 2 × 4 trials)
    assert seen and seen[-1][1] == 8 and all(d <= t for d, t in seen) and [d for d, _ in seen] == sorted(d for d, _ in seen)
    assert first.stats["tuning_decision"]["winner"] in ("untuned", "tuned", "tuned_tvm_kernels")
    second = tvm.tune(load_model(b, example_inputs=(x,)).capture(), CompileOptions(tune_trials=4, work_dir=db))
    assert second.stats["tasks"] == 2 and len(second.stats["tasks_reused"]) == 1
    assert second.stats["trials_run"] == 2                   # the new task's share only
    with torch.no_grad():
        torch.testing.assert_close(second(x)[0], b(x), rtol=1e-4, atol=1e-5)
