"""The bench's figures a user can trust: unreliable cells named on the table, the page and the plot;
the whole-process cross-check's arithmetic; worker processes for real targets (slow)."""
from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from mlcomp.hardware.noise import CpuTimes, LoadWatch
from mlcomp.hardware.timing import TimingPolicy
from mlcomp.measure.bench import BenchConfig, plot_bench, run_bench

FAST = TimingPolicy(warmup=1, budget_s=0.005, min_repeats=1, max_repeats=12)


def busy_watch(others_ticks: int):
    """A watch factory whose counters say others used ``others_ticks`` of every 100 ticks on 2 CPUs."""
    def factory(pids):
        state = {"t": CpuTimes(0, 0, 0, 0, 2)}

        def read(_):
            t = state["t"]
            state["t"] = CpuTimes(t.total + 100, t.busy + 50 + others_ticks, t.steal, t.ours + 50, 2)
            return t
        return LoadWatch(pids, read=read, cores=2, loadavg=lambda: 5.0)
    return factory


def _traced(model, inputs, target, pipeline, options):
    return torch.jit.trace(model, inputs)


def _bench(watch, settle_s: float = 0.0):
    cfg = BenchConfig(targets=("traced",), batches=(1,), policy=FAST, memory=False, threads=2, settle_s=settle_s)
    return run_bench("mlp", cfg, compiler=_traced, availability=lambda: {"traced": None}, watch=watch)


def test_a_busy_machine_marks_every_cell_on_the_table_the_json_and_the_plot(tmp_path) -> None:
    res = _bench(busy_watch(90))
    text = res.format()
    assert "UNRELIABLE" in text and "busy: other processes used 1.8 of 2 cores while this run needed 2" in text
    assert "1 speedup(s) UNRELIABLE" in text
    row = json.loads(json.dumps(res.to_json()))["rows"][1]
    assert row["unreliable"][0].startswith("busy:") and row["speedup_interval"]["lo"] <= row["speedup"]
    plot_bench([res], str(tmp_path / "b.png"))
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


def test_a_quiet_machine_marks_nothing_busy_and_settles_at_once() -> None:
    res = _bench(busy_watch(0), settle_s=30)
    assert not any(r.startswith("busy") for row in res.rows for r in row.unreliable)
    assert "; quiet after" in res.notes[0]


def test_the_report_page_names_unreliable_figures(tmp_path) -> None:
    from mlcomp.html_report import ReportConfig, build_report

    cfg = ReportConfig(BenchConfig(targets=("traced",), batches=(1,), policy=FAST, memory=False, threads=2),
                       bench_options={"compiler": _traced, "availability": lambda: {"traced": None},
                                      "watch": busy_watch(90)})
    build_report("mlp", tmp_path / "rep", cfg)
    page = (tmp_path / "rep" / "index.html").read_text()
    assert "1 speedup(s) UNRELIABLE</strong>: traced batch 1: busy: other processes used 1.8" in page
    assert "in rotated rounds" in page and "95% interval" in page


def test_crosscheck_subtracts_start_up_and_divides_by_calls(monkeypatch) -> None:
    import mlcomp.measure.crosscheck as cc

    per_call = {"eager": 2e-3, "ort": 5e-4}
    runs = []

    def fake_run(config, calls):                          # 1.5 s to start, then calls x cost
        name = "eager" if config["model"] else "ort"
        runs.append((name, calls))
        return 1.5 + calls * per_call[name]
    monkeypatch.setattr(cc, "_run", fake_run)
    monkeypatch.setattr("mlcomp.measure.samplers.saved", lambda art, folder: folder)
    ratios = cc.crosscheck({"ort": object()}, {"spec": "mlp"}, (torch.zeros(1, 4),),
                           per_call_s={"eager": 2e-3, "ort": 5e-4}, threads=1)
    assert ratios == {"ort": pytest.approx(4.0)}
    sized = {int(cc.CALLS_S / 2e-3), int(cc.CALLS_S / 5e-4)}
    assert {c for _, c in runs} == {0} | sized and len(runs) == 2 * 2 * cc.ROUNDS


def test_crosscheck_gives_no_figure_when_start_up_varies_more_than_the_calls_take(monkeypatch) -> None:
    import itertools

    import mlcomp.measure.crosscheck as cc

    starts = itertools.cycle([1.0, 9.0, 4.0])              # a busy machine: start-up from 1 to 9 s
    monkeypatch.setattr(cc, "_run", lambda config, calls: next(starts) + calls * 1e-4)
    monkeypatch.setattr("mlcomp.measure.samplers.saved", lambda art, folder: folder)
    ratios = cc.crosscheck({"ort": object()}, {"spec": "mlp"}, (torch.zeros(1, 4),),
                           per_call_s={"eager": 1e-4, "ort": 1e-4}, threads=1)
    assert ratios == {"ort": None}


