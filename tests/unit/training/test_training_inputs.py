"""Training graphs, bad inputs: each a clear MlcompError (one paragraph, no traceback), before anything is
written; and a parameter the loss never reaches, traced as frozen.

    input                                         error
    a per-sample loss (reduction="none")          the loss ... is not a scalar (shape (2, 2))
    OptimizerSpec.parse("sgd{lr=0.1 momentm=0.9}") optimizer 'sgd' has no option 'momentm'; did you mean 'momentum'?
    mlcomp.compile(..., mode="train", target="tvm") target tvm cannot compile training graphs
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mlcomp
from mlcomp.frontend.joint import LossKind, TrainingError, capture_joint, output_names
from mlcomp.runtime.optim import OptimizerSpec, OptimizerSpecError
from mlcomp.training.step import TrainingCapabilityError, compile_training, verify_gradients


def _tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.ReLU(), nn.Linear(3, 2))



def test_non_scalar_loss_is_refused():
    with pytest.raises(TrainingError, match="is not a scalar .shape \\(2, 2\\)") as info:
        capture_joint(_tiny(), (torch.randn(2, 4),), torch.randn(2, 2),
                      loss=lambda out, y: F.mse_loss(out, y, reduction="none"))
    assert "reduction='mean'" in info.value.message and "Traceback" not in info.value.message


def test_model_without_trainable_parameters_is_refused():
    model = _tiny().requires_grad_(False)
    with pytest.raises(TrainingError, match="no parameters that require grad"):
        capture_joint(model, (torch.randn(2, 4),), torch.randint(0, 2, (2,)))


def test_integer_only_output_is_refused():
    class ArgMax(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = _tiny()

        def forward(self, x):
            return self.net(x).argmax(-1)

    with pytest.raises(TrainingError, match="returns an integer tensor"):
        capture_joint(ArgMax(), (torch.randn(2, 4),), torch.randint(0, 2, (2,)))


@pytest.mark.parametrize("spec,message", [
    ("sgd{lr=0.1 momentm=0.9}", "optimizer 'sgd' has no option 'momentm'; did you mean 'momentum'?"),
    ("adam{lr=fast}", "option 'lr' of optimizer 'adam' expects float > 0, got 'fast'"),
    ("adm{lr=0.1}", "unknown optimizer 'adm'; did you mean 'adam'?"),
    ("sgd{lr}", "expected '=' after option name 'lr'"),
    ("sgd{lr=0}", "option 'lr' of optimizer 'sgd' must be greater than 0, got 0.0"),
    ("sgd{lr=0.1 momentum=1}", "option 'momentum' of optimizer 'sgd' must be in [0, 1), got 1.0"),
    ("adam{betas=(0.9,1.0)}", "option 'betas' of optimizer 'adam' must have every item in [0, 1), got [0.9,1.0]"),
    ("sgd{lr=-1}", "option 'lr' of optimizer 'sgd' must be greater than 0, got -1.0"),
    ("adam{betas=(0.9)}", "option 'betas' of optimizer 'adam' expects list of 2 float in [0, 1), got ['0.9'] (1 items)"),
    ("sgd,adam", "names 2 optimizers; give one"),
])
def test_bad_optimizer_specs(spec, message):
    """The spec grammar's errors, in optimizer words: column, did-you-mean, declared ranges."""
    with pytest.raises(OptimizerSpecError) as info:
        OptimizerSpec.parse(spec)
    assert message in info.value.message and "Traceback" not in info.value.message
    assert "pass" not in info.value.message.replace("passes", "")


def test_optimizer_spec_parses_typed_options():
    spec = OptimizerSpec.parse("sgd{lr=0.05, momentum=0.9 nesterov=true}")
    assert (spec.options.lr, spec.options.momentum, spec.options.nesterov) == (0.05, 0.9, True)
    assert spec.text() == "sgd{lr=0.05,momentum=0.9,nesterov=true}" and OptimizerSpec.parse(spec.text()) == spec
    adam = OptimizerSpec.parse("adam{lr=1e-3 betas=(0.9,0.99)}")
    assert adam.options.betas == (0.9, 0.99) and adam.options.eps == 1e-8 == torch.optim.Adam([
        torch.zeros(1, requires_grad=True)]).defaults["eps"]
    assert OptimizerSpec.parse("adam{betas=[0.9,0.99]}").options.betas == (0.9, 0.99)
    assert OptimizerSpec.parse("adamw").options.weight_decay == 0.01
    opt = adam.build([torch.zeros(2, requires_grad=True)])
    assert isinstance(opt, torch.optim.Adam) and opt.defaults["betas"] == (0.9, 0.99) and opt.defaults["foreach"]


@pytest.mark.parametrize("target", ["onnxruntime", "tvm"])
def test_training_on_inference_targets_is_refused(target):
    with pytest.raises(TrainingCapabilityError, match=f"target {target} cannot compile training graphs"):
        mlcomp.compile(_tiny(), (torch.randn(2, 4),), mode="train", target=target,
                       y=torch.randint(0, 2, (2,)), optimizer="sgd")


@pytest.mark.parametrize("args,message", [
    (["--target", "onnxruntime"], "target onnxruntime cannot compile training graphs"),
    (["--optimizer", "sgd{lr=0.1 foo=1}"], "optimizer 'sgd' has no option 'foo'"),
    (["--loss", "hinge"], "there is no loss named 'hinge'"),
])
def test_cli_compile_train_refuses_before_writing(tmp_path, args, message):
    from click.testing import CliRunner

    from mlcomp.cli.main import main

    out = tmp_path / "art"
    result = CliRunner().invoke(main, ["compile", "mlp", "--train", "-o", str(out), *args])
    assert result.exit_code != 0
    assert message in result.output and "Traceback" not in result.output
    assert not out.exists() and list(tmp_path.iterdir()) == []


class _UnusedHead(nn.Module):
    """A model with a parameter the loss never reaches (like BERT's pooler under a last-hidden head)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 4)
        self.pooler = nn.Linear(4, 4)          # never called

    def forward(self, x):
        return self.body(x)


def test_parameters_the_loss_never_reaches_are_traced_as_frozen():
    torch.manual_seed(0)
    model, x = _UnusedHead(), torch.randn(3, 8)
    y = torch.randint(0, 4, (3,))
    graph = capture_joint(model, (x,), y, loss=LossKind.CROSS_ENTROPY)
    assert all(p.requires_grad for p in model.parameters())          # the user's module is left as it was
    assert [n for n in output_names(graph) if n.startswith("grad:")] == ["grad:body.weight", "grad:body.bias"]
    art = compile_training(graph, optimizer="sgd{lr=0.1}", state_keys=list(model.state_dict()))
    check = verify_gradients(art, model, F.cross_entropy, (x, y))
    assert check["passed"] and check["worst_rel"] == 0.0
    reference = copy.deepcopy(model)
    art.step(x, y)
    assert torch.equal(art.state_dict()["pooler.weight"], reference.pooler.weight)   # eager's optimizer skips it too
