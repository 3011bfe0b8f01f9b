"""Selection-aware verification: a router whose near-tie bf16 rounding flips, and what it must still catch.

The model: ``h = pre(x)`` (an identity linear: under mixed precision it rounds ``x`` to bf16), a
router ``[h0, h1 + h2]`` kept in fp32 (it feeds a topk), ``topk(1)`` choosing between two experts
that answer very differently.  Row 0's scores are 1.0038 vs 1.0037 in fp32 (expert 0) but
1.0 vs 1.0037 once ``x`` is rounded to bf16 (expert 1); row 1's are far apart.
"""
from __future__ import annotations

import pytest
import torch
from torch import nn

import mlcomp
from mlcomp.analysis.selections import NearTies, near_tie_reference, selection_nodes
from mlcomp.analysis.verify import compare
from mlcomp.api import lowering
from mlcomp.base.errors import VerificationError
from mlcomp.ir.interpreter import Interpreter
from tests.helpers.captures import captured_once

TIE = torch.tensor([[1.0038, 1.0, 0.0037], [2.0, 1.0, 0.0]])      # row 0: near-tie that bf16 flips
APART = torch.tensor([[1.5, 1.0, 0.0037], [2.0, 1.0, 0.0]])       # no near-tie anywhere


class Routed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.pre = nn.Linear(3, 3, bias=False)
        self.router = nn.Linear(3, 2, bias=False)
        self.e0, self.e1 = nn.Linear(3, 3, bias=False), nn.Linear(3, 3, bias=False)
        with torch.no_grad():
            self.pre.weight.copy_(torch.eye(3))
            self.router.weight.copy_(torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 1.0]]))
            self.e0.weight.copy_(torch.eye(3) * 2)
            self.e1.weight.copy_(-torch.eye(3))

    def forward(self, x):
        h = self.pre(x)
        idx = self.router(h).topk(1, dim=-1).indices                    # [B, 1]
        experts = torch.stack([self.e0(h), self.e1(h)], dim=1)          # [B, 2, 3]
        return experts.gather(1, idx[..., None].expand(-1, 1, 3)).squeeze(1)


@captured_once
def _graphs(x):
    """The router model captured on ``x`` and lowered to bf16 (once per input; each call gets copies)."""
    from mlcomp.api.inputs import load_source
    from mlcomp.pipeline import run_pipeline

    source = load_source(Routed().eval(), (x,), {})
    captured = source.capture()
    lowered, _ = run_pipeline(captured.copy(), "cleanup,mixed-precision{dtype=bf16}", example_inputs=(x,),
                              deterministic=True)
    return captured, lowered


def test_the_router_stays_fp32_and_bf16_rounding_flips_the_near_tie():
    captured, lowered = _graphs(TIE)
    (topk,) = selection_nodes(lowered)
    assert lowered.node(topk.inputs[0].name).tensor_meta.dtype == torch.float32
    ref, low = Interpreter(captured).run(TIE)[0], Interpreter(lowered).run(TIE)[0].float()
    assert torch.allclose(ref[0], 2 * TIE[0], atol=1e-6) and torch.allclose(low[0], -TIE[0], atol=1e-2)
    assert not compare((ref,), (low,), 4e-2).passed                    # the plain comparison fails


def test_near_tie_reference_takes_the_flip_and_matches():
    captured, lowered = _graphs(TIE)
    actual = Interpreter(lowered).run(TIE)
    ties = near_tie_reference(captured, lowered, (TIE,), actual)
    assert isinstance(ties, NearTies) and ties.ties == 1 and ties.nodes == {"topk": 1}
    assert ties.swaps[0][1:] == (0, 0)                                  # row 0, ranks 0 and 1
    assert compare(ties.outputs, tuple(a.float() for a in actual), 4e-2).passed


def test_a_wrong_answer_downstream_still_fails():
    captured, lowered = _graphs(TIE)
    wrong = tuple(a.float() * 1.2 for a in Interpreter(lowered).run(TIE))   # a wrong expert scale
    ties = near_tie_reference(captured, lowered, (TIE,), wrong)
    assert not compare(ties.outputs, wrong, 4e-2).passed


def test_a_pick_beyond_the_perturbation_is_no_near_tie():
    captured, lowered = _graphs(APART)
    picked_wrong = (torch.stack([-APART[0], 2 * APART[1]]),)            # expert 1 where fp32 says 0 by 0.5
    ties = near_tie_reference(captured, lowered, (APART,), picked_wrong)
    assert ties.ties == 0 and not compare(ties.outputs, picked_wrong, 4e-2).passed


def test_an_fp32_graph_has_no_declared_perturbation():
    captured, _ = _graphs(TIE)
    assert near_tie_reference(captured, captured, (TIE,), Interpreter(captured).run(TIE)) is None


MIXED = dict(target="cpu", pipeline="cleanup,mixed-precision{dtype=bf16}", deterministic=True)


def test_compile_verifies_through_the_near_tie_and_records_it(monkeypatch):
    art = mlcomp.compile(Routed().eval(), (TIE,), **MIXED)
    record = art.verification
    assert record["passed"] and record["near_tie_selections"] == 1 and record["near_tie_nodes"] == {"topk": 1}
    assert "near-tie" in art.manifest["verified_against"]
    assert art.verify().passed                                         # the kept reference is the swapped one
    monkeypatch.setattr(lowering, "verify_near_ties", lambda *a, **k: None)   # without the rule: a failure
    with pytest.raises(VerificationError):
        mlcomp.compile(Routed().eval(), (TIE,), **MIXED)


@pytest.mark.ort
def test_onnxruntime_artifact_verifies_through_the_near_tie():
    art = mlcomp.compile(Routed().eval(), (TIE,), **dict(MIXED, target="onnxruntime"))
    assert art.verification["passed"] and art.verification["near_tie_selections"] == 1
    assert torch.allclose(art(TIE)[0], -TIE[0], atol=1e-2)             # ORT took expert 1 at the tie
