"""Training under ``torch.compile(backend="mlcomp")`` through mlcomp's joint graph: remat, mixed precision, fallback."""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from mlcomp import models
from mlcomp.dynamo import backend as mb
from mlcomp.dynamo.report import AOT
from mlcomp.training.check import GRAD_FLOOR, K_AUTOCAST


pytestmark = pytest.mark.usefixtures("fresh_dynamo")   # tests/conftest.py


def train_once(model, x, **options):
    """Gradients of ``sum(out**2)`` through the backend and in eager, on twins of ``model``; and the report."""
    twin = copy.deepcopy(model)
    report = mb.BackendReport()
    fast = torch.compile(model, backend="mlcomp", options={"report": report, "optimize": False, **options})
    fast(x).pow(2).sum().backward()
    twin(x).pow(2).sum().backward()
    return [p.grad for p in model.parameters()], [p.grad for p in twin.parameters()], report


def _same_fp32(grads, ref):
    """fp32 gradients equal within rounding (torch's default float32 tolerance): bit-identity depends on the CPU's
    kernels (an AVX2 host sums the joint graph's ``mm`` + ``add`` in another order than eager's ``addmm``)."""
    for g, r in zip(grads, ref, strict=True):
        torch.testing.assert_close(g, r)


def zoo(name, batch):
    z = models.get(name)
    return z.build().train(), z.example_inputs(batch)[0]


def test_training_runs_mlcomps_joint_graph_and_gradients_equal_eager(capsys):
    model, x = zoo("mlp", 4)
    grads, ref, report = train_once(model, x, pipeline="-O2", explain=True)
    _same_fp32(grads, ref)
    (part,) = report.partitions
    assert (part.graph, part.name, part.ran_on) == ("graph0", "joint", "mlcomp:cpu")
    (joint,) = report.joints
    assert joint.saved == joint.saved_before == 3 and joint.recomputed == 0   # x and two ReLU outputs
    assert "graph0 joint graph: forward saves 3 tensors" in capsys.readouterr().out


def test_remat_recomputes_in_the_joint_graph_and_saves_fewer_tensors(capsys):
    model, x = zoo("mlp", 4)
    # the input alone is 0.57 of the saved bytes at this size: saved=0.6 leaves room to recompute both ReLUs
    grads, ref, report = train_once(model, x, pipeline="remat{saved=0.6}", explain=True)
    _same_fp32(grads, ref)
    (joint,) = report.joints
    assert joint.recomputed == 2 and joint.nodes_recomputed > 0
    assert joint.saved == 1 < joint.saved_before == 3
    assert joint.saved_bytes == x.numel() * 4 < joint.saved_before_bytes
    out = capsys.readouterr().out
    assert "forward saves 1 tensors (8192 bytes)" in out and "remat recomputed 2 values" in out


@pytest.mark.slow
def test_remat_on_a_conv_net():
    model, x = zoo("lenet", 4)
    grads, ref, report = train_once(model, x, pipeline="remat{saved=0.5}")
    _same_fp32(grads, ref)
    (joint,) = report.joints
    assert joint.recomputed > 0
    assert joint.saved_bytes < joint.saved_before_bytes
    assert joint.saved_bytes <= 0.75 * joint.saved_before_bytes


@pytest.mark.slow
def test_mixed_precision_in_the_joint_graph_is_within_its_declared_tolerance():
    """The standard of mlcomp.training.check: norm-wise, per parameter,
    err(compiled, fp32) <= max(declared tolerance, K_AUTOCAST * err(eager bf16 autocast, fp32))."""
    model, x = zoo("lenet", 4)
    autocast = copy.deepcopy(model)
    grads, ref, report = train_once(model, x, pipeline="mixed-precision{dtype=bf16}")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        autocast(x).float().pow(2).sum().backward()
    (joint,) = report.joints
    assert joint.tolerance is not None and joint.tolerance > 0
    assert any(not torch.equal(g, r) for g, r in zip(grads, ref))      # bf16 did run
    floor = GRAD_FLOOR * max(r.norm().item() for r in ref)
    for g, r, a in zip(grads, ref, (p.grad for p in autocast.parameters())):
        err = (g - r).norm().item() / max(r.norm().item(), floor)
        err_autocast = (a - r).norm().item() / max(r.norm().item(), floor)
        assert err <= max(joint.tolerance, K_AUTOCAST * err_autocast)


