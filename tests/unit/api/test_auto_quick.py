"""The auto target's timing processes are started once and shared; clear losers leave the ranking early.

The pool is driven with fake processes (they record what they were told and answer samples from
a table), so the number of processes started and the commands each got are asserted without
starting Python.  Eliminations are checked on fake samples and, end to end, in the manifest of
an auto compile of fake targets on a fake clock.
"""
from __future__ import annotations

import itertools
import random
from pathlib import Path
from typing import Any

import pytest

from mlcomp.api import compile_auto
from mlcomp.api.auto import rank as auto_rank
from mlcomp.api.auto.workers import WorkerPool
from mlcomp.hardware.decide import ELIMINATE_ABOVE
from mlcomp.hardware.timing import TimingPolicy
from tests.unit.api.test_auto_target import FakeClock, FakeTarget


class FakeProcess:
    """Stands for one HostWorker: records hosts, drops and samples; a sample is ``speed[name] * (1 + index)``."""

    def __init__(self, index: int, speed: dict[str, float], log: list[tuple[int, str, str]]) -> None:
        self.index, self.speed, self.log = index, speed, log
        self.pid = 1000 + index
        self.watched: list[int] = []
        self.hosted: dict[str, float] = {}
        self.pending: list[str] = []
        self.closed = False

    def __enter__(self) -> "FakeProcess":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.closed = True

    def host(self, name: str, folder: Path) -> None:
        assert (folder / "manifest.json").exists()
        self.pending.append(name)
        self.log.append((self.index, "host", name))

    def wait_hosted(self, timeout: float) -> dict[str, float]:
        self.hosted.update({n: self.speed[n] for n in self.pending})
        self.pending.clear()
        return dict(self.hosted)

    def warm(self, timeout: float) -> dict[str, float]:
        self.log.append((self.index, "warm", ""))
        return {}

    def sampler(self, name: str):
        def sample() -> float:
            self.log.append((self.index, "sample", name))
            return self.speed[name] * (1 + self.index)
        return sample

    def drop(self, name: str) -> None:
        self.hosted.pop(name, None)
        self.log.append((self.index, "drop", name))

    def kill(self) -> None:
        self.log.append((self.index, "kill", ""))

    def watch(self, pids: list[int]) -> None:
        self.watched = list(pids)

    def stats(self) -> dict[str, float]:
        return {"imports": 2.0 - self.index, "total": 3.0}


class Saveable:
    """An artifact as the pool sees it: a manifest and ``save``."""

    def __init__(self) -> None:
        self.manifest: dict[str, Any] = {"target": "fake"}

    def save(self, folder: Path) -> Path:
        folder.mkdir(parents=True)
        (folder / "manifest.json").write_text("{}")
        return folder


def fake_pool(speed: dict[str, float], procs: int = 2):
    log: list[tuple[int, str, str]] = []
    made: list[FakeProcess] = []

    def spawn(feed: Path, n: int, **_: Any) -> list[FakeProcess]:
        assert feed.exists()
        base = len(made)
        made.extend(FakeProcess(base + i, speed, log) for i in range(n))
        return made[-n:]
    pool = WorkerPool([], warmup=1, block_s=0.01, procs=procs, spawn=spawn)
    return pool, made, log


def test_the_timing_processes_are_started_once_and_every_candidate_is_loaded_into_each():
    speed = {"cpu": 2e-3, "onnxruntime": 1e-3, "tvm": 5e-3}
    pool, made, log = fake_pool(speed)
    with pool:
        pool.start()
        pool.start()                                        # idempotent
        for name in speed:
            pool.add(name, Saveable())
        samplers = pool.samplers(["cpu", "onnxruntime"])    # tvm is no longer timed: released
        # a round samples every candidate in one process, the next round in the next
        rounds = [[samplers[n]() for n in samplers] for _ in range(4)]
        pool.stop("cpu")
    assert pool.started == 2 and len(made) == 2 and all(p.closed for p in made)
    assert [e for e in log if e[1] == "host"] == [(i, "host", n) for n in speed for i in (0, 1)]
    # every load first, then the warm-ups: process 0's, then process 1's, before the first sample
    assert [e[:2] for e in log if e[1] in ("warm", "sample")][:3] == [(0, "warm"), (1, "warm"), (0, "sample")]
    assert max(k for k, e in enumerate(log) if e[1] == "host") < log.index((0, "warm", ""))
    assert rounds == [[2e-3, 1e-3], [4e-3, 2e-3], [2e-3, 1e-3], [4e-3, 2e-3]]
    assert {(i, n) for i, verb, n in log if verb == "drop"} == {(0, "tvm"), (1, "tvm"), (0, "cpu"), (1, "cpu")}
    assert pool.groups["cpu"].per_process == [[2e-3, 2e-3], [4e-3, 4e-3]]
    assert [p.watched for p in made] == [[1000, 1001]] * 2       # each watches every timing process for quiet
    assert pool.cpu_seconds() == [{"imports": 2.0, "total": 3.0}, {"imports": 1.0, "total": 3.0}]


