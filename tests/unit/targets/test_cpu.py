"""The cpu target (TorchScript trace + freeze), the shared code generator, support checks and fallback."""
from __future__ import annotations

import operator

import pytest
import torch
from mlcomp.targets import CompileOptions, Fallback, available_targets, get_target
from mlcomp.runtime.artifact import Artifact
from mlcomp.runtime.codegen import param_names, to_fx
from mlcomp.targets.fallback import split_regions

from mlcomp.base.errors import InputSpecError, MlcompError, TargetUnavailableError, UnsupportedOpError
from mlcomp.frontend.loading import load_model
from mlcomp.ir import Graph, Node, Ref, TensorMeta
from mlcomp.ir.ops import INPUT, OUTPUT, aten
from tests.helpers.targets import FP32_RTOL, ZOO_NAMES, compile_zoo, fresh_process_check


@pytest.fixture(scope="module")
def built(captured, tmp_path_factory):
    return compile_zoo("cpu", captured, tmp_path_factory.mktemp("cpu"))


@pytest.mark.parametrize("name", ZOO_NAMES)
def test_zoo_compiles_and_verifies(built, name):
    b = built[name]
    assert b.max_rel <= FP32_RTOL
    assert b.artifact.manifest["verification"]["passed"]
    assert b.artifact.manifest["runtime_info"]["optimize"] in (True, False)
    assert (b.directory / "model.pt").is_file()
    with torch.no_grad():
        assert torch.allclose(b.artifact(*b.inputs), b.module(*b.inputs), rtol=1e-4, atol=1e-5)


def test_fresh_process_reload_and_plain_torch_jit_load(built):
    report = fresh_process_check([b.directory for b in built.values()], plain="torchscript")
    assert set(report) == set(ZOO_NAMES)
    for name, r in report.items():
        assert r["passed"] and r["target"] == "cpu", name
        assert r["mlcomp_rel"] <= FP32_RTOL and r["plain_rel"] <= FP32_RTOL, (name, r)


def test_codegen_matches_interpreter_and_maps_parameter_names(captured):
    module, inputs, graph = captured("resnet18")
    gm = to_fx(graph)
    names = param_names(gm)
    assert names["layer1_0_conv1_weight"] == "layer1.0.conv1.weight"
    assert all(a.isidentifier() for a in names)
    with torch.no_grad():
        out = gm(*inputs)
    assert isinstance(out, tuple) and len(out) == 1
    assert torch.allclose(out[0], module(*inputs), rtol=1e-5, atol=1e-5)


def test_codegen_honours_device_annotations():
    g = Graph("placed")
    g.add(Node("x", INPUT, meta=TensorMeta((2, 3), torch.float32)))
    g.add_constant("w", torch.ones(2, 3))
    g.add(Node("a", aten("add.Tensor"), (Ref("x"), Ref("w")), meta=TensorMeta((2, 3), torch.float32))
          .with_ann(device="meta"))
    g.add(Node("r", aten("relu"), (Ref("a"),), meta=TensorMeta((2, 3), torch.float32)))
    g.add(Node("output", OUTPUT, inputs=((Ref("r"),),)))
    gm = to_fx(g)
    assert gm.w.device.type == "meta"                # its only reader is placed on meta
    calls = [n for n in gm.graph.nodes if n.target is torch.ops.aten._to_copy.default]
    assert [n.kwargs["device"].type for n in calls] == ["meta", "cpu"]  # x → meta, a → back to cpu


def test_spectral_model_is_rejected_listing_every_unsupported_node():
    from tests.data.spectral import build

    module, inputs = build()
    graph = load_model(module, example_inputs=inputs).capture()
    for target in ("cpu", "onnxruntime", "tvm"):
        bad = get_target(target).unsupported(graph)
        assert sorted(bad) == ["_fft_r2c", "abs_1"], target
    with pytest.raises(UnsupportedOpError) as err:
        get_target("cpu").compile(graph, CompileOptions())
    text = str(err.value)
    assert "%_fft_r2c (aten._fft_r2c.default)" in text and "%abs_1 (aten.abs.default)" in text
    assert "spectral.py:" in text and "--fallback eager" in text