@pytest.mark.parametrize("pipeline", [None, "remat{budget=1.0}"])      # the default (-O2), and remat
def test_five_sgd_steps_through_the_joint_graph_equal_eager(pipeline):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    reference = copy.deepcopy(model)
    report = mb.BackendReport()
    options = {"report": report} if pipeline is None else {"report": report, "pipeline": pipeline}
    fast = torch.compile(model, backend="mlcomp", options=options)
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, reference))
    for _ in range(5):
        x, y = torch.randn(4, 8), torch.randn(4, 4)
        for net, o in ((fast, opt), (reference, ref_opt)):
            o.zero_grad()
            nn.functional.mse_loss(net(x), y).backward()
            o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    assert [p.ran_on for p in report.partitions] == ["mlcomp:cpu"] and len(report.joints) == 1


class Normed(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc, self.bn = nn.Linear(6, 8), nn.BatchNorm1d(8)

    def forward(self, x):
        return self.bn(self.fc(x)).relu()


def sgd_steps(model, batches, options, steps=5, dynamic=None):
    """``steps`` SGD-momentum steps of ``mean(out**2)`` through the backend and in eager on a twin; the report."""
    reference = copy.deepcopy(model)
    report = mb.BackendReport()
    fast = torch.compile(model, backend="mlcomp", dynamic=dynamic, options={"report": report, **options})
    opt, ref_opt = (torch.optim.SGD(m.parameters(), lr=0.01, momentum=0.9) for m in (model, reference))
    for step in range(steps):
        x = batches(step)
        for net, o in ((fast, opt), (reference, ref_opt)):
            o.zero_grad()
            net(x).pow(2).mean().backward()
            o.step()
    return reference, report


def test_batchnorm_trains_through_the_joint_graph_and_its_running_statistics_equal_eager():
    """The running statistics and num_batches_tracked are outputs of the forward, copied into the buffers."""
    torch.manual_seed(0)
    model = Normed().train()
    reference, report = sgd_steps(model, lambda step: torch.randn(5, 6), {})
    mine, theirs = model.state_dict(), reference.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)            # bit-identical, buffers included
    assert model.bn.num_batches_tracked.item() == 5
    assert [p.ran_on for p in report.partitions] == ["mlcomp:cpu"] and len(report.joints) == 1


@pytest.mark.parametrize("dynamic, graphs", [(True, 1), (None, 2)])   # None: static first, symbolic at the 2nd size
def test_a_changing_batch_trains_through_a_symbolic_joint_graph(dynamic, graphs):
    """Six batch sizes, BatchNorm included: one joint graph keeps the batch symbolic and serves them all."""
    torch.manual_seed(0)
    model = Normed().train()
    sizes = (3, 5, 7, 4, 9, 2)
    reference, report = sgd_steps(model, lambda step: torch.randn(sizes[step], 6), {}, steps=6, dynamic=dynamic)
    mine, theirs = model.state_dict(), reference.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert report.graphs == graphs and len(report.joints) == graphs
    assert {p.ran_on for p in report.partitions} == {"mlcomp:cpu"}


def test_a_scalar_baked_into_the_joint_graph_takes_its_new_value():
    """Under dynamic=True BatchNorm's momentum is a graph input read by .item(): baked in, each value its own."""
    torch.manual_seed(0)
    model = Normed().train()
    twin = copy.deepcopy(model)
    report = mb.BackendReport()
    fast = torch.compile(model, backend="mlcomp", dynamic=True, options={"report": report})
    for momentum, batch in ((0.1, 4), (0.5, 6)):
        model.bn.momentum = twin.bn.momentum = momentum
        x = torch.randn(batch, 6)
        torch.testing.assert_close(fast(x), twin(x), rtol=0, atol=0)
    assert torch.equal(model.bn.running_mean, twin.bn.running_mean)
    assert {p.ran_on for p in report.partitions} == {"mlcomp:cpu"}


