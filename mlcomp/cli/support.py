"""``mlcomp support``: the support matrix (architectures x capture, -O2 per target, mixed precision, training).

    mlcomp support                                   # everything; docs/SUPPORT.md and docs/SUPPORT.json
    mlcomp support --models mlp,bert,gpt2 --cells capture,O2:cpu,O2:onnxruntime,train --md out.md --json out.json

The same code as ``benchmarks/support_matrix.py`` (:mod:`mlcomp.measure.support_run`).
"""
from __future__ import annotations

from pathlib import Path

import click

__all__ = ["support_cmd"]


@click.command("support")
@click.option("--models", default=None, help="Comma-separated architectures (default: every one buildable here).")
@click.option("--cells", default=None,
              help="Comma-separated cells: capture, train, O2:T, bf16:T, fp16:T (default: all for this host).")
@click.option("--timeout", "timeout_s", type=float, default=180.0, show_default=True, help="Seconds per cell.")
@click.option("--isolate", is_flag=True, help="One child process per cell (slower).")
@click.option("--json", "json_out", default=None, metavar="FILE", help="JSON output (default docs/SUPPORT.json).")
@click.option("--md", "md_out", default=None, metavar="FILE", help="Markdown output (default docs/SUPPORT.md).")
@click.option("--no-probe", is_flag=True, help="Skip the bf16/fp16 matmul probe in the header.")
def support_cmd(models: str | None, cells: str | None, timeout_s: float, isolate: bool, json_out: str | None,
                md_out: str | None, no_probe: bool) -> None:
    """Run the support matrix: each cell verified, refused up front with a reason, or failed with its first error."""
    from mlcomp.measure.support_run import DOCS, run_support

    run_support(models, cells, timeout_s=timeout_s, isolate=isolate,
                json_path=Path(json_out) if json_out else DOCS / "SUPPORT.json",
                md_path=Path(md_out) if md_out else DOCS / "SUPPORT.md", probe=not no_probe,
                command="mlcomp support", echo=click.echo)
