"""The support matrix's parts without running a model: cells, outcome classes, columns per host, the document."""
from __future__ import annotations

import pytest

from mlcomp.base.errors import CaptureError, OptionError, OutputPathError, TargetUnavailableError, VerificationError
from mlcomp.measure.support_cells import Cell, CellResult, Status, classify, first_line
from mlcomp.measure.support_doc import matrix_json, merge_runs, render_markdown, summary
from mlcomp.measure.support_matrix import Matrix, default_cells, host_dtypes, preload_modules
from mlcomp.measure.support_run import MD_MARK, _earlier, _write_markdown, plan
from mlcomp.targets.capabilities import CapabilityError

HOST = {"cpu": "Fake CPU", "flags": {"avx2": True, "avx512f": False}, "cores": 2, "python": "3.11",
        "versions": {"torch": "2.13"}, "date": "2026-01-01 00:00 UTC", "probe": {"bf16": "bf16 4x the fp32 time"}}


def test_cells_parse_and_name_their_column():
    assert Cell.parse("bf16:tvm") == Cell("bf16", "tvm") and Cell.parse("bf16:tvm").key == "bf16:tvm"
    assert Cell.parse("train").key == "train" and Cell.parse("capture").target == "cpu"
    with pytest.raises(ValueError, match="unknown cell kind 'O9'"):
        Cell.parse("O9:cpu")


def test_refusals_are_mlcomps_up_front_errors_and_everything_else_fails():
    status, detail = classify(TargetUnavailableError("tvm is not installed"))
    assert status is Status.REFUSED and detail.startswith("TargetUnavailableError: tvm is not installed")
    assert classify(CapabilityError.__mro__[1]("aten.foo has no lowering"))[0] is Status.REFUSED
    assert classify(CaptureError("torch.export could not capture X\nmore"))[1] == \
        "CaptureError: torch.export could not capture X"
    assert classify(VerificationError("outputs differ"))[0] is Status.FAILED
    assert classify(AssertionError())[1] == "AssertionError: AssertionError()"
    assert len(first_line("x" * 1000)) == 300
    script = "The following operation failed in the TorchScript interpreter.\nTraceback:\n  f()\nRuntimeError: bad"
    assert first_line(script) == "The following operation failed in the TorchScript interpreter. … RuntimeError: bad"


@pytest.mark.parametrize("cuda, flags, dtypes", [
    (False, ("avx2",), ["bf16"]), (False, ("avx512f", "avx512_bf16"), ["bf16"]),
    (False, ("amx_bf16", "amx_fp16"), ["bf16", "fp16"]), (False, ("avx512_fp16",), ["bf16", "fp16"]),
    (True, (), ["bf16", "fp16"])])
def test_low_precision_columns_follow_the_host_profile(cuda, flags, dtypes):
    assert host_dtypes(cuda, flags) == dtypes
    keys = [c.key for c in default_cells(["cpu", "tvm"], dtypes)]
    assert keys[:3] == ["capture", "O2:cpu", "O2:tvm"] and keys[-1] == "train"
    assert len(keys) == 2 + 2 * (1 + len(dtypes))


def _matrix() -> Matrix:
    cells = [Cell.parse(c) for c in ("capture", "O2:cpu", "O2:tvm")]
    m = Matrix(cells, families={"mlp": "zoo", "gpt2": "decoder"}, left_out={"target cuda": "no GPU"}, seconds=90)
    m.rows["mlp"] = {"capture": CellResult(Status.VERIFIED, "8 nodes"), "O2:cpu": CellResult(Status.VERIFIED),
                     "O2:tvm": CellResult(Status.REFUSED, "CapabilityError: bf16 is not a dtype target tvm handles")}
    m.rows["gpt2"] = {"capture": CellResult(Status.FAILED, "CaptureError: DynamicCache in output")}
    return m


def test_document_counts_marks_and_lists_every_cell_not_verified():
    data = matrix_json(_matrix(), HOST)
    counts = summary(data)
    assert counts["capture"] == {"verified": 1, "refused": 0, "failed": 1}
    assert counts["target tvm"] == {"verified": 0, "refused": 1, "failed": 0}
    doc = render_markdown(data)
    assert "| mlp | zoo | ✅ | ✅ | 🚫 |" in doc and "| gpt2 | decoder | ❌ | · | · |" in doc
    assert "| capture | 1 | 0 | 1 | 50% |" in doc and "| target cpu | 1 | 0 | 0 | 100% |" in doc
    assert "- **gpt2** `capture` failed: CaptureError: DynamicCache in output" in doc
    assert "- target cuda: no GPU" in doc and "Fake CPU" in doc and "avx512f no" in doc and "1.5 min" in doc