def test_cli_comparison_options() -> None:
    from mlcomp.cli.main import main

    out = CliRunner().invoke(main, ["bench", "mlp", "--targets", "eager", "--budget", "0.005", "--min-repeats", "1",
                                    "--max-repeats", "8", "--no-memory", "--in-process", "--precision", "0",
                                    "--json"])
    assert out.exit_code == 0, out.output
    assert json.loads(out.stdout)[0]["timed"][0].startswith("batch 1: 1 variant timed in this process, 8 rounds")
    bad = CliRunner().invoke(main, ["bench", "mlp", "--precision", "2"])
    assert bad.exit_code == 2 and "--precision" in bad.output and "Traceback" not in bad.output


@pytest.mark.slow
def test_real_targets_are_timed_in_worker_processes() -> None:
    cfg = BenchConfig(targets=("cpu",), batches=(2,), memory=False, threads=1,
                      policy=TimingPolicy(warmup=1, budget_s=0.05, min_repeats=8, max_repeats=8))
    res = run_bench("mlp", cfg)
    assert "2 variants timed in 2 worker processes, 8 rounds" in res.notes[0]
    cpu = res.rows[1]
    assert cpu.status == "ok" and cpu.interval is not None and cpu.interval.lo <= cpu.speedup <= cpu.interval.hi


def test_an_asked_for_crosscheck_keeps_its_column_where_it_gave_no_figure() -> None:
    cfg = BenchConfig(targets=("traced",), batches=(1,), policy=FAST, memory=False, threads=2, crosscheck=True)
    res = run_bench("mlp", cfg, compiler=_traced, availability=lambda: {"traced": None}, watch=busy_watch(0))
    table = res.table()
    assert "whole-process" in table.columns and all(row[table.columns.index("whole-process")] == "—"
                                                    for row in table.rows)
    assert "whole-process cross-check: needs a model spec and saved artifacts on cpu" in res.notes[0]
    plain = run_bench("mlp", BenchConfig(targets=("traced",), batches=(1,), policy=FAST, memory=False, threads=2),
                      compiler=_traced, availability=lambda: {"traced": None}, watch=busy_watch(0))
    assert "whole-process" not in plain.table().columns


def test_two_processes_per_variant_are_reported_with_their_gap() -> None:
    from mlcomp.measure.bench_results import BenchRow
    from mlcomp.measure.bench_timing import process_medians
    from mlcomp.measure.samplers import ProcessGroup

    order = []
    first, second = iter([1.0, 1.2, 0.8]), iter([2.0, 2.2, 50.0])   # the third round busy for process 1
    group = ProcessGroup([lambda: order.append(0) or next(first), lambda: order.append(1) or next(second)])
    assert [group() for _ in range(3)] == pytest.approx([1.5, 1.7, 25.4])
    assert order == [0, 1, 1, 0, 0, 1] and group.per_process == [[1.0, 1.2, 0.8], [2.0, 2.2, 50.0]]
    assert process_medians({"cpu": group}, kept=[0, 1]) == {"cpu": (1.1, 2.1)}
    res = _bench(busy_watch(0))
    row = BenchRow("mlp", "cpu", 1, process_medians=(1.0e-3, 1.5e-3))
    assert row.process_gap() == pytest.approx(0.5) and BenchRow("mlp", "cpu", 1).process_gap() is None
    from dataclasses import replace

    table = replace(res, rows=(*res.rows, replace(res.rows[1], target="cpu", process_medians=(1.0e-3, 1.5e-3)))
                    ).table()
    col = table.columns.index("per process (gap)")
    assert table.rows[-1][col] == "1 ms / 1.5 ms (50%)" and table.rows[0][col] == "—"
    assert "per process (gap)" not in res.table().columns
    with pytest.raises(Exception, match="--procs 5 is not between 1 and 4"):
        BenchConfig(procs=5)


@pytest.mark.slow
def test_bench_procs_2_times_each_runtime_in_two_worker_processes() -> None:
    cfg = BenchConfig(targets=("cpu",), batches=(2,), memory=False, threads=1, procs=2,
                      policy=TimingPolicy(warmup=1, budget_s=0.05, min_repeats=8, max_repeats=8))
    res = run_bench("mlp", cfg)
    assert "2 variants timed in 4 worker processes (2 per variant), 8 rounds" in res.notes[0]
    assert all(len(r.process_medians) == 2 and r.process_gap() is not None for r in res.rows)
    assert json.loads(json.dumps(res.to_json()))["rows"][1]["process_medians_s"] == list(res.rows[1].process_medians)
