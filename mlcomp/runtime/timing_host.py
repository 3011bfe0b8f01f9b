"""A timing process that hosts several saved artifacts and times any of them on request.

::

    with HostWorker.spawn_host(inputs_file, threads=2, warmup=3, block_s=0.02) as w:   # imports torch now
        w.host("cpu", cpu_dir)              # not waiting: the child loads it while the caller goes on
        w.host("onnxruntime", ort_dir)
        w.wait_hosted(timeout=300)          # every hosted artifact loaded, checked once and warmed up
        w.sampler("cpu")()                  # seconds per call of one block of cpu's artifact
        w.drop("cpu")                       # a clear loser: released, never sampled again

The processes a ranking wants (two for ``auto``) start once, at the start of a compile, from one
start-up (:meth:`HostWorker.spawn_group`: the first imports torch, mlcomp and the modules the candidates'
loads need, then forks the others,
:mod:`mlcomp.runtime.zygote`), and each candidate is loaded into every one of them as soon as it
verifies.  So the number of processes does not grow with the number of candidates, and a
candidate's start-up is only its own load.

A sample waits until every other runtime's threads, in this process and in the other timing
processes (``watch``), are quiet (:func:`mlcomp.runtime.quiet.wait_quiet`, at most ``settle_s``),
then runs untimed calls of its artifact (at least ``block_s``; until three in a row are as fast as the fastest
call it made before, or 15), then takes the median call of a block
(:func:`~mlcomp.runtime.timing_worker.take_sample`): a runtime hosted beside others is timed as alone.

Protocol (one JSON line per reply on the child's private stdout)::

    parent: "load {"name": …, "artifact": …}"  ->  child: {"ready": per_call_s, "calls": k, "name": …}
                                                   (``warm_later``: {"ready": null, "calls": null, …}, no call made)
    parent: "warm"                              ->  child: {"warmed": {NAME: per_call_s, …}}   the ones not warm yet
    parent: "sample NAME"                       ->  child: {"sample": s}
    parent: "drop NAME"                            (no reply) the artifact is released
    parent: "watch [PID, ...]"                     (no reply) the other timing processes, watched before a sample
    parent: "stats"                             ->  child: {"stats": {"imports": s, "preload": s, "postload": s, ...}}
    parent: "quit" or EOF                          the child exits
    child:  {"error": "..."}                       a load or sample failed; the parent raises WorkerError
"""
from __future__ import annotations

import importlib
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import torch

from mlcomp.base.errors import MlcompError
from mlcomp.hardware.timing import synchronizer
from mlcomp.runtime.quiet import cpu_of_others
from mlcomp.runtime.zygote import Forked, fork_siblings
from mlcomp.runtime.timing_worker import SETTLE_S, ProcessSampler, load_runner, run_child, take_sample, warm_up

__all__ = ["HostWorker", "preload", "serve_host"]