def test_a_disabled_pool_starts_nothing_and_a_missing_candidate_is_a_worker_error():
    from mlcomp.runtime.timing_worker import WorkerError

    pool, made, _ = fake_pool({"cpu": 1e-3})
    pool.enabled = False
    with pool:
        pool.start()
        pool.add("cpu", Saveable())
    assert pool.started == 0 and made == []
    pool, made, _ = fake_pool({"cpu": 1e-3, "tvm": 1e-3})
    with pool:
        pool.add("cpu", Saveable())                           # add starts the pool when start() was not called
        with pytest.raises(WorkerError, match="no timing process has tvm"):
            pool.samplers(["cpu", "tvm"])
    assert pool.started == 2


def _ticks():
    ticks = itertools.count(step=0.001)
    return lambda: next(ticks)


def test_clear_losers_stop_being_sampled_and_near_ones_do_not():
    """``slow`` (2-2.6x, noisy) is decided above ELIMINATE_ABOVE after the sixth round; ``near`` (1.3x) never is."""
    noise = itertools.cycle([1.0, 1.3, 1.1, 0.95, 1.2, 1.05])
    taken = {"fast": 0, "near": 0, "slow": 0}

    def sampler(name: str, base: float):
        def sample() -> float:
            taken[name] += 1
            return base * (next(noise) if name == "slow" else 1.0)
        return sample
    samplers = {"fast": sampler("fast", 1e-3), "near": sampler("near", 1.3e-3), "slow": sampler("slow", 2e-3)}
    policy = TimingPolicy(warmup=0, budget_s=1.0, min_repeats=3, max_repeats=30)
    ranking = auto_rank.rank_samplers(samplers, policy, clock=_ticks(), early=None)      # the sign test's rule only
    assert ranking.picked == "fast" and list(ranking.eliminated) == ["slow"]
    gone = ranking.eliminated["slow"]
    assert gone.after_rounds == auto_rank.MIN_ROUNDS and gone.leader == "fast" and gone.ratio > ELIMINATE_ABOVE
    assert gone.p_value < auto_rank.ALPHA and gone.why.startswith("eliminated after 6 rounds: ")
    assert taken["slow"] == 6 and taken["near"] >= 6 and ranking.p_values["near"] < auto_rank.ALPHA


def test_a_loser_that_sometimes_wins_is_not_eliminated_early():
    """Above 1.5x in 5 of 6 rounds: the sign test against 1.5 cannot decide (p=0.22), so it is sampled on."""
    seq = itertools.cycle([2.0, 2.0, 2.0, 1.4, 2.0, 2.0])
    samplers = {"a": lambda: 1e-3, "b": lambda: 1e-3 * next(seq)}
    policy = TimingPolicy(warmup=0, budget_s=1e-6, min_repeats=6, max_repeats=6)
    ranking = auto_rank.rank_samplers(samplers, policy, clock=_ticks(), early=None)
    assert ranking.eliminated == {} and ranking.rounds == 6 and ranking.picked == "a"


def test_the_manifest_records_each_eliminated_candidate_with_why(captured):
    from mlcomp.frontend.loading import load_model

    module, inputs, graph = captured("mlp", 2)
    source = load_model(module, example_inputs=inputs)
    clock = FakeClock()
    fakes = [FakeTarget("slow", clock, 3e-3), FakeTarget("fast", clock, 1e-3), FakeTarget("near", clock, 1.1e-3)]
    policy = TimingPolicy(warmup=1, budget_s=0.01, min_repeats=3, max_repeats=12)
    result = compile_auto(source, graph, candidates=fakes, pipeline="", policy=policy, clock=clock, isolate=False)
    auto = result.artifact.manifest["auto"]
    rows = {c["target"]: c for c in auto["candidates"]}
    assert auto["picked"] == "fast" and list(auto["timing"]["eliminated"]) == ["slow"]
    slow = auto["timing"]["eliminated"]["slow"]
    assert (slow["after_rounds"], slow["leader"], slow["ratio"]) == (4, "fast", pytest.approx(3.0))
    assert slow["why"] == rows["slow"]["reason"] and rows["slow"]["verified"] and not rows["slow"]["picked"]
    assert rows["near"]["reason"] is None and rows["near"]["ratio_to_picked"] == pytest.approx(1.1)
    assert auto["timing"]["processes"] == 0                  # isolate=False: timed in this process
    table = result.auto.table().format()
    assert "yes; eliminated after 4 rounds: 3.00x the time of fast, above 1.2x in every round" in table


