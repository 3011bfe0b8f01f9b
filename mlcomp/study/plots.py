"""The plots of ``mlcomp bench`` and of the studies that have no plot of their own.

matplotlib is imported inside each function (``Agg`` backend, files only), so
importing this module costs nothing; every PNG is written atomically.
"""
from __future__ import annotations

from mlcomp.base.files import atomic_path
from mlcomp.study.common import StudyResult, format_value



def bar_plot(result: StudyResult, path: str, *, unit: str = "s") -> None:
    """Horizontal bars of every measured figure in ``unit`` (the default plot of a study)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs = [f for f in result.figures if f.unit == unit and f.measured is not None]
    fig, ax = plt.subplots(figsize=(11, 0.45 * max(len(figs), 2) + 1.6))
    labels = [f.label for f in figs][::-1]
    values = [f.measured for f in figs][::-1]
    ax.barh(labels, values, color="#4c72b0")
    for y, v in enumerate(values):
        ax.text(v, y, " " + format_value(v, unit), va="center", fontsize=8)
    positive = [v for v in values if v > 0]
    if positive and max(positive) / min(positive) > 50:      # figures spanning orders of magnitude
        ax.set_xscale("log")
    ax.set_xlabel({"s": "seconds (median)", "B": "bytes"}.get(unit, unit)
                  + (", log scale" if ax.get_xscale() == "log" else ""))
    fig.suptitle(result.title, fontsize=10)
    ax.margins(x=0.25)
    fig.tight_layout()
    with atomic_path(path, "png") as tmp:
        fig.savefig(tmp, format="png", dpi=110)
    plt.close(fig)
