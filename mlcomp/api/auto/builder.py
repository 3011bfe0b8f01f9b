"""The auto target's builder process: the candidate whose build is long is built there, beside the others.

A cold ``auto`` compile builds every candidate.  The compiling process does that on one core, and
TVM's build alone is most of it (ResNet-18: ``import tvm`` 2.5 CPU-s, then the Relax build 3.6-3.8
CPU-s, against 0.6-2.4 for each other candidate).  So the timing processes' zygote
(:mod:`mlcomp.runtime.zygote`), right after importing torch and mlcomp, forks one more process: the
builder.  It imports TVM's compiler while the caller captures, builds what :data:`BUILT_APART` names
while the caller builds the others, and saves the artifact; the caller loads it, verifies it against
eager and hosts it in the timing processes like any candidate::

    caller:   capture | build cpu | build onnxruntime | build openvino | load tvm, verify | rank
    zygote:   import torch, mlcomp | fork builder | preload | fork timing process 1 | load ...
    builder:                        import tvm ......  | build tvm, save |

Protocol (one JSON line per reply on the builder's pipe; a forked builder says its pid first)::

    parent: "build PATH"    PATH: a pickled request {graph, inputs, target, pipeline, options, out}
    child:  {"built": FOLDER, "lowered": PATH, "seconds": s, "cpu": s}    the artifact saved in FOLDER,
                                                      the rest of :class:`~mlcomp.api.lowering.Lowered` pickled
            {"failed": REASON, "seconds": s}          the build failed: the candidate's own failure
    parent: "quit" or EOF   the child exits

Anything else going wrong (the builder gone, a request or a result that does not pickle) leaves
that candidate to the caller, who builds it itself, as without a builder.
"""
from __future__ import annotations

import json
import os
import pickle
import select
import shutil
import sys
import tempfile
import time
import weakref
from pathlib import Path
from typing import IO, Any, Sequence

import torch

from mlcomp.api.lowering import CompileResult, Lowered, finish_compile, lower_graph
from mlcomp.base.errors import MlcompError
from mlcomp.runtime.artifact import Artifact
from mlcomp.runtime.timing_host import preload
from mlcomp.runtime.timing_worker import run_child, save_for_worker
from mlcomp.runtime.zygote import Forked

__all__ = ["BUILT_APART", "SERVE", "Builder", "finish_built", "serve_build"]

# the candidates built in the builder process, and the modules their builds import (imported by the builder
# while the caller captures); measured on ResNet-18 (benchmarks/RESULTS.md, the auto compile sections)
BUILT_APART: dict[str, tuple[str, ...]] = {
    "tvm": ("tvm", "tvm.relax", "mlcomp.targets.tvm.target", "mlcomp.targets.tvm.build", "mlcomp.targets.tvm.lowering"),
}
SERVE = f"{__name__}:serve_build"      # what the zygote forks the builder to serve
REQUEST, ARTIFACT, LOWERED = "request.pkl", "artifact", "lowered.pkl"     # in a build's folder