def test_equals_within_noise_leave_the_tie_break_and_the_decision_says_so(monkeypatch):
    """Two candidates equal to 0.5 %: the interval of their ratios lies within 1 +- NEAR_TIE well before
    the tie-break's bound; with NEAR_TIE 0 they are sampled until the bound."""
    def pair(seed: int):
        rng = random.Random(seed)
        return {"a": lambda: 1e-3 * (1 + rng.uniform(-0.005, 0.005)),
                "b": lambda: 1e-3 * (1 + rng.uniform(-0.005, 0.005))}
    policy = TimingPolicy(warmup=0, budget_s=0.05, min_repeats=6, max_repeats=400)
    quick = auto_rank.rank_samplers(pair(1), policy, clock=_ticks())
    other = [n for n in "ab" if n != quick.picked][0]
    lo, hi = quick.near_ties[other]
    assert 1 / (1 + auto_rank.NEAR_TIE) <= lo <= 1 <= hi <= 1 + auto_rank.NEAR_TIE
    assert "within 1+-0.02" in quick.decision().why
    monkeypatch.setattr(auto_rank, "NEAR_TIE", 0.0)
    slow = auto_rank.rank_samplers(pair(1), policy, clock=_ticks())
    assert quick.rounds + quick.tie_break_rounds < slow.rounds + slow.tie_break_rounds


def test_every_candidate_is_verified_against_one_eager_run(captured):
    """Three candidates, one of which fails verification: eager runs once, and each is checked against it."""
    from mlcomp.frontend.loading import load_model

    module, inputs, graph = captured("mlp", 2)
    source = load_model(module, example_inputs=inputs)
    runs = []
    eager = source.eager
    source.eager = lambda *xs: runs.append(1) or eager(*xs)
    clock = FakeClock()
    fakes = [FakeTarget("a", clock, 2e-3), FakeTarget("wrong", clock, 1e-3, offset=1.0), FakeTarget("b", clock, 1e-3)]
    policy = TimingPolicy(warmup=1, budget_s=0.01, min_repeats=3, max_repeats=12)
    result = compile_auto(source, graph, candidates=fakes, pipeline="", policy=policy, clock=clock, isolate=False)
    rows = {c["target"]: c for c in result.artifact.manifest["auto"]["candidates"]}
    assert len(runs) == 1 and result.artifact.target == "b"
    assert rows["a"]["verified"] and not rows["wrong"]["verified"]
    assert rows["wrong"]["reason"].startswith("verification failed")



def test_a_pool_that_hosted_nothing_is_killed_not_waited_for():
    """No candidate verified: the processes (maybe still importing torch) are killed once, not told to quit."""
    pool, made, log = fake_pool({"cpu": 1e-3})
    with pool:
        pool.start()
    assert [(i, verb) for i, verb, _ in log] == [(0, "kill"), (1, "kill")] and all(p.closed for p in made)
    assert pool.started == 0 and not pool.enabled


def test_the_ranking_stops_once_the_leader_is_decided_against_every_contender():
    """1.2x slower in every round: decided after MIN_ROUNDS, long before the budget; alternating 0.9x/1.1x
    (undecided) goes on until the budget is spent."""
    policy = TimingPolicy(warmup=0, budget_s=1.0, min_repeats=3, max_repeats=400)
    decided = auto_rank.rank_samplers({"a": lambda: 1e-3, "b": lambda: 1.2e-3}, policy, clock=_ticks())
    assert decided.picked == "a" and decided.rounds == auto_rank.MIN_ROUNDS and decided.tie_break_rounds == 0
    assert decided.decision().verdict.value == "decided"
    seq = itertools.cycle([0.9, 1.1])
    noisy = auto_rank.rank_samplers({"a": lambda: 1e-3, "b": lambda: 1e-3 * next(seq)}, policy, clock=_ticks())
    assert noisy.rounds > auto_rank.MIN_ROUNDS and noisy.decision().verdict.value == "undecided"


