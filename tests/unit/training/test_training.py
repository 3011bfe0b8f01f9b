"""Training graphs: joint capture, saved activations, the compiled training step (bad inputs:
``tests/unit/training/test_training_inputs.py``).

Every zoo model and two Hugging Face models (BERT and ViT from small configs) are
captured once (batch 4) as a joint forward+loss+backward graph; each one must
verify, give gradients within 1e-5 relative of eager autograd, and follow eager
through 5 SGD and 5 Adam steps (torch's default ``eps=1e-8``) within 1e-5 per
parameter.  Both hold because the joint graph keeps the fused kernels eager autograd
runs (``mlcomp.frontend.joint.joint_decompositions``): on CPU the gradients are
bitwise eager's.  To keep the file cheap the transformer (2 layers, d_model 64,
seq 16), the GRU (6 steps) and ``resnet`` (ResNet-18's stem, identity and strided 1x1-conv shortcuts and
batch norms at widths 8 and 16, one block per stage: ``tests.helpers.modules.small_resnet``) are the zoo
classes at a reduced size; every model is captured once per module.  Dropout is set to 0: the graph's
dropout draws different random numbers from eager's kernel.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mlcomp
from mlcomp.analysis.training_graph import (
    phase_flops,
    predicted_peak,
    saved_activations,
    saved_bytes_by_module,
)
from mlcomp.base.errors import MlcompError
from mlcomp.frontend.joint import capture_joint, example_target, loss_function, without_dropout
from mlcomp.ir import Graph, Mode, Node, Ref, TensorMeta
from mlcomp.ir.node import Phase
from mlcomp.ir.ops import INPUT, OUTPUT, aten
from mlcomp.training.step import compare_steps, compile_training, verify_gradients
from tests.helpers.modules import small_resnet

BATCH = 4
GRAD_TOL = 1e-5      # gradients, relative to the parameter's largest gradient (fp32)
# every parameter and buffer after 5 steps: max |compiled - eager| / max |eager|, per tensor.  The
# gradients are eager's bit for bit on CPU, so this holds with Adam's default eps=1e-8, which
# divides each element by its own magnitude and would turn any rounding difference in a
# mathematically zero gradient (attention key biases) into a whole lr step.
STEP_TOL = 1e-5
LOSS_TOL = 1e-5      # losses of the five steps, max |compiled - eager| / the first eager loss
SGD = "sgd{lr=0.01 momentum=0.9 weight_decay=1e-4}"
ADAM = "adam{lr=1e-3}"


# ---------------------------------------------------------------------------
# models


def _tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))


class Logits(nn.Module):
    """HF models return a ModelOutput; the loss reads ``.logits``."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).logits


def _bert():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.BertConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
                        vocab_size=500, num_labels=3, hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids = torch.randint(0, 500, (BATCH, 16), generator=torch.Generator().manual_seed(0))
    return Logits(tf.BertForSequenceClassification(cfg)), (ids,)


