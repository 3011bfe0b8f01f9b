"""Tied and unused parameters in training: one parameter under two names, one the loss never reaches.

A tiny language model whose output projection is its input embedding (as GPT-2, OPT,
BART, T5 and Whisper tie theirs), with a position table it never reads and one
block called twice.  The compiled step must give that parameter one gradient (the sum
of both uses), leave the unused one alone as eager's optimizer does, follow eager
through several Adam steps, and show the one updated tensor under both
``state_dict`` keys, in memory and after a save and load.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import mlcomp
from mlcomp.frontend.joint import output_names
from mlcomp.frontend.tied import TIED, tied_parameters
from mlcomp.training.step import TrainingArtifact


class TinyTiedLM(nn.Module):
    """Embedding → block (used twice) → head; ``head.weight is embed.weight``; ``pos`` is never read."""

    def __init__(self, vocab: int = 12, dim: int = 6) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Embedding(8, dim)         # unused, like a table a config switched off
        self.block = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.block(self.embed(ids)))
        return self.head(torch.tanh(self.block(h)))


@pytest.fixture(scope="module")
def tied():
    torch.manual_seed(0)
    model, ids = TinyTiedLM(), torch.randint(0, 12, (3, 5))
    y = torch.randn(3, 5, 12)
    art = mlcomp.compile(model, (ids,), mode="train", target="cpu", loss="mse", optimizer="adam{lr=0.01}", y=y)
    return model, ids, y, art


def _eager_steps(model: nn.Module, ids: torch.Tensor, y: torch.Tensor, steps: int) -> nn.Module:
    ref = copy.deepcopy(model)
    opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        F.mse_loss(ref(ids), y).backward()
        opt.step()
    return ref


def test_aliases_are_found_by_identity():
    assert tied_parameters(TinyTiedLM()) == {"head.weight": "embed.weight"}
    assert tied_parameters(nn.Linear(2, 2)) == {}


def test_joint_graph_has_one_gradient_per_tied_parameter(tied):
    model, _, _, art = tied
    grads = [n for n in output_names(art.graph) if n.startswith("grad:")]
    assert grads == ["grad:embed.weight", "grad:block.weight", "grad:block.bias"]   # no head, no pos
    assert dict(art.graph.output_node.attrs[TIED]) == {"head.weight": "embed.weight"}
    assert "head.weight" not in art.graph.constants
    assert model.head.weight is model.embed.weight and all(p.requires_grad for p in model.parameters())


def test_gradient_is_the_sum_of_both_uses(tied):
    model, ids, y, art = tied
    check = art.verification
    assert check["passed"] and set(check["params"]) == {"embed.weight", "block.weight", "block.bias"}
    assert check["worst_rel"] <= 1e-6
    _, grads = art.gradients(ids, y)
    ref = copy.deepcopy(model)
    F.mse_loss(ref(ids), y).backward()
    torch.testing.assert_close(grads["embed.weight"], ref.embed.weight.grad, rtol=1e-6, atol=1e-7)
    # the head's use alone would be a different gradient: both uses are in the one above
    only_head = torch.autograd.grad(F.mse_loss(F.linear(torch.tanh(ref.block(torch.tanh(ref.block(
        ref.embed(ids).detach())))), ref.head.weight), y), ref.head.weight)[0]
    assert not torch.allclose(only_head, ref.embed.weight.grad)


def test_steps_follow_eager_and_state_stays_tied(tied, tmp_path):
    model, ids, y, art = tied
    trial = copy.deepcopy(art)      # a copy steps on its own tensors (its TorchScript module re-bound)
    for _ in range(3):
        trial.step(ids, y)
    assert art.steps == 0 and torch.equal(art.state_dict()["embed.weight"], model.embed.weight)
    ref = _eager_steps(model, ids, y, 3)
    state = trial.state_dict()
    assert list(state) == list(model.state_dict())
    for key, value in ref.state_dict().items():
        torch.testing.assert_close(state[key], value, rtol=1e-5, atol=1e-6)
    assert state["head.weight"] is state["embed.weight"]
    assert torch.equal(state["pos.weight"], model.pos.weight)        # never reached: never updated
    reloaded = TrainingArtifact.load(trial.save(tmp_path / "tied", inputs=(ids, y)))
    assert reloaded.verification["reload"]["passed"]
    assert reloaded.state_dict()["head.weight"] is reloaded.state_dict()["embed.weight"]
    copy_of_model = copy.deepcopy(model)
    copy_of_model.load_state_dict(reloaded.state_dict())
    assert copy_of_model.head.weight is copy_of_model.embed.weight