def test_timing_processes_started_before_the_capture_are_killed_when_no_ranking_needs_them(captured):
    """A pool started early (as mlcomp.compile does before capturing) and then not wanted (here: timed in
    this process) is killed, not waited for, and the compile times its candidates without it."""
    from mlcomp.frontend.loading import load_model

    module, inputs, graph = captured("mlp", 2)
    source = load_model(module, example_inputs=inputs)
    pool, made, log = fake_pool({"a": 1e-3, "b": 2e-3})
    pool.start()
    clock = FakeClock()
    fakes = [FakeTarget("a", clock, 1e-3), FakeTarget("b", clock, 2e-3)]
    policy = TimingPolicy(warmup=1, budget_s=0.01, min_repeats=3, max_repeats=12)
    result = compile_auto(source, graph, candidates=fakes, pipeline="", policy=policy, clock=clock, isolate=False,
                          pool=pool)
    timing = result.artifact.manifest["auto"]["timing"]
    assert result.artifact.target == "a" and timing["processes"] == 0
    assert "close" not in timing["phase_seconds"] and "close" not in timing["phase_cpu_seconds"]
    assert [(i, verb) for i, verb, _ in log] == [(0, "kill"), (1, "kill")] and all(p.closed for p in made)


def test_the_close_phase_is_timed_when_timing_processes_ran(captured, monkeypatch):
    """Candidates ranked in two (fake) timing processes: the manifest counts them and times their close."""
    from mlcomp.api.auto import workers
    from mlcomp.frontend.loading import load_model

    module, inputs, graph = captured("mlp", 2)
    source = load_model(module, example_inputs=inputs)
    monkeypatch.setattr(workers, "save_for_worker", lambda artifact, folder: Saveable().save(folder))
    pool, made, log = fake_pool({"a": 1e-3, "b": 2e-3})
    clock = FakeClock()
    fakes = [FakeTarget("a", clock, 1e-3), FakeTarget("b", clock, 2e-3)]
    policy = TimingPolicy(warmup=1, budget_s=0.01, min_repeats=3, max_repeats=12)
    result = compile_auto(source, graph, candidates=fakes, pipeline="", policy=policy, clock=clock, pool=pool)
    timing = result.artifact.manifest["auto"]["timing"]
    assert result.artifact.target == "a" and timing["processes"] == 2 and all(p.closed for p in made)
    assert {"compile", "rank", "close"} <= set(timing["phase_seconds"]) == set(timing["phase_cpu_seconds"])
    assert [i for i, verb, n in log if verb == "sample" and n == "a"] != []


def test_the_environment_selects_the_timing_scheme(monkeypatch):
    """Forked processes and a quiet wait by default; MLCOMP_AUTO_PROCESSES=spawn starts each afresh,
    MLCOMP_AUTO_SETTLE=fixed settles with calls, MLCOMP_AUTO_LEAD=fixed keeps the whole lead-in,
    MLCOMP_AUTO_WARM=load warms each artifact up as it loads: the pool passes them to its spawner."""
    from mlcomp.api.auto import workers

    seen = []
    pool = WorkerPool([], warmup=1, block_s=0.01, procs=2, spawn=lambda feed, n, **kw: seen.append(kw) or [])
    with pool:
        pool.start()
    monkeypatch.setenv("MLCOMP_AUTO_PROCESSES", "spawn")
    monkeypatch.setenv("MLCOMP_AUTO_SETTLE", "fixed")
    monkeypatch.setenv("MLCOMP_AUTO_PRELOAD", "off")
    assert (seen[0]["fork"], seen[0]["quiet"]) == (True, True)
    monkeypatch.setenv("MLCOMP_AUTO_POSTLOAD", "off")
    assert workers._variant() == {"fork": False, "quiet": False, "preload": (), "postload": (), "warm_later": True}
    monkeypatch.delenv("MLCOMP_AUTO_POSTLOAD")
    assert workers._variant() == {"fork": False, "quiet": False, "preload": (), "warm_later": True}
    monkeypatch.setenv("MLCOMP_AUTO_PROCESSES", "fork")
    assert workers._variant() == {"fork": True, "quiet": False, "preload": (), "warm_later": True}
    monkeypatch.delenv("MLCOMP_AUTO_SETTLE")
    monkeypatch.delenv("MLCOMP_AUTO_PRELOAD")
    assert workers._variant() == {"fork": True, "quiet": True, "warm_later": True}
    monkeypatch.setenv("MLCOMP_AUTO_LEAD", "fixed")           # the lead-in never ends early on steady calls
    monkeypatch.setenv("MLCOMP_AUTO_WARM", "load")            # each load warms its artifact up at once
    assert workers._variant() == {"fork": True, "quiet": True, "steady": False, "warm_later": False}