def _vit():
    tf = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = tf.ViTConfig(image_size=32, patch_size=8, num_channels=3, hidden_size=64, num_hidden_layers=2,
                       num_attention_heads=4, intermediate_size=128, num_labels=10, hidden_dropout_prob=0.0,
                       attention_probs_dropout_prob=0.0)
    x = torch.randn(BATCH, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    return Logits(tf.ViTForImageClassification(cfg)), (x,)


def _zoo(name: str):
    from mlcomp.models import get

    z = get(name)
    return z.build(), z.example_inputs(BATCH)


def _small_transformer():
    from tests.helpers.modules import small_transformer

    return small_transformer(BATCH)


def _small_gru():
    from mlcomp.models.sequence import GRUClassifier

    torch.manual_seed(0)
    return GRUClassifier(steps=6), (torch.randn(BATCH, 6, 64, generator=torch.Generator().manual_seed(0)),)


MODELS = {"mlp": lambda: _zoo("mlp"), "lenet": lambda: _zoo("lenet"), "resnet": lambda: small_resnet(BATCH),
          "transformer": _small_transformer, "gru": _small_gru, "bert": _bert, "vit": _vit}


@pytest.fixture(scope="module")
def captured():
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            model, inputs = MODELS[name]()
            model = without_dropout(model).train()
            y = example_target(model, inputs, "cross_entropy")
            reference = copy.deepcopy(model)        # untouched copy: the eager side of each comparison
            graph = capture_joint(model, inputs, y, loss="cross_entropy", name=name)
            cache[name] = (reference, inputs, y, graph)
        return cache[name]

    return get


# ---------------------------------------------------------------------------
# joint capture: IR before/after (golden text), phases, outputs

TINY_GOLDEN = """\
graph tiny(%args_0: f32[2, 4], %target: f32[2, 2]) {
  %0.weight: f32[3, 4] = param   # 0
  %0.bias: f32[3] = param   # 0
  %2.weight: f32[2, 3] = param   # 2
  %2.bias: f32[2] = param   # 2
  %permute: f32[4, 3] = aten.permute.default(%0.weight, [1, 0])   # 0 {phase=forward}
  %addmm: f32[2, 3] = aten.addmm.default(%0.bias, %args_0, %permute)   # 0 {phase=forward}
  %relu: f32[2, 3] = aten.relu.default(%addmm)   # 1 {phase=forward}
  %permute_1: f32[3, 2] = aten.permute.default(%2.weight, [1, 0])   # 2 {phase=forward}
  %addmm_1: f32[2, 2] = aten.addmm.default(%2.bias, %relu, %permute_1)   # 2 {phase=forward}
  %loss: f32[] = aten.mse_loss.default(%addmm_1, %target)   # {phase=loss}
  %full_like: f32[] = aten.full_like.default(%loss, 1, pin_memory=False, memory_format=torch.preserve_format)   # {phase=backward}
  %mse_loss_backward: f32[2, 2] = aten.mse_loss_backward.default(%full_like, %addmm_1, %target, 1)   # 2 {phase=backward}
  %permute_2: f32[2, 3] = aten.permute.default(%permute_1, [1, 0])   # 2 {phase=backward}
  %mm: f32[2, 3] = aten.mm.default(%mse_loss_backward, %permute_2)   # 2 {phase=backward}
  %permute_3: f32[2, 2] = aten.permute.default(%mse_loss_backward, [1, 0])   # 2 {phase=backward}
  %mm_1: f32[2, 3] = aten.mm.default(%permute_3, %relu)   # 2 {phase=backward}
  %permute_4: f32[3, 2] = aten.permute.default(%mm_1, [1, 0])   # 2 {phase=backward}
  %sum_1: f32[1, 2] = aten.sum.dim_IntList(%mse_loss_backward, [0], True)   # 2 {phase=backward}
  %grad:2.bias: f32[2] = aten.reshape.default(%sum_1, [2])   # 2 {phase=backward}
  %grad:2.weight: f32[2, 3] = aten.permute.default(%permute_4, [1, 0])   # 2 {phase=backward}
  %threshold_backward: f32[2, 3] = aten.threshold_backward.default(%mm, %relu, 0)   # 1 {phase=backward}
  %permute_6: f32[3, 2] = aten.permute.default(%threshold_backward, [1, 0])   # 1 {phase=backward}
  %mm_2: f32[3, 4] = aten.mm.default(%permute_6, %args_0)   # 0 {phase=backward}
  %permute_7: f32[4, 3] = aten.permute.default(%mm_2, [1, 0])   # 0 {phase=backward}
  %sum_2: f32[1, 3] = aten.sum.dim_IntList(%threshold_backward, [0], True)   # 0 {phase=backward}
  %grad:0.bias: f32[3] = aten.reshape.default(%sum_2, [3])   # 0 {phase=backward}
  %grad:0.weight: f32[3, 4] = aten.permute.default(%permute_7, [1, 0])   # 0 {phase=backward}
  return (%loss, %grad:0.weight, %grad:0.bias, %grad:2.weight, %grad:2.bias)
}"""


@pytest.fixture(scope="module")
def tiny():
    model = _tiny()
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(1))
    y = torch.randn(2, 2, generator=torch.Generator().manual_seed(2))
    before = model.state_dict()
    before = {k: v.clone() for k, v in before.items()}
    graph = capture_joint(model, (x,), y, loss="mse", name="tiny")
    return model, x, y, graph, before


def test_tiny_joint_graph_golden(tiny):
    model, _, _, graph, before = tiny
    graph.verify()
    assert graph.mode is Mode.TRAINING
    assert graph.format() == TINY_GOLDEN
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())   # capture updates nothing


def test_tiny_joint_graph_numbers_match_autograd(tiny):
    model, x, y, graph, _ = tiny
    from mlcomp.ir.interpreter import Interpreter

    outs = Interpreter(graph).run(x, y)
    ref = copy.deepcopy(model)
    loss = F.mse_loss(ref(x), y)
    loss.backward()
    torch.testing.assert_close(outs[0], loss.detach(), rtol=1e-6, atol=0)
    names = [r.name for r in graph.output_refs]
    for name, p in ref.named_parameters():
        torch.testing.assert_close(outs[names.index(f"grad:{name}")], p.grad, rtol=1e-5, atol=1e-7)


