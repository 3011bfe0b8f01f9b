"""targets/tvm/build.py: untuned MLP numerics, save -> load in a fresh process, tuning-database reuse,
and a build that leaves the process as it found it (Ctrl-C included)."""
from __future__ import annotations

import inspect
import logging
import os
import signal
import subprocess
import sys
import tempfile
import textwrap

import pytest
import torch
from torch import nn

pytestmark = pytest.mark.tvm

tvm_backend = pytest.importorskip("mlcomp.targets.tvm.build")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 128), nn.ReLU(),
                         nn.Linear(128, 2)).eval()


def test_host_target_is_a_dict():
    t = tvm_backend.host_llvm_target(num_cores=2)
    assert t["kind"] == "llvm" and t["num-cores"] == 2 and t["mcpu"]


def test_mlp_untuned_save_and_load_in_fresh_process(tmp_path):
    model, x = _mlp(), torch.randn(4, 512)
    with torch.inference_mode():
        ref = model(x)
    mod = tvm_backend.build(model, (x,))
    out = mod(x)
    assert isinstance(out, tuple) and len(out) == 1
    torch.testing.assert_close(out[0], ref, rtol=1e-4, atol=1e-5)
    assert mod.stats["offload"]["host"]["kernels"] and "tune_trials" in mod.stats

    files = mod.save(str(tmp_path / "art"))
    assert "model.so" in files and all((tmp_path / "art" / f).exists() for f in files)
    torch.save({"x": x, "ref": ref}, tmp_path / "io.pt")
    # a CPU load needs TVM's runtime libraries only: the compiler's Python package stays unimported;
    # the loaded module saves the very library it came from
    script = textwrap.dedent(f"""
        import filecmp, sys, torch
        from mlcomp.targets.tvm.module import TvmModule
        io = torch.load({str(tmp_path / "io.pt")!r})
        loaded = TvmModule.load({str(tmp_path / "art")!r})
        out = loaded(io["x"])
        torch.testing.assert_close(out[0], io["ref"], rtol=1e-4, atol=1e-5)
        assert "tvm" not in sys.modules, "loading imported tvm"
        loaded.save({str(tmp_path / "again")!r})
        assert filecmp.cmp({str(tmp_path / "art" / "model.so")!r}, {str(tmp_path / "again" / "model.so")!r},
                           shallow=False)
        print("LOAD_OK", len(out))
    """)
    res = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "LOAD_OK 1" in res.stdout, res.stderr[-2000:]


def test_tuning_database_is_reused(tmp_path):
    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(64, 32), nn.ReLU()).eval(), torch.randn(2, 64)
    with torch.inference_mode():
        ref = model(x)
    work = str(tmp_path / "tune")
    # kernels=True: one search (the torch-kernels module); the default's second search with TVM's own
    # kernels is tuned and reused in tests/unit/targets/test_tvm.py's slow tuning tests; no small-GEMM probe
    # (what it keeps as TVM code changes the tasks, and its choice is a measurement of the moment)
    config = tvm_backend.BuildConfig(tune_trials=8, work_dir=work, kernels=True, small_gemms=False)
    first = tvm_backend.build(model, (x,), config)
    assert first.stats["trials_run"] == 8 and not first.stats["db_reused"]
    assert first.stats["tasks"] >= 1 and all(n >= 1 for n in first.stats["records_per_task"].values())
    torch.testing.assert_close(first(x)[0], ref, rtol=1e-4, atol=1e-5)

    records = (tmp_path / "tune" / "database_tuning_record.json").read_text()
    second = tvm_backend.build(model, (x,), config)
    assert second.stats["db_reused"] and second.stats["trials_run"] == 0 and second.stats["trials_before"] == 8
    # nothing was measured again: the database holds exactly the first build's records
    assert (tmp_path / "tune" / "database_tuning_record.json").read_text() == records
    assert second.stats["records_per_task"] == first.stats["records_per_task"]
    assert sorted(os.listdir(tmp_path / "tune" / "logs")) and all(
        name.startswith("task_") for name in os.listdir(tmp_path / "tune" / "logs"))
    torch.testing.assert_close(second(x)[0], ref, rtol=1e-4, atol=1e-5)


def _process_state() -> dict:
    """What a build must leave as it found it: patched functions, logging, environment, fd 2."""
    manager = logging.root.manager
    loggers = {name: (log.level, tuple(log.handlers), log.propagate, log.disabled)
               for name, log in manager.loggerDict.items() if isinstance(log, logging.Logger)}
    loggers[""] = (logging.root.level, tuple(logging.root.handlers), True, False)
    fd2 = os.fstat(2)
    return {"stack": inspect.stack, "loggers": loggers, "environ": dict(os.environ),
            "fd2": (fd2.st_dev, fd2.st_ino), "sigint": signal.getsignal(signal.SIGINT),
            "tempdir": tempfile.gettempdir(), "temp_files": sorted(os.listdir(tempfile.gettempdir()))}


def _assert_restored(before: dict) -> None:
    """Everything as before; loggers first created during the build (by TVM imports) are left bare."""
    after = _process_state()
    new = {name: after["loggers"].pop(name) for name in set(after["loggers"]) - set(before["loggers"])}
    assert after == before
    assert all(level == logging.NOTSET and handlers == () for level, handlers, _, _ in new.values()), new


