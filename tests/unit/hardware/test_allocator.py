"""The host allocator policy: resolving ``auto``, applying once, and the resident set it leaves."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from mlcomp.base.errors import MlcompError
from mlcomp.hardware import allocator

# big blocks of growing size, each followed by a small block kept alive (so freed neighbours never merge),
# five big ones live at a time (four, then the next): glibc's heap has no hole that fits the next one and
# grows, mapped blocks go back to the OS; prints the live peak and the RSS high-water mark's growth
FRAGMENTING = r"""
import json, sys, torch
from mlcomp.hardware import allocator
from mlcomp.hardware.peak_memory import PeakMemory
state = allocator.apply(sys.argv[1], where="test")
first = torch.ones(16 << 20, dtype=torch.uint8); del first    # glibc raises its mmap threshold to 16 MiB
with PeakMemory("cpu") as mem:
    live, pins, peak = [], [], 0
    for i in range(40):
        live.append(torch.ones((1 << 20) + i * (64 << 10), dtype=torch.uint8))
        pins.append(torch.ones(1024, dtype=torch.uint8))
        peak = max(peak, sum(t.numel() for t in live))
        live = live[-4:]
print(json.dumps({"live": peak, "rss": mem.reading.growth, "state": state}))
"""


def _run(policy: str) -> dict:
    out = subprocess.run([sys.executable, "-c", FRAGMENTING, policy], capture_output=True, text=True, timeout=120,
                         check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt and /proc/self/status")


@LINUX
def test_return_policy_keeps_the_resident_set_at_the_live_bytes():
    returned = _run("return")
    if returned["state"].get("unavailable"):
        pytest.skip("this C library has no mallopt")
    assert returned["state"]["policy"] == "return" and returned["state"]["applied"] == "test"
    assert returned["rss"] <= 1.1 * returned["live"] + (1 << 20)     # the pins and page rounding


@LINUX
@pytest.mark.slow
def test_glibc_left_alone_grows_its_heap_over_freed_blocks():
    kept = _run("keep")
    assert kept["state"]["policy"] == "keep" and kept["rss"] > 2 * kept["live"]


def test_auto_returns_memory_only_for_a_step_that_asks_for_less():
    assert allocator.resolve("auto", wants_memory=True) == "return"
    assert allocator.resolve("auto", wants_memory=False) == "keep"
    assert allocator.resolve("return", wants_memory=False) == "return"
    with pytest.raises(MlcompError, match="host memory policy 'mmap' is not one of auto, keep, return"):
        allocator.resolve("mmap", wants_memory=True)


def test_asking_for_memory_reads_the_pipeline_and_the_fused_update():
    from mlcomp.training.host_memory import asks_for_memory

    assert asks_for_memory("remat{budget=0.25 fused=true},schedule{fused=true}", fused=False)
    assert asks_for_memory("cleanup", fused=True)
    assert not asks_for_memory("cleanup", fused=False) and not asks_for_memory(None, fused=False)
