"""Targets declare what they compile; ``compile`` refuses what does not fit before anything is built."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from mlcomp.base.errors import UnsupportedOpError
from mlcomp.ir import Mode
from mlcomp.ir.builder import GraphBuilder
from mlcomp.ir.ops import aten
from mlcomp.targets import (Capabilities, CapabilityError, CompileOptions, DeviceKind, Fallback, LogLevel,
                            Target, TargetName, get_target)
from mlcomp.targets.capabilities import REAL_DTYPES, MismatchKind, mismatches
from mlcomp.training.step import training_capabilities
from mlcomp.targets.options import OptionsError

TARGETS = [t.value for t in TargetName]
# ids that do not read as the `cuda` marker (conftest skips items whose keywords contain "cuda")
BY_TARGET = pytest.mark.parametrize("name", TARGETS, ids=[f"{t}-target" for t in TARGETS])


def _fp8_training_graph():
    """A training graph whose weights are stored in two float8 formats and cast up to f32."""
    b = GraphBuilder("fp8mlp", mode=Mode.TRAINING)
    x = b.input("x", (2, 8))
    w1 = b.param("fc1.weight", torch.randn(8, 8).to(torch.float8_e4m3fn))
    w2 = b.param("fc2.weight", torch.randn(4, 8).to(torch.float8_e5m2))
    up1 = b.call(aten("_to_copy"), w1, dtype=torch.float32, name="up1")
    up2 = b.call(aten("_to_copy"), w2, dtype=torch.float32, name="up2")
    h = b.call(aten("relu"), b.call(aten("mm"), x, b.call(aten("permute"), up1, [1, 0])))
    return b.output(b.call(aten("mm"), h, b.call(aten("permute"), up2, [1, 0])))


def _plain_graph(dtype=torch.float32, mode=Mode.INFERENCE):
    b = GraphBuilder("plain", mode=mode)
    x = b.input("x", (2, 8), dtype)
    return b.output(b.call(aten("relu"), x))


@pytest.fixture
def unreachable_backend(monkeypatch):
    """Every target's build (and the eager-fallback splitter) fails the test if reached."""
    from mlcomp.targets import fallback

    def reached(*args, **kwargs):
        raise AssertionError("the backend was reached before the capability check refused the graph")

    for name in TARGETS:
        monkeypatch.setattr(type(get_target(name)), "build", reached)
    monkeypatch.setattr(fallback, "build_partitioned", reached)


@pytest.fixture
def ready(monkeypatch):
    """``ready(name)``: the target, skipping if its package is missing; cuda works without a GPU
    (the check it stands for needs none)."""
    def get(name: str) -> Target:
        target = get_target(name)
        if name == "cuda":
            monkeypatch.setattr(type(target), "available", lambda self: None)
        elif target.available():
            pytest.skip(target.available())
        return target

    return get


@BY_TARGET
def test_training_graph_and_fp8_refused_up_front_with_every_problem(name, ready, unreachable_backend):
    graph = _fp8_training_graph()
    with pytest.raises(CapabilityError) as err:
        ready(name).compile(graph, CompileOptions(device="mps"))
    problems = {p.kind: p for p in err.value.problems}
    trains = Mode.TRAINING in get_target(name).capabilities.modes   # cpu, cuda: training graphs (issue 9)
    assert [p.kind for p in err.value.problems] == [MismatchKind.MODE] * (not trains) + [
        MismatchKind.DTYPE, MismatchKind.DTYPE, MismatchKind.DEVICE]
    dtype_nodes = {p.detail.split()[0]: p.nodes for p in err.value.problems if p.kind is MismatchKind.DTYPE}
    assert dtype_nodes == {"float8_e4m3fn": ("fc1.weight",), "float8_e5m2": ("fc2.weight",)}
    text = str(err.value)
    assert f"target {name} cannot compile fp8mlp" in text
    assert trains or ("fp8mlp is a training graph" in text and "compiles inference graphs" in text)
    assert "(used by %fc1.weight)" in text and "(used by %fc2.weight)" in text
    assert "device 'mps'" in text and (trains or "capture without --training" in text)
    assert trains or problems[MismatchKind.MODE].nodes == ()
    assert isinstance(err.value, UnsupportedOpError)   # callers catching the old error still do


