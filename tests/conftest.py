"""Shared fixtures and the marker policy.

Folders split tests by what they need: ``unit/<layer>/`` (one layer of mlcomp),
``integration/`` (the CLI, the zoo and third-party models end to end), ``corpus/``
(bad inputs, interrupts) and ``perf/`` (wall-clock comparisons).  Markers: ``tvm``
and ``ort`` run everywhere the Makefile installs their packages (CI included);
``cuda`` skips, saying why, when no GPU is present; ``slow`` and ``perf`` are
left out of ``make test`` (``make test-all`` adds ``slow``, ``make test-perf``
runs ``perf``).  Nothing else is skipped silently.
"""
from __future__ import annotations

import warnings

import pytest
import torch

warnings.filterwarnings("ignore", category=FutureWarning)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (torch.cuda.is_available() is False)")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="session")
def _no_compile_cache():
    """In-process CLI calls default to ``compile --no-cache`` (never the real ~/.cache, no hits between
    tests); cache tests pass ``--cache --cache-dir DIR``.  Session-scoped, so module-scoped fixtures that
    compile see it too; restored at the end of the session."""
    from mlcomp.cli.main import main

    before = main.context_settings.get("default_map", _ABSENT)
    main.context_settings["default_map"] = {"compile": {"use_cache": False}}
    yield
    if before is _ABSENT:
        main.context_settings.pop("default_map", None)
    else:
        main.context_settings["default_map"] = before


_ABSENT = object()


@pytest.fixture(autouse=True, scope="session")
def _cores_shared_by_workers():
    """Under pytest-xdist (``make test``: two workers) each worker's torch gets its share of the cores as
    intra-op threads, so the workers' OpenMP pools do not oversubscribe the machine (spin-waiting threads of
    one worker stall the other's); tests that set a thread count restore this one.  Without xdist the
    process keeps torch's default."""
    import os

    from mlcomp.hardware.noise import cores_available
    from mlcomp.hardware.threads import threads

    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    with threads(max(1, cores_available() // workers) if workers >= 2 else None):
        yield


@pytest.fixture
def fresh_dynamo():
    """``backend="mlcomp"`` registered and Dynamo's caches empty before and after the test."""
    from mlcomp.dynamo import backend as mb

    mb.register()
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture(scope="session")
def zoo():
    from mlcomp.models import ZOO

    return ZOO


@pytest.fixture(autouse=True, scope="session")
def _captured_once_unchanged():
    """The graphs of ``tests.helpers.captures.captured_once`` builders are unchanged when the session ends."""
    from tests.helpers.captures import changed

    yield
    assert not changed(), f"a test changed the shared captured graph(s) {changed()} in place"


@pytest.fixture(scope="session")
def _capture_cache(zoo):
    """Zoo graphs captured once per session; checked unchanged when the session ends."""
    from mlcomp.frontend.loading import load_model
    from tests.helpers.captures import fingerprint

    cache: dict[str, tuple] = {}
    prints: dict[str, tuple] = {}

    def get(name: str, batch: int = 2):
        key = f"{name}@{batch}"
        if key not in cache:
            z = zoo[name]
            module, inputs = z.build(), z.example_inputs(batch)
            graph = load_model(module, example_inputs=inputs).capture()
            cache[key] = (module, inputs, graph)
            prints[key] = fingerprint(graph)
        return cache[key]

    yield get
    changed = [key for key, (_, _, graph) in cache.items() if fingerprint(graph) != prints[key]]
    assert not changed, f"a test changed the shared captured graph(s) {changed} in place"


@pytest.fixture(scope="session")
def captured(_capture_cache):
    """Zoo graphs via torch.export: name -> (module, inputs, graph), a fresh copy of the graph per call.

    Session-scoped so module-scoped fixtures can use it; every call hands out its own
    ``graph.copy()`` (constants shared copy-on-write: ``graph.writable_constant`` clones),
    and the session checks at its end that no test changed the cached graphs.
    """
    def get(name: str, batch: int = 2):
        module, inputs, graph = _capture_cache(name, batch)
        return module, inputs, graph.copy()

    return get


@pytest.fixture
def fake_hardware():
    """``fake_hardware(key)`` makes the hardware probe report one of ``tests.unit.hardware.profiles.PROFILES``
    (avx2, avx512, avx512-bf16, amx, gpu) until the test ends; returns the profile."""
    from tests.unit.hardware.profiles import PROFILES, Installed, install

    installed = Installed()
    yield lambda key: install(PROFILES[key], installed)
    installed.undo()
