"""The support matrix: every architecture x every cell, each cell guarded by a timeout in a child process.

    >>> [c.key for c in default_cells(["cpu", "tvm"], ["bf16"])]
    ['capture', 'O2:cpu', 'O2:tvm', 'bf16:cpu', 'bf16:tvm', 'train']

and ``run_matrix(["mlp", "bert"], cells)`` runs them (``.rows["bert"]["O2:cpu"].status``).

Isolation: one child process per architecture runs that architecture's cells one
after another (the model is built once) and reports the start and end of each
cell through a pipe.  A cell that runs past ``timeout_s``, or a child that dies
(a segfault or abort inside a backend), costs only that cell: it is recorded as
failed (``timed out after …`` / ``process died …``), the child is ended and a
fresh one runs the architecture's remaining cells.  ``isolate=True`` gives every
cell its own child.  Children come from a ``forkserver`` that has imported torch,
``transformers`` and mlcomp once, so a child starts in a fraction of a second.

:func:`default_cells` is the full column list for this host: capture, ``-O2`` on
every available target, ``mixed-precision`` per target for each dtype the host runs
(:func:`host_dtypes`), and a training step on cpu.
"""
from __future__ import annotations

import multiprocessing as mp
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from mlcomp.measure.support_cells import Cell, CellResult, Status, run_cell

__all__ = ["Matrix", "default_cells", "host_dtypes", "inference_targets", "preload_modules", "run_matrix", "MATRIX_TARGETS"]

MATRIX_TARGETS = ("cpu", "onnxruntime", "openvino", "tvm", "cuda")
DEFAULT_TIMEOUT_S = 180.0
# imported once by the forkserver, so no child pays for them: capture, the targets and their backends
_PRELOAD = ["torch", "torch.export", "torch._dynamo", "transformers", "mlcomp.api", "mlcomp.frontend.joint",
            "mlcomp.measure.support_cells", "mlcomp.models.architectures", "mlcomp.targets.registry",
            "mlcomp.targets.torch.cpu"]
# a target's modules, preloaded only when some cell runs on it (``import tvm`` alone is ~2.5 CPU-s); an
# ``auto`` cell builds every candidate, so it needs them all
_TARGET_PRELOAD = {"onnxruntime": ["onnxruntime", "mlcomp.targets.onnx.target"],
                   "openvino": ["openvino", "mlcomp.targets.openvino.target"],
                   "tvm": ["tvm", "mlcomp.targets.tvm.target"]}
_TARGET_PRELOAD["auto"] = [m for modules in _TARGET_PRELOAD.values() for m in modules]


@dataclass
class Matrix:
    """Results by architecture and cell key, plus what the run could not include and why."""

    cells: list[Cell]
    rows: dict[str, dict[str, CellResult]] = field(default_factory=dict)
    families: dict[str, str] = field(default_factory=dict)
    left_out: dict[str, str] = field(default_factory=dict)     # architecture or target -> why
    seconds: float = 0.0


def inference_targets() -> tuple[list[str], dict[str, str]]:
    """``(targets usable here, {target: why not})`` among :data:`MATRIX_TARGETS`."""
    from mlcomp.targets.registry import available_targets

    avail = available_targets()
    usable = [t for t in MATRIX_TARGETS if avail.get(t) is None]
    return usable, {t: str(avail.get(t)) for t in MATRIX_TARGETS if t not in usable}


def host_dtypes(cuda: bool, cpu_flags: Sequence[str]) -> list[str]:
    """Low precisions the host runs: bf16 (torch runs it on every CPU, natively with
    ``avx512_bf16``/``amx_bf16``, emulated otherwise); fp16 with a GPU or native CPU fp16
    (``avx512_fp16``/``amx_fp16``) only, since an emulated fp16 CPU product is not a precision
    anyone deploys.

    >>> host_dtypes(False, ("avx512f",)), host_dtypes(False, ("amx_fp16",)), host_dtypes(True, ())
    (['bf16'], ['bf16', 'fp16'], ['bf16', 'fp16'])
    """
    native_fp16 = any(f in ("avx512_fp16", "amx_fp16") for f in cpu_flags)
    return ["bf16"] + (["fp16"] if cuda or native_fp16 else [])


def default_cells(targets: Sequence[str], dtypes: Sequence[str]) -> list[Cell]:
    """capture, ``O2:<target>`` each, ``<dtype>:<target>`` each, train."""
    return [Cell("capture"), *(Cell("O2", t) for t in targets),
            *(Cell(d, t) for d in dtypes for t in targets), Cell("train")]