@BY_TARGET
def test_fitting_graph_passes_the_check(name, ready, unreachable_backend):
    """The check lets a plain f32 inference graph through: the (patched) build is reached."""
    with pytest.raises(AssertionError, match="backend was reached"):
        ready(name).compile(_plain_graph(), CompileOptions())


def test_onnxruntime_refuses_bf16_at_the_boundary_only(ready, unreachable_backend):
    target = ready("onnxruntime")
    with pytest.raises(CapabilityError) as err:
        target.compile(_plain_graph(torch.bfloat16))
    assert [(p.kind, p.nodes) for p in err.value.problems] == [(MismatchKind.IO_DTYPE, ("x", "relu"))]
    assert "cannot take or return bf16" in str(err.value)
    b = GraphBuilder("inside")   # bf16 inside the graph, f32 at both ends: fits
    x = b.input("x", (2, 8))
    h = b.call(aten("relu"), b.call(aten("_to_copy"), x, dtype=torch.bfloat16))
    graph = b.output(b.call(aten("_to_copy"), h, dtype=torch.float32))
    with pytest.raises(AssertionError, match="backend was reached"):
        target.compile(graph)


def test_distributed_refuses_symbolic_sizes_and_cuda_target_refuses_cpu(ready, unreachable_backend):
    b = GraphBuilder("dyn")
    graph = b.output(b.call(aten("relu"), b.input("x", (2, 8))))
    graph.replace(graph.node("x").with_(meta=dataclasses.replace(graph.node("x").tensor_meta,
                                                                  shape=("batch", 8))))
    graph.symbols["batch"] = 2
    with pytest.raises(CapabilityError) as err:
        ready("distributed").compile(graph)
    assert [(p.kind, p.nodes) for p in err.value.problems] == [(MismatchKind.DYNAMIC_SHAPES, ("x",))]
    with pytest.raises(CapabilityError, match="device 'cpu' is not one target cuda runs on"):
        ready("cuda").compile(_plain_graph(), CompileOptions(device="cpu"))


def test_unsupported_ops_join_the_list_or_run_eagerly(ready, unreachable_backend):
    """Ops join a capability error under fallback=none; under eager their nodes skip the dtype check."""
    b = GraphBuilder("spec", mode=Mode.TRAINING)
    x = b.input("x", (2, 8))
    f = b.call(aten("_fft_r2c"), x, dim=[1], normalization=0, onesided=True)
    graph = b.output(b.call(aten("abs"), f))
    with pytest.raises(CapabilityError) as err:
        ready("onnxruntime").compile(graph)
    assert [p.kind for p in err.value.problems] == [MismatchKind.MODE, MismatchKind.OPS]
    assert set(err.value.nodes) == {"_fft_r2c", "abs"} and "_fft_r2c" in str(err.value)
    with pytest.raises(CapabilityError) as err:
        ready("onnxruntime").compile(graph, CompileOptions(fallback=Fallback.EAGER))
    assert [p.kind for p in err.value.problems] == [MismatchKind.MODE]   # c64 nodes run in torch


def test_placement_on_two_devices_is_refused():
    b = GraphBuilder("placed")
    graph = b.output(b.call(aten("neg"), b.call(aten("relu"), b.input("x", (2, 8)))))
    graph.replace(graph.node("relu").with_ann(device="cuda"))
    with pytest.raises(CapabilityError) as err:
        get_target("cpu").check_capabilities(graph, CompileOptions(), {})
    kinds = [(p.kind, p.nodes) for p in err.value.problems]
    assert kinds == [(MismatchKind.DEVICE, ("relu",)), (MismatchKind.MULTI_DEVICE, ("relu",))]
    assert "placed on 2 devices (cpu, cuda:0)" in str(err.value)
    graph.replace(graph.node("neg").with_ann(device="cuda:0"))   # all on one GPU: one device
    with pytest.raises(CapabilityError) as err:
        get_target("cpu").check_capabilities(graph, CompileOptions(), {})
    assert [(p.kind, p.nodes) for p in err.value.problems] == [(MismatchKind.DEVICE, ("relu", "neg"))]


