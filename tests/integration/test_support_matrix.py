"""The support matrix's fast subset: one architecture per family, capture, -O2 on cpu and onnxruntime, training.

The subset takes a cheap architecture of each family, preferring those no other fast test compiles: BERT
and ViT compile at -O2 on cpu and onnxruntime in ``test_third_party_presets`` and train in
``tests/unit/training/test_training.py``, so ALBERT and HF's ResNet stand for encoders and vision; BART
(with its cache) compiles in ``test_decoder_lms``, so the encoder-decoder family runs in the ``slow`` test
below (its training cell too: BART ties its output projection to the embedding, as GPT-2 does here), with
Qwen2, a second decoder LM that costs half again GPT-2's time.

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

FAST = ["mlp", "albert", "gpt2", "resnet", "wav2vec2"]      # zoo, encoder, decoder LM, vision, audio
SLOW = ["bart", "qwen2"]                                     # an encoder-decoder, a second decoder LM
CELLS = [Cell.parse(c) for c in ("capture", "O2:cpu", "O2:onnxruntime", "train")]
# failures known and open elsewhere: such a cell may fail only with this message, and passes the test once it is
# verified or refused with a reason
KNOWN_FAILURES: dict[tuple[str, str], str] = {}
HOST = {"cpu": "test host", "flags": {"avx2": True}, "cores": 2, "python": "3", "versions": {"torch": "2"},
        "date": "today"}


@pytest.fixture(scope="module")
def matrix():
    return run_matrix(FAST, CELLS, timeout_s=240)


def _check_cells(matrix, names) -> None:
    assert list(matrix.rows) == names
    failed = [f"{name} {key}: {r.detail}" for name, row in matrix.rows.items() for key, r in row.items()
              if r.status is Status.FAILED and KNOWN_FAILURES.get((name, key), "\0") not in r.detail]
    assert not failed, "\n".join(failed)
    refused = [r for row in matrix.rows.values() for r in row.values() if r.status is Status.REFUSED]
    assert all(r.detail.split(":", 1)[1].strip() for r in refused)      # "ErrorClass: reason"


def test_every_cell_is_verified_or_refused_with_a_reason(matrix):
    _check_cells(matrix, FAST)


@pytest.mark.slow
def test_encoder_decoder_and_second_decoder_cells_are_verified_or_fail_as_known():
    matrix = run_matrix(SLOW, CELLS, timeout_s=240)
    _check_cells(matrix, SLOW)
    assert matrix.rows["bart"]["train"].status is Status.VERIFIED, matrix.rows["bart"]["train"].detail  # tied


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
    assert counts["train"] == {"verified": len(FAST), "refused": 0, "failed": 0}
    assert sum(counts["target onnxruntime"].values()) == len(FAST)
    doc = render_markdown(data)
    for name in FAST:
        assert f"| {name} | {matrix.families[name]} |" in doc
    assert f"| O2:cpu | {len(FAST)} | 0 | 0 | 100% |" in doc


def test_training_verifies_tied_embedding_models_and_random_structure_switched_off(matrix):
    """gpt2 ties its output projection to the embedding (bart too: the slow test); wav2vec2's LayerDrop and
    SpecAugment draw outside the graph: the cell trains and verifies with them off and says so."""
    assert matrix.rows["gpt2"]["train"].status is Status.VERIFIED, matrix.rows["gpt2"]["train"].detail
    w2v = matrix.rows["wav2vec2"]["train"]
    assert w2v.status is Status.VERIFIED, w2v.detail
    assert "without config.layerdrop=0.1" in w2v.detail and "config.mask_time_prob=0.05" in w2v.detail
