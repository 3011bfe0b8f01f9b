"""The cpu target writes out the sizes of static views (``targets.torch.cpu.explicit_view_sizes``):
``torch.jit.freeze`` joins products that share an input and resolves a ``-1`` against the joined size."""
from __future__ import annotations

import torch
from torch import nn

import mlcomp
from mlcomp.frontend.capture import capture_module
from mlcomp.targets.torch.cpu import explicit_view_sizes


class SharedInputHeads(nn.Module):
    """Two projections of one input (one without a bias), each split into heads with a -1 (attention's q/k)."""

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k = nn.Linear(64, 64, bias=False), nn.Linear(64, 64)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.q(x).view(2, -1, 4, 16), self.k(x).view(2, -1, 4, 16)


def test_views_beside_joined_products_compile_on_cpu():
    torch.manual_seed(0)
    model, x = SharedInputHeads().eval(), torch.randn(32, 64)
    art = mlcomp.compile(model, (x,), target="cpu", pipeline="-O0", threads=1)
    for got, want in zip(art(x), model(x)):
        assert got.shape == (2, 16, 4, 16)
        torch.testing.assert_close(got, want)


def test_only_static_inferred_sizes_are_written_out():
    graph = capture_module(SharedInputHeads().eval(), (torch.randn(32, 64),))
    views = [n.name for n in graph.call_nodes() if n.op.name == "view" and -1 in n.inputs[1]]
    assert views
    fixed = explicit_view_sizes(graph)
    assert [list(fixed.node(v).inputs[1]) for v in views] == [[2, 16, 4, 16]] * len(views)
    assert all(-1 in graph.node(v).inputs[1] for v in views)          # the compiled graph is not modified
    assert explicit_view_sizes(fixed) is fixed
