"""What the cpu target rewrites before tracing (``targets.torch.cpu``): the sizes of static views written out
(``explicit_view_sizes``: ``torch.jit.freeze`` joins products that share an input and resolves a ``-1`` against
the joined size) and bool fill values as ints (``int_fill_values``: TorchScript's ``Scalar`` has no bool)."""
from __future__ import annotations

import torch
from torch import nn

import mlcomp
from mlcomp.frontend.capture import capture_module
from mlcomp.targets.torch.cpu import explicit_view_sizes, int_fill_values


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


class BoolMask(nn.Module):
    """A causal mask built with a bool fill (a traced GPT-2's ``full(..., True)``)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        keep = torch.full((x.shape[-1], x.shape[-1]), True).tril()
        return x.masked_fill(~keep, -1.0)


def test_bool_fills_trace_on_cpu():
    x = torch.randn(2, 5, 5)
    graph = capture_module(BoolMask(), (x,))
    fills = [n for n in graph.call_nodes() if n.op.name == "full"]
    assert [n.inputs[1] for n in fills] == [True]
    fixed = int_fill_values(graph)
    assert [(fixed.node(n.name).inputs[1], fixed.node(n.name).attrs["dtype"]) for n in fills] == [(1, torch.bool)]
    art = mlcomp.compile(BoolMask(), (x,), target="cpu", pipeline="", threads=1)
    assert torch.equal(art(x), BoolMask()(x))
