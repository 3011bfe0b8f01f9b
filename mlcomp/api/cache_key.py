"""The compile cache's key: everything that decides what a compile produces, hashed.

    >>> from mlcomp.ir.builder import linear_relu_graph
    >>> graph = linear_relu_graph(batch=2, features=512, out=256)     # relu(x @ W.T + b)
    >>> key = cache_key(graph, pipeline="cleanup,fuse,cleanup", target="cpu", options=CompileOptions())
    >>> len(key.short), sorted(key.parts)            # the hash changes with any part (mlcomp_source too)
    (12, ['format', 'graph', 'machine', 'mlcomp_source', 'model', 'options', 'pipeline',
          'target', 'versions'])
    >>> key == cache_key(graph, pipeline="cleanup", target="cpu", options=CompileOptions())
    False

Parts (all JSON, so the key is the same in every process):

* ``graph``: a digest of the captured graph's text (nodes, ops, literal arguments, shapes,
  dtypes, names, module paths), its mode and the names of its symbolic sizes (the shape
  class: not their example values, so one entry serves every size), and every constant's name, dtype,
  shape and bytes.  Two captures of the same model with the same weights agree; one
  changed weight changes it.
* ``pipeline``: the canonical spec of the pipeline *as it runs for the target* (a preset
  after adaptation, options written out only where they differ from the defaults).
* ``target`` and ``options``: the target name and every :class:`CompileOptions` field.
* ``versions``: python, mlcomp, torch and every backend's package version, plus a digest
  of mlcomp's own source files (a development tree changes without a version bump).
* ``machine``: the CPU model and its vector/matrix feature flags, and the GPU name when
  one is used (passes decide from the hardware probe).

Equal keys mean the artifact can be reused.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

import torch

from mlcomp.hardware.probe import cpu_flags, cpu_name
from mlcomp.ir import Graph
from mlcomp.targets import CompileOptions
from mlcomp.runtime.artifact import versions

__all__ = ["CacheKey", "cache_key", "graph_digest", "source_digest", "KEY_FORMAT"]

KEY_FORMAT = 1     # bump when the parts or their encoding change


@dataclass(frozen=True)
class CacheKey:
    """A hex digest and the parts it was computed from (stored with the entry for ``mlcomp cache info``)."""

    digest: str
    parts: Mapping[str, Any]

    @property
    def short(self) -> str:
        return self.digest[:12]


class UncacheableGraph(Exception):
    """A constant whose bytes cannot be read plainly (sparse, quantized, on a meta device)."""


def _tensor_bytes(name: str, tensor: torch.Tensor) -> memoryview:
    if tensor.layout is not torch.strided or tensor.is_quantized or tensor.device.type == "meta":
        raise UncacheableGraph(f"constant {name} is a {tensor.layout} {tensor.device.type} tensor")
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return memoryview(flat.view(torch.uint8).numpy())


def graph_digest(graph: Graph) -> str:
    """A digest of the graph's structure and constant bytes, stable across processes."""
    h = hashlib.blake2b(digest_size=32)
    h.update(graph.format().encode())
    # symbols by name only: their example values are one call's sizes, and an artifact serves every size
    h.update(json.dumps({"mode": str(graph.mode), "symbols": sorted(graph.symbols),
                         "devices": sorted({str(getattr(n.meta, "device", "")) for n in graph.nodes()})}).encode())
    for name in sorted(graph.constants):
        tensor = graph.constants[name]
        h.update(f"\0{name}\0{tensor.dtype}\0{tuple(tensor.shape)}\0".encode())
        h.update(_tensor_bytes(name, tensor))
    return h.hexdigest()


@lru_cache(maxsize=1)
def source_digest() -> str:
    """A digest of mlcomp's own Python files (relative path and bytes, in sorted order).

    Taken once per process: the code that runs is the code imported, whatever changes on
    disk afterwards (in a shared development tree, files change under a running process).
    """
    root = Path(__file__).resolve().parents[1]      # the mlcomp package
    h = hashlib.blake2b(digest_size=16)
    for path in sorted(root.rglob("*.py")):
        h.update(path.relative_to(root).as_posix().encode() + b"\0")
        h.update(path.read_bytes())
    return h.hexdigest()


def _machine(device: str) -> dict[str, Any]:
    out: dict[str, Any] = {"cpu": cpu_name(), "cpu_flags": list(cpu_flags())}
    if device.startswith("cuda") and torch.cuda.is_available():
        out["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return out


def cache_key(graph: Graph, *, pipeline: str | None, target: str, options: CompileOptions,
              device: str = "cpu", extra: Mapping[str, Any] | None = None) -> CacheKey:
    """The key of compiling ``graph`` with ``pipeline`` (canonical spec) for ``target`` with ``options``.

    ``extra``: further parts that change the result (the auto target's candidate list).
    Raises :class:`UncacheableGraph` when a constant's bytes cannot be hashed.
    """
    parts: dict[str, Any] = {
        "format": KEY_FORMAT, "model": graph.name, "graph": graph_digest(graph), "pipeline": pipeline or "",
        "target": target, "options": options.to_json(), "versions": versions(),
        "mlcomp_source": source_digest(), "machine": _machine(device),
    }
    if extra:
        parts.update(extra)
    text = json.dumps(parts, sort_keys=True, default=str)
    return CacheKey(hashlib.blake2b(text.encode(), digest_size=32).hexdigest(), parts)
