"""Running the support matrix from a command line: choose rows and columns, write JSON and Markdown.

:func:`plan` turns the ``--models`` / ``--cells`` choices into architectures and
cells (an unknown name is refused before anything runs; targets and architectures
this host cannot run are recorded in ``left_out`` with the reason); :func:`main` is
``benchmarks/support_matrix.py`` and ``mlcomp support``::

    >>> names, cells, left_out = plan("mlp,bert", "capture,O2:cpu,train")
    >>> names, [c.key for c in cells]
    (['mlp', 'bert'], ['capture', 'O2:cpu', 'train'])
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Callable, Sequence

from mlcomp.base.errors import OptionError, OutputPathError
from mlcomp.base.files import write_text_atomic
from mlcomp.measure.support_cells import Cell, CellResult, Status
from mlcomp.measure.support_doc import host_info, matrix_json, merge_runs, render_markdown
from mlcomp.measure.support_matrix import (
    DEFAULT_TIMEOUT_S, Matrix, default_cells, host_dtypes, inference_targets, run_matrix,
)

__all__ = ["main", "plan", "run_support", "write_results"]

MD_MARK = "<!-- written by mlcomp: benchmarks/support_matrix.py (mlcomp support); regenerate, do not edit -->"
DOCS = Path(__file__).resolve().parents[2] / "docs"


def _split(text: str | None) -> list[str]:
    return [t.strip() for t in (text or "").split(",") if t.strip()]


def plan(models: str | None, cells: str | None) -> tuple[list[str], list[Cell], dict[str, str]]:
    """``(architectures, cells, left_out)`` for the comma lists given (None: everything runnable here)."""
    from mlcomp.base.registry import did_you_mean
    from mlcomp.hardware.probe import cpu_flags
    from mlcomp.models.architectures import ARCHITECTURES, available_architectures

    usable, missing = available_architectures()
    names = _split(models) or usable
    for name in names:
        if name not in ARCHITECTURES:
            close = did_you_mean(name, ARCHITECTURES)
            raise OptionError(f"--models: there is no architecture named {name!r}"
                              + (f" (did you mean {close!r}?)" if close else ""),
                              hint=f"choose from {', '.join(ARCHITECTURES)}")
    targets, unavailable = inference_targets()
    left_out = {f"architecture {n}": why for n, why in missing.items()}
    left_out.update({f"target {t}": why for t, why in unavailable.items()})
    if cells:
        try:
            chosen = [Cell.parse(c) for c in _split(cells)]
        except ValueError as exc:
            raise OptionError(f"--cells: {exc}", hint="cells are capture, train, O2:T, bf16:T, fp16:T") from None
    else:
        import torch

        chosen = default_cells(targets, host_dtypes(torch.cuda.is_available(), cpu_flags()))
    return [n for n in names if n not in missing], chosen, left_out


def write_results(matrix: Matrix, host: dict, json_path: Path | None, md_path: Path | None, command: str,
                  earlier: dict | None = None) -> dict:
    """Write the run's record (folded into ``earlier``'s when given: :func:`merge_runs`) and its document."""
    data = {**matrix_json(matrix, host), "command": command}
    if earlier is not None:
        data = merge_runs(earlier, data)
    if json_path is not None:
        write_text_atomic(json_path, json.dumps({"written_by": "mlcomp", **data}, indent=1) + "\n", "json")
    if md_path is not None:
        _write_markdown(md_path, render_markdown(data, data["command"]))
    return data


def _write_markdown(path: Path, text: str) -> None:
    """Replace ``path`` only if it is missing or an earlier support matrix (its first line is :data:`MD_MARK`)."""
    if path.exists() and (path.is_dir() or path.read_text(errors="replace").split("\n", 1)[0] != MD_MARK):
        raise OutputPathError(f"the output {path} exists and is not a support matrix mlcomp wrote; "
                              "mlcomp never replaces it", hint="give a new file name with --md")
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(f"{MD_MARK}\n{text}")
    os.replace(tmp, path)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="support_matrix", description=__doc__.splitlines()[0])
    p.add_argument("--models", help="comma-separated architectures (default: all buildable here)")
    p.add_argument("--cells", help="comma-separated cells: capture, train, O2:T, bf16:T, fp16:T "
                                   "(default: all for this host)")
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT_S, help="seconds per cell")
    p.add_argument("--isolate", action="store_true", help="one child process per cell (slower)")
    p.add_argument("--json", default=str(DOCS / "SUPPORT.json"), help="JSON output ('' for none)")
    p.add_argument("--md", default=str(DOCS / "SUPPORT.md"), help="Markdown output ('' for none)")
    p.add_argument("--no-probe", action="store_true", help="skip the bf16/fp16 matmul probe in the header")
    p.add_argument("--render", metavar="JSON", help="only write --md from an earlier run's JSON (no cells run)")
    p.add_argument("--update", metavar="JSON", help="fold the cells run into an earlier run's JSON (the other "
                                                   "cells keep its results; the host lines stay its host's)")
    return p


def run_support(models: str | None = None, cells: str | None = None, *, timeout_s: float = DEFAULT_TIMEOUT_S,
                isolate: bool = False, json_path: Path | None = DOCS / "SUPPORT.json",
                md_path: Path | None = DOCS / "SUPPORT.md", probe: bool = True, command: str = "",
                echo: Callable[[str], None] = print, update: Path | None = None) -> dict:
    """Plan, run and write the matrix; returns :func:`~mlcomp.measure.support_doc.matrix_json`'s record
    (with ``update``: that earlier record with these cells re-run, :func:`merge_runs`)."""
    from mlcomp.models.architectures import ARCHITECTURES

    earlier = _earlier(update) if update is not None else None
    names, chosen, left_out = plan(models, cells)
    host = host_info(precision_probe=probe)
    partial = Matrix(chosen, left_out=left_out)

    def progress(name: str, key: str, result: CellResult) -> None:
        partial.families[name] = ARCHITECTURES[name].family
        partial.rows.setdefault(name, {})[key] = result
        write_results(partial, host, json_path, None, command, earlier)    # a killed run keeps what it finished
        echo(f"{name:16s} {key:18s} {result.status.value:8s} {result.seconds:6.1f}s  {result.detail}")

    matrix = run_matrix(names, chosen, timeout_s=timeout_s, isolate=isolate, on_cell=progress)
    matrix.left_out = left_out
    data = write_results(matrix, host, json_path, md_path, command, earlier)
    failed = sum(r.status is Status.FAILED for row in matrix.rows.values() for r in row.values())
    echo(f"{len(names)} architectures x {len(chosen)} cells in {matrix.seconds / 60:.1f} min; {failed} failed")
    return data


def _earlier(path: Path) -> dict:
    """An earlier run's record; refused (before anything runs) if it is missing or not one mlcomp wrote."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise OptionError(f"--update: cannot read an earlier support matrix from {path} ({exc})",
                          hint="give the JSON a full run wrote (docs/SUPPORT.json)") from None
    if not isinstance(data, dict) or data.pop("written_by", None) != "mlcomp" or "rows" not in data:
        raise OptionError(f"--update: {path} is not a support matrix mlcomp wrote",
                          hint="give the JSON a full run wrote (docs/SUPPORT.json)")
    return data


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.render:
        data = json.loads(Path(args.render).read_text())
        data.pop("written_by", None)
        _write_markdown(Path(args.md), render_markdown(data, data.get("command") or "benchmarks/support_matrix.py"))
        return 0
    command = "python benchmarks/support_matrix.py " + " ".join(argv if argv is not None else sys.argv[1:])
    run_support(args.models, args.cells, timeout_s=args.timeout, isolate=args.isolate,
                json_path=Path(args.json) if args.json else None, md_path=Path(args.md) if args.md else None,
                probe=not args.no_probe, command=command.strip(),
                update=Path(args.update) if args.update else None)
    return 0
