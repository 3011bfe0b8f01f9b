"""The compile cache (issue 14 part 6): keys, miss → hit, corrupt entries, --no-cache, ``mlcomp cache``.

Every test uses its own ``tmp_path`` cache folder; nothing touches the real ~/.cache.
A hit is proved by counters (the target's ``build`` calls, the cache's hits), never by time.
"""
from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner

from mlcomp.api import CacheStatus, CompileCache, cache_key, compile_model, graph_digest
from mlcomp.cli.main import main
from mlcomp.frontend.loading import load_model
from mlcomp.targets import CompileOptions
from mlcomp.targets.torch.cpu import CpuTarget


class CountingCpu(CpuTarget):
    """The cpu target, counting its builds (lowering)."""

    def __init__(self) -> None:
        self.builds = 0

    def build(self, graph, options, inputs):
        self.builds += 1
        return super().build(graph, options, inputs)


@pytest.fixture(scope="module")
def mlp(captured):
    module, inputs, graph = captured("mlp", 2)
    return load_model(module, example_inputs=inputs), graph


def _compile(mlp, cache, target, **kw):
    source, graph = mlp
    return compile_model(source, graph.copy(), target=target, pipeline=kw.pop("pipeline", "-O1"), cache=cache, **kw)


@pytest.fixture(scope="module")
def stored(mlp, tmp_path_factory):
    """One miss, stored in a module-scoped cache folder: (cache, counting target, result)."""
    cache, target = CompileCache(tmp_path_factory.mktemp("cache") / "c"), CountingCpu()
    return cache, target, _compile(mlp, cache, target)


def _copy(stored, tmp_path) -> CompileCache:
    shutil.copytree(stored[0].root, tmp_path / "c")
    return CompileCache(tmp_path / "c")


def test_miss_then_hit_skips_passes_and_lowering(mlp, stored):
    cache, target, first = stored
    assert first.cache.status is CacheStatus.STORED and target.builds == 1 and first.check.passed
    assert first.cache.line() == f"cache miss {first.cache.key.short}: compiled and stored"
    entry = cache.path(first.cache.key)
    assert sorted(p.name for p in entry.iterdir()) == ["artifact", "entry.json"]
    record = json.loads((entry / "entry.json").read_text())
    assert {f["path"] for f in record["files"]} == {".mlcomp", "manifest.json", "model.pt", "reference.pt"}
    assert record["parts"]["pipeline"] == "cleanup" and record["parts"]["target"] == "cpu"
    second = _compile(mlp, cache, target)
    assert second.cache.status is CacheStatus.HIT and second.cache.key == first.cache.key
    assert target.builds == 1 and second.pipeline_report is None and second.pipeline_seconds == 0.0
    assert (cache.hits, cache.misses, cache.stores, cache.corrupt) == (1, 1, 1, 0)
    assert second.check.passed and second.artifact.manifest["cache"]["status"] == "hit"
    assert second.cache.line() == f"cache hit {first.cache.key.short}: reused the stored artifact " \
                                  "(passes and lowering skipped)"
    x = mlp[0].inputs()
    torch.testing.assert_close(second.artifact(*x), first.artifact(*x), rtol=0, atol=0)
    assert list((cache.root / "tmp").iterdir()) == []                   # no staging folder left


def test_key_changes_with_pipeline_target_options_and_weights(mlp):
    source, graph = mlp
    opts = CompileOptions()
    base = cache_key(graph, pipeline="cleanup", target="cpu", options=opts)
    recaptured = load_model(source.eager, example_inputs=source.inputs()).capture()
    assert cache_key(recaptured, pipeline="cleanup", target="cpu", options=opts).digest == base.digest
    assert cache_key(graph, pipeline="cleanup,fuse,cleanup", target="cpu", options=opts).digest != base.digest
    assert cache_key(graph, pipeline="cleanup", target="onnxruntime", options=opts).digest != base.digest
    assert cache_key(graph, pipeline="cleanup", target="cpu",
                     options=CompileOptions(threads=1)).digest != base.digest
    changed = graph.copy()
    name = sorted(changed.constants)[0]
    changed.writable_constant(name).view(-1)[0] += 1.0          # one weight, one element
    assert graph_digest(changed) != graph_digest(graph)
    assert cache_key(changed, pipeline="cleanup", target="cpu", options=opts).digest != base.digest
    assert len(base.digest) == 64 and base.short == base.digest[:12]


