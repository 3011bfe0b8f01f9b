"""The compile cache: saved artifact folders keyed by :func:`mlcomp.api.cache_key.cache_key`.

    $ mlcomp compile mlp --target cpu -o out/a        # cold: capture, passes, lowering, verify, store
    cache miss ca02ab8c9972: compiled and stored
    $ mlcomp compile mlp --target cpu -o out/b        # warm: capture, lookup, load, verify
    cache hit ca02ab8c9972: reused the stored artifact (passes and lowering skipped)

Layout under the root (default ``~/.cache/mlcomp``, see :func:`default_cache_dir`)::

    CACHEDIR.TAG                 marks the folder as a cache for backup tools
    entries/<key>/entry.json     key parts, creation time, size and sha256 of every file below
    entries/<key>/artifact/      the folder Artifact.save wrote (manifest.json, payload, reference.pt)
    tmp/                         entries being written (one private folder per writer)
    trash/                       entries being removed

An entry is written in a private folder under ``tmp/`` and renamed to ``entries/<key>``
in one step; a directory rename never replaces a non-empty folder, so when two
processes store the same key the first rename wins and the second writer discards its
copy.  Removal renames the entry into ``trash/`` first, so a reader sees a whole entry
or none.  A lookup checks every file against ``entry.json`` (missing, extra, size,
sha256) and then loads the artifact (which checks its own payload); any problem removes
the entry and reports one line, and the caller compiles again.  Only verified artifacts
are stored; one that cannot be saved (or saved again once loaded, such as eager fallback
regions) is not cached, and the outcome says why.

Size cap: after every store the least recently used entries are evicted until the
entries fit ``max_bytes`` (default :data:`DEFAULT_MAX_BYTES`, 2 GiB; ``--cache-max-size``,
``mlcomp cache prune --max-size``).  The entry just stored is never evicted, even when
it alone is over the cap (the prune report says so).  An entry's use time is its
folder's mtime, set when it is stored and on every hit: one ``utime`` call, atomic,
without rewriting the checksummed ``entry.json`` that a concurrent reader may be
checking.  Eviction is removal (rename into ``trash/``, then delete), and a lookup
whose entry vanishes underneath it is a plain miss, not a corrupt entry::

    $ mlcomp compile mlp -o a; mlcomp compile lenet -o b; mlcomp compile mlp -o a2     # the hit refreshes mlp
    $ mlcomp compile mlp -O1 -o d --cache-max-size 1.5MiB --explain
    cache miss 695205e78e19: compiled and stored
    cache over its 1.5 MiB cap: evicted 1 least recently used entry (265.2 KiB); 1.3 MiB left in 2 entries
    cache evicted 592d0a44ab75 (lenet, cpu, 265.2 KiB)
"""
from __future__ import annotations

import enum
import json
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlcomp.api.cache_key import CacheKey
from mlcomp.api.cache_size import DEFAULT_MAX_BYTES, CacheEntry, PruneReport, lru_victims, parse_size
from mlcomp.base.errors import MlcompError
from mlcomp.base.files import sha256_file
from mlcomp.runtime.artifact import Artifact

__all__ = ["CompileCache", "CacheStatus", "CacheOutcome", "CacheEntry", "PruneReport", "default_cache_dir",
           "parse_size", "DEFAULT_MAX_BYTES", "ENTRY_FORMAT"]   # the size pieces live in mlcomp.api.cache_size

ENTRY = "entry.json"
MANIFEST = "manifest.json"
ARTIFACT = "artifact"
ENTRY_FORMAT = 1
_TAG = ("Signature: 8a477f597d28d172789f06886806bc55\n"
        "# This file is a cache directory tag created by mlcomp (compiled artifacts).\n")


def default_cache_dir() -> Path:
    """The user's cache folder for mlcomp: ``~/.cache/mlcomp``."""
    return Path.home() / ".cache" / "mlcomp"


class CacheStatus(enum.Enum):
    HIT = "hit"                 # an entry was reused: no passes, no lowering
    STORED = "stored"           # a miss: compiled, verified and stored
    NOT_STORED = "not-stored"   # a miss: compiled, but the artifact cannot be cached (reason)
    BYPASSED = "bypassed"       # the cache was not consulted (reason)


@dataclass
class CacheOutcome:
    """What the cache did for one compile; ``line()`` is what the CLI prints."""

    status: CacheStatus
    key: CacheKey | None = None
    reason: str | None = None
    removed: list[str] = field(default_factory=list)   # one line per corrupt entry removed

    def line(self) -> str:
        short = self.key.short if self.key else "-"
        if self.status is CacheStatus.HIT:
            return f"cache hit {short}: reused the stored artifact (passes and lowering skipped)"
        if self.status is CacheStatus.STORED:
            return f"cache miss {short}: compiled and stored"
        if self.status is CacheStatus.NOT_STORED:
            return f"cache miss {short}: not stored: {self.reason}"
        return f"cache not used: {self.reason}"

    def to_json(self) -> dict[str, Any]:
        return {"status": self.status.value, "key": self.key.digest if self.key else None,
                "reason": self.reason, "removed": list(self.removed)}


