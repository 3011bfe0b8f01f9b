"""Study ``hybridize``: the chapter's MLP called 1000 and 10000 times, eager vs compiled.

The chapter times ``net(x)`` in a Python loop on one 1x512 sample before and
after compiling the network (MXNet ``hybridize``, TorchScript in the PyTorch
notebooks).  Here the same loop runs for eager PyTorch, for TorchScript (the
notebooks' method) and for every mlcomp target that is available.  Each loop
is one sample; the device is synchronised before the clock stops; the figure
is the median over repeats after a warm-up loop.  The runners are timed in rotated rounds
(:func:`mlcomp.measure.rounds.compare`), so load drift on a shared machine falls on all of
them alike; each speedup is the median of the per-round ratios to eager with its 95 %
interval, and one that cannot be trusted (busy machine, spread, an interval including 1)
says why.
"""
from __future__ import annotations

from typing import Any, Callable

from mlcomp.hardware.decide import call_samplers
from mlcomp.hardware.noise import LoadWatch
from mlcomp.hardware.timing import synchronizer
from mlcomp.measure.rounds import MIN_ROUNDS, Comparison, compare
from mlcomp.study import chapter
from mlcomp.study.common import Figure, StudyConfig, StudyResult, Table, machine_line


def _runners(config: StudyConfig, model: Any, cpu_model: Any, x: Any,
             device: str) -> list[tuple[str, Callable[..., Any] | None, str]]:
    """(label, callable or None, note) per runner; targets compile from the CPU model, run on ``device``."""
    import torch

    from mlcomp.measure.bench import compile_for

    runners: list[tuple[str, Callable[..., Any] | None, str]] = [("eager", model, "")]
    try:
        runners.append(("torchscript", torch.jit.script(model), "torch.jit.script, the notebooks' method"))
    except Exception as exc:  # noqa: BLE001 - report, do not abort the study
        runners.append(("torchscript", None, f"torch.jit.script failed: {exc}"))
    targets = list(config.targets) + (["cuda"] if device == "cuda" and "cuda" not in config.targets else [])
    for target in targets:
        if (target == "cuda") != (device == "cuda"):
            where = "--device cuda" if target == "cuda" else "--device cpu"
            runners.append((target, None, f"runs on another device than this study; use {where}"))
            continue
        options = {} if config.threads is None else {"threads": config.threads}
        c = compile_for(cpu_model, (x.cpu(),), target, options=options)
        note = f"mlcomp target, compiled in {c.compile_s:.2f} s" if c.fn else c.reason
        runners.append((target, c.fn, note))
    return runners


def _loop(fn: Callable[..., Any], x: Any, n: int) -> Callable[[], None]:
    """The chapter's measurement: ``n`` calls in a Python loop, timed as one sample."""
    def loop() -> None:
        for _ in range(n):
            fn(x)

    return loop


def run(config: StudyConfig) -> StudyResult:
    import torch

    from mlcomp.models import get

    device = config.resolved_device()
    zoo = get("mlp")
    cpu_model = zoo.build()
    model = zoo.build().to(device)
    x = zoo.example_inputs(1)[0].to(device)
    sync = synchronizer(device)
    counts = (5, 20) if config.quick else (1000, 10000)
    policy = config.policy(warmup=1, min_repeats=3)
    measured: dict[int, dict[str, float]] = {n: {} for n in counts}
    compared: dict[int, Comparison] = {}
    figures: list[Figure] = []
    with torch.inference_mode():
        runners = _runners(config, model, cpu_model, x, device)
        for pos, n in enumerate(counts):
            loops = {label: _loop(fn, x, n) for label, fn, _ in runners if fn is not None}
            samplers = call_samplers(loops, warmup=policy.warmup, budget_s=policy.budget_s, clock=config.timer,
                                     syncs={k: sync for k in loops})
            compared[n] = c = compare(samplers, "eager", budget_s=policy.budget_s,
                                      min_rounds=max(policy.min_repeats, MIN_ROUNDS), max_rounds=policy.max_repeats,
                                      threads=torch.get_num_threads(), clock=config.timer,
                                      watch=None if config.clock else LoadWatch())
            measured[n] = {label: t.median for label, t in c.timings.items()}
            for label, fn, note in runners:
                if fn is None:
                    figures.append(Figure(f"{label}, {n} calls", None, "s", "", note))
                    continue
                med = measured[n][label]
                ratio = f"{c.speedups[label].text()} eager" if label != "eager" else "reference"
                key = ("eager" if label == "eager" else "compiled", pos)
                figures.append(Figure(f"{label}, {n} calls", med, "s", chapter.HYBRIDIZE.get(key, ""),
                                      f"{med / n * 1e6:.1f} µs/call; {ratio}; {note}".rstrip("; ")))
    speed = _speedup_table(runners, counts, compared)
    shaky = sorted({f"{label} at {n} calls: {why[0]}" for n, c in compared.items()
                    for label, why in c.reasons.items() if why and label != "eager"})
    notes = (
        ("UNRELIABLE: " + "; ".join(shaky)) if shaky else "Every speedup's interval is tight and the machine was quiet.",
        "The chapter compares against 'compiled' as one number: MXNet hybridize at 1000 calls, "
        "torch.jit.script at 10000 calls; every compiled row here is set beside that figure.",
        _rate_note(measured[counts[-1]].get("eager"), counts[-1]),
    )
    setup = (f"MLP 512-256-128-2 on one 1x512 sample, {device}; loops of {', '.join(map(str, counts))} calls; "
             f"warm-up {policy.warmup} loop, then runners timed in rotated rounds, median of >= "
             f"{min(max(policy.min_repeats, MIN_ROUNDS), policy.max_repeats)} loops each. {machine_line()}")
    return StudyResult("hybridize", "Imperative vs compiled: the MLP call loop (chapter 12.1)", setup,
                       tuple(figures), (speed,), notes, {"seconds": {str(n): v for n, v in measured.items()},
                                                         "device": device,
                                                         "comparisons": {str(n): c.to_json()
                                                                         for n, c in compared.items()}})