def test_fallback_eager_splits_and_round_trips(tmp_path):
    from tests.data.spectral import build

    module, inputs = build()
    graph = load_model(module, example_inputs=inputs).capture()
    art = get_target("cpu").compile(graph, CompileOptions(fallback=Fallback.EAGER))
    runs = [r["runs_on"] for r in art.manifest["fallback_regions"]]
    assert runs == ["cpu", "torch (eager)", "cpu"]
    assert art.manifest["fallback_regions"][1]["unsupported"] == ["_fft_r2c", "abs_1"]
    # weight transposes travel with the region that reads them, not between regions
    assert "permute_1" not in art.runtime.parts[0]["outputs"]
    with torch.no_grad():
        art.set_reference(inputs, (module(*inputs),))
    assert art.verify().max_rel <= FP32_RTOL
    art.save(tmp_path / "spec")
    again = Artifact.load(tmp_path / "spec")
    assert again.verify(record=False).passed
    assert (tmp_path / "spec" / "part1" / "model.pt2").is_file()


def test_split_regions_is_a_valid_order(captured):
    _, _, graph = captured("transformer")
    some = {n.name for n in graph.call_nodes() if n.op == aten("_softmax")}
    regions = split_regions(graph, some)
    order = [n for _, names in regions for n in names]
    assert sorted(order) == sorted(n.name for n in graph.call_nodes())
    pos = {n: i for i, n in enumerate(order)}
    for name in order:
        for src in graph.node(name).input_names():
            if src in pos:
                assert pos[src] < pos[name]
    assert all(ok != nxt for (ok, _), (nxt, _) in zip(regions, regions[1:]))  # alternating colours


def test_threads_option_does_not_leak(captured):
    _, inputs, graph = captured("mlp")
    before = torch.get_num_threads()
    want = 1 if before > 1 else 2          # a count other than the process's, whatever it runs with
    art = get_target("cpu").compile(graph, CompileOptions(threads=want, optimize=False))
    art(*inputs)
    assert torch.get_num_threads() == before
    assert art.manifest["options"]["threads"] == want


def test_options_are_checked():
    with pytest.raises(MlcompError, match="unknown compile option"):
        CompileOptions.make(thread=2)
    with pytest.raises(MlcompError, match="fallback"):
        CompileOptions.make(fallback="maybe")
    assert CompileOptions.make(fallback="eager").fallback is Fallback.EAGER


def test_registry_and_availability():
    avail = available_targets()
    assert set(avail) == {"cpu", "cuda", "onnxruntime", "openvino", "tvm", "distributed"}
    assert avail["cpu"] is None
    assert get_target("ort") is get_target("onnxruntime")
    with pytest.raises(TargetUnavailableError, match="did you mean 'tvm'"):
        get_target("tmv")


def test_symbolic_size_arithmetic_is_generated():
    g = Graph("sym")
    g.add(Node("x", INPUT, meta=TensorMeta((4, 6), torch.float32)))
    g.add(Node("n", aten("sym_size.int"), (Ref("x"), 0)))
    g.add(Node("m", Op_mul(), (Ref("n"), 6)))
    g.add(Node("v", aten("view"), (Ref("x"), [Ref("m")]), meta=TensorMeta((24,), torch.float32)))
    g.add(Node("output", OUTPUT, inputs=((Ref("v"),),)))
    art = get_target("cpu").compile(g, CompileOptions(optimize=False))
    x = torch.randn(4, 6)
    assert torch.equal(art(x), x.reshape(24))


def Op_mul():
    from mlcomp.ir.ops import Namespace, Op

    assert Op(Namespace.OPERATOR, "mul").resolve() is operator.mul
    return Op(Namespace.OPERATOR, "mul")


@pytest.mark.parametrize("target", ["cpu", pytest.param("onnxruntime", marks=pytest.mark.ort)])
def test_dynamic_batch_runs_other_batch_sizes(target, tmp_path):
    from mlcomp.models import get

    z = get("mlp")
    module, inputs = z.build(), z.example_inputs(4)
    graph = load_model(module, example_inputs=inputs).capture(dynamic_batch=True)
    art = get_target(target).compile(graph, CompileOptions())
    assert isinstance(art.inputs[0].shape[0], str)              # the batch is symbolic
    art.save(tmp_path / "dyn")
    again = Artifact.load(tmp_path / "dyn")
    for batch in (1, 7):
        x = torch.randn(batch, *z.input_shape)
        with torch.no_grad():
            assert torch.allclose(again(x), module(x), rtol=1e-4, atol=1e-5), batch
    with pytest.raises(InputSpecError, match="has shape"):
        again(torch.randn(3, 500))