def test_tiny_saved_activations_flops_and_peak(tiny):
    *_, graph, _ = tiny
    saved = {s.name: (s.nbytes, s.module) for s in saved_activations(graph)}
    # backward reads: x (mm_2), target and addmm_1 (recomputed sub_1), relu (mm_1 and the relu mask), loss (shape)
    assert saved == {"args_0": (32, "<input>"), "target": (16, "<input>"), "relu": (24, "0"),
                     "addmm_1": (16, "2"), "loss": (4, "<loss>")}
    assert saved_bytes_by_module(graph) == {"<input>": 48, "0": 24, "2": 16, "<loss>": 4}
    flops = phase_flops(graph)
    # forward: 2*2*4*3 + 2*2*3*2; backward: dX of layer 2, dW of both layers (no dX for the input)
    assert flops == {Phase.FORWARD: 48 + 24, Phase.LOSS: 0, Phase.BACKWARD: 24 + 24 + 48}


def test_predicted_peak_on_a_built_chain():
    g = Graph("chain")
    f32 = lambda *s: TensorMeta(s, torch.float32)
    g.add(Node("x", INPUT, meta=f32(4)))
    g.add(Node("a", aten("relu"), (Ref("x"),), meta=f32(4)))
    g.add(Node("v", aten("view"), (Ref("a"), [2, 2]), meta=f32(2, 2)))
    g.add(Node("b", aten("neg"), (Ref("a"),), meta=f32(4)))
    g.add(Node("d", aten("exp"), (Ref("b"),), meta=f32(4)))
    g.add(Node("e", aten("add", "Tensor"), (Ref("v"), Ref("d")), meta=f32(2, 2)))
    g.add(Node("output", OUTPUT, inputs=((Ref("e"),),)))
    peak = predicted_peak(g)
    # a 16 → v views a → b 32 → d 48 (the view v keeps a alive until e; b dies at d) → e 48 → a, d die
    assert (peak.resident, peak.transient, peak.at) == (16, 48, "d")


def test_phases_and_outputs_on_a_resnet(captured):
    reference, _, _, graph = captured("resnet")
    names = [r.name for r in graph.output_refs]
    assert names[0] == "loss"
    assert "grad:layer1.0.conv1.weight" in names and "new:layer1.0.bn1.running_mean" in names
    assert "new:stem.1.num_batches_tracked" in names
    counts = {p: 0 for p in Phase}
    for n in graph.call_nodes():
        assert n.ann.phase is not None, n.name
        counts[n.ann.phase] += 1
    assert counts[Phase.FORWARD] > 40 and counts[Phase.LOSS] >= 2 and counts[Phase.BACKWARD] > counts[Phase.FORWARD]
    convs = sum(isinstance(m, nn.Conv2d) for m in reference.modules())
    conv_fwd = [n for n in graph.call_nodes() if n.op.name == "convolution"]
    conv_bwd = [n for n in graph.call_nodes() if n.op.name == "convolution_backward"]
    assert len(conv_fwd) == len(conv_bwd) == convs and all(n.ann.phase is Phase.FORWARD for n in conv_fwd)
    assert all(n.ann.phase is Phase.BACKWARD for n in conv_bwd)
    # origins: forward nodes from the pre-joint program's modules, backward nodes from what they differentiate
    kinds = {n.op.name: set() for n in graph.call_nodes()}
    for n in graph.call_nodes():
        kinds[n.op.name].add(n.origin.module_type if n.origin else None)
    assert kinds["convolution"] == kinds["convolution_backward"] == {"Conv2d"}
    assert kinds["_native_batch_norm_legit_functional"] == kinds["native_batch_norm_backward"] == {"BatchNorm2d"}
    assert "ReLU" in kinds["relu"] and kinds["threshold_backward"] == kinds["relu"]   # F.relu: the block
    first = next(n for n in graph.call_nodes() if n.op.name == "convolution_backward" and
                 n.origin.module_path == "layer1.0.conv1")
    assert first.ann.phase is Phase.BACKWARD


def test_verify_names_the_first_diverging_backward_node(tiny):
    from mlcomp.base.errors import VerificationError
    from mlcomp.pipeline.instruments import Reference

    _, x, y, graph, _ = tiny
    broken = graph.copy()
    node = broken.node("mse_loss_backward")       # reduction mean (1) → none (0): no division by the batch
    broken.replace(node.with_(inputs=node.inputs[:3] + (0,)))
    with pytest.raises(VerificationError) as info:
        Reference(graph, (x, y)).check(broken, "fake-pass", "1/1")
    assert ("The first value that diverges is %mse_loss_backward (aten.mse_loss_backward.default) in the "
            "backward phase from module 2 (Linear)") in info.value.message


