"""Time a saved artifact in a fresh Python process, one sample at a time on request.

::

    with ProcessSampler.start(artifact_dir, inputs_file, threads=2, warmup=3, block_s=0.02) as s:
        s.wait_ready(timeout=300)          # the child loaded it, checked one call, warmed up
        s.sample()                         # seconds per call of one block (after an untimed block)

The reference of a comparison, the user's model run eagerly, can have a worker too:
``ProcessSampler.start(None, inputs_file, model={"spec": "mlp", "batch": 32}, ...)`` loads it
with :func:`mlcomp.frontend.loading.load_model` in the child and calls it under
``torch.inference_mode``.

Why: a deployed artifact runs in a process that loaded it (:meth:`Artifact.load`), not in the
one that compiled it, whose compile-time state (thread pools started by builds and probes,
allocator state) it would otherwise be timed in; and the thread pools of the runtime sampled
just before (torch's OpenMP pool, ONNX Runtime's, TVM's, OpenVINO's TBB arena) keep spinning for
a while, which ``settle_s`` waits out (``benchmarks/RESULTS.md`` has the cases).  A process that
hosts several artifacts and times one at a time is :mod:`mlcomp.runtime.timing_host`.

Protocol (one JSON line per message on the child's private stdout; its fd 1 is sent to
stderr so that backends' prints cannot corrupt it)::

    child:  {"ready": per_call_s, "calls": k}      after load, one checked call, warm-up
    parent: "sample"  ->  child: {"sample": s}      settle_s of untimed calls, then k timed; s = their median
    parent: "quit" or EOF                          the child exits
    child:  {"error": "..."}                        then exits 1

``k`` makes a block last about ``block_s``, from the fastest of three calls after warm-up.
The other workers' thread pools keep spinning for a while after their last sample:
``settle_s`` of untimed calls let them stop, and the
sample, the median call of the block, ignores a straggler.
"""
from __future__ import annotations

import json
import math
import os
import select
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median
from collections.abc import Callable, Sequence
from typing import IO, Any

import torch

from mlcomp.base.errors import MlcompError
from mlcomp.hardware.timing import Sync, calls_per_block, synchronizer
from mlcomp.runtime.artifact import Artifact
from mlcomp.runtime.quiet import wait_quiet

__all__ = ["ProcessGroup", "ProcessSampler", "WorkerError", "load_runner", "run_child", "save_inputs", "take_sample",
           "warm_up"]

MAX_CALLS = 1000          # a block never has more calls than this
# untimed calls before each sample: the previous worker's thread pools spin on after its sample,
# taking a core from this one
SETTLE_S = 0.1
BLOCK_LIMIT = 10          # a block stops after this many times block_s, however many calls it has made
# untimed calls after a quiet wait (besides block_s of them): enough for a runtime's pool and caches to
# reach their steady state before the timed block, unless the calls show it reached earlier (STEADY)
LEAD_CALLS = 15
# a lead-in call is steady when it takes at most STEADY x the warm estimate of one call; STEADY_CALLS
# steady calls in a row (after block_s) end the lead-in
STEADY = 1.25
STEADY_CALLS = 3


class WorkerError(MlcompError):
    """A timing worker could not start, load its artifact, or answer."""


def save_inputs(inputs: Any, path: Path) -> Path:
    """Write example inputs for workers (tensors only, so the child loads them with ``weights_only``)."""
    torch.save(list(inputs), path)
    return path


def _child_env() -> dict[str, str]:
    """This environment, with the folder holding this ``mlcomp`` first on the child's path, and TVM's
    runtime library only (``TVM_USE_RUNTIME_LIB``: a timing process loads built modules, it builds none).

    The child then imports the same mlcomp as the parent, installed or not (a source tree on
    ``sys.path``, a test run from a clone).
    """
    root = str(Path(__file__).resolve().parents[2])
    path = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": root + (os.pathsep + path if path else ""), "TVM_USE_RUNTIME_LIB": "1"}


