"""mlcomp.study: every study runs in quick mode and produces its table and plot; roofline placement.

Quick mode shrinks every size, so the figures are meaningless as numbers; the
tests check structure (rows, chapter column, notes, files), never timings.
"""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from mlcomp.study import STUDIES, StudyConfig, UnknownStudyError, plot_study, run_study
from mlcomp.study.common import Figure, StudyResult, Table


pytestmark = pytest.mark.usefixtures("one_thread")


PNG = b"\x89PNG\r\n\x1a\n"
QUICK = StudyConfig(quick=True, device="cpu", targets=())


def _check_json(result: StudyResult) -> None:
    """The JSON is plain JSON (no fallback conversion), complete, and reads back to the same result."""
    text = json.dumps(result.to_json(), allow_nan=True)        # raises on anything json cannot write
    d = json.loads(text)
    assert set(d) == {"study", "title", "setup", "figures", "tables", "notes", "data"}
    assert d["study"] == result.name and d["title"] == result.title and isinstance(d["setup"], str)
    assert len(d["figures"]) == len(result.figures)
    for f, fig in zip(d["figures"], result.figures):
        assert set(f) == {"label", "measured", "unit", "chapter", "note"}
        assert f["label"] == fig.label and isinstance(f["unit"], str)
        m = f["measured"]
        assert m is None or (isinstance(m, (int, float)) and not isinstance(m, bool) and m == fig.measured)
    for t in d["tables"]:
        assert isinstance(t["title"], str) and all(isinstance(c, str) for c in t["columns"])
        assert all(len(r) == len(t["columns"]) and all(isinstance(c, str) for c in r) for r in t["rows"])
    assert all(isinstance(n, str) for n in d["notes"]) and isinstance(d["data"], dict)
    back = StudyResult.from_json(d)
    assert back.format() == result.format()
    assert json.loads(json.dumps(back.to_json())) == d


def _check(result: StudyResult, tmp_path, *, chapter: bool = True) -> str:
    text = result.format()
    assert result.figures and text.startswith("== ")
    assert "measured here" in text and "the chapter" in text
    if chapter:
        assert any("§12" in f.chapter for f in result.figures)
    _check_json(result)
    out = tmp_path / f"{result.name}.png"
    plot_study(result, str(out))
    assert out.read_bytes()[:8] == PNG
    return text


def test_hybridize_quick(tmp_path) -> None:
    cfg = StudyConfig(quick=True, device="cpu", targets=("no-such-target",))
    res = run_study("hybridize", cfg)
    text = _check(res, tmp_path)
    labels = [f.label for f in res.figures]
    assert "eager, 5 calls" in labels and "torchscript, 20 calls" in labels
    skipped = [f for f in res.figures if f.label.startswith("no-such-target")]
    assert skipped and all(f.measured is None and f.note for f in skipped)   # with the reason
    assert "skipped" in text


def test_asynchrony_quick(tmp_path) -> None:
    res = run_study("asynchrony", QUICK)
    text = _check(res, tmp_path)
    assert "0.5186 s" in text                                         # the chapter's barrier figure
    backend = {f.label: f.measured for f in res.figures if f.label.startswith("CPU thread backend")}
    assert len(backend) == 2 and all(v is not None and v > 0 for v in backend.values())
    assert any("synchronous" in n or "No GPU" in n for n in res.notes)


def test_memory_quick(tmp_path) -> None:
    res = run_study("memory", QUICK)
    _check(res, tmp_path)
    mem = [f for f in res.figures if f.unit == "B"]
    assert len(mem) == 4 and all(f.measured is not None and f.measured >= 0 for f in mem)
    variants = res.data["variants"]
    assert set(variants) == {"direct-item", "direct-lazy", "backend-barrier", "backend-lazy"}
    losses = [v["mean_loss"] for v in variants.values()]            # same seed, same batches, same math
    assert max(losses) - min(losses) < 1e-3 * max(1.0, abs(losses[0]))
    assert all(len(v["marks_s"]) == 3 for v in variants.values())


def test_parallelism_quick(tmp_path) -> None:
    threads = torch.get_num_threads()
    res = run_study("parallelism", QUICK)
    _check(res, tmp_path)
    assert torch.get_num_threads() == threads                      # restored
    assert any("two threads" in f.label for f in res.figures)
    assert any(f.label == "overlap speedup over serial" and f.unit == "x" for f in res.figures)


