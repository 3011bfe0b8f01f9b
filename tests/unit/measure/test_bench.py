"""mlcomp.hardware.timing and mlcomp.measure.bench: the timing protocol with fakes, the bench with a fake compiler, the CLI.

No test asserts a wall-clock value: timing logic runs on a fake clock, and real
runs only check structure (rows, statuses, files).
"""
from __future__ import annotations

import io
import json

import pytest
import torch
from click.testing import CliRunner

from mlcomp.base.errors import MlcompError
from mlcomp.base.units import fmt_bytes
from mlcomp.hardware.peak_memory import PeakMemory
from mlcomp.hardware.threads import threads
from mlcomp.hardware.timing import (
    BenchConfigError,
    TimingPolicy,
    fmt_seconds,
    measure,
    measure_interleaved,
    median,
    percentile,
)
from mlcomp.measure.bench import BenchConfig, plot_bench, rebatch, run_bench
from mlcomp.measure.bench_results import to_csv


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread: on a small shared machine OpenMP spin-waits dominate tiny ops otherwise."""
    with threads(1):
        yield


class FakeClock:
    """Time moves only when told to; every read is logged."""

    def __init__(self, log: list[str] | None = None, tick: float = 0.0) -> None:
        self.now, self.log, self.tick = 0.0, log if log is not None else [], tick

    def __call__(self) -> float:
        self.log.append("clock")
        self.now += self.tick
        return self.now

    def advance(self, dt: float) -> None:
        self.now += dt


def test_sync_runs_before_the_clock_stops() -> None:
    log: list[str] = []
    clock = FakeClock(log)

    def fn() -> None:
        log.append("fn")
        clock.advance(0.25)

    t = measure(fn, TimingPolicy(warmup=2, budget_s=1.0, min_repeats=1), clock=clock, sync=lambda: log.append("sync"))
    # warm-up: each call is followed by its sync, then a clock read to check the warm-up budget
    assert log[:7] == ["clock", "fn", "sync", "clock", "fn", "sync", "clock"]
    timed = log[8:]                                    # after the 'begin' read
    for i in range(t.repeats):
        assert timed[4 * i: 4 * i + 4] == ["clock", "fn", "sync", "clock"]


def test_synchronised_work_is_counted() -> None:
    """Work that only completes in sync() (a queued device) lands inside the sample."""
    clock = FakeClock()
    t = measure(lambda: None, TimingPolicy(warmup=0, budget_s=1.0, min_repeats=1, max_repeats=3), clock=clock,
                sync=lambda: clock.advance(0.5))
    assert t.samples == (0.5, 0.5)


def test_repeats_are_sized_to_the_budget() -> None:
    clock = FakeClock()
    t = measure(lambda: clock.advance(0.25), TimingPolicy(warmup=1, budget_s=1.0, min_repeats=1), clock=clock)
    assert t.repeats == 4
    assert all(s == 0.25 for s in t.samples)


def test_min_and_max_repeats_bound_the_budget() -> None:
    clock = FakeClock()
    slow = measure(lambda: clock.advance(10.0), TimingPolicy(warmup=0, budget_s=0.1, min_repeats=5), clock=clock)
    assert slow.repeats == 5
    fast = measure(lambda: clock.advance(1e-6), TimingPolicy(warmup=0, budget_s=100.0, min_repeats=1,
                                                             max_repeats=7), clock=clock)
    assert fast.repeats == 7


def test_warmup_calls_are_not_samples() -> None:
    calls = []
    clock = FakeClock()
    t = measure(lambda: (calls.append(1), clock.advance(1.0)), TimingPolicy(warmup=3, budget_s=5.0, min_repeats=1),
                clock=clock)
    assert t.warmup_calls == 3 and t.warmup_s == 3.0
    assert len(calls) == 3 + t.repeats


def test_warmup_stops_after_one_budget() -> None:
    clock = FakeClock()
    t = measure(lambda: clock.advance(4.0), TimingPolicy(warmup=10, budget_s=5.0, min_repeats=2), clock=clock)
    assert t.warmup_calls == 2 and t.repeats == 2


def test_median_and_p90() -> None:
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    assert percentile([float(i) for i in range(1, 11)], 90) == pytest.approx(9.1)
    assert percentile([5.0], 90) == 5.0
    import numpy as np

    data = [0.3, 0.1, 0.7, 0.2, 0.9, 0.4, 0.15]
    assert percentile(data, 90) == pytest.approx(float(np.percentile(data, 90)))
    clock = FakeClock()
    durations = iter([1.0, 5.0, 2.0, 4.0, 3.0])
    t = measure(lambda: clock.advance(next(durations)), TimingPolicy(warmup=0, budget_s=1e9, min_repeats=5,
                                                                      max_repeats=5), clock=clock)
    assert t.median == 3.0 and t.p90 == pytest.approx(4.6) and t.min == 1.0


def test_interleaved_variants_alternate_and_share_the_budget() -> None:
    log: list[str] = []
    clock = FakeClock()

    def variant(name: str, dt: float):
        return lambda: (log.append(name), clock.advance(dt))

    t = measure_interleaved({"a": variant("a", 0.25), "b": variant("b", 0.5)},
                            TimingPolicy(warmup=1, budget_s=1.0, min_repeats=1), clock=clock,
                            sync={"a": lambda: log.append("sync-a"), "b": lambda: log.append("sync-b")})
    assert log[:4] == ["a", "sync-a", "b", "sync-b"]                # warm-up, each with its own barrier
    assert log[4:10] == ["a", "sync-a", "b", "sync-b", "a", "sync-a"]
    assert t["a"].repeats == t["b"].repeats == 3                   # 3 rounds x 0.75 s >= 2 x 1 s budget
    assert set(t["a"].samples) == {0.25} and set(t["b"].samples) == {0.5}


def test_lead_in_calls_run_before_each_sample_untimed() -> None:
    """A runtime's first call after another runtime's pays for that one's spinning threads: with
    ``lead_in`` it is run untimed, and only the call after it is a sample."""
    log: list[str] = []
    clock = FakeClock()
    first = {"a": True, "b": True}

    def variant(name: str):
        def call():
            log.append(name)
            clock.advance(9.0 if first[name] else 1.0)     # the call right after a switch is slow
            first[name], first["b" if name == "a" else "a"] = False, True
        return call

    t = measure_interleaved({"a": variant("a"), "b": variant("b")},
                            TimingPolicy(warmup=0, budget_s=1.0, min_repeats=3, max_repeats=3), clock=clock,
                            lead_in=1)
    assert log == ["a", "a", "b", "b"] * 3
    assert set(t["a"].samples) == set(t["b"].samples) == {1.0}
    plain = measure_interleaved({"a": variant("a"), "b": variant("b")},
                                TimingPolicy(warmup=0, budget_s=1.0, min_repeats=3, max_repeats=3), clock=clock)
    assert set(plain["a"].samples) == set(plain["b"].samples) == {9.0}   # what lead_in keeps out


@pytest.mark.parametrize("kwargs", [{"budget_s": 0}, {"warmup": -1}, {"min_repeats": 0},
                                    {"min_repeats": 5, "max_repeats": 2}])
def test_policy_rejects_bad_values(kwargs: dict) -> None:
    with pytest.raises(BenchConfigError) as exc:
        TimingPolicy(**kwargs)
    assert isinstance(exc.value, MlcompError)


def test_peak_memory_sees_an_allocation() -> None:
    with PeakMemory() as mem:
        x = torch.ones(64 << 20, dtype=torch.uint8)   # 64 MiB, touched
        del x
    assert mem.reading is not None
    assert mem.reading.growth >= 48 << 20
    assert mem.reading.method


def test_formatting() -> None:
    assert fmt_seconds(0.00123) == "1.23 ms"
    assert fmt_seconds(None) == "—"
    assert fmt_bytes(3 << 20, sign=True) == "+3.0 MiB"


# ---------------------------------------------------------------------------
# the bench, with a fake compiler and fake target availability

AVAIL = {"fake": None, "slow": None, "broken": None, "absent": "backend not installed"}
COST = {"eager": 0.002, "fake": 0.001, "slow": 0.004}     # fake seconds per call


class Ticking(torch.nn.Module):
    """The zoo MLP, each call moving a fake clock by eager's cost."""

    def __init__(self, clock: FakeClock) -> None:
        super().__init__()
        from mlcomp.models import get

        self.inner, self.clock = get("mlp").build().eval(), clock
        self.example_inputs = get("mlp").example_inputs(1)

    def forward(self, x):
        self.clock.advance(COST["eager"])
        return self.inner(x)


