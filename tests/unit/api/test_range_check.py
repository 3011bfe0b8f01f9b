"""Verification over symbolic ranges: a mismatch at one end of a range fails the compile's check."""
from __future__ import annotations

import torch
from torch import nn

import mlcomp
from mlcomp.api.lowering import eager_reference
from mlcomp.api.range_check import resized, verify_ranges
from mlcomp.frontend.loading import load_model


class Rows(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x).relu()


class WrongAtNine:
    """A runtime equal to the artifact's except when the sequence is 9 long (the range's top)."""

    def __init__(self, inner):
        self.inner = inner

    def __call__(self, *inputs):
        out = self.inner(*inputs)
        return tuple(o + 1.0 for o in out) if inputs[0].shape[1] == 9 else out


def test_a_mismatch_at_the_top_of_a_range_is_found_and_named():
    source = load_model(Rows().eval(), example_inputs=(torch.randn(2, 5, 4),))
    graph = source.capture(dynamic="batch=1..6,seq=3..9")
    art = mlcomp.compile(Rows().eval(), torch.randn(2, 5, 4), dynamic="batch=1..6,seq=3..9")
    art.runtime = WrongAtNine(art.runtime)
    first = art.verify(raise_on_failure=False)
    assert first.passed                                   # the example's sizes alone would pass
    source.eager = lambda x: art.runtime.inner(x)[0]       # eager: the compiled model without the fault
    outcome = verify_ranges(art, source, graph, None, first, tolerance=None, reference=eager_reference)
    assert not outcome.passed
    assert outcome.note.startswith("at batch=6, seq=9 (inside the symbolic ranges): FAILED")
    shapes = art.verification["shapes"]
    assert [(s["sizes"], s["passed"]) for s in shapes] == [
        ({"batch": 2, "seq": 5}, True), ({"batch": 1, "seq": 3}, True), ({"batch": 3, "seq": 6}, True),
        ({"batch": 6, "seq": 9}, False)]


def test_resized_inputs_keep_the_examples_values():
    ids = torch.tensor([[5, 6, 7]])
    assert resized(ids, (2, 2)).tolist() == [[5, 6], [5, 6]]
    assert resized(ids, (1, 7)).tolist() == [[5, 6, 7, 5, 6, 7, 5]]
