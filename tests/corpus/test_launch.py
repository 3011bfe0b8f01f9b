"""The launch corpus: `mlcomp launch` refuses arguments that do not fit the artifact before torchrun
starts, and Ctrl-C ends a running launch with "interrupted" (exit 130) and no rank's traceback.

    before: --nproc 3 on a 2-stage artifact: the message three times (once per rank), then torchrun's
            ChildFailedError traceback, after the ranks had started (12 s)
    after:  error: the artifact has 2 pipeline stages but --nproc 3 processes were asked for: ... (exit 2,
            no process started)
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlcomp.cli.main import main
from mlcomp.targets.distributed.supervise import LaunchOutcome
from tests.corpus.harness import REPO, check, snapshot


@pytest.fixture(scope="module")
def pipeline_artifact(tmp_path_factory):
    """A 2-stage pipeline artifact of the mlp (compiled once; the compile's own launch check is off)."""
    from mlcomp.targets import get_target

    out = tmp_path_factory.mktemp("launch") / "mlp-pp"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(get_target("distributed"), "check_launch", False)     # no 2-process run while compiling
        res = CliRunner().invoke(main, ["compile", "mlp", "--target", "distributed", "-p", "partition{stages=2}",
                                        "-o", str(out), "--no-cache"])
    assert res.exit_code == 0, res.output
    return out


@pytest.fixture
def no_torchrun(monkeypatch):
    """Any process start fails the test: every case here is refused before torchrun."""
    import mlcomp.targets.distributed.supervise as launch

    def refuse(*args, **kwargs):
        raise AssertionError(f"torchrun started: {args}")

    monkeypatch.setattr(launch.subprocess, "Popen", refuse)


@pytest.mark.parametrize("args, expect", [
    (["--nproc", "3"], ("2 pipeline stages but --nproc 3", "Launch with --nproc 2")),
    (["--nproc", "1"], ("2 pipeline stages but --nproc 1",)),
    (["--schedule", "interleaved", "--nproc", "3"], ("cannot share evenly", "one of 1, 2")),
    (["--microbatches", "1"], ("--microbatches 1 is fewer than the artifact's 2 stages", "--schedule gpipe")),
    (["--schedule", "interleaved", "--nproc", "2", "--microbatches", "5"], ("not a multiple", "--microbatches 4")),
])
def test_launch_mismatch_refused_before_torchrun(user_folder, pipeline_artifact, no_torchrun, args, expect):
    check(user_folder, ["launch", str(pipeline_artifact), *args], code=2, expect=expect)


def test_launch_of_a_single_process_artifact(user_folder, artifact, no_torchrun):
    check(user_folder, ["launch", str(artifact)], code=2, expect=("runs in one process", "--target distributed"))


def test_launch_of_a_missing_folder(user_folder, no_torchrun):
    check(user_folder, ["launch", "no-such-artifact"], code=2)


def test_failed_ranks_are_one_line(user_folder, pipeline_artifact, monkeypatch):
    """torchrun's failure report (ChildFailedError and all) becomes the ranks' message, shown once."""
    rank_error = "error: gloo could not connect. Check the network."
    stderr = "\n".join([rank_error, rank_error, "Traceback (most recent call last):", '  File "run.py"',
                        "torch.distributed.elastic.multiprocessing.errors.ChildFailedError: ",
                        "  exitcode  : 2 (pid: 7)"])
    monkeypatch.setattr("mlcomp.cli.launch.supervise", lambda cmd: LaunchOutcome(1, "", stderr))
    err = check(user_folder, ["launch", str(pipeline_artifact)], code=2, expect=("gloo could not connect",))
    assert err.count("gloo could not connect") == 1


def test_failed_torchrun_without_a_rank_message(user_folder, pipeline_artifact, monkeypatch):
    stderr = "Traceback (most recent call last):\n  File \"x\"\nRuntimeError: address already in use\n"
    monkeypatch.setattr("mlcomp.cli.launch.supervise", lambda cmd: LaunchOutcome(1, "", stderr))
    check(user_folder, ["launch", str(pipeline_artifact)], code=3,
          expect=("2-process launch", "torchrun exit 1", "address already in use"))


def test_interrupt_while_supervising(user_folder, pipeline_artifact, monkeypatch):
    def interrupted(cmd):
        raise KeyboardInterrupt

    monkeypatch.setattr("mlcomp.cli.launch.supervise", interrupted)
    check(user_folder, ["launch", str(pipeline_artifact), "--repeat", "200"], code=130)


def test_rank_entry_point_errors_are_one_line(pipeline_artifact, artifact, capsys, monkeypatch):
    """The rank entry point (what torchrun runs): a refusal and Ctrl-C are one line each, no traceback."""
    from mlcomp.targets.distributed import launch

    assert launch.main([str(artifact)]) == 2
    assert capsys.readouterr().err.startswith("error: the artifact at")

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(launch, "_run", interrupted)
    assert launch.main([str(pipeline_artifact)]) == 130
    assert capsys.readouterr().err == "interrupted\n"


def _launch_processes(pid: int) -> list[int]:
    """Pids of the ranks (`-m mlcomp.targets.distributed.launch`, any session) descending from ``pid``."""
    parents = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
                parents[int(entry.name)] = (int(stat.rsplit(")", 1)[1].split()[1]),
                                            (entry / "cmdline").read_bytes())
            except (OSError, ValueError, IndexError):
                continue
    def descends(p: int) -> bool:
        while p in parents and p > 1:
            p = parents[p][0]
            if p == pid:
                return True
        return False
    return [p for p, (_, cmd) in parents.items() if b"distributed.launch" in cmd and descends(p)]


def _ranks(pids: list[int]) -> list[int]:
    """The ranks among ``pids`` (torchrun's own command line names the entry point too)."""
    return [p for p in pids if b"torch.distributed.run" not in Path(f"/proc/{p}/cmdline").read_bytes()]


@pytest.mark.slow
def test_real_ctrl_c_during_a_launch(user_folder, pipeline_artifact):
    """A real `mlcomp launch --repeat 200000` and a real SIGINT once both ranks run: exit 130, stderr exactly
    "interrupted", no traceback from the parent, torchrun or a rank, and no rank left running."""
    before = snapshot(user_folder)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    script = f"from mlcomp.cli.main import main; main(['launch', {str(pipeline_artifact)!r}, '--repeat', '200000'])"
    proc = subprocess.Popen([sys.executable, "-c", script], cwd=user_folder, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    started: list[int] = []
    try:
        deadline = time.monotonic() + 240
        while len(_ranks(started)) < 2 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            started = _launch_processes(proc.pid)
        assert len(_ranks(started)) == 2, (proc.poll(), proc.stderr.read() if proc.poll() is not None else "")
        time.sleep(3)                                  # the ranks import torch, join gloo, start the batches
        os.killpg(proc.pid, signal.SIGINT)             # the terminal's Ctrl-C: the foreground process group
        out, err = proc.communicate(timeout=90)
    finally:
        for pid in [proc.pid, *started]:
            try:
                os.kill(pid, signal.SIGKILL) if proc.poll() is None or pid != proc.pid else None
            except ProcessLookupError:
                pass
    assert proc.returncode == 130, err
    assert err.strip() == "interrupted", err
    assert "Traceback" not in out + err
    time.sleep(1)
    assert not [p for p in started if Path(f"/proc/{p}").exists()
                and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"]
    assert snapshot(user_folder) == before
