"""Study ``hybridize``: the chapter's MLP called 1000 and 10000 times, eager vs compiled.

The chapter times ``net(x)`` in a Python loop on one 1x512 sample before and
after compiling the network (MXNet ``hybridize``, TorchScript in the PyTorch
notebooks).  Here the same loop runs for eager PyTorch, for TorchScript (the
notebooks' method) and for every mlcomp target that is available.  Each loop
is one sample; the device is synchronised before the clock stops; the figure
is the median over repeats after a warm-up loop.
"""
from __future__ import annotations

from typing import Any, Callable

from ..timing import measure, synchronizer
from . import chapter
from .common import Figure, StudyConfig, StudyResult, Table, machine_line


def _runners(config: StudyConfig, model: Any, x: Any, device: str) -> list[tuple[str, Callable[..., Any] | None,
                                                                                  str]]:
    import torch

    from ..bench import compile_for

    runners: list[tuple[str, Callable[..., Any] | None, str]] = [("eager", model, "")]
    try:
        runners.append(("torchscript", torch.jit.script(model), "torch.jit.script, the notebooks' method"))
    except Exception as exc:  # noqa: BLE001 - report, do not abort the study
        runners.append(("torchscript", None, f"torch.jit.script failed: {exc}"))
    targets = list(config.targets) + (["cuda"] if device == "cuda" and "cuda" not in config.targets else [])
    for target in targets:
        if (target == "cuda") != (device == "cuda"):
            continue
        c = compile_for(model, (x,), target)
        note = f"mlcomp target, compiled in {c.compile_s:.2f} s" if c.fn else c.reason
        runners.append((target, c.fn, note))
    return runners


def run(config: StudyConfig) -> StudyResult:
    import torch

    from ..models import get

    device = config.resolved_device()
    zoo = get("mlp")
    model = zoo.build().to(device)
    x = zoo.example_inputs(1)[0].to(device)
    sync = synchronizer(device)
    counts = (10, 100) if config.quick else (1000, 10000)
    policy = config.policy(warmup=1, min_repeats=3)
    measured: dict[int, dict[str, float]] = {n: {} for n in counts}
    figures: list[Figure] = []
    with torch.inference_mode():
        runners = _runners(config, model, x, device)
        for n in counts:
            base = None
            for label, fn, note in runners:
                if fn is None:
                    figures.append(Figure(f"{label}, {n} calls", None, "s", "", note))
                    continue

                def loop(fn: Callable[..., Any] = fn, n: int = n) -> None:
                    for _ in range(n):
                        fn(x)

                t = measure(loop, policy, clock=config.timer, sync=sync)
                measured[n][label] = t.median
                base = t.median if label == "eager" else base
                ratio = f"{base / t.median:.2f}x eager" if base and label != "eager" else "reference"
                per_call = f"{t.median / n * 1e6:.1f} µs/call"
                key = ("eager" if label == "eager" else "compiled", n)
                figures.append(Figure(f"{label}, {n} calls", t.median, "s", chapter.HYBRIDIZE.get(key, ""),
                                      f"{per_call}; {ratio}; {note}".rstrip("; ")))
    speed = Table("speedup over eager (same loop, median)", ("runner",) + tuple(f"{n} calls" for n in counts),
                  tuple((label,) + tuple(f"{measured[n]['eager'] / measured[n][label]:.2f}x"
                                         if label in measured[n] else "—" for n in counts)
                        for label, _, _ in runners if label != "eager"), frozenset({1, 2}))
    notes = (
        "The chapter compares against 'compiled' as one number: MXNet hybridize at 1000 calls, "
        "torch.jit.script at 10000 calls; every compiled row here is set beside that figure.",
        "A model this small (0.33 MFLOP per call) is overhead-bound: per-call time is dominated by "
        "Python and dispatch, which is exactly what compilation removes; see `mlcomp bench mlp "
        "--batch 1,32,256` for where it stops being so.",
    )
    setup = (f"MLP 512-256-128-2 on one 1x512 sample, {device}; loops of {', '.join(map(str, counts))} calls; "
             f"warm-up {policy.warmup} loop, median of >= {policy.min_repeats} loops. {machine_line()}")
    return StudyResult("hybridize", "Imperative vs compiled: the MLP call loop (chapter 12.1)", setup,
                       tuple(figures), (speed,), notes, {"seconds": {str(n): v for n, v in measured.items()},
                                                         "device": device})


def plot(result: StudyResult, path: str) -> None:
    """Grouped bars per loop length: each runner's median, the chapter's eager/compiled in grey."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ..output import atomic_path

    data = result.data["seconds"]
    counts = list(data)
    labels = list(dict.fromkeys(lb for n in counts for lb in data[n]))
    fig, axes = plt.subplots(1, len(counts), figsize=(5 * len(counts), 3.8), squeeze=False)
    for ax, n in zip(axes[0], counts):
        names = [lb for lb in labels if lb in data[n]]
        vals = [data[n][lb] for lb in names]
        bars = ax.bar(names, vals, color="#4c72b0")
        ax.bar_label(bars, fmt="%.3g s", fontsize=7)
        ax.set_title(f"{n} calls of the MLP (median, measured here)", fontsize=9)
        ax.set_ylabel("seconds per loop")
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