def _worker(name: str, keys: list[str], conn: Any) -> None:
    """Child: build ``name`` once, run each cell, send ``("start", key)`` and ``("done", key, json)``."""
    import torch

    torch.set_num_threads(1)
    try:
        import transformers

        transformers.logging.set_verbosity_error()
    except ImportError:
        pass
    from mlcomp.models.architectures import build_architecture
    from mlcomp.measure.support_cells import Session, classify

    try:
        model, inputs = build_architecture(name)
    except Exception as exc:   # noqa: BLE001 - a model that cannot be built fails every cell
        status, detail = classify(exc)
        for key in keys:
            conn.send(("done", key, CellResult(status, f"building the model: {detail}").to_json()))
        return
    session = Session(model, inputs)
    for key in keys:
        conn.send(("start", key))
        conn.send(("done", key, run_cell(session, Cell.parse(key)).to_json()))
    conn.close()


def _modeling_modules(names: Sequence[str]) -> list[str]:
    """The ``transformers`` modules defining the models of ``names`` (imported here to find them)."""
    from mlcomp.models.architectures import ARCHITECTURES

    found = []
    for name in names:
        arch = ARCHITECTURES[name]
        if arch.source == "transformers":
            try:
                import transformers

                found.append(getattr(transformers, arch.config).__module__.replace("configuration_", "modeling_"))
            except (ImportError, AttributeError):
                continue
    return list(dict.fromkeys(found))


def preload_modules(cells: Sequence[Cell]) -> list[str]:
    """What the forkserver imports once for ``cells``: capture's and the cpu target's modules, and the modules
    of each other target some inference cell runs on (every target's for ``auto``)."""
    targets = dict.fromkeys(c.target for c in cells if c.kind not in ("capture", "train"))
    return list(dict.fromkeys(_PRELOAD + [m for t in targets for m in _TARGET_PRELOAD.get(t, ())]))


def _context(names: Sequence[str], cells: Sequence[Cell]) -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(preload_modules(cells) + _modeling_modules(names))
    return ctx


def _run_child(ctx: Any, name: str, keys: list[str], timeout_s: float,
               on_cell: Callable[[str, str, CellResult], None]) -> dict[str, CellResult]:
    """Run ``keys`` of ``name`` in children until every key has a result."""
    results: dict[str, CellResult] = {}
    pending = list(keys)
    while pending:
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_worker, args=(name, pending, child), daemon=True)
        proc.start()
        child.close()
        current, started = None, time.perf_counter()
        while pending:
            if not parent.poll(timeout_s if current else timeout_s * 2):
                why = f"timed out after {timeout_s:.0f} s" if current else "the child process did not start"
                proc.kill()
                break
            try:
                msg = parent.recv()
            except EOFError:
                proc.join(5)
                why = f"process died (exit code {proc.exitcode})"
                break
            if msg[0] == "start":
                current, started = msg[1], time.perf_counter()
                continue
            results[msg[1]] = CellResult.from_json(msg[2])
            on_cell(name, msg[1], results[msg[1]])
            pending.remove(msg[1])
            current = None
        else:
            proc.join(10)
            break
        proc.join(5)
        lost = current or pending[0]
        results[lost] = CellResult(Status.FAILED, why, time.perf_counter() - started)
        on_cell(name, lost, results[lost])
        pending.remove(lost)
    return results


def run_matrix(names: Sequence[str], cells: Sequence[Cell], *, timeout_s: float = DEFAULT_TIMEOUT_S,
               isolate: bool = False, on_cell: Callable[[str, str, CellResult], None] | None = None) -> Matrix:
    """Run every cell of every architecture (one child at a time); ``on_cell`` sees each result."""
    from mlcomp.models.architectures import ARCHITECTURES

    report = on_cell or (lambda name, key, result: None)
    matrix = Matrix(list(cells))
    ctx = _context(names, cells)
    t0 = time.perf_counter()
    keys = [c.key for c in cells]
    for name in names:
        matrix.families[name] = ARCHITECTURES[name].family
        groups = [[k] for k in keys] if isolate else [keys]
        row: dict[str, CellResult] = {}
        for group in groups:
            row.update(_run_child(ctx, name, group, timeout_s, report))
        matrix.rows[name] = {k: row[k] for k in keys}
    matrix.seconds = time.perf_counter() - t0
    return matrix
