"""One timing process of ``benchmarks/commits.py``: compiles a zoo model with the mlcomp that
``PYTHONPATH`` points at (a checkout of any commit) and times it on request.

    PYTHONPATH=/path/to/checkout python benchmarks/tree_worker.py MODEL BATCH TARGET PIPELINE THREADS

It uses only what every mlcomp since the layer split has (``mlcomp.models.ZOO``,
``mlcomp.compile``), prints ``ready COMPILE_S MAX_REL_ERR`` once built and checked against
eager, then answers each ``sample SECONDS`` line with the seconds per call of a block of calls
lasting about SECONDS (after an untimed block of the same length: the thread pools of the
process timed before it spin down meanwhile), and stops at ``quit`` or the end of input.
"""
from __future__ import annotations

import sys
import time


def _outputs(value):
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    return [t for v in value for t in _outputs(v)]


def build(model: str, batch: int, target: str, pipeline: str, threads: int):
    """The compiled callable, its inputs, compile seconds and max relative error against eager."""
    import torch

    import mlcomp
    from mlcomp.models import ZOO

    torch.set_num_threads(threads)
    module = ZOO[model].build(seed=0).eval()
    inputs = ZOO[model].example_inputs(batch)
    with torch.no_grad():
        expected = _outputs(module(*inputs))
        start = time.perf_counter()
        if target == "eager":
            fn, seconds = module, 0.0
        else:
            fn = mlcomp.compile(module, inputs, target=target, pipeline=pipeline or None, threads=threads)
            seconds = time.perf_counter() - start
        got = _outputs(fn(*inputs))
    err = max(float(((g.float() - e.float()).abs().max() / e.float().abs().max().clamp_min(1e-12)))
              for g, e in zip(got, expected))
    return fn, inputs, seconds, err


def block(fn, inputs, seconds: float) -> float:
    """Seconds per call over calls lasting about ``seconds`` (at least one call)."""
    calls, start = 0, time.perf_counter()
    while True:
        fn(*inputs)
        calls += 1
        spent = time.perf_counter() - start
        if spent >= seconds:
            return spent / calls


def main(argv: list[str]) -> int:
    import torch

    model, batch, target, pipeline, threads = argv[0], int(argv[1]), argv[2], argv[3], int(argv[4])
    fn, inputs, seconds, err = build(model, batch, target, pipeline, threads)
    print(f"ready {seconds:.3f} {err:.3e}", flush=True)
    with torch.no_grad():
        for line in sys.stdin:
            words = line.split()
            if not words or words[0] == "quit":
                break
            block(fn, inputs, float(words[1]))                  # lead-in, untimed
            print(f"{block(fn, inputs, float(words[1])):.9f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
