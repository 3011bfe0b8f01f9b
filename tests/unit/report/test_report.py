"""mlcomp.html_report: the page, its plots and data files, written atomically; the CLI command."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from mlcomp.hardware.timing import TimingPolicy
from mlcomp.measure.bench import BenchConfig
from mlcomp.html_report import ReportConfig, build_report

PNG = b"\x89PNG\r\n\x1a\n"
FAST = TimingPolicy(warmup=1, budget_s=0.005, min_repeats=1, max_repeats=20)


pytestmark = pytest.mark.usefixtures("one_thread")


def _fake_options() -> dict:
    def compiler(model, inputs, target, pipeline, options):
        traced = torch.jit.trace(model, inputs)
        return traced

    return {"compiler": compiler, "availability": lambda: {"traced": None, "gone": "not installed here"}}


def test_report_page_with_plots(tmp_path) -> None:
    out = tmp_path / "rep"
    cfg = ReportConfig(BenchConfig(targets=("traced", "gone"), batches=(1, 4), policy=FAST),
                       bench_options=_fake_options())
    rep = build_report("mlp", out, cfg)
    page = (out / "index.html").read_text()
    assert "<img src='bench.png'" in page and "op histogram" in page and "parallelism profile" in page
    assert "skipped: not installed here" in page
    assert "No pipeline given" in page
    assert "which ops run in torch" not in page          # the TVM policy section: only when tvm is benchmarked
    assert (out / "bench.png").read_bytes()[:8] == PNG
    assert json.loads((out / "inspect.json").read_text())["name"]
    assert {r["target"] for r in json.loads((out / "bench.json").read_text())["rows"]} == {"eager", "traced", "gone"}
    assert (out / "bench.csv").read_text().startswith("model,target")
    assert set(rep.files) <= {p.name for p in out.iterdir()}
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]   # no temporaries left


def test_report_with_roofline(tmp_path) -> None:
    out = tmp_path / "rep"
    cfg = ReportConfig(BenchConfig(targets=("traced",), batches=(1,), policy=FAST, memory=False),
                       roofline=True, quick=True, bench_options=_fake_options())
    build_report("mlp", out, cfg)
    page = (out / "index.html").read_text()
    assert "<img src='roofline.png'" in page and "V100/A100/H100" in page
    assert (out / "roofline.png").read_bytes()[:8] == PNG


def test_failed_report_leaves_nothing(tmp_path, monkeypatch) -> None:
    import mlcomp.html_report as report

    out = tmp_path / "rep"
    out.mkdir()
    (out / "index.html").write_text("old report")
    (out / ".mlcomp").write_text('{"written_by": "mlcomp", "kind": "report"}')   # an earlier mlcomp output

    def boom(*a, **k):
        raise RuntimeError("plotting failed")

    monkeypatch.setattr(report, "plot_bench", boom)
    cfg = ReportConfig(BenchConfig(targets=("traced",), policy=FAST, memory=False), bench_options=_fake_options())
    with pytest.raises(RuntimeError):
        build_report("mlp", out, cfg)
    assert (out / "index.html").read_text() == "old report"             # the old output is untouched
    assert [p.name for p in tmp_path.iterdir()] == ["rep"]


def test_cli_report(tmp_path) -> None:
    from mlcomp.cli.main import main

    out = tmp_path / "r"
    res = CliRunner().invoke(main, ["report", "mlp", "-o", str(out), "--targets", "eager", "--bench-batch", "1,2",
                                    "--budget", "0.005", "--min-repeats", "1", "--warmup", "1"])
    assert res.exit_code == 0, res.output
    assert "wrote" in res.output and (out / "index.html").exists() and (out / "bench.png").exists()


def test_cli_report_with_a_training_section(tmp_path) -> None:
    from mlcomp.cli.main import main

    out = tmp_path / "r"
    res = CliRunner().invoke(main, ["report", "mlp", "-o", str(out), "--targets", "eager", "--batch", "2", "--train",
                                    "--budget", "0.005", "--min-repeats", "1", "--warmup", "1"])
    assert res.exit_code == 0, res.output
    data = json.loads((out / "training.json").read_text())
    assert "training step (joint graph" in (out / "index.html").read_text()
    flops = data["flops"]
    assert flops["backward"] > flops["forward"] > 0          # two matmuls per linear layer backward, one forward
    assert data["saved_bytes"] > 0 and data["predicted_peak"] > 0
    assert sum(data["saved_bytes_by_module"].values()) <= data["saved_bytes"]
