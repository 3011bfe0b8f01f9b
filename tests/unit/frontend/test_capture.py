"""Every zoo model through every capture path (the largest at a reduced size): interpreter == eager, verify
passes, FLOPs agree."""
from __future__ import annotations

import pytest
import torch
from mlcomp.models import ZOO, random_tensor
from torch.utils.flop_counter import FlopCounterMode

from mlcomp.analysis import cost
from mlcomp.analysis.inspect import inspect_graph
from mlcomp.frontend.decompose import DecompositionFailed, decompose
from mlcomp.targets import CompileOptions, get_target
from mlcomp.targets.torch.cpu import OptimizeReason, TorchScriptRuntime, _kernels, frozen_bytes, trace_frozen
from mlcomp.base.errors import CaptureError, InputSpecError
from mlcomp.frontend.capture import capture_exported
from mlcomp.frontend.loading import InputSpec, graph_random_inputs, load_model, save_torchscript
from mlcomp.ir.interpreter import Interpreter

PATHS = ["export", "fx", "torchscript", "pt2"]


def capture_via(path: str, module, inputs, tmp_path):
    if path in ("export", "fx"):
        return load_model(module, example_inputs=inputs).capture(method=path)
    if path == "torchscript":
        f = tmp_path / "model.pt"
        save_torchscript(module, inputs, f)
        return load_model(str(f)).capture()
    f = tmp_path / "model.pt2"
    torch.export.save(torch.export.export(module, inputs), str(f))
    return load_model(str(f)).capture()


def eager_flops(module, inputs) -> int:
    counter = FlopCounterMode(display=False)
    with counter:
        module(*inputs)
    return counter.get_total_flops()


def uncounted_attention_flops(module, inputs) -> int:
    """FLOPs of attention cores that FlopCounterMode misses in eager on CPU.

    Eager runs nn.MultiheadAttention through the fused CPU SDPA kernel, which
    has no FLOP formula registered, so the counter sees 0 for it; the captured
    graph spells the same work as two bmm's (Q·Kᵀ and P·V), which it counts.
    """
    total = 0
    for m in module.modules():
        if isinstance(m, torch.nn.MultiheadAttention):
            batch, seq, _ = inputs[0].shape
            total += 2 * (2 * batch * seq * seq * m.embed_dim)
    return total


def reduced(name: str):
    """The zoo model (batch 2), or for the three largest captures the zoo class at a reduced size (the same
    ops and structure, a third of the capture time): ResNet-18 at widths 8/16
    (``tests.helpers.modules.small_resnet``), the transformer with 2 layers of d_model 64 over 16 tokens,
    the GRU unrolled over 6 steps."""
    from mlcomp.models.sequence import GRUClassifier
    from tests.helpers.modules import small_resnet, small_transformer

    if name == "resnet18":
        module, inputs = small_resnet(2)
    elif name == "transformer":
        module, inputs = small_transformer(2)
    elif name == "gru":
        torch.manual_seed(0)
        module, inputs = GRUClassifier(steps=6), (torch.randn(2, 6, 64, generator=torch.Generator().manual_seed(0)),)
    else:
        return ZOO[name].build(), ZOO[name].example_inputs(2)
    return module.eval(), inputs


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(ZOO))
def test_capture_matches_eager(name, path, tmp_path, captured):
    """The export path on every zoo model at full size (the session's shared capture); the file paths
    (fx, torchscript, pt2) on :func:`reduced`."""
    if path == "export":
        module, inputs, graph = captured(name)
    else:
        module, inputs = reduced(name)
        graph = capture_via(path, module, inputs, tmp_path)
    graph.verify()
    with torch.no_grad():
        expected = module(*inputs)
        (actual,) = Interpreter(graph).run(*inputs)
    assert actual.shape == expected.shape
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5)
    # the graph owns its constants: none shares storage with the user's module
    user = {t.untyped_storage().data_ptr() for t in module.state_dict().values() if t.numel()}
    assert not user & {t.untyped_storage().data_ptr() for t in graph.constants.values() if t.numel()}
    # inspect's FLOPs are FlopCounterMode's, op by op
    flops = cost.total(cost.graph_cost(graph)).flops
    assert flops == eager_flops(module, inputs) + uncounted_attention_flops(module, inputs)


def test_parameters_keep_module_paths(captured):
    _, _, graph = captured("resnet18")
    assert "layer1.0.conv1.weight" in graph.constants
    conv = next(n for n in graph.call_nodes() if "layer1.0.conv1.weight" in n.input_names())
    assert conv.origin.module_path == "layer1.0.conv1"
    assert conv.origin.module_type == "Conv2d"
    assert conv.origin.source.endswith(".py:" + conv.origin.source.rsplit(":", 1)[1])


