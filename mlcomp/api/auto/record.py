"""What earlier ``auto`` compiles measured on this host, kept so the next one ranks without timing.

A record is keyed by (:class:`RecordKey`): the host's kind (:func:`mlcomp.hardware.fingerprint.host_fingerprint`:
CPU, its vector extensions, cores, torch threads and version, GPU), the model's class (its ops in
order and its constants' shapes, not their values: a retrained model of one architecture shares
it), the inputs' shape class (dtypes and shapes, the batch bucketed: 1, 2-8, 9-64, 65+) and the
setup (candidates, pipeline, the options that change a build).  It holds the median seconds per
call of each candidate that verified and was timed, and the pick.

The second ``auto`` compile with the same key builds its candidates best-recorded first and stops
at the first that compiles and verifies; nothing is timed.  Another host, shape class or setup has
another key, so it measures (and records) again.  Records live in the compile cache's folder,
``<cache>/auto-records/<digest>.json``; one that cannot be read is ignored (and rewritten by the
next measured compile)::

    store = RecordStore(tmp / "auto-records")
    key = record_key(graph, inputs, ["cpu", "onnxruntime"], "-O2", options)
    store.save(AutoRecord(key, {"cpu": 0.0021, "onnxruntime": 0.0009}, "onnxruntime"))
    store.load(key).order(["cpu", "onnxruntime"])      # ['onnxruntime', 'cpu']
"""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Sequence

from mlcomp.hardware.fingerprint import host_fingerprint

__all__ = ["FORMAT", "RECORDS_DIR", "AutoRecord", "RecordKey", "RecordStore", "batch_bucket", "model_class",
           "record_key", "shape_class"]

RECORDS_DIR = "auto-records"
FORMAT = 1
_BUCKETS = ((1, "1"), (8, "2-8"), (64, "9-64"))


def batch_bucket(n: int) -> str:
    """The batch's class: ``1``, ``2-8``, ``9-64`` or ``65+``.

        >>> [batch_bucket(n) for n in (1, 2, 32, 128)]
        ['1', '2-8', '9-64', '65+']
    """
    return next((name for top, name in _BUCKETS if n <= top), "65+")


def shape_class(inputs: Sequence[Any]) -> str:
    """The inputs' dtypes and shapes, the leading (batch) axis bucketed: ``float32[1,3,32,32]``."""
    parts = []
    for x in inputs:
        shape = list(getattr(x, "shape", ()))
        dims = [batch_bucket(int(shape[0])), *map(str, shape[1:])] if shape else []
        parts.append(f"{str(getattr(x, 'dtype', type(x).__name__)).replace('torch.', '')}[{','.join(dims)}]")
    return " ".join(parts)


def model_class(graph: Any) -> str:
    """16 hex digits of the graph's name, its ops in order and its constants' shapes (not their values)."""
    h = hashlib.sha256(str(getattr(graph, "name", "")).encode())
    for node in graph.call_nodes():
        h.update(str(node.op).encode() + b";")
    for name, value in sorted(graph.constants.items()):
        h.update(f"{name}:{tuple(value.shape)}:{value.dtype};".encode())
    return h.hexdigest()[:16]


@dataclass(frozen=True)
class RecordKey:
    """Host kind, model class, shape class and setup: what a record answers for."""

    host: str
    model: str
    shape: str
    setup: str

    @property
    def digest(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:24]


def record_key(graph: Any, inputs: Sequence[Any], candidates: Sequence[str], pipeline: Any, options: Any,
               host: str | None = None) -> RecordKey:
    """The key of an ``auto`` compile of ``graph`` on ``inputs`` (``host``: default this machine's fingerprint)."""
    setup = json.dumps({"candidates": list(candidates), "pipeline": str(pipeline),
                        "options": options.to_json() if hasattr(options, "to_json") else repr(options)},
                       sort_keys=True, default=str)
    return RecordKey(host or host_fingerprint(), model_class(graph), shape_class(inputs),
                     hashlib.sha256(setup.encode()).hexdigest()[:16])


@dataclass(frozen=True)
class AutoRecord:
    """One measured ``auto`` compile: seconds per call of each timed candidate and the pick."""

    key: RecordKey
    medians: dict[str, float]
    picked: str

    def order(self, names: Sequence[str]) -> list[str]:
        """``names`` best-recorded first (the pick, then by median); unrecorded ones after, in their order."""
        known = sorted((n for n in names if n in self.medians), key=lambda n: (n != self.picked, self.medians[n]))
        return known + [n for n in names if n not in self.medians]

    def ratio(self, name: str) -> float | None:
        """``name``'s recorded median over the pick's (None: not recorded)."""
        if name not in self.medians or not self.medians.get(self.picked):
            return None
        return self.medians[name] / self.medians[self.picked]

    def to_json(self) -> dict[str, Any]:
        return {"format": FORMAT, "key": asdict(self.key), "medians_s": dict(self.medians), "picked": self.picked}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "AutoRecord":
        return cls(RecordKey(**data["key"]), {k: float(v) for k, v in data["medians_s"].items()}, data["picked"])


class RecordStore:
    """Records as one JSON file per key under ``root``."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)

    def path(self, key: RecordKey) -> Path:
        return self.root / f"{key.digest}.json"

    def load(self, key: RecordKey) -> AutoRecord | None:
        """The record of ``key``, or None (none, unreadable, another format, or its key differs)."""
        try:
            data = json.loads(self.path(key).read_text())
            record = AutoRecord.from_json(data) if data.get("format") == FORMAT else None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return record if record is not None and record.key == key and record.picked in record.medians else None

    def save(self, record: AutoRecord) -> Path:
        """Write ``record`` (atomically: a reader sees the old file or the new one)."""
        self.root.mkdir(parents=True, exist_ok=True)
        target = self.path(record.key)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=".record-", suffix=".json")
        with os.fdopen(fd, "w") as fh:
            json.dump(record.to_json(), fh, indent=1, sort_keys=True)
        os.replace(tmp, target)
        return target