def test_roofline_quick(tmp_path) -> None:
    res = run_study("roofline", StudyConfig(quick=True, device="cpu", model="mlp"))
    text = _check(res, tmp_path)
    ops = res.data["ops"]
    assert {o["op"] for o in ops} >= {"addmm", "relu"}
    assert all(o["bound"] in ("memory", "compute") and len(o["spec_bounds"]) == 3 for o in ops)
    assert "V100/A100/H100" in text
    hw = res.data["hardware"]
    assert hw["peak_flops"]["fp32"] > 0 and hw["bandwidth"] > 0


def test_place_ops_on_a_given_spec() -> None:
    from mlcomp.frontend.loading import load_model
    from mlcomp.hardware.spec import DEFAULT_CPU
    from mlcomp.hardware.timing import TimingPolicy
    from mlcomp.study.roofline import place_ops

    src = load_model("lenet")
    graph = src.capture()
    pts = place_ops(graph, src.inputs(), DEFAULT_CPU, TimingPolicy(warmup=0, budget_s=0.001, min_repeats=1))
    convs = [p for p in pts if p.op == "convolution"]
    assert len(convs) == 2 and all(p.flops > 0 and p.seconds > 0 for p in convs)
    assert all(p.roofline_s == max(p.flops / DEFAULT_CPU.peak(torch.float32), p.bytes / DEFAULT_CPU.bandwidth)
               for p in pts)
    assert not any(p.op in ("permute", "view") for p in pts)      # views move nothing: not placed


def test_unknown_study() -> None:
    with pytest.raises(UnknownStudyError) as exc:
        run_study("hybridise", QUICK)
    assert "did you mean 'hybridize'" in exc.value.message
    assert set(STUDIES) == {"hybridize", "asynchrony", "memory", "parallelism", "roofline"}


def test_table_and_figure_formatting() -> None:
    t = Table("t", ("a", "bb"), (("x", "1"), ("yyy", "22")), frozenset({1}))
    assert t.format().splitlines() == ["t", "a    bb", "---  --", "x     1", "yyy  22"]
    assert "<td class=\"num\">22</td>" in t.to_html()
    assert "| yyy | 22 |" in t.to_markdown()
    assert Figure("f", None).value_text() == "skipped"
    assert Figure("f", 2.5, "x").value_text() == "2.50x"


def test_cli_study(tmp_path) -> None:
    from mlcomp.cli.main import main

    runner = CliRunner()
    listing = runner.invoke(main, ["study"])
    assert listing.exit_code == 0 and "roofline" in listing.output
    out = runner.invoke(main, ["study", "asynchrony", "--quick", "--device", "cpu", "--plot",
                               str(tmp_path / "a.png")])
    assert out.exit_code == 0, out.output
    assert "the chapter" in out.output and (tmp_path / "a.png").exists()
    bad = runner.invoke(main, ["study", "nope"])
    assert bad.exit_code == 2 and bad.output.startswith("error: there is no study named 'nope'")


def test_wrong_and_right_on_a_fake_asynchronous_device() -> None:
    """Queued work is missed by the wrong number, counted by the right one, never leaked across samples."""
    from mlcomp.hardware.timing import TimingPolicy
    from mlcomp.study.asynchrony import wrong_and_right

    state = {"now": 0.0, "queued": 0.0}

    def work() -> None:              # returns at once, leaves 1 s of work queued
        state["now"] += 0.001
        state["queued"] += 1.0

    def drain() -> None:             # the barrier: wait until the queue is empty
        state["now"] += state["queued"]
        state["queued"] = 0.0

    wrong, right = wrong_and_right(work, drain, lambda: state["now"],
                                   TimingPolicy(warmup=1, budget_s=2.0, min_repeats=3))
    assert wrong == pytest.approx(0.001) and right == pytest.approx(1.001)


def test_result_round_trips_through_json() -> None:
    res = StudyResult("x", "T", "setup", (Figure("a", 1.0, "s", "0.5 s (MXNet ed. §12.1)", "n"),),
                      (Table("t", ("c", "d"), (("1", "2"),), frozenset({1})),), ("note",), {"k": [1, 2]})
    again = StudyResult.from_json(json.loads(json.dumps(res.to_json())))
    assert again == res and again.format() == res.format()