def test_dynamic_batch_runs_other_batch_sizes():
    z = ZOO["mlp"]
    module = z.build()
    graph = load_model(module, example_inputs=z.example_inputs(4)).capture(dynamic_batch=True)
    graph.verify()
    assert isinstance(graph.input_nodes[0].tensor_meta.shape[0], str)
    for batch in (1, 7):
        x = z.example_inputs(batch)
        torch.testing.assert_close(Interpreter(graph).run(*x)[0], module(*x), rtol=1e-5, atol=1e-5)


def test_training_mode_graph_is_differentiable():
    z = ZOO["lenet"]
    module = z.build().train()
    graph = load_model(module, example_inputs=z.example_inputs(2)).capture(training=True)
    assert graph.mode.value == "training"
    (out,) = Interpreter(graph).run(*z.example_inputs(2))
    out.sum().backward()
    grads = [t.grad for t in graph.constants.values() if t.is_floating_point()]
    assert grads and all(g is not None for g in grads)
    assert all(p.grad is None for p in module.parameters())       # the graph's copies, not the module's


@pytest.mark.parametrize("text", ["2x3:f32", "2x3:fp32", "2x3:float32", "2x3"])
def test_input_shapes_parse_every_dtype_spelling_and_print_the_short_one(text):
    spec = InputSpec.parse(text)
    assert spec == InputSpec((2, 3), torch.float32)
    assert str(spec) == "2x3:f32" and spec.to_json() == {"shape": [2, 3], "dtype": "f32"}
    assert InputSpec.from_json(spec.to_json()) == spec


def test_input_shape_errors_name_the_short_form():
    with pytest.raises(InputSpecError, match=r"1x3x32x32\[:f32\]"):
        InputSpec.parse("1,3")
    with pytest.raises(InputSpecError, match="unknown dtype 'f33'"):
        InputSpec.parse("1x3:f33")


def test_random_inputs_follow_the_graph_and_its_symbols():
    z = ZOO["mlp"]
    graph = load_model(z.build(), example_inputs=z.example_inputs(4)).capture(dynamic_batch=True)
    (x,) = graph_random_inputs(graph, seed=3)
    assert x.shape == (4, 512) and x.dtype == torch.float32          # the symbol's example value
    assert torch.equal(x, graph_random_inputs(graph, seed=3)[0])
    assert not torch.equal(x, graph_random_inputs(graph, seed=4)[0])
    ints = random_tensor((1000,), torch.int64, torch.Generator().manual_seed(0))
    assert ints.dtype == torch.int64 and int(ints.min()) == 0 and int(ints.max()) == 9
    assert random_tensor((8,), torch.bool).dtype == torch.bool


# ---------------------------------------------------------------------------
# Issue 14 part 5: op-by-op decomposition fallback (mlcomp/frontend/decompose.py).
# A torch.library op in a namespace of this module only, with CPU and Meta kernels;
# the user's decomposition of it either works or raises.

_LIB = torch.library.Library("mlcomp_test_capture", "DEF")
_LIB.define("twice(Tensor x) -> Tensor")
_LIB.impl("twice", lambda x: x * 2, "CPU")
_LIB.impl("twice", lambda x: torch.empty_like(x), "Meta")
TWICE = torch.ops.mlcomp_test_capture.twice.default


def _broken(x):
    raise RuntimeError("decomposition of twice is broken")


class WithTwice(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4)

    def forward(self, x):
        return torch.nn.functional.gelu(self.b(TWICE(torch.relu(self.a(x)))))


X8 = torch.randn(3, 8, generator=torch.Generator().manual_seed(0))
KEPT_OPS = ["aten.permute.default", "aten.addmm.default", "aten.relu.default", "mlcomp_test_capture::twice.default",
            "aten.permute.default", "aten.addmm.default", "aten.gelu.default"]


@pytest.fixture(scope="module")
def kept_graph():
    return load_model(WithTwice().eval(), example_inputs=(X8,)).capture(decompositions={TWICE: _broken})


def test_a_failing_decomposition_keeps_only_that_op(kept_graph):
    graph = kept_graph
    graph.verify()
    assert [str(n.op) for n in graph.call_nodes()] == KEPT_OPS          # everything else is core ATen
    assert graph.kept_ops == {"mlcomp_test_capture::twice.default":
                              "its decomposition fails: RuntimeError: decomposition of twice is broken"}
    model = WithTwice().eval()
    with torch.no_grad():
        torch.testing.assert_close(Interpreter(graph).run(X8)[0], model(X8), rtol=1e-6, atol=1e-6)
    assert "kept     mlcomp_test_capture::twice.default undecomposed" in inspect_graph(graph).format()
    assert inspect_graph(graph).to_json()["kept_ops"] == graph.kept_ops
    assert graph.copy().kept_ops == graph.kept_ops
    assert graph.capture_trace == ("two traces: the one-trace export failed: "      # mlcomp.frontend.one_trace
                                   "RuntimeError: decomposition of twice is broken")


