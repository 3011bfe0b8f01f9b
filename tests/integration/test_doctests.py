"""Docstrings' ``>>>`` examples run as doctests.

Every mlcomp module whose source holds a ``>>>`` example is found here and its examples are run
(``doctest.testmod``, ELLIPSIS and NORMALIZE_WHITESPACE, in an empty working folder).  A module
whose examples are sketches over objects they never build (``compare(eager(x), artifact(x))``) is
listed in :data:`SKETCHES` until its examples are made runnable (:func:`test_sketch_list_is_current`
fails when a listed module no longer has examples).
"""
from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "mlcomp"
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE

# modules whose examples are illustrations, not yet runnable doctests (they name objects the example
# never builds, or print timings of this machine); each entry is work left
SKETCHES = frozenset({
})


def _modules_with_examples() -> list[str]:
    names = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if ">>>" in path.read_text(encoding="utf-8"):
            parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
            names.append(".".join(parts[:-1] if parts[-1] == "__init__" else parts))
    return names


MODULES = _modules_with_examples()


def _run(name: str) -> doctest.TestResults:
    module = importlib.import_module(name)
    return doctest.testmod(module, optionflags=FLAGS, report=False, verbose=False)


@pytest.mark.parametrize("name", [m for m in MODULES if m not in SKETCHES])
def test_docstring_examples_run(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                     # an example that saves writes here
    result = _run(name)
    assert result.attempted > 0, f"{name}: no example found by doctest (a '>>>' outside a docstring?)"
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples fail (run " \
                               f"`python -m doctest -v {name.replace('.', '/')}.py` to see them)"


def test_sketch_list_is_current():
    assert SKETCHES <= set(MODULES), sorted(SKETCHES - set(MODULES))
