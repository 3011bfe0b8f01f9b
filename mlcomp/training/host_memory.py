"""Which host allocator policy a training step gets (:mod:`mlcomp.hardware.allocator`), and when.

A step that asks for less memory -- a pipeline with ``remat`` or ``schedule``, a
rematerialised graph, the optimizer in the backward -- is worth nothing to a user
who watches the process's resident set unless freed tensors go back to the OS, so
``host_memory="auto"`` gives it the ``return`` policy; any other step keeps glibc's
own (buffers reused, no page faults).  The API and the CLI call :func:`before_capture`
with the request, so the policy holds before the model's first tensors are freed;
:func:`at_compile` applies it for a graph that arrives already captured (less
completely: blocks freed earlier stay in the heap's free lists).

    >>> asks_for_memory("cleanup,remat{budget=0.5}", fused=False), asks_for_memory(None, fused=False)
    (True, False)
"""
from __future__ import annotations

from typing import Any

from mlcomp.hardware import allocator
from mlcomp.ir import Graph
from mlcomp.pipeline.spec import Pipeline

__all__ = ["MEMORY_PASSES", "asks_for_memory", "at_compile", "before_capture", "rematerialised"]

MEMORY_PASSES = frozenset({"remat", "schedule"})   # passes whose point is a lower peak
RECOMPUTED = ".remat"                              # in the name of every node remat adds


def rematerialised(graph: Graph) -> bool:
    """Whether ``remat`` recomputes something in ``graph``."""
    return any(RECOMPUTED in n.name for n in graph)


def asks_for_memory(pipeline: Any, *, fused: bool) -> bool:
    """Whether a request (a pipeline as :meth:`~mlcomp.pipeline.spec.Pipeline.coerce` takes it, the fused
    update) aims at a lower peak."""
    names = set(Pipeline.coerce(pipeline).names) if pipeline not in (None, "") else set()
    return fused or bool(names & MEMORY_PASSES)


def before_capture(choice: str, pipeline: Any, *, fused: bool) -> dict[str, Any]:
    """Apply the policy ``choice`` resolves to for this request, before anything is captured."""
    return allocator.apply(allocator.resolve(choice, wants_memory=asks_for_memory(pipeline, fused=fused)),
                           where="before capture")


def at_compile(choice: str, graph: Graph, *, fused: bool) -> dict[str, Any]:
    """Apply the policy for a captured graph (``auto``: rematerialised or fused); the process's setting."""
    return allocator.apply(allocator.resolve(choice, wants_memory=fused or rematerialised(graph)),
                           where="at compile")
