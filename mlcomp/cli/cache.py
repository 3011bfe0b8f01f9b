"""``mlcomp cache list|info|clear``: look into and empty the compile cache.

    $ mlcomp cache list
    1 cached artifact(s) in /root/.cache/mlcomp
    key           model  target  pipeline                   size  created
    ------------  -----  ------  --------------------  ---------  ------------------------
    ca02ab8c9972  mlp    cpu     cleanup,fuse,cleanup  664.4 KiB  2026-11-23T22:04:40+0000
    $ mlcomp cache info ca02           # one entry: every part of its key
    $ mlcomp cache info                # the folder: entries, bytes, leftover temporaries
    $ mlcomp cache clear
    removed 1 cached artifact(s), 664.4 KiB, from /root/.cache/mlcomp

Before: there was no cache to look into; after, the folder ``mlcomp compile`` reuses
artifacts from (:mod:`mlcomp.api.cache`) can be listed, inspected and emptied, with the
same ``--cache-dir`` option as ``compile``.  Registered lazily by :mod:`mlcomp.cli.main`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from mlcomp.base.errors import OptionError
from mlcomp.base.table import Table
from mlcomp.hardware.timing import fmt_bytes

__all__ = ["cache_group"]


def _cache_dir_option(fn: Any) -> Any:
    return click.option("--cache-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
                        help="Compile cache folder (default ~/.cache/mlcomp, as for `mlcomp compile`).")(fn)


def _open(cache_dir: Path | None):
    from mlcomp.api import CompileCache, default_cache_dir

    return CompileCache(cache_dir or default_cache_dir())


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
