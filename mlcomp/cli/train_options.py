"""Options of ``mlcomp compile --train`` for the step itself (no torch import: the CLI starts fast)."""
from __future__ import annotations

from typing import Any

import click

__all__ = ["train_step_options"]


def train_step_options(fn: Any) -> Any:
    """``--loss``, ``--optimizer``, ``--steps``, ``--loss-scale``, ``--fused-update`` and ``--host-memory`` of
    ``mlcomp compile --train``."""
    fn = click.option("--host-memory", type=click.Choice(["auto", "return", "keep"]), default="auto",
                      show_default=True,
                      help="With --train: whether tensors the step frees go back to the OS (return: the RSS follows "
                           "the predicted peak, a page fault per 4 KiB allocated; keep: glibc's reuse; auto: return "
                           "for a step with remat, schedule or --fused-update).")(fn)
    fn = click.option("--fused-update", is_flag=True,
                      help="With --train: update each parameter inside the backward as soon as its gradient is "
                           "complete, and free the gradient there (a lower peak; the same parameters).")(fn)
    fn = click.option("--loss-scale", default=None, metavar="SPEC",
                      help='With --train: dynamic, none, a static scale (1024) or '
                           '"dynamic{init=65536 growth_interval=2000}" (default: dynamic when the graph computes in '
                           "fp16, else none).")(fn)
    fn = click.option("--steps", type=click.IntRange(min=1), default=5, show_default=True,
                      help="With --train: compiled steps compared with as many eager steps.")(fn)
    fn = click.option("--optimizer", default="sgd{lr=0.01 momentum=0.9}", show_default=True,
                      help='With --train: e.g. "sgd{lr=0.05 momentum=0.9}" or "adam{lr=1e-3}".')(fn)
    return click.option("--loss", default="cross_entropy", show_default=True,
                        help="With --train: cross_entropy, mse or model.")(fn)