def test_the_timing_processes_preload_what_the_candidates_loads_import(monkeypatch):
    """The pool of an auto compile names the target registry and each candidate's runtime modules (no
    duplicates) for its zygote to import before it forks; MLCOMP_AUTO_PRELOAD=off names none."""
    from mlcomp.api.auto.search import timing_pool
    from mlcomp.targets import get_target

    targets = [get_target(n) for n in ("cpu", "onnxruntime", "tvm", "cpu")]
    seen = []
    for preload in ("on", "off"):
        monkeypatch.setenv("MLCOMP_AUTO_PRELOAD", preload)
        monkeypatch.setenv("MLCOMP_AUTO_POSTLOAD", preload)
        with timing_pool([], targets) as pool:
            pool._spawn = lambda feed, n, **kw: seen.append((kw["preload"], kw["postload"])) or []
            pool.start()
    assert seen[0][0] == ("mlcomp.targets.registry", "mlcomp.targets.torch.cpu", "mlcomp.targets.onnx.target",
                          "mlcomp.targets.tvm.target", "mlcomp.targets.tvm.module")
    assert seen[0][1] == ("onnxruntime", "tvm_ffi")       # the runtimes, imported by each process once forked
    assert seen[1] == ((), ())


def test_the_cli_starts_the_timing_processes_before_the_capture_and_closes_them_at_the_end(monkeypatch, captured):
    """``mlcomp compile --target auto``: the pool starts once the model is loaded, before its capture, is
    handed to the compile, and is closed when the command ends (here: the compile fails)."""
    from click.testing import CliRunner

    import mlcomp.api
    from mlcomp.api import compiler
    from mlcomp.base.errors import MlcompError
    from mlcomp.cli.main import main
    from mlcomp.frontend.source import ModelSource

    events: list[Any] = []

    class Pool:
        closed = False

        def __enter__(self) -> "Pool":
            return self

        def __exit__(self, *exc: Any) -> None:
            self.closed = True

    def early(source, target, candidates, options):
        events.append(("pool", target, candidates))
        return Pool()

    def compile_model(source, graph, **kw):
        events.append(("compile", kw["pool"]))
        raise MlcompError("stopped by the test", hint="none")
    graph = captured("mlp", 2)[2]                        # the capture itself is not what is tested
    monkeypatch.setattr(compiler, "early_pool", early)
    monkeypatch.setattr(mlcomp.api, "compile_model", compile_model)
    monkeypatch.setattr(ModelSource, "capture", lambda self, **kw: events.append("capture") or graph)
    result = CliRunner().invoke(main, ["compile", "mlp", "--batch", "2", "--target", "auto",
                                       "--candidates", "cpu,onnxruntime", "--no-cache"])
    assert "stopped by the test" in result.output and result.exit_code != 0
    assert events[:2] == [("pool", "auto", ["cpu", "onnxruntime"]), "capture"]
    assert events[2][0] == "compile" and isinstance(events[2][1], Pool) and events[2][1].closed


def test_the_preloaded_modules_start_no_thread_and_import_no_runtime_or_dynamo():
    """What the zygote imports before it forks (each auto candidate's ``runtime_modules``, after ``mlcomp.api``) must
    start no thread (a fork copies only the calling one) and pull in no runtime or dynamo (those are paid by
    the load that needs them, or by the capture); what a tvm load imports first (``LOAD_IMPORTS``) is the runtime
    (tvm_ffi), not TVM's compiler package."""
    import subprocess
    import sys

    code = ("import sys, threading; import mlcomp.api; from mlcomp.api.auto.search import auto_candidates; "
            "before = threading.active_count(); "
            "mods = [m for target in auto_candidates() for m in target.runtime_modules]; "
            "[__import__(m) for m in mods]; "
            "heavy = [m for m in ('openvino', 'onnxruntime', 'tvm', 'torch._dynamo', 'torch._inductor') "
            "if m in sys.modules]; from mlcomp.api.auto.search import LOAD_IMPORTS; "
            "[__import__(m) for m in LOAD_IMPORTS['tvm']]; compiler = 'tvm' in sys.modules; "
            "print(len(mods), threading.active_count() - before, compiler, heavy)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    count, threads, compiler, heavy = out.stdout.strip().split(" ", 3)
    assert int(count) > 0 and threads == "0" and heavy == "[]", out.stdout
    assert compiler == "False", "a timing process's tvm load would import TVM's compiler package"
