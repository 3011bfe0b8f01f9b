"""The zygote's fork step on fake forks (no process is forked): who gets which pipes, and a fork that fails."""
from __future__ import annotations

import json
import os
import signal
import subprocess

import pytest

from mlcomp.runtime.zygote import Forked, fork_siblings


def _pairs(n: int) -> list[tuple[int, int]]:
    """(commands read end, replies write end) per sibling, as the zygote holds them (the other ends closed)."""
    out = []
    for _ in range(n):
        (cmd_r, cmd_w), (rep_r, rep_w) = os.pipe(), os.pipe()
        os.close(cmd_w), os.close(rep_r)
        out.append((cmd_r, rep_w))
    return out


def _open(fd: int) -> bool:
    try:
        os.fstat(fd)
        return True
    except OSError:
        return False


@pytest.fixture(autouse=True)
def _sigchld():
    """fork_siblings leaves SIGCHLD as it was (a zygote's subprocesses keep their exit codes; a sibling's pid
    is not reused while the zygote lives)."""
    before = signal.getsignal(signal.SIGCHLD)
    yield
    assert signal.getsignal(signal.SIGCHLD) == before


def test_each_sibling_is_forked_and_the_zygote_keeps_none_of_their_pipes():
    pairs = _pairs(2)
    forks = iter([4242, 4243])
    pids = fork_siblings({"siblings": [list(p) for p in pairs], "threads": 2}, serve=None,
                         module="m", fork=lambda: next(forks), spawn=None)
    assert pids == [4242, 4243]
    assert not any(_open(fd) for pair in pairs for fd in pair)          # the zygote closed both ends it held


def test_a_fork_that_fails_starts_that_sibling_afresh_on_the_same_pipes():
    pairs = _pairs(2)
    spawned = []

    def fork() -> int:
        raise OSError(11, "Resource temporarily unavailable")

    def spawn(config, fds, module):
        spawned.append((config, fds, module))
        return 9000 + len(spawned)
    pids = fork_siblings({"siblings": [list(p) for p in pairs], "threads": 2},
                         serve=None, module="mlcomp.runtime.timing_host", fork=fork, spawn=spawn)
    assert pids == [9001, 9002]
    assert [fds for _, fds, _ in spawned] == pairs
    config = spawned[0][0]
    # the fresh one serves one pair, says its pid first, imports what its loads need (no siblings)
    assert config == {"threads": 2, "sibling": True} and spawned[0][2] == "mlcomp.runtime.timing_host"
    assert not any(_open(fd) for pair in pairs for fd in pair)


def test_a_forked_handle_waits_for_its_pipe_to_close_and_kills_by_the_pid_it_said():
    commands_r, commands_w = os.pipe()
    replies_r, replies_w = os.pipe()
    child = subprocess.Popen(["sleep", "60"])               # stands for the forked process
    handle = Forked(commands_w, replies_r)
    with pytest.raises(subprocess.TimeoutExpired):
        handle.wait(timeout=0.01)                           # its reply pipe is open: still there
    os.write(replies_w, json.dumps({"pid": child.pid}).encode() + b"\n")
    handle.kill()                                           # the pid nobody read yet is read, and killed
    assert handle.pid == child.pid and child.wait(timeout=30) == -signal.SIGKILL and handle.poll() == -1
    os.close(replies_w), os.close(commands_r)
    handle.stdin.close(), handle.stdout.close()
    ended = Forked(*_ends())
    ended.kill()                                            # no pid said: nothing to kill, it ends on EOF
    assert ended.pid is None and ended.wait(timeout=0) == -1


def _ends() -> tuple[int, int]:
    (cmd_r, cmd_w), (rep_r, rep_w) = os.pipe(), os.pipe()
    os.close(cmd_r), os.close(rep_w)
    return cmd_w, rep_r