def _speedup_table(runners: list, counts: tuple[int, ...], compared: dict[int, Comparison]) -> Table:
    """Per runner and loop length: the paired speedup over eager with its 95 % interval, marked when unreliable."""
    def cell(label: str, n: int) -> str:
        s = compared[n].speedups.get(label)
        if s is None:
            return "—"
        return s.text() + (" UNRELIABLE" if compared[n].reasons.get(label) else "")
    return Table("speedup over eager (same loop; median of per-round ratios, 95% interval)",
                 ("runner",) + tuple(f"{n} calls" for n in counts),
                 tuple((label,) + tuple(cell(label, n) for n in counts) for label, _, _ in runners if label != "eager"),
                 frozenset(range(1, len(counts) + 1)))


def _rate_note(eager_s: float | None, calls: int) -> str:
    """What the eager loop's rate says: FLOP/s achieved by one call of the MLP."""
    flops = 2 * (512 * 256 + 256 * 128 + 128 * 2)          # multiply-adds of the three layers, batch 1
    if not eager_s:
        return ""
    per_call = eager_s / calls
    return (f"One call does {flops / 1e6:.2f} MFLOP; eager takes {per_call * 1e6:.0f} µs per call, i.e. "
            f"{flops / per_call / 1e9:.2f} GFLOP/s. Compare with this machine's peak (`mlcomp study roofline`): "
            "the loop measures per-call overhead (Python, dispatch, allocation), which is what compilation "
            "removes; `mlcomp bench mlp --batch 1,32,256` shows where that stops dominating.")


def plot(result: StudyResult, path: str) -> None:
    """Bars per loop length: each runner's median; the chapter's eager/compiled figures as grey lines."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mlcomp.base.files import atomic_path

    data = result.data["seconds"]
    counts = list(data)
    labels = list(dict.fromkeys(lb for n in counts for lb in data[n]))
    fig, axes = plt.subplots(1, len(counts), figsize=(5 * len(counts), 3.8), squeeze=False)
    for pos, (ax, n) in enumerate(zip(axes[0], counts)):
        names = [lb for lb in labels if lb in data[n]]
        vals = [data[n][lb] for lb in names]
        bars = ax.bar(names, vals, color="#4c72b0", label="measured here")
        ax.bar_label(bars, fmt="%.3g s", fontsize=7)
        if pos < 2 and int(n) == (1000, 10000)[pos]:    # the chapter timed 1000 and 10000 calls
            ed = "MXNet ed." if pos == 0 else "PyTorch nb."
            for kind, style in (("eager", "--"), ("compiled", ":")):
                ax.axhline(chapter.HYBRIDIZE_SECONDS[(kind, pos)], color="grey", ls=style, lw=1,
                           label=f"chapter, {kind} ({ed}, {(1000, 10000)[pos]} calls)")
            ax.legend(fontsize=7)
        ax.set_title(f"{n} calls of the MLP (median)", fontsize=9)
        ax.set_ylabel("seconds per loop")
        ax.tick_params(axis="x", labelrotation=20, labelsize=8)
    fig.tight_layout()
    with atomic_path(path, "png") as tmp:
        fig.savefig(tmp, format="png", dpi=100)
    plt.close(fig)