def test_markdown_replaces_only_an_earlier_matrix(tmp_path):
    ours, theirs = tmp_path / "SUPPORT.md", tmp_path / "notes.md"
    _write_markdown(ours, "first")
    _write_markdown(ours, "second")
    assert ours.read_text() == f"{MD_MARK}\nsecond"
    theirs.write_text("my notes")
    with pytest.raises(OutputPathError, match="not a support matrix mlcomp wrote"):
        _write_markdown(theirs, "x")
    assert theirs.read_text() == "my notes"


def test_unknown_architecture_is_refused_before_anything_runs():
    with pytest.raises(Exception, match="no architecture named 'bertt'.*did you mean 'bert'"):
        plan("bertt", "capture")


def test_update_replaces_only_the_cells_rerun(tmp_path):
    earlier = {**matrix_json(_matrix(), HOST), "command": "first run"}
    rerun = Matrix([Cell("capture")], families={"gpt2": "decoder", "bert": "encoder"}, seconds=30)
    rerun.rows["gpt2"] = {"capture": CellResult(Status.VERIFIED, "90 nodes")}
    rerun.rows["bert"] = {"capture": CellResult(Status.VERIFIED, "70 nodes")}
    later = {**matrix_json(rerun, dict(HOST, date="2026-01-02 00:00 UTC")), "command": "second run"}
    merged = merge_runs(earlier, later)
    rows = {r["architecture"]: r["cells"] for r in merged["rows"]}
    assert list(rows) == ["mlp", "gpt2", "bert"] and merged["columns"] == earlier["columns"]
    assert rows["gpt2"]["capture"]["status"] == "verified" and rows["mlp"] == earlier["rows"][0]["cells"]
    assert earlier["rows"][1]["cells"]["capture"]["status"] == "failed"          # the earlier record is untouched
    doc = render_markdown(merged, merged["command"])
    assert "from one run of `first run`" in doc and "| gpt2 | decoder | ✅ | · | · |" in doc
    assert "Re-run on 2026-01-02 00:00 UTC: `capture` for mlp, gpt2, bert" not in doc
    assert "Re-run on 2026-01-02 00:00 UTC: `capture` for gpt2, bert, by `second run` (0.5 min)" in doc
    bad = tmp_path / "other.json"
    bad.write_text('{"rows": []}')
    with pytest.raises(OptionError, match="not a support matrix mlcomp wrote"):
        _earlier(bad)


def test_verified_cells_with_a_note_are_listed_with_it():
    m = _matrix()
    m.rows["mlp"]["O2:cpu"] = CellResult(Status.VERIFIED, "max |diff| 0.003; against the reference taking the "
                                                          "artifact's order at 1 near-tie selection row(s)")
    doc = render_markdown(matrix_json(m, HOST))
    notes = doc.split("## Cells verified with a note")[1].split("##")[0]
    assert "- **mlp** `O2:cpu`: against the reference taking the artifact's order at 1 near-tie" in notes
    assert "capture" not in notes                                  # "8 nodes": verified without a note
    assert "## Cells verified with a note\n\n- none" in render_markdown(matrix_json(_matrix(), HOST))


def test_an_auto_cell_names_the_target_auto_picked(monkeypatch):
    """``O2:auto`` says which candidate won; a named target's cell keeps the bare figure (a fake compile)."""
    from types import SimpleNamespace

    import mlcomp.api.compiler as compiler
    from mlcomp.measure.support_cells import Session, run_cell

    def fake_compile(source, graph, *, target, **options):
        art = SimpleNamespace(target="onnxruntime" if target == "auto" else target, verification={"max_abs": 1.5e-07})
        return SimpleNamespace(check=SimpleNamespace(raise_if_failed=lambda where: None), artifact=art)

    monkeypatch.setattr(compiler, "compile_model", fake_compile)
    session = Session(None, ())
    monkeypatch.setattr(session, "captured", lambda: (None, SimpleNamespace(name="g", copy=lambda: None), 0.0))
    auto, cpu = run_cell(session, Cell.parse("O2:auto")), run_cell(session, Cell.parse("O2:cpu"))
    assert auto.status is Status.VERIFIED and auto.detail == "max |diff| 1.5e-07 (auto picked onnxruntime)"
    assert cpu.status is Status.VERIFIED and cpu.detail == "max |diff| 1.5e-07"


def test_the_forkserver_preloads_the_targets_the_cells_run_on():
    """A named target's modules only where a cell runs on it; an ``auto`` cell's candidates are every target."""
    cells = lambda *keys: [Cell.parse(k) for k in keys]      # noqa: E731
    plain = preload_modules(cells("capture", "O2:cpu", "train"))
    assert "torch" in plain and not {"tvm", "onnxruntime", "openvino"} & set(plain)
    assert {"tvm", "mlcomp.targets.tvm.target"} <= set(preload_modules(cells("bf16:tvm"))) and \
        "openvino" not in preload_modules(cells("bf16:tvm"))
    auto = preload_modules(cells("O2:auto", "O2:tvm"))
    assert {"tvm", "onnxruntime", "openvino"} <= set(auto) and len(auto) == len(set(auto))