class HostWorker(ProcessSampler):
    """The parent's handle on one hosting process (:meth:`sampler` of a hosted name is a ranking's sampler)."""

    MODULE = "mlcomp.runtime.timing_host"

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self._pending: list[str] = []          # names sent to load, their replies not read yet
        self.hosted: dict[str, float] = {}     # loaded name -> seconds of one call

    @classmethod
    def spawn_host(cls, inputs_file: Path, *, threads: int, warmup: int, block_s: float,
                   settle_s: float = SETTLE_S, label: str = "a timing process") -> "HostWorker":
        """A process that imports torch and mlcomp now and loads ``inputs_file``; artifacts come with :meth:`host`."""
        return cls._popen({"inputs": str(inputs_file), "threads": threads, "warmup": warmup,
                           "block_s": block_s, "settle_s": settle_s}, label)

    @classmethod
    def spawn_group(cls, inputs_file: Path, procs: int, *, threads: int, warmup: int, block_s: float,
                    settle_s: float = SETTLE_S, fork: bool = True, quiet: bool = True,
                    preload: Sequence[str] = (), steady: bool = True, warm_later: bool = False,
                    postload: Sequence[str] = ()) -> list["HostWorker"]:
        """``procs`` hosting processes from one start-up: a zygote that imports torch, mlcomp and the
        modules ``preload`` names (those its loads will need; none may start a thread on import), then
        forks the others (:mod:`mlcomp.runtime.zygote`); ``fork=False``: each started afresh, importing
        ``preload`` itself.  ``quiet=False``: a sample settles with ``settle_s`` of calls, not a quiet wait;
        ``steady=False``: its lead-in never ends early on steady calls (:func:`take_sample`'s ``per_call``);
        ``warm_later=True``: a load makes no call, :meth:`warm` (or the first sample) warms the artifacts up;
        ``postload``: modules each process imports at its first ``load`` (the runtimes the loads import, some of
        which start threads: after the fork, and after the capture, while the caller compiles the others)."""
        base = {"inputs": str(inputs_file), "threads": threads, "warmup": warmup, "block_s": block_s,
                "settle_s": settle_s, "quiet": quiet, "preload": list(preload), "steady": steady,
                "warm_later": warm_later, "postload": list(postload)}
        if not fork:
            return [cls._popen(base, f"timing process {i}") for i in range(procs)]
        pairs = [(os.pipe(), os.pipe()) for _ in range(procs - 1)]     # (commands r, w), (replies r, w)
        child_fds = [fd for (cmd, rep) in pairs for fd in (cmd[0], rep[1])]
        config = {**base, "siblings": [[cmd[0], rep[1]] for cmd, rep in pairs]}
        try:
            first = cls._popen(config, "timing process 0", pass_fds=child_fds)
        except WorkerError:
            for (cmd, rep) in pairs:
                for fd in (*cmd, *rep):
                    os.close(fd)
            raise
        for fd in child_fds:
            os.close(fd)
        workers = [first]
        for i, (cmd, rep) in enumerate(pairs, 1):
            worker = cls(Forked(cmd[1], rep[0]), first._log, f"timing process {i}")
            worker._shared_log = True
            workers.append(worker)
        return workers

    def _read(self, timeout: float) -> dict[str, Any]:
        message = super()._read(timeout)
        if "pid" in message and len(message) == 1:         # a forked process says its pid first
            self._proc.pid = int(message["pid"])
            message = super()._read(timeout)
        return message

    def host(self, name: str, artifact_dir: Path) -> None:
        """Have the child load ``artifact_dir`` as ``name`` (the reply is read by :meth:`wait_hosted`)."""
        self._write("load " + json.dumps({"name": name, "artifact": str(artifact_dir)}))
        self._pending.append(name)

    def wait_hosted(self, timeout: float) -> dict[str, float]:
        """Block until every artifact sent is loaded and warm; name -> its estimate of one call in seconds."""
        while self._pending:
            name = self._pending[0]
            message = self._read(timeout)
            self._pending.pop(0)
            self.hosted[name] = float(message["ready"] or 0.0)      # 0: loaded, not warmed up yet
        return dict(self.hosted)

    def warm(self, timeout: float) -> dict[str, float]:
        """Block until every hosted artifact not warmed up yet is; name -> its estimate of one call in seconds."""
        self.wait_hosted(timeout)
        self._write("warm")
        warmed = {name: float(s) for name, s in self._read(timeout)["warmed"].items()}
        self.hosted.update(warmed)
        return warmed

    def sampler(self, name: str) -> Callable[[], float]:
        """One block of ``name``'s artifact timed in the child: seconds per call."""
        def sample(timeout: float = 600.0) -> float:
            self._write(f"sample {name}")
            return float(self._read(timeout)["sample"])
        return sample

    def stats(self, timeout: float = 60.0) -> dict[str, float]:
        """The child's CPU seconds (every thread) by what it did: ``imports`` (everything before it served),
        ``preload`` (the modules its loads need, imported before a zygote forks; ``preloaded``: how many it
        imported itself, none in a forked process), ``postload`` (the runtimes it imported at its first load;
        ``postloaded``: how many), ``loads`` (loading, checking, warming up its artifacts),
        ``samples``, and ``total``; ``load NAME``: the CPU seconds of loading, checking and warming up ``NAME``
        (``warm NAME``: of which its warm-up calls); ``lead_calls``: the untimed calls its samples made first;
        ``waited_wall``, the wall seconds its samples waited for quiet, and its ``nice`` value."""
        self._write("stats")
        return {k: float(v) for k, v in self._read(timeout)["stats"].items()}

    def watch(self, pids: list[int]) -> None:
        """Have the child wait, before each sample, until the threads of processes ``pids`` are quiet too."""
        self._write("watch " + json.dumps(list(pids)))

    def drop(self, name: str) -> None:
        """Release ``name``'s artifact in the child (it is sampled no more)."""
        if self._proc.poll() is None and name in self.hosted:
            self._write(f"drop {name}")
            del self.hosted[name]


class _Hosted:
    """One hosted artifact: its runner and barrier, and once warm its calls per block and fastest call."""

    def __init__(self, runner: Any, barrier: Any) -> None:
        self.runner, self.barrier = runner, barrier
        self.calls: int | None = None           # None: not warmed up yet
        self.per_call: float | None = None      # the steady lead-in's bound (None: no early end)

    def warm(self, inputs: list, config: dict[str, Any]) -> float:
        """Warm it up (:func:`warm_up`); seconds of one call."""
        per_call, self.calls = warm_up(self.runner, inputs, self.barrier, config["warmup"], config["block_s"])
        self.per_call = per_call if config.get("steady", True) else None
        return per_call


