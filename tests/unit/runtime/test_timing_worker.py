"""The timing worker: a saved artifact timed in a fresh process, and its failures reported; a
process that hosts several artifacts.

These start real Python processes (about 2 s each to import torch), so there are few of them:
a cpu artifact answers ``ready`` and samples; a folder that is not an artifact, and a child
that dies, come back as one-paragraph :class:`WorkerError` s naming the candidate.
"""
from __future__ import annotations

import io
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import mlcomp
from mlcomp.hardware.timing import calls_per_block
from mlcomp.runtime.timing_host import HostWorker, preload, serve_host
from mlcomp.runtime.timing_worker import (LEAD_CALLS, STEADY_CALLS, ProcessSampler, WorkerError, save_inputs, serve,
                                          take_sample)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("worker")
    art = mlcomp.compile("mlp", target="cpu", pipeline="-O0")
    inputs = art.reference[0] if art.reference else mlcomp.capture("mlp").example_inputs
    return art.save(root / "art"), save_inputs(inputs, root / "inputs.pt"), root


def test_a_worker_loads_warms_up_and_samples(saved):
    folder, feed, _ = saved
    with ProcessSampler.start(folder, feed, threads=1, warmup=2, block_s=0.01, label="cpu") as worker:
        per_call = worker.wait_ready(timeout=300)
        samples = [worker.sample() for _ in range(3)]
    assert per_call > 0 and worker.calls == calls_per_block(0.01, per_call)
    assert len(samples) == 3 and all(s > 0 for s in samples)
    # that a sample is seconds per call, not per block, is compared on the clock in tests/perf


def test_a_folder_that_is_no_artifact_is_a_clear_worker_error(saved, tmp_path):
    _, feed, _ = saved
    with ProcessSampler.start(tmp_path, feed, threads=1, warmup=1, block_s=0.005, label="tvm") as worker:
        with pytest.raises(WorkerError) as err:
            worker.wait_ready(timeout=300)
    assert str(err.value).startswith("the timing process for tvm failed: ")
    assert "manifest.json" in str(err.value) and "\n" not in str(err.value)


def test_a_dead_worker_is_reported_with_the_tail_of_its_log(saved, tmp_path):
    folder, _, _ = saved
    missing = tmp_path / "no-inputs.pt"
    with ProcessSampler.start(folder, missing, threads=1, warmup=1, block_s=0.005, label="cpu") as worker:
        with pytest.raises(WorkerError, match="the timing process for cpu failed: .*no-inputs.pt"):
            worker.wait_ready(timeout=300)


def test_serve_protocol_in_process(saved):
    """The child's loop, run here: ready line, one sample per request, stops at ``quit``."""
    folder, feed, _ = saved
    out = io.StringIO()
    serve({"artifact": str(folder), "inputs": str(feed), "threads": torch.get_num_threads(), "warmup": 1,
           "block_s": 0.001, "settle_s": 0.0}, out, io.StringIO("sample\nsample\nquit\nsample\n"))
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert list(lines[0]) == ["ready", "calls"] and [list(m) for m in lines[1:]] == [["sample"], ["sample"]]


def test_a_hosting_process_loads_several_samples_each_and_drops_on_request(saved, tmp_path):
    """The hosting child's loop, run here: a reply per load (a bad folder is an error line, the rest
    stay hosted), a sample per request of the name asked for, no reply to ``drop``."""
    folder, feed, _ = saved
    out = io.StringIO()
    commands = ["load " + json.dumps({"name": "a", "artifact": str(folder)}),
                "load " + json.dumps({"name": "bad", "artifact": str(tmp_path)}),
                "load " + json.dumps({"name": "b", "artifact": str(folder)}),
                "sample b", "drop b", "sample a", "stats", "quit", "sample a"]
    serve_host({"inputs": str(feed), "threads": torch.get_num_threads(), "warmup": 1, "block_s": 0.001,
                "settle_s": 0.0}, out, io.StringIO("\n".join(commands) + "\n"))
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [m.get("name") for m in lines[:3]] == ["a", None, "b"] and lines[1]["error"].startswith("bad: ")
    assert [list(m) for m in lines[3:5]] == [["sample"], ["sample"]] and all(m["sample"] > 0 for m in lines[3:5])
    stats = lines[5]["stats"]           # CPU per load (none for the failed one), a lead-in call per sample
    assert {k for k in stats if k.startswith("load ")} == {"load a", "load b"} and stats["lead_calls"] == 2
    assert stats["loads"] == pytest.approx(stats["load a"] + stats["load b"]) and len(lines) == 6
    assert 0 < stats["warm a"] <= stats["load a"] and 0 < stats["warm b"] <= stats["load b"]



def test_a_hosting_process_told_to_warm_later_loads_without_calls_and_warms_on_request(saved):
    """``warm_later``: a load replies without an estimate; ``warm`` warms every artifact not warm yet (a second
    ``warm``: none); an artifact sampled before any ``warm`` is warmed up first; stats count each warm-up."""
    folder, feed, _ = saved
    out = io.StringIO()
    commands = ["load " + json.dumps({"name": n, "artifact": str(folder)}) for n in ("a", "b")] + \
        ["warm", "warm", "load " + json.dumps({"name": "c", "artifact": str(folder)}), "sample c", "stats", "quit"]
    serve_host({"inputs": str(feed), "threads": torch.get_num_threads(), "warmup": 1, "block_s": 0.001,
                "settle_s": 0.0, "warm_later": True}, out, io.StringIO("\n".join(commands) + "\n"))
    lines = [json.loads(line) for line in out.getvalue().splitlines()]
    assert [(m["name"], m["ready"], m["calls"]) for m in lines[:2]] == [("a", None, None), ("b", None, None)]
    assert sorted(lines[2]["warmed"]) == ["a", "b"] and all(s > 0 for s in lines[2]["warmed"].values())
    assert lines[3] == {"warmed": {}} and lines[4]["ready"] is None and lines[5]["sample"] > 0
    stats = lines[6]["stats"]
    assert {k for k in stats if k.startswith("warm ")} == {"warm a", "warm b", "warm c"}
    assert all(0 < stats[f"warm {n}"] <= stats[f"load {n}"] for n in "abc")

