"""The onnxruntime artifact's call overhead against calling its ``InferenceSession`` directly (wall clock)."""
from __future__ import annotations

import statistics
import time

import pytest

from mlcomp.targets import CompileOptions, get_target

pytestmark = [pytest.mark.perf, pytest.mark.ort]


def test_call_overhead_is_no_worse_than_calling_the_session_directly(captured):
    """The artifact (spec check + C++ run + from_numpy) against ``session.run`` with numpy feeds.

    One intra-op thread on both sides, so a busy machine cannot stall a worker thread of one
    and not the other; rounds are interleaved so load changes hit both alike.
    """
    _, (x,), graph = captured("mlp")
    art = get_target("onnxruntime").compile(graph, CompileOptions(threads=1))
    session = art.runtime.session
    name = session.get_inputs()[0].name

    def direct():
        return session.run(None, {name: x.numpy()})

    def ours():
        return art(x)

    times = {direct: [], ours: []}
    for fn in times:
        for _ in range(50):
            fn()
    for _ in range(30):
        for fn, acc in times.items():
            t0 = time.perf_counter()
            for _ in range(20):
                fn()
            acc.append((time.perf_counter() - t0) / 20)
    t_direct, t_ours = statistics.median(times[direct]), statistics.median(times[ours])
    assert t_ours <= 1.10 * t_direct + 5e-6, (t_ours, t_direct)
