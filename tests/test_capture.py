"""Every zoo model through every capture path: interpreter == eager, verify passes, FLOPs agree."""
from __future__ import annotations

import pytest
import torch
from mlcomp.models import ZOO, random_tensor
from torch.utils.flop_counter import FlopCounterMode

from mlcomp.analysis import cost
from mlcomp.base.errors import InputSpecError
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


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("name", list(ZOO))
def test_capture_matches_eager(name, path, tmp_path):
    z = ZOO[name]
    module, inputs = z.build(), z.example_inputs(2)
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
