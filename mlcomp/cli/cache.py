"""``mlcomp cache list|info|clear|prune``: look into, empty and cap the compile cache.

    $ mlcomp cache list
    1 cached artifact(s) in /root/.cache/mlcomp
    key           model  target  pipeline                   size  created
    ------------  -----  ------  --------------------  ---------  ------------------------
    ca02ab8c9972  mlp    cpu     cleanup,fuse,cleanup  664.4 KiB  2026-11-23T22:04:40+0000
    $ mlcomp cache info ca02           # one entry: every part of its key
    $ mlcomp cache info                # the folder: entries, bytes, leftover temporaries
    $ mlcomp cache clear
    removed 1 cached artifact(s), 664.4 KiB, from /root/.cache/mlcomp
    $ mlcomp cache prune --max-size 500MB   # evict least recently used entries until the rest fit
    evicted 3 least recently used entries (1.1 GiB) from /root/.cache/mlcomp; 12 entries, 441.2 MiB left (cap 476.8 MiB)

The folder ``mlcomp compile`` reuses artifacts from (:mod:`mlcomp.api.cache`) can be listed, inspected and emptied, with the
same ``--cache-dir`` option as ``compile``.  Registered lazily by :mod:`mlcomp.cli.main`.
``mlcomp compile`` takes its cache options from here too (``--cache-max-size``, the
eviction lines it prints after a store).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from mlcomp.base.errors import OptionError
from mlcomp.base.table import Table
from mlcomp.base.units import fmt_bytes

__all__ = ["cache_for_compile", "cache_group", "cache_max_size_option", "eviction_lines"]


def _cache_dir_option(fn: Any) -> Any:
    return click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                        help="Compile cache folder (default ~/.cache/mlcomp, as for `mlcomp compile`).")(fn)


def _size(ctx: click.Context, param: click.Parameter, value: str | None) -> int | None:
    """A size option in bytes, checked before any model is loaded or folder touched."""
    from mlcomp.api.cache_size import parse_size

    return None if value is None else parse_size(value, option=param.opts[0])


def cache_max_size_option(fn: Any) -> Any:
    """``mlcomp compile --cache-max-size SIZE``."""
    return click.option("--cache-max-size", default=None, metavar="SIZE", callback=_size,
                        help="Cap on the compile cache (500MB, 2GiB; default 2GiB): after a store the least "
                             "recently used entries are evicted until the rest fit (never the one just stored).")(fn)


def _open(cache_dir: Path | None, max_bytes: int | None = None):
    from mlcomp.api.cache import DEFAULT_MAX_BYTES, CompileCache, default_cache_dir

    return CompileCache(cache_dir or default_cache_dir(), DEFAULT_MAX_BYTES if max_bytes is None else max_bytes)


def cache_for_compile(use_cache: bool, cache_dir: Path | None, request: Any,
                      max_bytes: int | None = None) -> tuple[Any, str | None]:
    """The compile cache ``mlcomp compile`` uses (None with --no-cache) and a line when the flags bypass it."""
    if not use_cache:
        return None, None
    if request.dump_after or request.verify:
        return None, f"cache not used: {'--dump-after' if request.dump_after else '--verify'} needs the passes to run"
    return _open(cache_dir, max_bytes), None


def eviction_lines(cache: Any, facts: dict[str, Any], *, each: bool = False) -> list[str]:
    """What the eviction after a store did (nothing if nothing was evicted); recorded in ``facts`` too."""
    report = cache.last_prune if cache is not None else None
    if report is None:
        return []
    facts["prune"] = report.to_json()
    return report.lines(each=each)


@click.group("cache")
def cache_group() -> None:
    """The compile cache: artifacts `mlcomp compile` reuses when the same model is compiled again."""


@cache_group.command("list")
@_cache_dir_option
@click.option("--json", "as_json", is_flag=True,
              help="Print the entries (key, model, target, pipeline, bytes) as JSON.")
def cache_list(cache_dir: Path | None, as_json: bool) -> None:
    """List the cached artifacts, newest first."""
    cache = _open(cache_dir)
    entries = cache.entries()
    if as_json:
        click.echo(json.dumps([e.to_json() for e in entries], indent=2))
        return
    if not entries:
        click.echo(f"no cached artifacts in {cache.root}")
        return
    rows = tuple((e.key[:12], str(e.parts.get("model", "?")), str(e.parts.get("target", "?")),
                  str(e.parts.get("pipeline", "")) or "(no passes)", fmt_bytes(e.bytes), e.created or "?")
                 for e in entries)
    click.echo(Table(f"{len(entries)} cached artifact(s) in {cache.root}",
                     ("key", "model", "target", "pipeline", "size", "created"), rows,
                     right=frozenset({4})).format())


@cache_group.command("info")
@click.argument("key", required=False)
@_cache_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print the same facts as JSON.")
def cache_info(key: str | None, cache_dir: Path | None, as_json: bool) -> None:
    """Without KEY: the cache folder, its entries and bytes.  With KEY (a prefix): every part of that entry's key."""
    cache = _open(cache_dir)
    if key is None:
        entries = cache.entries()
        leftovers = [p for sub in ("tmp", "trash") if (cache.root / sub).is_dir() for p in (cache.root / sub).iterdir()]
        facts = {"folder": str(cache.root), "entries": len(entries), "bytes": sum(e.bytes for e in entries),
                 "leftover_temporaries": len(leftovers)}
        if as_json:
            click.echo(json.dumps(facts, indent=2))
            return
        click.echo(f"compile cache {cache.root}: {len(entries)} entr{'y' if len(entries) == 1 else 'ies'}, "
                   f"{fmt_bytes(facts['bytes'])}"
                   + (f"; {len(leftovers)} leftover temporar{'y' if len(leftovers) == 1 else 'ies'} "
                      f"(`mlcomp cache clear` removes them)" if leftovers else ""))
        return
    found = cache.find(key)
    if not found:
        raise OptionError(f"no cache entry in {cache.root} starts with {key!r}",
                          hint="`mlcomp cache list` shows the keys")
    if len(found) > 1:
        raise OptionError(f"{len(found)} cache entries in {cache.root} start with {key!r}",
                          hint="give a longer key prefix; `mlcomp cache list` shows the keys")
    entry = found[0]
    if as_json:
        click.echo(json.dumps(dict(entry.to_json(), parts=entry.parts), indent=2, default=str))
        return
    click.echo(f"entry {entry.key}\n  folder   {entry.path}\n  created  {entry.created}\n  size     "
               f"{fmt_bytes(entry.bytes)}")
    for name, value in sorted(entry.parts.items()):
        text = json.dumps(value, sort_keys=True, default=str) if isinstance(value, (dict, list)) else str(value)
        click.echo(f"  {name:<14} {text}")


