"""Docstrings' ``>>>`` examples run as doctests.

Every mlcomp module whose source holds a ``>>>`` example is found here and its examples are run
(``doctest.testmod``, ELLIPSIS and NORMALIZE_WHITESPACE, in an empty working folder).  There is no
skip list: an example builds what it uses (a zoo model, a graph from ``GraphBuilder``) and asserts
structure rather than printing timings; an illustration that cannot run cheaply (a CLI session, a
benchmark, a GPU or TVM build) is a literal block without ``>>>``.
"""
from __future__ import annotations

import doctest
import importlib
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "mlcomp"
FLAGS = doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE


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


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples_run(name, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)                     # an example that saves writes here
    result = _run(name)
    assert result.attempted > 0, f"{name}: no example found by doctest (a '>>>' outside a docstring?)"
    assert result.failed == 0, f"{name}: {result.failed} of {result.attempted} examples fail (run " \
                               f"`python -m doctest -v {name.replace('.', '/')}.py` to see them)"