@pytest.mark.slow
def test_resnet18_trains_through_the_joint_graph_five_steps_equal_eager():
    torch.manual_seed(0)
    z = models.get("resnet18")
    model, x = z.build().train(), z.example_inputs(2)[0]
    reference, report = sgd_steps(model, lambda step: torch.randn_like(x), {})
    mine, theirs = model.state_dict(), reference.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)            # weights, running_mean/var, counts
    assert [p.ran_on for p in report.partitions] == ["mlcomp:cpu"] and len(report.joints) == 1


def test_graph_the_joint_route_refuses_trains_through_aot_autograd_and_says_why(capsys):
    """remat{saved=0.5} is infeasible on this mlp (the input alone is 0.57 of the saved bytes)."""
    model, x = zoo("mlp", 4)
    grads, ref, report = train_once(model, x, pipeline="cleanup,remat{saved=0.5}", explain=True)
    for g, r in zip(grads, ref):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6)
    (refused,) = [p for p in report.partitions if p.ran_on == AOT]
    assert "not through mlcomp's joint graph" in refused.reason and "minimum feasible cap" in refused.reason
    assert "remat{saved=0.5} need the joint graph and do not run on the halves" in refused.reason
    assert {p.graph for p in report.partitions} == {"graph0", "graph0.forward", "graph0.backward"}
    halves = [p for p in report.partitions if p.ran_on != AOT]
    assert halves and all(p.ran_on == "mlcomp:cpu" and p.pipeline == "cleanup" for p in halves)
    assert not report.joints
    out = capsys.readouterr().out
    assert AOT in out and "not through mlcomp's joint graph" in out


def test_input_gradients_and_fused_norm_backward_equal_eager():
    """LayerNorm's and GELU's fused backward kernels (scripted: the JIT tracer takes no bool[3]); x needs a gradient."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.LayerNorm(16), nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    report = mb.BackendReport()
    fast = torch.compile(model, backend="mlcomp", options={"report": report, "pipeline": "-O2"})
    x = torch.randn(6, 8, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    fast(x).tanh().sum().backward()
    twin(x2).tanh().sum().backward()
    assert torch.equal(x.grad, x2.grad)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), twin.parameters()))
    assert [p.ran_on for p in report.partitions] == ["mlcomp:cpu"] and len(report.joints) == 1


def test_a_compiled_step_with_its_loss_and_class_targets_equals_eager():
    """The class targets index the log-probabilities: the target builds on them, not on random integers."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))
    twin = copy.deepcopy(model)

    def step(net, x, y):
        return nn.functional.cross_entropy(net(x), y)

    report = mb.BackendReport()
    fast = torch.compile(step, backend="mlcomp", options={"report": report, "pipeline": "-O2"})
    x, y = torch.randn(6, 8), torch.tensor([0, 1, 2, 3, 0, 1])
    loss = fast(model, x, y)
    loss.backward()
    ref = step(twin, x, y)
    ref.backward()
    assert torch.equal(loss, ref)
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), twin.parameters()))
    assert [p.ran_on for p in report.partitions] == ["mlcomp:cpu"]


class Logits(nn.Module):
    """A ``transformers`` classifier's logits (its output is a ModelOutput)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x).logits


def transformer(kind):
    """Random-weight BERT or ViT classifiers, 2 layers, hidden 128, dropout off (eager's masks are not the graph's)."""
    tf = pytest.importorskip("transformers")
    size = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=256,
                hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    torch.manual_seed(0)
    if kind == "bert":
        model = tf.BertForSequenceClassification(tf.BertConfig(vocab_size=1000, max_position_embeddings=64, **size))
        return Logits(model.train()), lambda step: torch.randint(0, 1000, (4, 16))
    model = tf.ViTForImageClassification(tf.ViTConfig(image_size=32, patch_size=8, num_labels=10, **size))
    return Logits(model.train()), lambda step: torch.randn(4, 3, 32, 32)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["bert", "vit"])
def test_bert_and_vit_train_through_the_joint_graph_five_steps_equal_eager(kind):
    """SDPA's CPU flash kernel and its backward are kept (not decomposed to math): the state is bit-identical."""
    model, batches = transformer(kind)
    reference, report = sgd_steps(model, batches, {})
    mine, theirs = model.state_dict(), reference.state_dict()
    assert all(torch.equal(mine[k], theirs[k]) for k in theirs)
    assert [p.ran_on for p in report.partitions] == ["mlcomp:cpu"] and len(report.joints) == 1


