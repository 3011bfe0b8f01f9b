"""Which machine a measurement belongs to: a short digest of what makes targets rank differently.

The CPU model, the instruction-set extensions kernels dispatch on (AVX2/FMA, AVX-512, AMX, VNNI),
the cores, torch's intra-op threads and version, and the GPU if any.  Two processes on one host
with the same thread count get the same fingerprint; a host with another CPU kind (or the same
host asked for another thread count) gets another.  Read through :func:`~mlcomp.hardware.probe.cpu_info`,
so a fake hardware profile changes it::

    host_fingerprint()        # 'c1d2e3f4a5b6c7d8' (16 hex digits)
    host_facts()["cpu"]       # 'AMD EPYC 9R14'
"""
from __future__ import annotations

import hashlib
import json
import os
from typing import Any

import torch

from mlcomp.hardware.probe import cpu_info

__all__ = ["host_facts", "host_fingerprint"]

_FLAG_PREFIXES = ("avx", "amx", "fma", "f16c", "sse4", "neon", "sve", "asimd")


def host_facts() -> dict[str, Any]:
    """The facts the fingerprint hashes (JSON-ready)."""
    info = cpu_info()
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    return {"cpu": info.name, "flags": sorted(f for f in info.flags if f.startswith(_FLAG_PREFIXES)),
            "cores": os.cpu_count(), "threads": torch.get_num_threads(), "torch": torch.__version__, "gpu": gpu}


def host_fingerprint(facts: dict[str, Any] | None = None) -> str:
    """16 hex digits naming this host's (or ``facts``') kind for recorded measurements."""
    text = json.dumps(facts if facts is not None else host_facts(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]