@cache_group.command("clear")
@_cache_dir_option
def cache_clear(cache_dir: Path | None) -> None:
    """Remove every cached artifact (and temporaries left by interrupted compiles)."""
    cache = _open(cache_dir)
    count, size = cache.clear()
    click.echo(f"removed {count} cached artifact(s), {fmt_bytes(size)}, from {cache.root}")


@cache_group.command("prune")
@_cache_dir_option
@click.option("--max-size", default=None, metavar="SIZE", callback=_size,
              help="Keep the cache under SIZE (500MB, 2GiB; default 2GiB, as `mlcomp compile`), evicting the least "
                   "recently used entries (a hit counts as a use).")
@click.option("--json", "as_json", is_flag=True, help="Print what was evicted and kept as JSON.")
def cache_prune(cache_dir: Path | None, max_size: int | None, as_json: bool) -> None:
    """Evict least recently used cached artifacts until the rest fit the size cap."""
    cache = _open(cache_dir, max_size)
    report = cache.prune()
    if as_json:
        click.echo(json.dumps(dict(report.to_json(), folder=str(cache.root)), indent=2))
        return
    n, left = len(report.evicted), len(report.kept)
    click.echo(f"evicted {n} least recently used entr{'y' if n == 1 else 'ies'} ({fmt_bytes(report.freed)}) "
               f"from {cache.root}; {left} entr{'y' if left == 1 else 'ies'}, {fmt_bytes(report.kept_bytes)} left "
               f"(cap {fmt_bytes(report.max_bytes)})")