@pytest.fixture
def private_tmp(tmp_path, monkeypatch):
    """The process's temporary folder, private to this test (children inherit it).

    torch keeps a cache folder there (``torchinductor_<user>``, made by the first torch.export);
    tests compare the folder before and after a build that follows a warm-up build.
    """
    folder = tmp_path / "systmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    monkeypatch.setenv("TMPDIR", str(folder))
    return folder


def test_build_restores_process_state_and_leaves_no_temp_files(private_tmp):
    model, x = _mlp(), torch.randn(2, 512)
    tvm_backend.build(model, (x,))           # warm-up: imports TVM (creates loggers), torch's temp cache
    before = _process_state()
    mod = tvm_backend.build(model, (x,), tvm_backend.BuildConfig(tune_trials=0))
    _assert_restored(before)
    with torch.inference_mode():
        torch.testing.assert_close(mod(x)[0], model(x), rtol=1e-4, atol=1e-5)


def test_keyboard_interrupt_in_build_restores_everything(private_tmp, monkeypatch):
    model, x = _mlp(), torch.randn(2, 512)
    tvm_backend.build(model, (x,))
    before = _process_state()
    seen = {}

    def interrupted(mod, target):
        seen["scope_tmp"] = [p for p in os.listdir(private_tmp) if p.startswith("mlcomp-tvm-")]
        seen["stack_patched"] = inspect.stack is not before["stack"]
        seen["fd2_diverted"] = (os.fstat(2).st_dev, os.fstat(2).st_ino) != before["fd2"]
        raise KeyboardInterrupt

    monkeypatch.setattr(tvm_backend, "lower_to_tir", interrupted)
    with pytest.raises(KeyboardInterrupt):
        tvm_backend.build(model, (x,))
    assert seen == {"scope_tmp": [seen["scope_tmp"][0]], "stack_patched": True, "fd2_diverted": True}
    _assert_restored(before)


@pytest.mark.slow
def test_ctrl_c_while_tuning_stops_at_the_next_batch(private_tmp, monkeypatch, tmp_path):
    """A real SIGINT arriving inside MetaSchedule's C++ scheduler: KeyboardInterrupt, nothing left behind.

    An exception raised in a callback deep inside the scheduler can abort the process
    (std::terminate); the scope records the signal and stops at the end of the batch.
    """
    from tvm.s_tir.meta_schedule import runner as ms_runner

    real = ms_runner.LocalRunner
    calls = []

    def interrupting_runner(**kwargs):
        inner = real(**kwargs)

        class Interrupting:
            pool = inner.pool

            def run(self, runner_inputs):
                calls.append(len(runner_inputs))
                signal.raise_signal(signal.SIGINT)   # as if Ctrl-C came while candidates are measured
                return inner.run(runner_inputs)

        return Interrupting()

    torch.manual_seed(0)
    model, x = nn.Sequential(nn.Linear(16, 8), nn.ReLU()).eval(), torch.randn(2, 16)
    tvm_backend.build(model, (x,))
    before = _process_state()
    monkeypatch.setattr(ms_runner, "LocalRunner", interrupting_runner)
    with pytest.raises(KeyboardInterrupt):
        tvm_backend.build(model, (x,), tvm_backend.BuildConfig(tune_trials=64, work_dir=str(tmp_path / "db")))
    assert calls == [1]       # the first candidate measured; the rest of the batch and the budget skipped
    _assert_restored(before)
    ledger = tmp_path / "db" / "mlcomp_ledger.json"
    assert not ledger.exists()                   # an interrupted tuning does not count as spent


def test_scope_hides_torch_from_children_only_inside_for_workers(private_tmp):
    from mlcomp.targets.tvm.scope import TvmScope

    before = _process_state()
    probe = [sys.executable, "-c", "import tempfile\ntry:\n import torch\nexcept ImportError as e:\n print('hidden', e)\n"
             "else:\n print('visible')\nprint(tempfile.gettempdir())"]
    with TvmScope() as scope:
        assert os.environ == before["environ"]
        with scope.for_workers():
            inside = subprocess.run(probe, capture_output=True, text=True, timeout=120).stdout.split("\n")
        assert os.environ == before["environ"]
    assert inside[0].startswith("hidden") and inside[1].startswith(scope.tmp)
    assert not os.path.exists(scope.tmp)
    _assert_restored(before)


def test_scopes_in_two_threads_run_one_after_the_other():
    """What a scope patches is process-wide: a second thread's scope waits for the first to end."""
    import threading

    from mlcomp.targets.tvm.scope import TvmScope

    original = inspect.stack
    order, entered, release = [], threading.Event(), threading.Event()

    def first():
        with TvmScope():
            order.append("first in")
            entered.set()
            release.wait(30)
            order.append("first out")

    def second():
        entered.wait(30)
        with TvmScope():
            order.append("second in")
            assert inspect.stack is not original
        order.append("second out")

    threads = [threading.Thread(target=first), threading.Thread(target=second)]
    for t in threads:
        t.start()
    entered.wait(30)
    threading.Event().wait(0.5)      # give the second thread time to block on the scope
    assert order == ["first in"]
    release.set()
    for t in threads:
        t.join(30)
    assert order == ["first in", "first out", "second in", "second out"]
    assert inspect.stack is original
