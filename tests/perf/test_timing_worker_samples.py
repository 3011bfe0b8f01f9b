"""The timing worker's samples on the wall clock: a sample is seconds per call, not per block of calls."""
from __future__ import annotations

import pytest

from mlcomp.hardware.timing import calls_per_block
from mlcomp.runtime.timing_worker import ProcessSampler
from tests.unit.runtime.test_timing_worker import saved  # noqa: F401  (the saved cpu artifact and its inputs)

pytestmark = pytest.mark.perf


def test_a_sample_is_seconds_per_call(saved):  # noqa: F811
    folder, feed, _ = saved
    with ProcessSampler.start(folder, feed, threads=1, warmup=2, block_s=0.01, label="cpu") as worker:
        per_call = worker.wait_ready(timeout=300)
        samples = [worker.sample() for _ in range(3)]
    assert worker.calls == calls_per_block(0.01, per_call)
    assert worker.calls > 20                       # the mlp takes well under 0.5 ms a call
    # a sample is seconds per call, not per block of ``calls`` calls
    assert all(per_call / 20 < s < per_call * 20 for s in samples)
