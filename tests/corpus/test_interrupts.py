"""The bad-input corpus, part 2 (issue 15): Ctrl-C anywhere exits 130 with "interrupted".

Each case interrupts one stage (capture, a pass, the target build, writing the
artifact, export, bench, report) and asserts what :func:`tests.corpus.harness.check`
asserts for every case: exit 130, stderr exactly ``interrupted``, no traceback,
and the user's folder byte for byte as before (no artifact, no temporary).

    before: Ctrl-C during a TVM build was ignored (artifact saved) or became
            "error: TVM could not build resnet18: RuntimeError: ." (exit 3)
    after:  "interrupted", exit 130, nothing written
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests.corpus.harness import REPO, check, snapshot as _snapshot


def _raise_interrupt(*args, **kwargs):
    raise KeyboardInterrupt


def test_interrupt_during_target_build(user_folder, monkeypatch):
    from mlcomp.targets.torch.cpu import CpuTarget

    monkeypatch.setattr(CpuTarget, "build", _raise_interrupt)
    check(user_folder, ["compile", "mlp", "--target", "cpu"], code=130)
    check(user_folder, ["compile", "mlp", "--target", "cpu", "-o", "earlier", "--force"], code=130)


def test_interrupt_during_a_pass(user_folder, monkeypatch):
    from mlcomp.pipeline import REGISTRY

    monkeypatch.setattr(REGISTRY.get("dce").cls, "run", _raise_interrupt)
    check(user_folder, ["compile", "mlp", "-p", "dce", "-o", "out"], code=130)


def test_interrupt_while_writing_the_artifact(user_folder, monkeypatch):
    from mlcomp.targets.torch.cpu import TorchScriptRuntime

    def partial(self, directory):
        (directory / "model.pt").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(TorchScriptRuntime, "save", partial)
    check(user_folder, ["compile", "mlp", "--target", "cpu", "-o", "deep/new/out"], code=130)


def test_interrupt_turned_into_a_library_error(user_folder, monkeypatch):
    """A native library (TVM's FFI) catches the KeyboardInterrupt and raises its own error."""
    from mlcomp.base.errors import MlcompError
    from mlcomp.targets.torch.cpu import CpuTarget

    def swallow(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        except KeyboardInterrupt:
            raise MlcompError("TVM could not build mlp: RuntimeError: .") from None

    monkeypatch.setattr(CpuTarget, "build", swallow)
    check(user_folder, ["compile", "mlp", "--target", "cpu", "-o", "out"], code=130)


def test_interrupt_swallowed_entirely_saves_nothing(user_folder, monkeypatch):
    from mlcomp.targets.torch.cpu import CpuTarget

    real = CpuTarget.build

    def swallow(self, *args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        except KeyboardInterrupt:
            pass
        return real(self, *args, **kwargs)

    monkeypatch.setattr(CpuTarget, "build", swallow)
    check(user_folder, ["compile", "mlp", "--target", "cpu", "-o", "out"], code=130)


@pytest.mark.parametrize("where, args", [
    ("mlcomp.targets.export:export_graph", ["export", "mlp", "--format", "onnx", "-o", "m.onnx"]),
    ("mlcomp.html_report:run_bench", ["report", "mlp", "--targets", "eager", "-o", "rep"]),
    ("mlcomp.measure.bench:run_bench", ["bench", "mlp", "--targets", "eager", "--json", "b.json"]),
    ("mlcomp.frontend.loading:load_model", ["inspect", "mlp", "--dot", "g.dot"]),
    ("mlcomp.frontend.loading:save_torchscript", ["models", "save", "mlp", "--format", "torchscript", "-o", "m.pt"]),
])
def test_interrupt_in_every_command(user_folder, monkeypatch, where, args):
    import importlib

    module, _, attr = where.partition(":")
    monkeypatch.setattr(importlib.import_module(module), attr, _raise_interrupt)
    check(user_folder, args, code=130)


def test_real_ctrl_c_during_a_slow_build(user_folder):
    """A real process and a real SIGINT while the target build runs."""
    script = ("import sys, time\n"
              "from mlcomp.targets.torch.cpu import CpuTarget\n"
              "def slow(*a, **k):\n"
              "    print('building', flush=True)\n"
              "    for _ in range(600):\n"        # a slow step that returns to Python now and then
              "        time.sleep(0.1)\n"
              "CpuTarget.build = slow\n"
              "from mlcomp.cli.main import main\n"
              "main(['compile', 'mlp', '--target', 'cpu', '-o', 'out', '--no-cache'])\n")
    before = _snapshot(user_folder)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=user_folder, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        for line in proc.stdout:
            if line.startswith("building"):
                break
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert time.monotonic() - t0 < 30
    assert err.strip() == "interrupted" and "Traceback" not in err + out
    assert _snapshot(user_folder) == before


def test_interrupt_swallowed_by_a_command_that_finishes(user_folder, monkeypatch):
    """bench-like code that catches every error per target still ends as an interruption."""
    import mlcomp.frontend.loading as loading

    real = loading.load_model

    def swallow(*args, **kwargs):
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        except KeyboardInterrupt:
            pass
        return real(*args, **kwargs)

    monkeypatch.setattr(loading, "load_model", swallow)
    check(user_folder, ["inspect", "mlp"], code=130)


def test_bench_stops_at_the_interrupted_build(user_folder, monkeypatch):
    """Ctrl-C during a target build that the native library turns into its own error (TVM's FFI does):
    bench records the cell as failed, but its next progress step stops the run (no further builds)."""
    from mlcomp.targets.torch.cpu import CpuTarget

    calls = []

    def native_build(*args, **kwargs):
        calls.append(1)
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        except KeyboardInterrupt:
            raise RuntimeError("TVMError: .") from None

    monkeypatch.setattr(CpuTarget, "build", native_build)
    check(user_folder, ["bench", "mlp", "--targets", "eager,cpu", "--batch", "1,2", "--budget", "0.002",
                        "--min-repeats", "1", "--warmup", "0", "--no-memory"], code=130)
    assert len(calls) == 1                      # batch 2 was never built