class CorruptEntry(Exception):
    """An entry that fails its checks; the message says which."""




def _files(folder: Path) -> dict[str, Path]:
    return {p.relative_to(folder).as_posix(): p for p in sorted(folder.rglob("*")) if p.is_file()}


def _payload_names(manifest: Path | None) -> set[str]:
    """The files an artifact's manifest lists with their sha256 (checked again by ``Artifact.load``)."""
    try:
        return {e["path"] for e in json.loads(manifest.read_text())["payload"]} if manifest else set()
    except (OSError, ValueError, KeyError, TypeError):
        return set()


class CompileCache:
    """A compile cache rooted at ``root``, its entries kept under ``max_bytes`` (``None``: no cap).

    Counts ``hits``, ``misses``, ``stores``, ``corrupt`` and ``evicted`` entries; ``last_prune``
    is the :class:`PruneReport` of the latest store.
    """

    def __init__(self, root: str | os.PathLike[str], max_bytes: int | None = DEFAULT_MAX_BYTES) -> None:
        self.root = Path(root).expanduser()
        self.max_bytes = None if max_bytes is None else parse_size(max_bytes, option="max_bytes")
        self.hits = self.misses = self.stores = self.corrupt = self.evicted = 0
        self.last_prune: PruneReport | None = None

    def __repr__(self) -> str:
        return f"<CompileCache {self.root}: {self.hits} hit(s), {self.misses} miss(es)>"

    @property
    def entries_dir(self) -> Path:
        return self.root / "entries"

    def path(self, key: CacheKey) -> Path:
        return self.entries_dir / key.digest

    def _prepare(self) -> None:
        if self.root.exists() and not self.root.is_dir():
            raise MlcompError(f"the cache folder {self.root} is a file", hint="give --cache-dir a folder")
        for sub in ("entries", "tmp", "trash"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        tag = self.root / "CACHEDIR.TAG"
        if not tag.exists():
            tmp = self.root / "tmp" / f"CACHEDIR.TAG.{os.getpid()}"
            tmp.write_text(_TAG)
            os.replace(tmp, tag)

    # -- lookup -------------------------------------------------------------
    def lookup(self, key: CacheKey) -> tuple[Artifact | None, str | None]:
        """The stored artifact for ``key`` (None on a miss) and a line if a corrupt entry was removed."""
        entry = self.path(key)
        if not entry.is_dir():
            self.misses += 1
            return None, None
        try:
            self._check(entry, key)
            artifact = Artifact.load(entry / ARTIFACT)
        except (CorruptEntry, MlcompError, OSError, ValueError, KeyError, TypeError) as exc:
            if not entry.is_dir():      # evicted or removed by another process while we read it
                self.misses += 1
                return None, None
            what = exc.what if isinstance(exc, MlcompError) else str(exc)
            what = what.split(" is damaged: ", 1)[-1]          # Artifact.load's "the artifact at PATH is damaged"
            self.remove(entry)
            self.corrupt += 1
            self.misses += 1
            what = " ".join(what.split())[:300]
            return None, f"cache entry {key.short} is corrupt ({what}); removed, compiling again"
        self.hits += 1
        _touch(entry)                   # a hit makes the entry the most recently used
        return artifact, None

    def _check(self, entry: Path, key: CacheKey) -> dict[str, Any]:
        try:
            record = json.loads((entry / ENTRY).read_text())
        except FileNotFoundError:
            raise CorruptEntry(f"{ENTRY} is missing") from None
        except (ValueError, UnicodeDecodeError):
            raise CorruptEntry(f"{ENTRY} is not valid JSON") from None
        if not isinstance(record, dict) or record.get("key") != key.digest or record.get("format") != ENTRY_FORMAT:
            raise CorruptEntry(f"{ENTRY} does not describe key {key.short}")
        listed = {f["path"]: f for f in record.get("files", [])}
        found = _files(entry / ARTIFACT)
        if set(listed) != set(found):
            missing, extra = sorted(set(listed) - set(found)), sorted(set(found) - set(listed))
            raise CorruptEntry("files " + ", ".join([*(f"{m} missing" for m in missing),
                                                     *(f"{x} unexpected" for x in extra)]))
        for name, path in found.items():
            if path.stat().st_size != listed[name]["bytes"]:
                raise CorruptEntry(f"{name} does not match its checksum (truncated or modified)")
        # hashed here: the artifact's manifest and anything it does not list; its payload files are hashed
        # by Artifact.load against that manifest (once, not twice: resnet18's payload is 45 MB)
        covered = _payload_names(found.get(MANIFEST))
        for name, path in found.items():
            if name not in covered and sha256_file(path) != listed[name]["sha256"]:
                raise CorruptEntry(f"{name} does not match its checksum (truncated or modified)")
        return record

    # -- store --------------------------------------------------------------
    def store(self, key: CacheKey, artifact: Artifact) -> str | None:
        """Store a verified artifact under ``key``; None when stored, else why it was not."""
        why = uncacheable(artifact)
        if why:
            return why
        try:
            self._prepare()
            staging = Path(tempfile.mkdtemp(prefix=f"{key.short}.", dir=self.root / "tmp"))
        except OSError as exc:
            return f"the cache folder {self.root} cannot be written ({exc.strerror or exc})"
        try:
            try:
                artifact.save(staging / ARTIFACT)
            except (MlcompError, OSError, RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
                return f"the {artifact.target} artifact cannot be saved ({type(exc).__name__}: {exc})"
            files = [{"path": name, "bytes": p.stat().st_size, "sha256": sha256_file(p)}
                     for name, p in _files(staging / ARTIFACT).items()]
            record = {"format": ENTRY_FORMAT, "key": key.digest, "parts": dict(key.parts),
                      "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "files": files,
                      "bytes": sum(f["bytes"] for f in files)}
            (staging / ENTRY).write_text(json.dumps(record, indent=1, default=str))
            try:
                os.rename(staging, self.path(key))       # never replaces a non-empty folder
            except OSError:
                if not self.path(key).is_dir():
                    raise
                # another process stored the same key first: its entry is as good as ours
            self.stores += 1
            _touch(self.path(key))
            if self.max_bytes is not None:
                self.last_prune = self.prune(self.max_bytes, keep=key.digest)
            return None
        except OSError as exc:
            return f"writing the cache entry failed ({exc.strerror or exc})"
        finally:
            shutil.rmtree(staging, ignore_errors=True)

    # -- maintenance --------------------------------------------------------
    def remove(self, entry: Path) -> bool:
        """Take ``entry`` out of ``entries/`` in one rename, then delete it; False if it was already gone."""
        self._prepare()
        grave = Path(tempfile.mkdtemp(prefix=f"{entry.name[:12]}.", dir=self.root / "trash"))
        try:
            os.rename(entry, grave / "entry")
            removed = True
        except OSError:
            removed = False                             # already gone (another process removed it)
        shutil.rmtree(grave, ignore_errors=True)
        return removed

    def prune(self, max_bytes: int | str | None = None, *, keep: str | None = None) -> PruneReport:
        """Evict least recently used entries until the rest fit ``max_bytes`` (default: this cache's cap).

        ``keep``: the digest of an entry never evicted (the one just stored); when it alone is
        over the cap every other entry goes and the report's ``kept_over_cap`` names it.
        """
        cap = self.max_bytes if max_bytes is None else parse_size(max_bytes, option="--max-size")
        entries = self.entries()
        victims = lru_victims(entries, cap, keep=keep) if cap is not None else []
        report = PruneReport(cap)
        gone = {e.key for e in victims}
        for entry in victims:
            if self.remove(entry.path):               # False: another process removed it first
                report.evicted.append(entry)
        report.kept = [e for e in entries if e.key not in gone]
        report.kept_over_cap = next((e for e in report.kept if e.key == keep and cap is not None
                                     and e.bytes > cap), None)
        self.evicted += len(report.evicted)
        return report

    def entries(self) -> list[CacheEntry]:
        """Every stored entry, newest first (unreadable ones are listed with empty parts)."""
        out = []
        if not self.entries_dir.is_dir():
            return out
        for entry in self.entries_dir.iterdir():
            try:
                used = entry.stat().st_mtime
                record = json.loads((entry / ENTRY).read_text())
                parts, created, size = record.get("parts", {}), record.get("created", ""), int(record.get("bytes", 0))
            except (OSError, ValueError, AttributeError):
                if not entry.is_dir():
                    continue                            # removed while we listed
                used, parts, created = 0.0, {}, ""
                size = sum(p.stat().st_size for p in _files(entry).values() if p.exists())
            out.append(CacheEntry(entry.name, entry, parts, created, size, used))
        return sorted(out, key=lambda e: (e.created, e.key), reverse=True)

    def find(self, prefix: str) -> list[CacheEntry]:
        return [e for e in self.entries() if e.key.startswith(prefix.lower())]

    def clear(self) -> tuple[int, int]:
        """Remove every entry and leftover temporary folder; ``(entries removed, bytes freed)``."""
        entries = self.entries()
        for entry in entries:
            self.remove(entry.path)
        for sub in ("tmp", "trash"):
            folder = self.root / sub
            if folder.is_dir():
                for leftover in folder.iterdir():
                    shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink()
        return len(entries), sum(e.bytes for e in entries)


def _touch(entry: Path) -> None:
    """Mark ``entry`` used now (its folder's mtime); an entry evicted meanwhile is left alone."""
    try:
        os.utime(entry)
    except OSError:
        pass


def uncacheable(artifact: Artifact) -> str | None:
    """Why ``artifact`` cannot be cached, or None."""
    eager = [r for r in artifact.manifest.get("fallback_regions") or [] if r.get("runs_on") != artifact.target]
    if eager:
        return (f"{len(eager)} fallback region(s) run in eager torch, and a region loaded from disk "
                f"cannot be saved again to -o")
    return None
