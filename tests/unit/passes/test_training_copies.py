"""cleanup in a training graph drops the copies a p=0 dropout leaves (the same tensor), and keeps real copies."""
from __future__ import annotations

import torch
from torch import nn

from mlcomp.analysis.step_peak import step_memory
from mlcomp.frontend.joint import LossKind, capture_joint, without_dropout
from mlcomp.ir.opsets import CLONE
from mlcomp.pipeline import run_pipeline
from mlcomp.training.step import compile_training


class Block(nn.Module):
    """relu → dropout (turned off: a clone in the joint graph) and a transpose made contiguous (a real copy)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.drop, self.fc2 = nn.Linear(16, 64), nn.Dropout(0.1), nn.Linear(64, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.drop(torch.relu(self.fc1(x)))
        return self.fc2(h) + self.fc2(h.transpose(0, 1).contiguous().transpose(0, 1))


def _joint():
    torch.manual_seed(0)
    model = without_dropout(Block())
    x, y = torch.randn(8, 16), torch.randint(0, 4, (8,))
    return capture_joint(model, (x,), y, loss=LossKind.CROSS_ENTROPY), (x, y)


def test_the_dropout_copy_goes_the_layout_copy_stays_and_gradients_are_bit_identical():
    graph, args = _joint()
    clones = [n for n in graph if n.op == CLONE]
    after, report = run_pipeline(graph, "cleanup")
    left = [n for n in after if n.op == CLONE]
    assert len(left) < len(clones) and report.records[0].stats["copies_removed"] >= 1
    assert left and all(n.attrs.get("memory_format") == torch.contiguous_format for n in left)   # the real copy
    (l0, g0), (l1, g1) = compile_training(graph).gradients(*args), compile_training(after).gradients(*args)
    assert torch.equal(l0, l1) and all(torch.equal(g0[k], g1[k]) for k in g0)
    assert step_memory(after, fused=True).peak_bytes < step_memory(graph, fused=True).peak_bytes