def test_pipeline_on_the_joint_graph_keeps_gradients():
    model = _tiny()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 2, (8,), generator=torch.Generator().manual_seed(4))
    art = mlcomp.compile(model, (x,), mode="train", y=y, optimizer="adam{lr=1e-3}", pipeline="-O2",
                         pipeline_verify=True)
    assert len(art.params) == 4 and art.verification["worst_rel"] <= GRAD_TOL
    assert len(art.graph) < len(capture_joint(_tiny(), (x,), y))   # the passes did remove nodes


# ---------------------------------------------------------------------------
# every model: capture verifies, gradients, 5 SGD and 5 Adam steps


@pytest.mark.parametrize("name", list(MODELS))
def test_training_matches_eager(name, captured):
    reference, inputs, y, graph = captured(name)
    graph.verify()
    loss_fn = loss_function("cross_entropy")
    args = tuple(inputs) + (y,)
    keys = list(reference.state_dict())
    sgd = compile_training(graph, optimizer=SGD, state_keys=keys)
    result = verify_gradients(sgd, reference, loss_fn, args, tolerance=GRAD_TOL)
    assert result["passed"] and result["worst_rel"] <= GRAD_TOL and len(result["params"]) == len(sgd.params)
    assert list(sgd.state_dict()) == keys
    for spec in (SGD, ADAM):
        art = compile_training(graph, optimizer=spec, state_keys=keys)
        eager = copy.deepcopy(reference)
        before = {k: v.clone() for k, v in art.state_dict().items()}
        cmp = compare_steps(art, eager, loss_fn, args, steps=5)
        assert cmp["worst_rel"] <= STEP_TOL, (spec, cmp["worst"], cmp["worst_rel"])
        assert cmp["loss_rel"] <= LOSS_TOL, (spec, cmp["compiled_losses"], cmp["eager_losses"])
        moved = [k for k, v in art.state_dict().items() if v.is_floating_point() and not torch.equal(v, before[k])]
        assert len(moved) >= len(art.params)    # every parameter was updated by the artifact itself


def test_batchnorm_running_stats_follow_eager(captured):
    reference, inputs, y, graph = captured("resnet")
    art = compile_training(graph, optimizer="sgd{lr=0.01}", state_keys=list(reference.state_dict()))
    eager = copy.deepcopy(reference)
    compare_steps(art, eager, loss_function("cross_entropy"), tuple(inputs) + (y,), steps=2)
    mine, theirs = art.state_dict(), eager.state_dict()
    assert int(mine["stem.1.num_batches_tracked"]) == int(theirs["stem.1.num_batches_tracked"]) == 2
    torch.testing.assert_close(mine["layer1.0.bn1.running_var"], theirs["layer1.0.bn1.running_var"],
                               rtol=1e-5, atol=1e-6)
    assert not torch.equal(mine["layer1.0.bn1.running_mean"], reference.state_dict()["layer1.0.bn1.running_mean"])


def test_state_dict_round_trip(captured):
    reference, inputs, y, graph = captured("mlp")
    art = compile_training(graph, optimizer="adam{lr=1e-2}", state_keys=list(reference.state_dict()))
    start = {k: v.clone() for k, v in art.state_dict().items()}
    art.step(*inputs, y)
    assert not torch.equal(art.state_dict()["0.weight"], start["0.weight"])
    art.load_state_dict(start)
    assert all(torch.equal(v, start[k]) for k, v in art.state_dict().items())
    with pytest.raises(MlcompError, match="missing 0.weight"):
        art.load_state_dict({k: v for k, v in start.items() if k != "0.weight"})


def test_mlcomp_compile_train_api():
    model = _tiny()
    x = torch.randn(8, 4, generator=torch.Generator().manual_seed(3))
    y = torch.randint(0, 2, (8,), generator=torch.Generator().manual_seed(4))
    art = mlcomp.compile(model, (x,), mode="train", loss="cross_entropy", y=y,
                         optimizer="sgd{lr=0.05 momentum=0.9}", target="cpu")
    assert art.verification["passed"] and art.verification["worst_rel"] <= GRAD_TOL
    assert list(art.state_dict()) == list(model.state_dict())
    losses = [art.step(x, y).item() for _ in range(20)]
    assert losses[-1] < losses[0]
    assert torch.equal(model.state_dict()["0.weight"], _tiny().state_dict()["0.weight"])   # the user's model untouched


def test_model_returning_its_loss():
    class WithLoss(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _tiny()

        def forward(self, x, y):
            return F.mse_loss(self.net(x), y)

    model = WithLoss()
    x, y = torch.randn(2, 4), torch.randn(2, 2)
    graph = capture_joint(model, (x, y), None, loss="model", name="withloss")
    assert graph.output_refs[0].name == "loss"
    art = compile_training(graph, optimizer="sgd{lr=0.1}", state_keys=list(model.state_dict()))
    result = verify_gradients(art, model, None, (x, y), tolerance=GRAD_TOL)
    assert result["passed"]