def test_remat_after_O2_lowers_the_measured_peak_of_a_step():
    """torch's CPU allocator over one step (after a warm one), as benchmarks/remat.py measures it: remat's
    saved bytes fall, and the step's peak falls with them."""
    from mlcomp.hardware.peak_memory import MemorySource
    from mlcomp.measure.training_bench import step_peak

    peaks, joints = {}, {}
    for pipeline in ("-O2", "-O2,remat{saved=0.6}"):
        model, x = zoo("mlp", 256)
        report = mb.BackendReport()
        fast = torch.compile(model, backend="mlcomp", options={"report": report, "pipeline": pipeline})
        opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)

        def step():
            opt.zero_grad(set_to_none=True)
            fast(x).pow(2).mean().backward()
            opt.step()
        peaks[pipeline] = step_peak(step, "cpu", MemorySource.ALLOCATOR).growth
        (joints[pipeline],) = report.joints
    plain, remat = joints["-O2"], joints["-O2,remat{saved=0.6}"]
    assert plain.recomputed == 0 and remat.recomputed == 2                    # fused addmm+relu recomputed
    assert remat.saved_bytes <= 0.6 * remat.saved_before_bytes < plain.saved_bytes
    assert peaks["-O2"] - peaks["-O2,remat{saved=0.6}"] >= 0.5 * (plain.saved_bytes - remat.saved_bytes)


def test_dropout_trains_through_the_joint_graph_and_its_mask_reaches_the_backward():
    """The forward saves the mask it drew; the gradients are eager's for that mask (read off the output)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Dropout(0.5)).train()
    twin = copy.deepcopy(model[0])
    report = mb.BackendReport()
    fast = torch.compile(model, backend="mlcomp", options={"report": report})
    x, t = torch.randn(32, 8), torch.randn(32, 16)
    out = fast(x)
    (out * t).sum().backward()
    kept = out != 0
    assert 0.3 < kept.float().mean().item() < 0.7                         # a mask was drawn, p = 0.5
    expected = twin(x) * kept * 2.0
    torch.testing.assert_close(out, expected, rtol=1e-6, atol=0)
    (expected * t).sum().backward()
    torch.testing.assert_close(model[0].weight.grad, twin.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(model[0].bias.grad, twin.bias.grad, rtol=1e-5, atol=1e-6)
    assert [p.ran_on for p in report.partitions] == ["mlcomp:cpu"]


class Heads(nn.Module):
    """Splits the features into heads by the symbolic batch size: the backward needs that size again."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        b = x.shape[0]
        return self.fc(x).view(b, 2, 4).softmax(-1).reshape(b, 8)


def test_a_size_the_backward_reads_is_computed_again_there_not_saved():
    torch.manual_seed(0)
    model = Heads()
    twin = copy.deepcopy(model)
    report = mb.BackendReport()
    fast = torch.compile(model, backend="mlcomp", dynamic=True, options={"report": report})
    for batch in (3, 6, 5):
        x, t = torch.randn(batch, 8), torch.randn(batch, 8)
        (fast(x) * t).sum().backward()
        (twin(x) * t).sum().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), twin.parameters()))
    assert report.graphs == 1 and [p.ran_on for p in report.partitions] == ["mlcomp:cpu"]


@pytest.mark.slow
def test_bert_over_changing_batch_and_sequence_compiles_twice_through_the_joint_graph():
    model, _ = transformer("bert")
    twin = copy.deepcopy(model)
    report = mb.BackendReport()
    fast = torch.compile(model, backend="mlcomp", options={"report": report})
    for batch, seq in ((4, 16), (2, 24), (3, 32), (5, 8), (4, 40)):
        x = torch.randint(0, 1000, (batch, seq))
        fast(x).pow(2).mean().backward()
        twin(x).pow(2).mean().backward()
    assert all(torch.equal(a.grad, b.grad) for a, b in zip(model.parameters(), twin.parameters()))
    assert report.graphs == 2 and {p.ran_on for p in report.partitions} == {"mlcomp:cpu"}