def test_a_working_decomposition_is_used():
    graph = load_model(WithTwice().eval(), example_inputs=(X8,)).capture(decompositions={TWICE: lambda x: x * 2})
    assert graph.kept_ops == {}
    assert [str(n.op) for n in graph.call_nodes()] == [o.replace("mlcomp_test_capture::twice.default", "aten.mul.Tensor")
                                                      for o in KEPT_OPS]


@pytest.mark.slow
def test_bisection_finds_every_culprit_in_log_runs():
    ep = torch.export.export(WithTwice().eval(), (X8,))
    table = {TWICE: _broken, torch.ops.aten.gelu.default: _broken}
    lowered, report = decompose(ep, table)
    assert set(report.kept) == {"mlcomp_test_capture::twice.default", "aten.gelu.default"}
    # 1 failing run, 1 with every suspect kept, then per culprit ~log2(k) probes and one check (k = 4 here)
    assert report.runs <= 2 + 2 * (2 + 1)
    kinds = {n.target for n in lowered.graph_module.graph.nodes if n.op == "call_function"}
    assert {TWICE, torch.ops.aten.gelu.default} <= kinds and torch.ops.aten.linear.default not in kinds
    assert report.to_json()["kept"] == report.kept


def test_a_failure_no_kept_op_explains_is_the_first_error():
    broken_meta = [False]

    def meta(x):
        if broken_meta[0]:
            raise RuntimeError("shape function of fragile is broken")
        return torch.empty_like(x)

    _LIB.define("fragile(Tensor x) -> Tensor")
    _LIB.impl("fragile", lambda x: x + 1, "CPU")
    _LIB.impl("fragile", meta, "Meta")

    class Fragile(torch.nn.Module):
        def forward(self, x):
            return torch.ops.mlcomp_test_capture.fragile(TWICE(x))

    ep = torch.export.export(Fragile(), (X8,))
    broken_meta[0] = True                      # from here on no retrace can run it, whatever is kept
    with pytest.raises(DecompositionFailed, match="shape function of fragile is broken"):
        decompose(ep, {TWICE: _broken})
    with pytest.raises(CaptureError, match="even keeping every op kind undecomposed: shape function of fragile"):
        capture_exported(ep, name="fragile", decompositions={TWICE: _broken})


def test_kept_op_runs_on_cpu_and_is_refused_clearly_elsewhere(kept_graph):
    model = WithTwice().eval()
    art = get_target("cpu").compile(kept_graph.copy(), CompileOptions.make())
    with torch.no_grad():
        torch.testing.assert_close(art(X8), model(X8))
    node = next(n for n in kept_graph.call_nodes() if str(n.op).startswith("mlcomp_test_capture"))
    assert get_target("onnxruntime").explain(node, kept_graph) == \
        "mlcomp_test_capture::twice.default has no ONNX translation"
    assert "no converter for mlcomp_test_capture::twice.default" in get_target("tvm").explain(node, kept_graph)


@pytest.mark.ort
def test_kept_op_runs_in_torch_under_fallback_eager(kept_graph):
    pytest.importorskip("onnxruntime")
    model = WithTwice().eval()
    mixed = get_target("onnxruntime").compile(kept_graph.copy(), CompileOptions.make(fallback="eager"))
    with torch.no_grad():
        torch.testing.assert_close(mixed(X8), model(X8), rtol=1e-5, atol=1e-5)
    regions = mixed.manifest["fallback_regions"]
    assert [r["ops"] for r in regions if r["runs_on"] != "onnxruntime"] == [["mlcomp_test_capture::twice.default"]]


# Issue 14 part 6b: the cpu target times optimize_for_inference only where it changes the kernels.

def test_cpu_target_times_optimize_only_when_it_changes_kernels(captured):
    _, inputs, graph = captured("lenet")
    payload = frozen_bytes(trace_frozen(graph, inputs))
    plain = TorchScriptRuntime._load_module(payload, False, "cpu")
    tuned = TorchScriptRuntime._load_module(payload, True, "cpu")
    assert _kernels(plain) != _kernels(tuned)              # lenet: convolutions become MKLDNN
    _, inputs, graph = captured("mlp")
    art = get_target("cpu").compile(graph, CompileOptions.make())
    # decided without timing: same kernels either way (the frozen products' linears count as their addmm)
    assert art.runtime.optimize is False and art.runtime.choice.reason is OptimizeReason.SAME_KERNELS
    torch.testing.assert_close(art(*inputs), Interpreter(graph).run(*inputs)[0])
