"""A check from outside: eager and each artifact timed as whole processes, no in-process clock involved.

For every variant two processes run: one that loads it and makes no call, one that loads it
and makes ``calls`` calls (``python -m mlcomp.measure.crosscheck CONFIG``).  The parent times
each process from start to exit; ``(t_calls - t_0) / calls`` is the time per call with start-up
(interpreter, imports, loading) removed.  Variants and the two lengths are run in rotated
rounds, the median over rounds taken, and a variant's whole-process speedup is eager's time
per call over its own.  ``calls`` is sized per variant from its in-process median so that its calls last
about ``CALLS_S`` seconds.

It agrees with the in-process figure when the in-process timing measures what a user's
process will see; a large gap means one of them is measuring something else (start-up,
thread pools competing, caches).  Where start-up varies more than the calls take (a busy
machine), there is no figure: the column shows "—".
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from statistics import median
from typing import Any

__all__ = ["CALLS_S", "ROUNDS", "crosscheck"]

CALLS_S = 3.0     # seconds of calls per long process
ROUNDS = 3


def _calls_for(per_call_s: float) -> int:
    return max(10, min(20_000, int(CALLS_S / max(per_call_s, 1e-7))))


def _run(config: dict[str, Any], calls: int) -> float:
    from mlcomp.runtime.timing_worker import _child_env

    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "mlcomp.measure.crosscheck", json.dumps({**config, "calls": calls})],
                          env=_child_env(), capture_output=True, text=True, timeout=900)
    took = time.perf_counter() - start
    if done.returncode != 0:
        tail = " | ".join([s for s in done.stderr.splitlines() if s.strip()][-2:])
        raise RuntimeError(f"the whole-process run failed (status {done.returncode}): {tail}")
    return took


def crosscheck(artifacts: Mapping[str, Any], eager: Mapping[str, Any], inputs: Sequence[Any], *,
               per_call_s: Mapping[str, float], threads: int) -> dict[str, float | None]:
    """Whole-process speedup over eager per artifact (None where start-up varied more than the calls took) (``artifacts``: name -> Artifact; ``eager``: the
    ``load_model`` arguments of the reference; ``per_call_s``: in-process medians, to size the runs)."""
    from mlcomp.measure.samplers import saved
    from mlcomp.runtime.timing_worker import save_inputs

    with tempfile.TemporaryDirectory(prefix="mlcomp-crosscheck-") as tmp:
        root = Path(tmp)
        feed = str(save_inputs(inputs, root / "inputs.pt"))
        configs = {"eager": {"model": dict(eager), "artifact": None, "inputs": feed, "threads": threads}}
        for name, art in artifacts.items():
            configs[name] = {"model": None, "artifact": str(saved(art, root / name)), "inputs": feed,
                             "threads": threads}
        names = list(configs)
        calls = {n: _calls_for(per_call_s[n]) for n in names}
        times: dict[str, dict[int, list[float]]] = {n: {0: [], calls[n]: []} for n in names}
        for r in range(ROUNDS):
            for name in names[r % len(names):] + names[:r % len(names)]:
                for n in ((0, calls[name]) if r % 2 == 0 else (calls[name], 0)):
                    times[name][n].append(_run(configs[name], n))
    per_call = {n: _per_call(t[0], t[calls[n]], calls[n]) for n, t in times.items()}
    base = per_call["eager"]
    return {n: (base / v if base is not None and v is not None else None) for n, v in per_call.items() if n != "eager"}


def _per_call(short: Sequence[float], long: Sequence[float], calls: int) -> float | None:
    """Seconds per call from the runs without and with ``calls`` calls; None when the calls took less
    than twice the spread of start-up (the figure would be start-up noise).

        >>> _per_call([1.0, 1.1, 1.0], [3.0, 3.1, 3.0], 1000), _per_call([1.0, 2.0, 1.5], [2.0, 2.5, 2.1], 10)
        (0.002, None)
    """
    took = median(long) - median(short)
    return took / calls if took > 2 * (max(short) - min(short)) and took > 0 else None


def main(argv: list[str]) -> int:
    """The child: load the variant, make ``calls`` calls, exit."""
    import torch

    from mlcomp.runtime.timing_worker import load_runner

    config = json.loads(argv[0])
    torch.set_num_threads(int(config["threads"]))
    runner, _ = load_runner(config)
    inputs = torch.load(config["inputs"], map_location="cpu", weights_only=True)
    with torch.inference_mode():
        for _ in range(int(config["calls"])):
            runner(*inputs)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