def serve_host(config: dict[str, Any], channel: IO[str], commands: IO[str]) -> None:
    """Answer ``load``, ``warm``, ``sample`` and ``drop`` until ``quit`` or end of input (module doc)."""
    if config.get("sibling"):
        channel.write(json.dumps({"pid": os.getpid()}) + "\n")
        channel.flush()
    cpu = {"imports": time.process_time(), "loads": 0.0, "samples": 0.0, "waited_wall": 0.0, "lead_calls": 0.0}
    cpu["preloaded"], cpu["preload"] = preload(config.get("preload", ()))
    cpu["threads_at_fork"] = float(len(os.listdir("/proc/self/task"))) if config.get("siblings") else 0.0
    if config.get("siblings"):
        fork_siblings(config, serve_host, HostWorker.MODULE, closing=[channel.fileno()])
    cpu["postloaded"], cpu["postload"] = 0.0, 0.0
    runtimes = list(config.get("postload", ()))        # imported at the first load
    waits = config.get("quiet", True)
    quiet = cpu_of_others() if waits else None
    torch.set_num_threads(int(config["threads"]))
    inputs = torch.load(config["inputs"], map_location="cpu", weights_only=True)
    hosted: dict[str, _Hosted] = {}

    def reply(message: dict[str, Any]) -> None:
        channel.write(json.dumps(message) + "\n")
        channel.flush()

    def warm(name: str) -> float:
        c1 = time.process_time()
        per_call = hosted[name].warm(inputs, config)
        cpu[f"warm {name}"] = time.process_time() - c1
        cpu[f"load {name}"] = cpu.get(f"load {name}", 0.0) + cpu[f"warm {name}"]
        cpu["loads"] += cpu[f"warm {name}"]
        return per_call

    for line in commands:
        verb, _, rest = line.strip().partition(" ")
        c0 = time.process_time()
        if verb == "load":
            if runtimes:                       # the first load: the runtimes of every candidate, once
                cpu["postloaded"], cpu["postload"] = preload(runtimes)
                runtimes, c0 = [], time.process_time()
            spec = json.loads(rest)
            try:
                runner, device = load_runner({"artifact": spec["artifact"]})
                hosted[spec["name"]] = _Hosted(runner, synchronizer(device))
                cpu[f"load {spec['name']}"] = time.process_time() - c0
                cpu["loads"] += cpu[f"load {spec['name']}"]
                per_call = None if config.get("warm_later") else warm(spec["name"])
            except Exception as exc:  # noqa: BLE001 - that candidate's failure; the others stay hosted
                hosted.pop(spec["name"], None)
                reply({"error": f"{spec['name']}: " + _one_line(exc)})
                continue
            reply({"ready": per_call, "calls": hosted[spec["name"]].calls, "name": spec["name"]})
        elif verb == "warm":
            try:
                warmed = {name: warm(name) for name, h in hosted.items() if h.calls is None}
            except Exception as exc:  # noqa: BLE001 - reported; the parent times in its own process instead
                reply({"error": _one_line(exc)})
                continue
            reply({"warmed": warmed})
        elif verb == "sample":
            entry = hosted[rest]
            if entry.calls is None:
                warm(rest)
                c0 = time.process_time()
            seconds, waited, lead, fastest = take_sample(entry.runner, inputs, entry.barrier, entry.calls,
                                                         config["settle_s"], config["block_s"], quiet, entry.per_call)
            if entry.per_call is not None and fastest < entry.per_call:
                entry.per_call = fastest           # the steady bound follows the fastest call
            cpu["samples"] += time.process_time() - c0
            cpu["lead_calls"] += lead
            cpu["waited_wall"] += waited       # wall seconds waited for quiet (not CPU: it sleeps meanwhile)
            reply({"sample": seconds})
        elif verb == "watch":
            quiet = cpu_of_others(json.loads(rest)) if waits else None
        elif verb == "stats":
            reply({"stats": dict(cpu, total=time.process_time(), nice=float(os.nice(0)))})
        elif verb == "drop":
            hosted.pop(rest, None)
        else:
            break


def _one_line(exc: BaseException) -> str:
    text = exc.message if isinstance(exc, MlcompError) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())[:500]


def preload(modules: Sequence[str]) -> tuple[float, float]:
    """Import ``modules`` (one that does not import here is left for its load to report); (how many were not
    imported before, CPU seconds spent).  A process forked after this finds them imported."""
    c0, fresh = time.process_time(), 0
    for name in modules:
        if name in sys.modules:
            continue
        try:
            importlib.import_module(name)
            fresh += 1
        except Exception:  # noqa: BLE001 - the load that needs it fails with the reason, as without a preload
            continue
    return float(fresh), time.process_time() - c0


if __name__ == "__main__":
    sys.exit(run_child(serve_host, sys.argv[1:]))

