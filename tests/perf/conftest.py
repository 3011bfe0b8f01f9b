"""Tests that compare wall-clock times depend on the machine and its load: ``make test`` and
``make test-all`` leave them out (marker ``perf``), ``make test-perf`` runs them.  Every module
here sets ``pytestmark = pytest.mark.perf``; the hook below refuses one that does not.
"""
from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if item.nodeid.startswith("tests/perf/") and "perf" not in item.keywords:
            raise pytest.UsageError(f"{item.nodeid} is under tests/perf but not marked perf")