class Builder:
    """The caller's handle on the builder process (:meth:`submit` a build, :meth:`collect` its reply);
    ``pipes``: the :class:`~mlcomp.runtime.zygote.Forked` pipes the zygote's spawn returned.  Each build has
    a folder of its own (request, artifact, the rest of its :class:`Lowered`), kept while its artifact is."""

    def __init__(self, pipes: Forked) -> None:
        self.pipes = pipes
        self.pending: list[Path] = []
        self.broken: str | None = None        # why the builder can no longer be used

    def submit(self, name: str, graph: Any, inputs: Sequence[Any], target: str, pipeline: Any,
               options: dict[str, Any]) -> bool:
        """Send a build of ``graph`` for ``target``; False (nothing sent) when the builder cannot take it."""
        if self.broken is not None:
            return False
        folder = Path(tempfile.mkdtemp(prefix=f"mlcomp-auto-{name}-"))
        try:
            with open(folder / REQUEST, "wb") as f:
                pickle.dump({"graph": graph, "inputs": list(inputs), "target": target, "pipeline": pipeline,
                             "options": options, "out": str(folder)}, f, protocol=pickle.HIGHEST_PROTOCOL)
            self.pipes.stdin.write(f"build {folder / REQUEST}\n".encode())
            self.pipes.stdin.flush()
        except (OSError, pickle.PicklingError, TypeError, AttributeError) as exc:
            shutil.rmtree(folder, ignore_errors=True)
            self.broken = f"{type(exc).__name__}: {exc}"
            return False
        self.pending.append(folder)
        return True

    def collect(self, timeout: float) -> dict[str, Any] | None:
        """The reply to the oldest build sent (its ``lowered`` unpickled, artifact not loaded yet), or None when
        the builder failed to answer (the caller builds that candidate itself)."""
        folder = self.pending.pop(0)
        end = time.monotonic() + timeout
        while True:
            ready, _, _ = select.select([self.pipes.stdout], [], [], max(0.0, end - time.monotonic()))
            line = self.pipes.stdout.readline() if ready else b""
            try:
                message = json.loads(line) if line else None
            except ValueError:
                message = None
            if message is None or "error" in message:
                self.broken = (message or {}).get("error") or ("no answer" if not ready else "it exited")
                if not ready:
                    self.pipes.kill()
                shutil.rmtree(folder, ignore_errors=True)
                return None
            if set(message) == {"pid"}:
                self.pipes.pid = int(message["pid"])
                continue
            break
        (folder / REQUEST).unlink(missing_ok=True)
        if "lowered" not in message:          # a failed build: nothing of it is kept
            shutil.rmtree(folder, ignore_errors=True)
            return message
        try:
            with open(folder / LOWERED, "rb") as f:
                message["lowered"] = pickle.load(f)
        except (OSError, pickle.UnpicklingError, EOFError, AttributeError) as exc:
            self.broken = f"its result does not load: {type(exc).__name__}: {exc}"
            shutil.rmtree(folder, ignore_errors=True)
            return None
        (folder / LOWERED).unlink(missing_ok=True)
        message["folder"] = str(folder)
        return message

    def close(self) -> None:
        """Tell it to quit (it exits at the end of its pipe); one still building is killed."""
        if self.pending:
            self.pipes.kill()
        for folder in self.pending:
            shutil.rmtree(folder, ignore_errors=True)
        for stream in (self.pipes.stdin, self.pipes.stdout):
            try:
                stream.close()
            except OSError:
                pass


def finish_built(reply: dict[str, Any], source: Any, graph: Any, *, capture_seconds: float, eager: Any,
                 options: dict[str, Any]) -> CompileResult:
    """The caller's half of a build the builder made (``reply``: :meth:`Builder.collect`'s): the artifact
    loaded from its folder, then the manifest's record, the eager reference and the verification
    (:func:`~mlcomp.api.lowering.finish_compile`).  The folder is removed when the artifact's runtime goes."""
    lowered: Lowered = reply["lowered"]
    lowered.artifact = Artifact.load(reply["built"])
    weakref.finalize(lowered.artifact.runtime, shutil.rmtree, reply["folder"], ignore_errors=True)
    return finish_compile(source, graph, lowered, verify=True, capture_seconds=capture_seconds,
                          raise_on_failure=False, eager=eager, **options)


def serve_build(config: dict[str, Any], channel: IO[str], commands: IO[str]) -> None:
    """The builder: import what :data:`BUILT_APART`'s builds need, then answer ``build`` until the end of input."""
    if config.get("sibling"):
        channel.write(json.dumps({"pid": os.getpid()}) + "\n")
        channel.flush()
    torch.set_num_threads(int(config["threads"]))
    os.environ.pop("TVM_USE_RUNTIME_LIB", None)     # the timing processes' setting: this one builds, so the compiler's
    preload([m for modules in BUILT_APART.values() for m in modules])
    for line in commands:
        verb, _, rest = line.strip().partition(" ")
        if verb != "build":
            break
        channel.write(json.dumps(build_request(Path(rest))) + "\n")
        channel.flush()


def build_request(path: Path) -> dict[str, Any]:
    """Build one pickled request (module doc): the reply."""
    t0, c0 = time.perf_counter(), time.process_time()
    with open(path, "rb") as f:
        request = pickle.load(f)
    try:
        lowered = lower_graph(request["graph"], request["inputs"], target=request["target"],
                              pipeline=request["pipeline"], **request["options"])
    except Exception as exc:  # noqa: BLE001 - the candidate's failure, reported as in the caller
        text = exc.message if isinstance(exc, MlcompError) else f"compile failed: {type(exc).__name__}: {exc}"
        return {"failed": " ".join(text.split())[:500], "seconds": time.perf_counter() - t0}
    out = Path(request["out"])
    folder = save_for_worker(lowered.artifact, out / ARTIFACT)
    with open(out / LOWERED, "wb") as f:
        pickle.dump(Lowered(None, lowered.report, lowered.graph, lowered.pipeline_seconds, lowered.spec), f,
                    protocol=pickle.HIGHEST_PROTOCOL)
    return {"built": str(folder), "lowered": LOWERED, "seconds": time.perf_counter() - t0,
            "cpu": time.process_time() - c0}


if __name__ == "__main__":
    sys.exit(run_child(serve_build, sys.argv[1:]))
