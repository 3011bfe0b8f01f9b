"""The anchors' executed-graph check: the kernels OpenVINO runs at the bf16 hint, mlcomp's side and its own.

``benchmarks/anchors.py`` calls :func:`graph_row` once per row (no clock; a process of its own, so its
compiles stay out of the timing workers' way)::

    graph_row("mlp-mixer@2", args)      # {"extra": {...}, "missing": {...}, "own_total": 39, "ours_total": 51, ...}

mlcomp's side is the pipeline ``GRAPH_PIPELINE`` for the openvino target; OpenVINO's own is
``ov.convert_model`` of ``torch.export`` (of the module where export fails).  Both are compiled with
``INFERENCE_PRECISION_HINT=bf16``, which shows the kernels of a bf16 run on any CPU.  Where OpenVINO's own
conversion fails, the answer says so and counts mlcomp's side alone.
"""
from __future__ import annotations

import argparse
import multiprocessing as mp
import os

from anchors_report import kernels_verdict   # benchmarks/ is the script folder: anchors.py runs it

GRAPH_PIPELINE = "-O2,mixed-precision{dtype=bf16}"


def build_row(row: str):
    """``(module in eval mode, example inputs)`` of a ``name@batch`` row: zoo, held-out or third-party."""
    import torch

    from mlcomp.models import ZOO
    from mlcomp.models.held_out import HELD_OUT, build_held_out
    from mlcomp.models.third_party import build_third_party

    name, batch = row.split("@")
    if name in ZOO:
        return ZOO[name].build(seed=0).eval(), ZOO[name].example_inputs(int(batch))
    if name in HELD_OUT:
        return build_held_out(name, int(batch))
    model, inputs = build_third_party(name, int(batch), seed=0)
    torch.manual_seed(0)
    return model, inputs


def graph_worker(conn, row: str, threads: int) -> None:
    """Kernels OpenVINO runs at the bf16 hint for mlcomp's bf16 pipeline and for its own conversion (no clock).

    OpenVINO's own side is each documented way in (:data:`~mlcomp.measure.executed.OV_WAYS`: the
    ``torch.export`` program and the module); the answer is the comparison with the best verdict, and
    ``others`` the verdicts against the rest."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    import warnings

    warnings.filterwarnings("ignore")
    from mlcomp.measure.executed import ov_owns

    def why(exc: BaseException) -> str:
        return " ".join(f"{type(exc).__name__}: {exc}".split())[:200]

    try:
        module, inputs = build_row(row)
        owns, failed = ov_owns(module, inputs)
    except BaseException as exc:  # noqa: BLE001 - the row itself cannot be built
        conn.send({"error": why(exc)})
        return
    if not owns:                  # OpenVINO's own conversion fails every way: mlcomp's side alone
        conn.send(_ours_alone(row, "; ".join(failed), threads))
        return
    try:
        answers = [_against(row, module, inputs, own, threads) for own in owns]
    except BaseException as exc:  # noqa: BLE001 - a failing side is a cell, not a crash
        conn.send({"error": why(exc)})
        return
    answers.sort(key=_rank)
    conn.send(dict(answers[0], others={a["anchor"]: kernels_verdict(a["extra"], a["missing"], a["own_total"],
                                                                    a["ours_total"]) for a in answers[1:]},
                   own_failed=failed))


def _against(row: str, module, inputs, own, threads: int) -> dict:
    from mlcomp.measure.executed import compare

    diff = compare(row, module, inputs, "openvino", pipeline=GRAPH_PIPELINE, hint="bf16", threads=threads, own=own)
    return {"extra": diff.extra(), "missing": diff.missing(), "own_total": sum(diff.own.values()),
            "ours_total": sum(diff.ours.values()), "anchor": diff.anchor, "effective": diff.effective}


def _rank(answer: dict) -> tuple[int, int]:
    """Met before not met, then the fewer kernels on OpenVINO's side (its better conversion)."""
    verdict = kernels_verdict(answer["extra"], answer["missing"], answer["own_total"], answer["ours_total"])
    return (0 if verdict.startswith("met") else 1, answer["own_total"])


def _ours_alone(row: str, own_error: str, threads: int) -> dict:
    """Where OpenVINO's own conversion fails: whether mlcomp's bf16 pipeline builds, and its kernel count."""
    try:
        import openvino as ov

        import mlcomp
        from mlcomp.measure.executed import ov_executed
        from mlcomp.targets.openvino.target import cpu_config

        module, inputs = build_row(row)
        art = mlcomp.compile(module, inputs, target="openvino", pipeline=GRAPH_PIPELINE, threads=threads)
        compiled = ov.Core().compile_model(art.runtime.model, "CPU", cpu_config("bf16", threads))
        return {"own_error": own_error, "ours_total": sum(ov_executed(compiled).values())}
    except BaseException as exc:  # noqa: BLE001 - both sides fail
        return {"error": f"both fail; mlcomp: {' '.join(f'{type(exc).__name__}: {exc}'.split())[:120]}"}


def graph_row(row: str, args: argparse.Namespace) -> dict:
    """:func:`graph_worker` in a process of its own (its compiles stay out of the timing workers' way)."""
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=graph_worker, args=(child, row, args.threads), daemon=True)
    proc.start()
    child.close()
    try:
        info = parent.recv() if parent.poll(args.build_timeout) else {"error": "no executed graph in time"}
    except EOFError:
        info = {"error": f"worker died (exit code {proc.exitcode})"}
    proc.join(10)
    if proc.is_alive():
        proc.terminate()
    return info