def _gone(pid: int, patience_s: float = 10.0) -> bool:
    """Whether ``pid`` has exited and been reaped (polled up to ``patience_s``: exits are not instant)."""
    end = time.monotonic() + patience_s
    while time.monotonic() < end:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.02)
    return False


def test_a_group_of_timing_processes_is_forked_from_one_start_up_and_leaves_nothing_behind(saved):
    """Two hosting processes from one zygote: the second is the zygote's fork (its parent), both host and
    sample, a sibling that dies is a WorkerError that says so, and after close no process is left."""
    folder, feed, _ = saved
    preload = ["mlcomp.targets.registry", "mlcomp.targets.torch.cpu", "mlcomp.no_such_module"]
    workers = HostWorker.spawn_group(feed, 2, threads=1, warmup=1, block_s=0.01, preload=preload,
                                     postload=["colorsys", "mlcomp.no_such_module"])
    zygote, sibling = workers
    try:
        for worker in workers:
            worker.host("a", folder)
            worker.host("b", folder)
        ready = [w.wait_hosted(timeout=300) for w in workers]
        pids = [w.pid for w in workers]
        ppid = int(Path(f"/proc/{sibling.pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
        assert ppid == zygote.pid and len(set(pids)) == 2
        for worker in workers:
            worker.watch(pids)
        samples = [w.sampler(n)() for w in workers for n in ("a", "b")]
        stats = [w.stats() for w in workers]
        assert all(sorted(r) == ["a", "b"] for r in ready) and all(s > 0 for s in samples)
        assert all(s["samples"] > 0 and s["total"] > 0 for s in stats)
        # the zygote imported the two that exist before it forked: the sibling found them imported
        assert [s["preloaded"] for s in stats] == [2.0, 0.0]
        # a module to import after the fork is imported by each process itself, at its first load
        assert [s["postloaded"] for s in stats] == [1.0, 1.0]
        os.kill(sibling.pid, signal.SIGKILL)                # a timing process that dies
        with pytest.raises(WorkerError, match="the timing process for timing process 1 failed: it exited"):
            sibling.sampler("a")()
        assert zygote.sampler("b")() > 0                    # the other one still answers
    finally:
        for worker in reversed(workers):
            worker.close()
    assert _gone(pids[0]) and _gone(pids[1])


def test_a_group_killed_while_it_imports_leaves_no_process():
    workers = HostWorker.spawn_group(Path("no-inputs.pt"), 2, threads=1, warmup=1, block_s=0.01)
    zygote = workers[0].pid
    for worker in workers:                                  # as a pool that hosted nothing is discarded
        worker.kill()
    for worker in workers:
        worker.close()
    assert _gone(zygote)


def test_a_preload_imports_each_module_once_and_leaves_a_missing_one_to_its_load(tmp_path, monkeypatch):
    (tmp_path / "mlcomp_preload_probe.py").write_text("LOADED = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "mlcomp_preload_probe", raising=False)
    try:
        fresh, _ = preload(["mlcomp_preload_probe", "mlcomp_preload_missing", "mlcomp_preload_probe"])
        assert fresh == 1.0 and sys.modules["mlcomp_preload_probe"].LOADED
        assert preload(["mlcomp_preload_probe"])[0] == 0.0          # imported already: nothing to do
    finally:
        sys.modules.pop("mlcomp_preload_probe", None)


def test_the_child_imports_this_mlcomp_first(monkeypatch):
    from mlcomp.runtime.timing_worker import _child_env

    monkeypatch.setenv("PYTHONPATH", "elsewhere")
    first, *rest = _child_env()["PYTHONPATH"].split(os.pathsep)
    assert Path(first) / "mlcomp" == Path(mlcomp.__file__).resolve().parent
    assert rest == ["elsewhere"]


def test_a_block_lasts_about_its_seconds_within_its_bounds():
    assert calls_per_block(0.02, 40e-6) == 500
    assert calls_per_block(0.02, 0.5) == 1                 # a slow call: one per block
    assert calls_per_block(0.02, 0.0) == 1000              # a call too fast to time: the cap
    assert calls_per_block(0.02, 1e-6, most=50) == 50


class Counted:
    """An artifact that counts its calls (each one instant)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, *inputs: Any) -> None:
        self.calls += 1


@pytest.mark.parametrize("per_call, lead", [(None, LEAD_CALLS), (1.0, STEADY_CALLS), (1e-12, LEAD_CALLS)])
def test_a_lead_in_ends_on_steady_calls_else_after_its_count(per_call, lead):
    """After a quiet wait, the lead-in makes LEAD_CALLS untimed calls; given the warm estimate of one call
    it stops at STEADY_CALLS calls in a row within STEADY of it (1 s: every call; 1e-12 s: none)."""
    art = Counted()
    median_s, waited, made, fastest = take_sample(art, [], lambda: None, 1, settle_s=60.0, block_s=0.0,
                                                  quiet=lambda: 0.0, per_call=per_call)
    assert made == lead and art.calls == lead + 1 and fastest == median_s >= 0 and waited >= 0