def _compiler(clock: FakeClock | None = None):
    def compile_fn(model, inputs, target, pipeline, options):
        if target == "broken":
            raise MlcompError("the broken target cannot lower aten.addmm", hint="use another target")
        inner = getattr(model, "inner", model)

        def run(*xs):
            if clock is not None:
                clock.advance(COST[target])
            return inner(*xs) + (1e-3 if target == "slow" else 0.0)

        return run

    return compile_fn


def test_bench_rows_statuses_and_speedup() -> None:
    clock = FakeClock()
    syncs: list[str] = []
    cfg = BenchConfig(targets=("fake", "slow", "broken", "absent"), batches=(1, 4),
                      policy=TimingPolicy(warmup=1, budget_s=0.5, min_repeats=2, max_repeats=50), memory=False)
    model = Ticking(clock)
    res = run_bench(model, cfg, input_shapes=("1x512",), clock=clock,
                    sync_for=lambda d: (lambda: syncs.append(d)), compiler=_compiler(clock),
                    availability=lambda: AVAIL, watch=None)
    by = {(r.target, r.batch): r for r in res.rows}
    assert [r.target for r in res.rows[:5]] == ["eager", "fake", "slow", "broken", "absent"]
    assert by[("eager", 1)].speedup == 1.0 and by[("eager", 1)].speedup_text() == "reference"
    assert by[("slow", 1)].speedup == pytest.approx(0.5)      # 4 ms per call vs 2 ms on the fake clock
    fake = by[("fake", 1)]
    assert fake.speedup == pytest.approx(2.0) and fake.interval.lo == pytest.approx(2.0)
    assert fake.rounds == by[("eager", 1)].rounds >= 8 and not fake.unreliable
    assert by[("slow", 4)].max_abs_err == pytest.approx(1e-3, rel=1e-3)
    assert by[("slow", 4)].verified is False and "differs from eager" in by[("slow", 4)].reason
    assert fake.max_abs_err == 0.0 and fake.verified is True
    assert fake.compile_s is not None and fake.first_call_s is not None
    assert by[("broken", 1)].status == "failed" and "cannot lower" in by[("broken", 1)].reason
    assert by[("absent", 4)].status == "skipped" and by[("absent", 4)].reason == "backend not installed"
    assert syncs and set(syncs) == {"cpu"}
    text = res.format()
    assert "skipped: backend not installed" in text and "failed: the broken target" in text
    assert "2.00x [2.00-2.00]" in text and "0.50x [0.50-0.50]" in text and "UNRELIABLE" not in text
    assert "batch 1: 3 variants timed in this process" in text
    blob = json.loads(json.dumps(res.to_json()))
    assert blob["rows"][0]["timing"]["repeats"] >= 8
    assert blob["rows"][1]["speedup_interval"]["lo"] == pytest.approx(2.0)
    csv_text = to_csv([res])
    assert csv_text.splitlines()[0].startswith("model,target,device,batch,status,median_s")
    assert len(csv_text.splitlines()) == 1 + len(res.rows)


