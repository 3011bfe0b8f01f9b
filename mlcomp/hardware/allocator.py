"""The host's C allocator: whether memory a step frees goes back to the OS.

torch's CPU tensors come from ``malloc``.  glibc serves a block from ``mmap``
(returned to the OS on free) only while it is above the *mmap threshold*, and it
raises that threshold to the size of each mmapped block freed, up to 32 MiB.  After
the first training step nearly every tensor therefore comes from the heap, where a
freed block stays resident and later blocks are cut from whatever free chunk fits:
the process's resident set grows to the heap's extent, not to the live bytes.
Measured on ResNet-18 (CIFAR shape, batch 32, SGD with momentum) the step's RSS
high-water mark rises 294 MiB above its baseline for a predicted and allocator peak
of 177 MiB, and 199 MiB for a rematerialised step predicted at 78 MiB.

A policy (:data:`POLICIES`, rules as data) configures glibc through ``mallopt``:

* ``keep`` -- glibc as it is: blocks are reused from the heap (no page faults), the
  RSS includes the heap's fragmentation;
* ``return`` -- the mmap and trim thresholds held at glibc's initial 128 KiB: every
  tensor of 128 KiB or more is mapped on allocation and unmapped on free, so the RSS
  follows the live bytes (the predicted peak) at the price of a page fault per
  4 KiB allocated (about 0.5 s of system time per ResNet-18 step above).

The setting is process-wide and cannot be undone (glibc has no call that restores
its adaptive threshold), so it is applied once, as early as possible: big blocks
freed *before* it sit in the heap's free lists, and later tensors reuse them.  The
API and the CLI apply it before capturing a model whose step asks for less memory
(``auto``: a pipeline with ``remat`` or ``schedule``, or the optimizer in the
backward); :func:`state` says what was applied and when, for the manifest.

    >>> POLICIES["return"].mmap_threshold, POLICIES["keep"].mmap_threshold is None
    (131072, True)
    >>> resolve("auto", wants_memory=True), resolve("auto", wants_memory=False), resolve("keep", wants_memory=True)
    ('return', 'keep', 'keep')
"""
from __future__ import annotations

import ctypes
import ctypes.util
from dataclasses import dataclass
from typing import Any

from mlcomp.base.errors import MlcompError

__all__ = ["M_MMAP_THRESHOLD", "M_TRIM_THRESHOLD", "POLICIES", "AllocatorPolicy", "apply", "resolve", "state"]

M_TRIM_THRESHOLD = -1     # glibc's mallopt parameter numbers (malloc.h)
M_MMAP_THRESHOLD = -3
GLIBC_INITIAL_THRESHOLD = 128 * 1024


@dataclass(frozen=True)
class AllocatorPolicy:
    """What a policy sets: ``None`` leaves glibc's own adaptive behaviour."""

    name: str
    mmap_threshold: int | None
    trim_threshold: int | None
    effect: str


POLICIES: dict[str, AllocatorPolicy] = {p.name: p for p in (
    AllocatorPolicy("keep", None, None, "glibc's adaptive mmap threshold: freed blocks stay in the heap and are "
                    "reused; the RSS includes the heap's fragmentation"),
    AllocatorPolicy("return", GLIBC_INITIAL_THRESHOLD, GLIBC_INITIAL_THRESHOLD,
                    "blocks of 128 KiB or more mapped on allocation and returned to the OS on free: the RSS follows "
                    "the live bytes; one page fault per 4 KiB allocated"),
)}
CHOICES = ("auto", *POLICIES)

_applied: dict[str, Any] = {}      # the process's setting: policy, thresholds, where it was applied


def resolve(choice: str, *, wants_memory: bool) -> str:
    """The policy name for ``choice`` (``auto``: ``return`` when the step asks for less memory)."""
    if choice not in CHOICES:
        raise MlcompError(f"host memory policy {choice!r} is not one of {', '.join(CHOICES)}",
                          hint="auto (return memory when the step is rematerialised or fused), return, or keep")
    if choice == "auto":
        return "return" if wants_memory else "keep"
    return choice


def _libc() -> Any:
    name = ctypes.util.find_library("c") or "libc.so.6"
    try:
        lib = ctypes.CDLL(name)
        return lib if hasattr(lib, "mallopt") else None
    except OSError:
        return None


def apply(name: str, *, where: str) -> dict[str, Any]:
    """Apply policy ``name`` to the process (once: a later call with ``keep`` changes nothing) and return
    :func:`state`.  ``where`` names the moment (``before capture``, ``at compile``) for the manifest."""
    policy = POLICIES[name]
    if policy.mmap_threshold is None or _applied.get("policy") == name:
        return state()
    libc = _libc()
    if libc is None:             # not glibc (musl, macOS): nothing to configure
        _applied.update(policy="keep", unavailable="no mallopt in this C library")
        return state()
    ok = libc.mallopt(M_MMAP_THRESHOLD, policy.mmap_threshold) == 1
    ok = ok and libc.mallopt(M_TRIM_THRESHOLD, policy.trim_threshold) == 1
    libc.malloc_trim(0)
    _applied.clear()
    _applied.update(policy=name if ok else "keep", mmap_threshold=policy.mmap_threshold,
                    trim_threshold=policy.trim_threshold, applied=where, effect=policy.effect)
    if not ok:
        _applied["unavailable"] = "mallopt refused the thresholds"
    return state()


def state() -> dict[str, Any]:
    """The process's allocator setting as mlcomp left it (``policy``: ``keep`` until a policy is applied)."""
    return dict(_applied) if _applied else {"policy": "keep", "effect": POLICIES["keep"].effect}
