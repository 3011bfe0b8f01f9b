"""The compile cache's size cap: size strings, LRU eviction after a store, hit refresh, ``mlcomp cache prune``.

Entries here are one tiny mlp artifact stored under several made-up keys (a store is a
save, a few milliseconds); use times are set with ``os.utime`` so the order never depends
on the clock's resolution.  Nothing touches the real ~/.cache.
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlcomp.api import CompileCache, compile_model
from mlcomp.api.cache_key import CacheKey
from mlcomp.api.cache_size import DEFAULT_MAX_BYTES, CacheEntry, PruneReport, lru_victims, parse_size
from mlcomp.base.errors import OptionError
from mlcomp.cli.main import main
from mlcomp.frontend.loading import load_model
from mlcomp.base.units import fmt_bytes


@pytest.fixture(scope="module")
def artifact(captured):
    module, inputs, graph = captured("mlp", 2)
    result = compile_model(load_model(module, example_inputs=inputs), graph, target="cpu", pipeline="")
    assert result.check.passed
    return result.artifact


def _key(name: str) -> CacheKey:
    return CacheKey((name * 64)[:64], {"model": f"m{name}", "target": "cpu", "pipeline": ""})


def _fill(cache: CompileCache, artifact, names: str, start: float = 1_000_000.0) -> dict[str, CacheKey]:
    """Store one entry per letter, used one after another (oldest first)."""
    keys = {}
    for i, name in enumerate(names):
        keys[name] = _key(name)
        assert cache.store(keys[name], artifact) is None
        os.utime(cache.path(keys[name]), (start + i, start + i))
    return keys


def _present(cache: CompileCache) -> str:
    return "".join(sorted(e.key[0] for e in cache.entries()))


@pytest.mark.parametrize("text, expect", [
    ("500MB", 500_000_000), ("2GiB", 2 * 2**30), ("2G", 2 * 2**30), ("1.5 KiB", 1536), ("1024", 1024),
    ("0", 0), (" 3kb ", 3000), ("1TB", 10**12), (7, 7),
])
def test_sizes_parse(text, expect):
    assert parse_size(text) == expect
    assert DEFAULT_MAX_BYTES == 2 * 2**30


@pytest.mark.parametrize("text, expect", [
    ("lots", "--cache-max-size 'lots' is not a size (a size is a number of bytes and an optional unit)"),
    ("-5MB", "--cache-max-size '-5MB' is not a size"),
    ("5XB", "--cache-max-size '5XB' is not a size (unknown unit 'XB')"),
    ("", "is not a size"), (-1, "'-1' is not a size"), (True, "'True' is not a size"),
])
def test_bad_sizes_are_option_errors(text, expect):
    with pytest.raises(OptionError) as err:
        parse_size(text)
    assert expect in err.value.message and "500MB, 2GiB" in err.value.message


def test_lru_victims_is_oldest_first_and_spares_the_kept_one():
    def entry(key, used, size):
        return CacheEntry(key, Path(key), {}, "", size, used)
    entries = [entry("c", 3.0, 40), entry("a", 1.0, 40), entry("b", 2.0, 40), entry("d", 1.0, 40)]
    assert [e.key for e in lru_victims(entries, 100)] == ["a", "d"]        # tie on use time: by key
    assert [e.key for e in lru_victims(entries, 160)] == []
    assert [e.key for e in lru_victims(entries, 100, keep="a")] == ["d", "b"]
    assert [e.key for e in lru_victims(entries, 0, keep="b")] == ["a", "d", "c"]


def test_store_evicts_least_recently_used_and_a_hit_refreshes(artifact, tmp_path):
    cache = CompileCache(tmp_path / "c", max_bytes=None)
    keys = _fill(cache, artifact, "abc")
    size = max(e.bytes for e in cache.entries())
    assert cache.last_prune is None and _present(cache) == "abc"
    art, line = cache.lookup(keys["a"])                      # a hit: a becomes the most recently used
    assert art is not None and line is None
    assert cache.path(keys["a"]).stat().st_mtime > time.time() - 60 > cache.path(keys["b"]).stat().st_mtime
    cache.max_bytes = int(3.5 * size)                        # room for three entries
    assert cache.store(_key("d"), artifact) is None          # four now: b is the least recently used
    report = cache.last_prune
    assert [e.key[0] for e in report.evicted] == ["b"] and _present(cache) == "acd" and cache.evicted == 1
    left = sum(e.bytes for e in cache.entries())
    expect = (f"cache over its {fmt_bytes(cache.max_bytes)} cap: evicted 1 least recently used entry "
              f"({fmt_bytes(report.evicted[0].bytes)}); {fmt_bytes(left)} left in 3 entries")
    assert report.lines() == [expect]
    assert report.kept_over_cap is None and report.to_json()["evicted"] == [keys["b"].digest]
    assert report.lines(each=True)[1].startswith(f"cache evicted {keys['b'].short} (mb, cpu, ")
    assert list((cache.root / "trash").iterdir()) == []
    assert cache.store(_key("e"), artifact) is None          # then c (a was refreshed after c was used)
    assert [e.key[0] for e in cache.last_prune.evicted] == ["c"] and _present(cache) == "ade"


def test_cap_smaller_than_one_entry_keeps_the_new_one_and_says_so(artifact, tmp_path):
    cache = CompileCache(tmp_path / "c", max_bytes=None)
    _fill(cache, artifact, "ab")
    cache.max_bytes = 1
    assert cache.store(_key("n"), artifact) is None
    report = cache.last_prune
    assert _present(cache) == "n" and sorted(e.key[0] for e in report.evicted) == ["a", "b"]
    assert report.kept_over_cap is not None and report.kept_over_cap.key == _key("n").digest
    assert report.summary().startswith("cache over its 1 B cap: evicted 2 least recently used entries (")
    assert report.summary().endswith("is larger than the cap by itself and was kept")
    assert cache.lookup(_key("n"))[0] is not None           # still a whole, loadable entry


def test_a_vanishing_entry_is_a_miss_not_a_corrupt_one(artifact, tmp_path):
    class EvictedMeanwhile(CompileCache):
        def _check(self, entry, key):
            self.remove(entry)                              # another process evicts it as we read
            return super()._check(entry, key)

    cache = EvictedMeanwhile(tmp_path / "c")
    assert cache.store(_key("v"), artifact) is None
    assert cache.lookup(_key("v")) == (None, None)
    assert (cache.misses, cache.corrupt, cache.hits) == (1, 0, 0)
    assert cache.prune(0).evicted == [] and isinstance(cache.prune(0), PruneReport)


def test_cli_compile_cap_and_prune(artifact, tmp_path):
    store = tmp_path / "store"
    _fill(CompileCache(store, max_bytes=None), artifact, "ab")
    runner = CliRunner()
    out = runner.invoke(main, ["compile", "mlp", "-O0", "--target", "cpu", "--cache", "--cache-dir", str(store),
                               "--cache-max-size", "1KB", "--explain", "-o", str(tmp_path / "a")])
    assert out.exit_code == 0, out.output
    lines = [ln for ln in out.output.splitlines() if ln.startswith("cache ")]
    assert lines[0].startswith("cache miss ") and lines[0].endswith(": compiled and stored")
    assert lines[1].startswith("cache over its 1000 B cap: evicted 2 least recently used entries (")
    assert lines[1].endswith("is larger than the cap by itself and was kept")
    assert sorted(lines[2:]) == [f"cache evicted {_key(n).short} (m{n}, cpu, " + lines[2].split(", ")[-1]
                                 for n in "ab"]
    assert len(CompileCache(store).entries()) == 1
    pruned = runner.invoke(main, ["cache", "prune", "--max-size", "0", "--cache-dir", str(store), "--json"])
    assert pruned.exit_code == 0, pruned.output
    facts = json.loads(pruned.output)
    assert len(facts["evicted"]) == 1 and facts["kept"] == 0 and facts["max_bytes"] == 0
    again = runner.invoke(main, ["cache", "prune", "--cache-dir", str(store)])
    assert again.exit_code == 0 and again.output.startswith("evicted 0 least recently used entries (0 B) from ")
    assert again.output.rstrip().endswith("0 entries, 0 B left (cap 2.0 GiB)")