class ProcessSampler:
    """The parent's handle on one worker process; :meth:`sample` is a sampler for ``rank``."""

    MODULE = "mlcomp.runtime.timing_worker"      # what the child runs (``python -m``)

    def __init__(self, proc: subprocess.Popen, log: IO[bytes], label: str) -> None:
        self._proc, self._log, self.label = proc, log, label
        self._shared_log = False                          # its log is another handle's (closed by that one)
        self.per_call_s: float | None = None
        self.calls: int | None = None

    @property
    def pid(self) -> int:
        """The worker's process id (its CPU time is this run's, not other load)."""
        return self._proc.pid

    @classmethod
    def start(cls, artifact_dir: Path | None, inputs_file: Path, *, threads: int, warmup: int, block_s: float,
              settle_s: float = SETTLE_S, label: str = "", model: dict[str, Any] | None = None) -> "ProcessSampler":
        """A worker for the artifact at ``artifact_dir``, or for ``model`` run eagerly (``spec``, and
        optionally ``input_shapes``, ``trust_pickle``, ``batch`` as :func:`load_model` takes them)."""
        return cls._popen({"artifact": None if artifact_dir is None else str(artifact_dir),
                           "inputs": str(inputs_file), "threads": threads, "warmup": warmup,
                           "block_s": block_s, "settle_s": settle_s, "model": model},
                          label or str(artifact_dir))

    @classmethod
    def _popen(cls, config: dict[str, Any], label: str, **popen: Any) -> "ProcessSampler":
        log = tempfile.TemporaryFile()
        try:
            proc = subprocess.Popen([sys.executable, "-m", cls.MODULE, json.dumps(config)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, bufsize=0,
                                    env=_child_env(), **popen)
        except OSError as exc:
            log.close()
            raise WorkerError(f"could not start a timing process for {label}: {exc}") from None
        return cls(proc, log, label)

    def wait_ready(self, timeout: float) -> float:
        """Block until the child is warm; its estimate of one call in seconds."""
        message = self._read(timeout)
        self.per_call_s, self.calls = float(message["ready"]), int(message["calls"])
        return self.per_call_s

    def sample(self, timeout: float = 600.0) -> float:
        """One block timed in the child: seconds per call."""
        self._write("sample")
        return float(self._read(timeout)["sample"])

    def kill(self) -> None:
        """End the child now, whatever it is doing (importing, loading): nothing of it is wanted."""
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._write("quit")
                self._proc.wait(timeout=10)
            except (WorkerError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        for stream in (self._proc.stdin, self._proc.stdout):
            if stream is not None:
                stream.close()
        if not self._shared_log:
            self._log.close()

    def __enter__(self) -> "ProcessSampler":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- plumbing ---------------------------------------------------------
    def _write(self, line: str) -> None:
        try:
            assert self._proc.stdin is not None
            self._proc.stdin.write(line.encode() + b"\n")
            self._proc.stdin.flush()
        except (BrokenPipeError, OSError):
            raise self._failure("it exited") from None

    def _read(self, timeout: float) -> dict[str, Any]:
        out = self._proc.stdout
        assert out is not None
        ready, _, _ = select.select([out], [], [], timeout)
        if not ready:
            self._proc.kill()
            raise WorkerError(f"the timing process for {self.label} gave no answer in {timeout:.0f} s")
        line = out.readline()          # unbuffered pipe: reads exactly one line, nothing past it
        if not line:
            self._proc.wait()
            raise self._failure(f"it exited with status {self._proc.returncode}")
        message = json.loads(line)
        if "error" in message:
            raise WorkerError(f"the timing process for {self.label} failed: {message['error']}")
        return message

    def _failure(self, what: str) -> WorkerError:
        self._log.seek(0)
        tail = [s for s in self._log.read().decode(errors="replace").splitlines() if s.strip()][-3:]
        return WorkerError(f"the timing process for {self.label} failed: {what}"
                           + (f" ({' | '.join(tail)})" if tail else ""))


# ---------------------------------------------------------------------------
# child side


class ProcessGroup:
    """One variant's samplers in several processes, taken together: each call takes one sample of
    every process (the first one a process later than in the call before) and returns their mean;
    ``per_process[i]`` keeps process ``i``'s samples, one per call.

        >>> group = ProcessGroup([lambda: 1.0, lambda: 3.0])
        >>> group(), group(), group.per_process
        (2.0, 2.0, [[1.0, 1.0], [3.0, 3.0]])

    ``alternate=True``: each call takes one sample, of process ``calls % n``.  Groups called in
    lockstep (once per round each, as a ranking does) then sample one process per round, so a
    round's paired ratios compare the variants within one process, and every process is used:

        >>> group = ProcessGroup([lambda: 1.0, lambda: 3.0], alternate=True)
        >>> group(), group(), group(), group.per_process
        (1.0, 3.0, 1.0, [[1.0, 1.0], [3.0]])
    """

    def __init__(self, samplers: Sequence[Callable[[], float]], *, alternate: bool = False) -> None:
        self.samplers = list(samplers)
        self.alternate = alternate
        self.calls = 0
        self.per_process: list[list[float]] = [[] for _ in self.samplers]

    def __call__(self) -> float:
        n, k = len(self.samplers), self.calls % len(self.samplers)
        self.calls += 1
        order = [k] if self.alternate else [*range(k, n), *range(k)]
        for i in order:
            self.per_process[i].append(self.samplers[i]())
        return sum(self.per_process[i][-1] for i in order) / len(order)


def load_runner(config: dict[str, Any]) -> tuple[Any, str]:
    """(callable, device): the saved artifact, or the model of ``config["model"]`` run eagerly."""
    model = config.get("model")
    if not model:
        artifact = Artifact.load(config["artifact"])
        return artifact, artifact.manifest.get("device") or "cpu"
    from mlcomp.frontend.loading import load_model

    source = load_model(model["spec"], input_shapes=model.get("input_shapes", ()),
                        trust_pickle=bool(model.get("trust_pickle")), batch=model.get("batch"))
    eager = source.eager

    def run(*xs: Any) -> Any:
        with torch.inference_mode():
            return eager(*xs)
    return run, "cpu"


def _calls(artifact: Any, inputs: list, calls: int, barrier: Sync, limit_s: float = float("inf")) -> list[float]:
    """Seconds of each of ``calls`` calls (each followed by the device's barrier); fewer (at least one)
    once ``limit_s`` has passed, so a block sized on a quiet machine cannot last minutes on a busy one."""
    clock, out = time.perf_counter, []
    begin = clock()
    for _ in range(calls):
        start = clock()
        artifact(*inputs)
        barrier()
        out.append(clock() - start)
        if start - begin > limit_s:
            break
    return out


def warm_up(artifact: Any, inputs: list, barrier: Sync, warmup: int, block_s: float) -> tuple[float, int]:
    """Warm ``artifact`` up; (seconds of one call, calls per block of about ``block_s``)."""
    _calls(artifact, inputs, max(1, int(warmup)), barrier)
    per_call = min(_calls(artifact, inputs, 3, barrier))      # after warm-up: TorchScript's first runs profile
    return per_call, calls_per_block(float(block_s), per_call, MAX_CALLS)


def take_sample(artifact: Any, inputs: list, barrier: Sync, calls: int, settle_s: float, block_s: float,
                quiet: Callable[[], float] | None = None, per_call: float | None = None) -> tuple[float, float, int, float]:
    """(the median call of a block, seconds waited before it, untimed lead-in calls made, the block's fastest call).

    Without ``quiet``: ``settle_s`` of untimed calls first (the last sample's thread pools spin down
    meanwhile).  With ``quiet`` (a reading of the CPU seconds of the threads that could spin,
    :func:`mlcomp.runtime.quiet.cpu_of_others`): wait until they are quiet (at most ``settle_s``), then
    untimed calls of this runtime (its pool wakes up and reaches its steady state, its data comes back
    into the caches) for at least ``block_s`` and ``LEAD_CALLS`` calls, or ``settle_s``.  With ``per_call``
    (the fastest call seen so far: the warm estimate, then the fastest of the earlier blocks, so an estimate
    taken while a build loaded the cores is corrected by the first quiet block) the lead-in also ends, after
    ``block_s``, at ``STEADY_CALLS`` calls in a row that each took at most ``STEADY`` x ``per_call``: the
    runtime is in its steady state already.
    """
    waited = wait_quiet(quiet, float(settle_s)) if quiet is not None else 0.0
    start, made, steady = time.perf_counter(), 0, 0
    bound = -math.inf if per_call is None else STEADY * float(per_call)     # None: no call is steady
    while True:
        took = _calls(artifact, inputs, 1, barrier)[0]
        made, spent = made + 1, time.perf_counter() - start
        steady = steady + 1 if took <= bound else 0
        if spent >= float(settle_s) or quiet is not None and spent >= float(block_s) and (
                made >= LEAD_CALLS or steady >= STEADY_CALLS):
            break
    block = _calls(artifact, inputs, calls, barrier, BLOCK_LIMIT * float(block_s))
    return median(block), waited, made, min(block)


def serve(config: dict[str, Any], channel: IO[str], commands: IO[str]) -> None:
    """Load, check, warm up, then answer ``sample`` requests until ``quit`` or end of input."""
    torch.set_num_threads(int(config["threads"]))
    artifact, device = load_runner(config)
    inputs = torch.load(config["inputs"], map_location="cpu", weights_only=True)
    barrier = synchronizer(device)
    per_call, calls = warm_up(artifact, inputs, barrier, config["warmup"], config["block_s"])
    channel.write(json.dumps({"ready": per_call, "calls": calls}) + "\n")
    channel.flush()
    for line in commands:
        if line.strip() != "sample":
            break
        sample, _, _, _ = take_sample(artifact, inputs, barrier, calls, config["settle_s"], config["block_s"])
        channel.write(json.dumps({"sample": sample}) + "\n")
        channel.flush()


def run_child(serve_fn: Callable[[dict[str, Any], IO[str], IO[str]], None], argv: list[str]) -> int:
    """A worker's ``main``: the protocol on a private copy of stdout, stray prints to the log, an error
    as a message.  The process ends here, without tearing torch and the backends down (seconds for
    some): everything it had to say is written by then."""
    config = json.loads(argv[0])
    if config.get("fds"):                                      # a timing process started on given pipes
        commands, channel = os.fdopen(config["fds"][0], "r"), os.fdopen(config["fds"][1], "w", buffering=1)
    else:
        commands, channel = sys.stdin, os.fdopen(os.dup(1), "w", buffering=1)   # the protocol's private stdout
    os.dup2(2, 1)                                              # stray prints go to the log
    status = 0
    try:
        serve_fn(config, channel, commands)
    except Exception as exc:  # noqa: BLE001 - reported to the parent as this candidate's failure
        text = exc.message if isinstance(exc, MlcompError) else f"{type(exc).__name__}: {exc}"
        channel.write(json.dumps({"error": " ".join(text.split())[:500]}) + "\n")
        status = 1
    channel.flush()
    sys.stderr.flush()
    os._exit(status)


def main(argv: list[str]) -> int:
    return run_child(serve, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


def save_for_worker(artifact: Any, folder: Path) -> Path:
    """Save ``artifact`` for a worker, leaving its manifest as it was (saving records the payload there)."""
    manifest = artifact.manifest
    artifact.manifest = dict(manifest)
    try:
        return artifact.save(folder)
    finally:
        artifact.manifest = manifest