def test_bench_measures_memory_and_plots(tmp_path) -> None:
    cfg = BenchConfig(targets=("fake",), batches=(1, 8), policy=TimingPolicy(warmup=1, budget_s=0.005, min_repeats=1))
    res = run_bench("mlp", cfg, compiler=_compiler(), availability=lambda: AVAIL, watch=None)
    assert all(r.memory is not None for r in res.rows)
    out = tmp_path / "bench.png"
    plot_bench([res, res], str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_target_is_a_user_error() -> None:
    with pytest.raises(BenchConfigError) as exc:
        run_bench("mlp", BenchConfig(targets=("fakee",)), compiler=_compiler(), availability=lambda: AVAIL)
    assert "did you mean 'fake'" in exc.value.message


def test_unavailable_target_is_skipped_with_its_reason() -> None:
    res = run_bench("mlp", BenchConfig(targets=("cpu",), policy=TimingPolicy(warmup=0, budget_s=0.001, min_repeats=1),
                                       memory=False),
                    availability=lambda: {"cpu": "mlcomp.targets cannot be imported"})
    assert [r.status for r in res.rows] == ["ok", "skipped"]


def test_rebatch() -> None:
    x = torch.randn(1, 3, 4)
    (y,) = rebatch((x,), 5)
    assert y.shape == (5, 3, 4) and y.dtype == x.dtype
    assert rebatch((x,), 1)[0] is x
    assert rebatch((torch.tensor(3.0),), 5)[0].dim() == 0


def test_bench_config_validation() -> None:
    with pytest.raises(BenchConfigError):
        BenchConfig(batches=(0,))


# ---------------------------------------------------------------------------
# CLI

def test_cli_bench_json_and_csv(tmp_path) -> None:
    from mlcomp.cli.main import main

    runner = CliRunner()
    out = runner.invoke(main, ["bench", "mlp", "--targets", "eager", "--batch", "1,2", "--budget", "0.005",
                               "--warmup", "1", "--min-repeats", "1", "--no-memory", "--json"])
    assert out.exit_code == 0, out.output
    data = json.loads(out.stdout)
    assert [r["batch"] for r in data[0]["rows"]] == [1, 2]
    csv_file = tmp_path / "r.csv"
    out = runner.invoke(main, ["bench", "mlp", "--targets", "eager", "--budget", "0.005", "--min-repeats", "1",
                               "--csv", str(csv_file), "--plot", str(tmp_path / "p.png")])
    assert out.exit_code == 0, out.output
    assert "eager" in out.stdout and csv_file.exists() and (tmp_path / "p.png").exists()


def test_cli_bench_errors_are_one_paragraph() -> None:
    from mlcomp.cli.main import main

    out = CliRunner().invoke(main, ["bench", "mlp", "--budget", "-1"])
    assert out.exit_code == 2 and "error: time budget" in out.output and "Traceback" not in out.output
    out = CliRunner().invoke(main, ["bench", "--targets", "eager"])
    assert out.exit_code == 2 and "no model given" in out.output
    out = CliRunner().invoke(main, ["bench", "mlp", "--batch", "1,x"])
    assert out.exit_code == 2 and "comma-separated" in out.output


def test_progress_line_formats() -> None:
    from mlcomp.cli.bench import ProgressLine

    buf = io.StringIO()
    p = ProgressLine(buf, tty=False)
    p(0, 2, "mlp eager batch 1")
    p(2, 2, "mlp done")
    lines = buf.getvalue().splitlines()
    assert len(lines) == 2 and lines[0].startswith("[0/2") and lines[0].endswith("mlp eager batch 1")
    tty = io.StringIO()
    q = ProgressLine(tty, tty=True)
    q(0, 1, "long message here")
    q(1, 1, "done")
    assert tty.getvalue().startswith("\r[0/1") and tty.getvalue().endswith("\n") and "\r[1/1" in tty.getvalue()