def test_cuda_target_runs_a_graph_placed_on_its_gpu_and_the_cpu():
    b = GraphBuilder("placed")
    graph = b.output(b.call(aten("neg"), b.call(aten("relu"), b.input("x", (2, 8)))))
    graph.replace(graph.node("relu").with_ann(device="cpu"))        # the rest runs on the target's GPU
    cuda = get_target("cuda")
    assert mismatches(cuda.capabilities, "cuda", graph, "cuda:0") == []
    assert "nodes placed on cpu, cuda" in cuda.capabilities.describe()
    assert [p.kind for p in mismatches(cuda.capabilities, "cuda", graph, "cpu")] == [MismatchKind.DEVICE]
    # a training step runs on one device: the placement would be ignored, so it is refused
    training = training_capabilities(cuda)
    assert training is not None and not training.multi_device
    assert MismatchKind.MULTI_DEVICE in [p.kind for p in mismatches(training, "cuda", graph, "cuda:0")]


def test_declared_capabilities():
    caps = {t: get_target(t).capabilities for t in TARGETS}
    for name, c in caps.items():   # torch-code targets also run training graphs (issue 9)
        trains = {Mode.TRAINING} if name in ("cpu", "cuda") else set()
        assert isinstance(c, Capabilities) and c.modes == {Mode.INFERENCE} | trains
        assert c.multi_device == (name == "cuda")      # the cuda target runs place{devices=[cuda:0,cpu]}
        assert not any(d.is_complex for d in c.dtypes)
        with pytest.raises(dataclasses.FrozenInstanceError):
            c.multi_device = True
    assert caps["cpu"].devices == {DeviceKind.CPU} and caps["cuda"].devices == {DeviceKind.CUDA}
    assert caps["tvm"].devices == caps["onnxruntime"].devices == {DeviceKind.CPU, DeviceKind.CUDA}
    assert caps["tvm"].dynamic_shapes and caps["onnxruntime"].dynamic_shapes and caps["openvino"].dynamic_shapes
    assert not caps["distributed"].dynamic_shapes          # one static graph per pipeline stage
    assert caps["onnxruntime"].boundary_dtypes == REAL_DTYPES - {torch.bfloat16}
    assert caps["tvm"].to_json()["devices"] == ["cpu", "cuda"]
    assert caps["onnxruntime"].describe().startswith("modes inference; dtypes f32, f16, bf16, f64")
    assert "(inputs/outputs without bf16)" in caps["onnxruntime"].describe()


def test_backend_knobs_are_validated_options():
    opts = CompileOptions.make(tune_build_timeout=300, tune_run_timeout=30, log_level="INFO",
                               tune_worker_torch=True)
    assert (opts.tune_build_timeout, opts.tune_run_timeout) == (300.0, 30.0)
    assert opts.log_level is LogLevel.INFO and opts.to_json()["log_level"] == "info"
    assert CompileOptions().log_level is LogLevel.WARNING and CompileOptions().tune_build_timeout == 180.0
    for bad in ({"tune_build_timeout": 0}, {"tune_run_timeout": "soon"}, {"log_level": "loud"},
                {"tune_worker_torch": "yes"}, {"tune_build_timeout": float("inf")}):
        with pytest.raises(OptionsError, match=next(iter(bad))):
            CompileOptions.make(**bad)
    with pytest.raises(OptionsError, match="log_level"):   # the dataclass itself validates too
        CompileOptions(log_level="loud")
