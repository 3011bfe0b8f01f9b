"""The support matrix's fast subset: one architecture per family, capture, -O2 on cpu and onnxruntime, training.

Each cell runs in the matrix's own child processes (as ``benchmarks/support_matrix.py``
runs them) and must be verified or refused up front with a reason, never failed: a
regression in capture, a target or the training step on any of these families fails
here with the architecture, the cell and the first error line.  Failures known and open elsewhere are
listed in :data:`KNOWN_FAILURES` with their message (any other failure of those cells still fails).
"""
from __future__ import annotations

import json

import pytest

from mlcomp.measure.support_cells import Cell, Status
from mlcomp.measure.support_doc import matrix_json, render_markdown, summary
from mlcomp.measure.support_matrix import run_matrix

pytest.importorskip("transformers", reason="transformers is part of the test extra")
pytest.importorskip("onnxruntime", reason="onnxruntime is part of the install")

pytestmark = pytest.mark.ort

FAST = ["mlp", "bert", "gpt2", "bart", "vit", "wav2vec2"]   # zoo, encoder, decoder LM, enc-dec, vision, audio
CELLS = [Cell.parse(c) for c in ("capture", "O2:cpu", "O2:onnxruntime", "train")]
# failures known and open elsewhere: such a cell may fail only with this message, and passes the test once it is
# verified or refused with a reason (wav2vec2's train cell is refused: LayerDrop and SpecAugment draw at random)
KNOWN_FAILURES: dict[tuple[str, str], str] = {}
HOST = {"cpu": "test host", "flags": {"avx2": True}, "cores": 2, "python": "3", "versions": {"torch": "2"},
        "date": "today"}


@pytest.fixture(scope="module")
def matrix():
    return run_matrix(FAST, CELLS, timeout_s=240)


def test_every_cell_is_verified_or_refused_with_a_reason(matrix):
    assert list(matrix.rows) == FAST
    failed = [f"{name} {key}: {r.detail}" for name, row in matrix.rows.items() for key, r in row.items()
              if r.status is Status.FAILED and KNOWN_FAILURES.get((name, key), "\0") not in r.detail]
    assert not failed, "\n".join(failed)
    refused = [r for row in matrix.rows.values() for r in row.values() if r.status is Status.REFUSED]
    assert all(r.detail.split(":", 1)[1].strip() for r in refused)      # "ErrorClass: reason"


def test_capture_and_cpu_verify_every_family(matrix):
    """Decoder LMs included: their cache outputs are captured and verified on cpu and onnxruntime."""
    for name, row in matrix.rows.items():
        assert row["capture"].status is Status.VERIFIED, (name, row["capture"].detail)
        assert row["capture"].detail.endswith("nodes") and int(row["capture"].detail.split()[0]) > 0
        assert row["O2:cpu"].status is Status.VERIFIED, (name, row["O2:cpu"].detail)
        assert row["O2:cpu"].detail.startswith("max |diff|")
        assert row["O2:onnxruntime"].status is Status.VERIFIED, (name, row["O2:onnxruntime"].detail)


def test_record_and_document_hold_every_cell(matrix):
    data = json.loads(json.dumps(matrix_json(matrix, HOST)))
    assert data["columns"] == [c.key for c in CELLS]
    counts = summary(data)
    assert counts["O2:cpu"]["verified"] == len(FAST)
    assert counts["train"] == {"verified": len(FAST) - 1, "refused": 1, "failed": 0}
    assert sum(counts["target onnxruntime"].values()) == len(FAST)
    doc = render_markdown(data)
    for name in FAST:
        assert f"| {name} | {matrix.families[name]} |" in doc
    assert "| O2:cpu | 6 | 0 | 0 | 100% |" in doc


def test_training_verifies_tied_embedding_models_and_refuses_random_structure(matrix):
    """gpt2 and bart tie their output projection to the embedding; wav2vec2 trains with LayerDrop and SpecAugment."""
    for name in ("gpt2", "bart"):
        assert matrix.rows[name]["train"].status is Status.VERIFIED, matrix.rows[name]["train"].detail
    w2v = matrix.rows["wav2vec2"]["train"]
    assert w2v.status is Status.REFUSED and w2v.detail.startswith("TrainingError:")
    assert "config.layerdrop=0.1" in w2v.detail and "config.mask_time_prob=0.05" in w2v.detail