@pytest.mark.parametrize("damage", ["truncate", "flip-byte", "manifest", "entry-json", "extra-file"])
def test_corrupt_entry_is_detected_and_removed(stored, tmp_path, damage):
    key = stored[2].cache.key
    cache = _copy(stored, tmp_path)
    artifact = cache.path(key) / "artifact"
    if damage == "truncate":
        payload = artifact / "model.pt"
        payload.write_bytes(payload.read_bytes()[:100])
    elif damage == "flip-byte":                                       # same size: only a hash sees it
        payload = artifact / "model.pt"
        data = bytearray(payload.read_bytes())
        data[len(data) // 2] ^= 0xFF
        payload.write_bytes(bytes(data))
    elif damage == "manifest":
        manifest = artifact / "manifest.json"
        manifest.write_text(manifest.read_text().replace('"cpu"', '"cpX"'))
    elif damage == "entry-json":
        (artifact.parent / "entry.json").write_text("{not json")
    else:
        (artifact / "stray.bin").write_bytes(b"x")
    art, line = cache.lookup(key)
    assert art is None and cache.corrupt == 1 and not cache.path(key).exists()
    assert line.startswith(f"cache entry {key.short} is corrupt (") and \
        line.endswith("); removed, compiling again") and "\n" not in line
    assert {"truncate": "model.pt does not match its checksum", "flip-byte": "model.pt does not match its checksum",
            "manifest": "manifest.json does not match its checksum", "entry-json": "entry.json is not valid JSON",
            "extra-file": "stray.bin unexpected"}[damage] in line
    assert list((cache.root / "trash").iterdir()) == []


def test_corrupt_entry_is_rebuilt_by_the_next_compile(mlp, stored, tmp_path):
    key = stored[2].cache.key
    cache, target = _copy(stored, tmp_path), CountingCpu()
    (cache.path(key) / "artifact" / "reference.pt").write_bytes(b"")
    again = _compile(mlp, cache, target)
    assert again.cache.status is CacheStatus.STORED and target.builds == 1 and again.check.passed
    assert again.cache.removed[0].startswith(f"cache entry {key.short} is corrupt (")
    third = _compile(mlp, cache, target)                                   # the rebuilt entry is whole
    assert third.cache.status is CacheStatus.HIT and target.builds == 1


def test_two_writers_of_one_key_keep_one_whole_entry(stored, tmp_path):
    a, b = _copy(stored, tmp_path), CompileCache(tmp_path / "c")
    key, artifact = stored[2].cache.key, stored[2].artifact
    assert b.store(key, artifact) is None              # its rename loses to the entry there; that one stays whole
    assert len(a.entries()) == 1 and a.lookup(key)[0] is not None and a.hits == 1


def test_unsaveable_or_unverified_artifacts_are_not_stored(mlp, tmp_path):
    cache = CompileCache(tmp_path / "c")
    unverified = _compile(mlp, cache, CountingCpu(), pipeline="", verify=False)
    assert unverified.cache.status is CacheStatus.NOT_STORED and unverified.check is None
    assert unverified.cache.reason == "it was not verified (--no-verify)" and cache.entries() == []

    class Unsaveable(CountingCpu):
        def build(self, graph, options, inputs):
            runtime = super().build(graph, options, inputs)

            def refuse(directory):
                raise RuntimeError("this payload has no file form")
            runtime.save = refuse
            return runtime

    result = _compile(mlp, cache, Unsaveable(), pipeline="")
    assert result.cache.status is CacheStatus.NOT_STORED and cache.entries() == []
    assert result.cache.reason == "the cpu artifact cannot be saved (RuntimeError: this payload has no file form)"
    assert list((tmp_path / "c" / "tmp").iterdir()) == []


def test_cli_miss_hit_list_info_and_clear(tmp_path):
    store = tmp_path / "store"
    args = ["compile", "mlp", "-O0", "--target", "cpu", "--cache", "--cache-dir", str(store)]
    runner = CliRunner()
    first = runner.invoke(main, [*args, "-o", str(tmp_path / "a")])
    assert first.exit_code == 0, first.output
    [miss] = [ln for ln in first.output.splitlines() if ln.startswith("cache ")]
    key = miss.split()[2].rstrip(":")
    assert miss == f"cache miss {key}: compiled and stored"
    second = runner.invoke(main, [*args, "-o", str(tmp_path / "b"), "--json"])
    assert second.exit_code == 0, second.output
    facts = json.loads(second.stdout)
    assert facts["cache"]["status"] == "hit" and facts["cache"]["key"].startswith(key)
    assert facts["verification"]["passed"] and facts["reloaded"]["passed"] and facts["pipeline_report"] is None
    listed = runner.invoke(main, ["cache", "list", "--cache-dir", str(store)])
    assert listed.exit_code == 0 and listed.output.splitlines()[0] == f"1 cached artifact(s) in {store}"
    assert listed.output.splitlines()[3].split()[:4] == [key, "mlp", "cpu", "(no"]
    info = runner.invoke(main, ["cache", "info", key[:6], "--cache-dir", str(store)])
    assert info.exit_code == 0 and info.output.startswith(f"entry {key}") and "mlcomp_source" in info.output
    cleared = runner.invoke(main, ["cache", "clear", "--cache-dir", str(store)])
    assert cleared.exit_code == 0 and cleared.output.startswith("removed 1 cached artifact(s), ")
    assert runner.invoke(main, ["cache", "list", "--cache-dir", str(store)]).output.startswith("no cached artifacts")
    missing = runner.invoke(main, ["cache", "info", "ffff", "--cache-dir", str(store)])
    assert missing.exit_code == 2 and "no cache entry" in missing.output
