"""The bench plot: speedup per target and batch with 95 % intervals, and latency against batch size (log axes).

A bar is the median paired speedup; its error bar the interval.  An unreliable cell is
hatched, its label ends in "?", and a line under the axes says why.

matplotlib is imported inside the function (``Agg`` backend, files only); the PNG is written atomically.
"""
from __future__ import annotations

from typing import Any, Sequence

from mlcomp.base.files import atomic_path

__all__ = ["bench_plot", "EAGER"]

EAGER = "eager"   # the bench's reference target


def _speedup_bars(ax: Any, rows: Sequence[Any], offset: float, width: float, label: str) -> None:
    """One target's bars across batches: median speedup, interval as error bar, unreliable ones hatched."""
    xs, ys, lo, hi, shaky = [], [], [], [], []
    for j, r in enumerate(rows):
        if r is None or not r.speedup:
            continue
        xs.append(j + offset)
        ys.append(r.speedup)
        lo.append(r.speedup - (r.interval.lo if r.interval else r.speedup))
        hi.append((r.interval.hi if r.interval else r.speedup) - r.speedup)
        shaky.append(bool(r.unreliable))
    bars = ax.bar(xs, ys, width, label=label, yerr=[lo, hi], capsize=3, error_kw={"lw": 0.8})
    for bar, bad in zip(bars, shaky):
        if bad:
            bar.set_hatch("//")
            bar.set_alpha(0.5)
    ax.bar_label(bars, labels=[f"{y:.2f}" + ("?" if bad else "") for y, bad in zip(ys, shaky)], fontsize=7)


def bench_plot(results: Sequence[Any], path: str) -> None:
    """Per model: speedup per target and batch (bars), latency vs batch on log axes (lines)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(len(results), 1)
    fig, axes = plt.subplots(n, 2, figsize=(12, 3.6 * n), squeeze=False)
    for (ax_s, ax_l), res in zip(axes, results):
        ok = [r for r in res.rows if r.status == "ok" and r.timing]
        batches = sorted({r.batch for r in res.rows})
        labels = list(dict.fromkeys(r.label for r in ok))
        compiled = [lb for lb in labels if not lb.startswith(EAGER)]
        width = 0.8 / max(len(compiled), 1)
        for k, lb in enumerate(compiled):
            _speedup_bars(ax_s, [next((r for r in ok if r.label == lb and r.batch == b), None) for b in batches],
                          (k - (len(compiled) - 1) / 2) * width, width, lb)
        missing = sorted({f"{r.label}: {r.status}" for r in res.rows if r.status != "ok"})
        shaky = sorted({f"{r.label} b{r.batch} ({', '.join(w.split(':')[0] for w in r.unreliable)})"
                        for r in ok if r.unreliable and r.interval})
        notes = (["not shown: " + "; ".join(missing)] if missing else []) + \
                (["unreliable (hatched, ?): " + "; ".join(shaky)] if shaky else [])
        if notes:
            import textwrap

            ax_s.text(0.0, -0.14, "\n".join(textwrap.fill(n, 95) for n in notes), transform=ax_s.transAxes,
                      fontsize=6, color="#a00", va="top")
        ax_s.axhline(1.0, color="black", lw=0.8, ls="--")
        ax_s.set_xticks(range(len(batches)), [f"batch {b}" for b in batches])
        ax_s.set_ylabel("speedup over eager (median, 95% CI)")
        ax_s.set_title(f"{res.model}: speedup per target", fontsize=10)
        if compiled:
            ax_s.legend(fontsize=8)
        for lb in labels:
            pts = sorted((r.batch, r.timing.median) for r in ok if r.label == lb)
            ax_l.plot([p[0] for p in pts], [p[1] * 1e3 for p in pts], marker="o", label=lb)
        eager = sorted((r.batch, r.timing.median) for r in ok if r.label == EAGER)
        if eager and len(batches) > 1:    # guides through eager's smallest batch: flat and proportional
            b0, t0 = eager[0]
            ax_l.plot(batches, [t0 * 1e3] * len(batches), color="grey", lw=0.7, ls=":",
                      label="flat: overhead-bound")
            ax_l.plot(batches, [t0 * 1e3 * b / b0 for b in batches], color="grey", lw=0.7, ls="--",
                      label="∝ batch: compute-bound")
        ax_l.set_xscale("log")
        ax_l.set_yscale("log")
        ax_l.set_xticks(batches, [str(b) for b in batches])
        ax_l.minorticks_off()
        ax_l.set_xlabel("batch size")
        ax_l.set_ylabel("latency per call, ms (median)")
        ax_l.set_title(f"{res.model}: latency vs batch size", fontsize=10)
        ax_l.legend(fontsize=7)
        ax_l.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    with atomic_path(path, "png") as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
