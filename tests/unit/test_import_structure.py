"""No function-local import dodges an import cycle (the rule next to import-linter's layers).

A function-local ``from mlcomp.b import x`` inside module ``a`` is a *cycle dodge* when
``b`` imports ``a`` back: at module level, or through other function-local imports (two
modules that each import the other inside a function are one cycle split in two).
Hoisting the import would make the modules import each other, so the function-local
import only hides a structure problem; the fix is to move the shared thing down
(``mlcomp.targets.registry`` is such a move)::

    before:  artifact._check_backend ──(in the function)──▶ base ──(in Target.compile)──▶ artifact
    after:   artifact ──▶ registry ◀── base ──▶ artifact           (all at module level)

Function-local imports that are not on a cycle pass by themselves: lazy loading of a
module that imports a heavy optional backend (tvm, onnxruntime, openvino, matplotlib,
transformers) at its top, and the CLI's lazy command modules.

The scan reads every module with ``ast`` (nothing is imported).  Imports under
``if TYPE_CHECKING:`` never run, so they are not edges.  ``from p import m`` where
``p.m`` is a module is an edge to ``p.m``, otherwise to ``p``; the package ``__init__``
Python runs first is not followed (import-linter's model: a package being
initialised is already in ``sys.modules``, so it cannot re-enter).
"""
from __future__ import annotations

import ast
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2] / "mlcomp"

# Cycle dodges in files this change may not edit, by (module, line): none today.  An entry
# must name the exact import and the fix in a comment; the test fails if an entry is stale.
ALLOWED: dict[tuple[str, int], str] = {}


@dataclass(frozen=True)
class Import:
    source: str        # importing module
    target: str        # imported mlcomp module
    line: int
    function: str      # enclosing function ("" at module level)


@dataclass
class ImportMap:
    modules: dict[str, Path] = field(default_factory=dict)
    top: list[Import] = field(default_factory=list)
    local: list[Import] = field(default_factory=list)


def _module_names(root: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: dict[str, Path],
             package: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name in known]
    base = node.module or ""
    if node.level:   # relative: resolve against the importing module's package
        parts = module.split(".") if is_package else module.split(".")[:-1]
        parts = parts[:len(parts) - (node.level - 1)]
        base = ".".join(parts + ([base] if base else []))
    if base.split(".")[0] != package:
        return []
    found = []
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        found.append(sub if sub in known else base)
    return list(dict.fromkeys(t for t in found if t in known))   # `from m import a, b`: one edge


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


class _Collector(ast.NodeVisitor):
    def __init__(self, imports: ImportMap, module: str, is_package: bool, package: str) -> None:
        self.imports, self.module, self.is_package, self.package = imports, module, is_package, package
        self.functions: list[str] = []

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):   # never runs: only the else branch counts
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def _record(self, node: ast.Import | ast.ImportFrom) -> None:
        where = self.imports.local if self.functions else self.imports.top
        fn = ".".join(self.functions)
        for target in _targets(node, self.module, self.is_package, self.imports.modules, self.package):
            if target != self.module:
                where.append(Import(self.module, target, node.lineno, fn))

    visit_Import = _record
    visit_ImportFrom = _record


def scan(root: Path) -> ImportMap:
    """Every module-level and function-local import of ``root``'s package by its own modules."""
    imports = ImportMap(_module_names(root))
    for module, path in imports.modules.items():
        _Collector(imports, module, path.name == "__init__.py", root.name).visit(ast.parse(path.read_text()))
    return imports


def _path(adjacency: dict[str, list[Import]], start: str, goal: str, skip: Import) -> list[Import] | None:
    """The shortest import chain start → … → goal not using ``skip`` (breadth-first, O(edges))."""
    came: dict[str, Import | None] = {start: None}
    queue = deque([start])
    while queue:
        here = queue.popleft()
        if here == goal:
            chain = []
            while came[here] is not None:
                step = came[here]
                chain.append(step)
                here = step.source
            return chain[::-1]
        for edge in adjacency.get(here, ()):
            if edge != skip and edge.target not in came:
                came[edge.target] = edge
                queue.append(edge.target)
    return None


def cycle_dodges(imports: ImportMap) -> list[tuple[Import, list[Import]]]:
    """Each function-local import A→B where B imports A back, with the chain B → … → A."""
    adjacency: dict[str, list[Import]] = {}
    for edge in imports.top + imports.local:
        adjacency.setdefault(edge.source, []).append(edge)
    found = []
    for edge in imports.local:
        chain = _path(adjacency, edge.target, edge.source, skip=edge)
        if chain is not None:
            found.append((edge, chain))
    return found


def describe(imports: ImportMap, edge: Import, chain: list[Import]) -> str:
    path = imports.modules[edge.source]
    rel = path.relative_to(path.parents[len(edge.source.split(".")) - (path.name != "__init__.py")]).as_posix()
    back = " → ".join([chain[0].source] + [f"{c.target} (line {c.line}{', in ' + c.function if c.function else ''})"
                                           for c in chain])
    return (f"{rel}:{edge.line} imports {edge.target} inside {edge.function}() although "
            f"{back} imports it back; move what both need into a lower module (or split one) and "
            "import it at module level")


@pytest.fixture(scope="module")
def mlcomp_imports() -> ImportMap:
    return scan(ROOT)


def test_no_function_local_import_dodges_a_cycle(mlcomp_imports: ImportMap) -> None:
    dodges = [(e, c) for e, c in cycle_dodges(mlcomp_imports) if (e.source, e.line) not in ALLOWED]
    assert not dodges, "\n".join(describe(mlcomp_imports, e, c) for e, c in dodges)


def test_allowances_are_not_stale(mlcomp_imports: ImportMap) -> None:
    current = {(e.source, e.line) for e, _ in cycle_dodges(mlcomp_imports)}
    assert not set(ALLOWED) - current, "remove allowances for dodges that are gone"


def test_scan_sees_the_whole_package(mlcomp_imports: ImportMap) -> None:
    # a scanner that silently read nothing would pass the rule above
    assert len(mlcomp_imports.modules) > 100
    assert len(mlcomp_imports.top) > 500
    lazy = {(e.source, e.target) for e in mlcomp_imports.local}
    assert ("mlcomp.cli.main", "mlcomp.api") in lazy          # the CLI's lazy loading is seen as such
    top = {(e.source, e.target) for e in mlcomp_imports.top}
    assert ("mlcomp.targets.base", "mlcomp.targets.registry") in top
    assert ("mlcomp.targets.base", "mlcomp.runtime.artifact") in top


# -- the detector on tiny synthetic packages ------------------------------------------------


def _package(tmp_path: Path, files: dict[str, str]) -> Path:
    root = tmp_path / "pkg"
    for name, text in {"__init__.py": "", **files}.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def _found(root: Path) -> list[tuple[str, int, str, list[str]]]:
    return [(e.source, e.line, e.target, [c.target for c in chain]) for e, chain in cycle_dodges(scan(root))]


def test_detector_finds_a_local_import_of_a_module_that_imports_back(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "a.py": "from pkg.b import helper\n",
        "b.py": "def helper():\n    from pkg.a import thing\n    return thing\n",
    })
    assert _found(root) == [("pkg.b", 2, "pkg.a", ["pkg.b"])]
    imports = scan(root)
    edge, chain = cycle_dodges(imports)[0]
    assert describe(imports, edge, chain).startswith("pkg/b.py:2 imports pkg.a inside helper() although pkg.a")


def test_detector_finds_two_local_imports_that_point_at_each_other(tmp_path: Path) -> None:
    # the shape of the old artifact ↔ base pair: neither import is at module level
    root = _package(tmp_path, {
        "a.py": "def f():\n    from pkg import b\n",
        "b.py": "import os\n\ndef g():\n    from . import a\n",
    })
    assert sorted(_found(root)) == [("pkg.a", 2, "pkg.b", ["pkg.a"]), ("pkg.b", 4, "pkg.a", ["pkg.b"])]


def test_detector_follows_longer_chains_and_relative_imports(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "a.py": "from .sub import c\n",
        "sub/__init__.py": "",
        "sub/c.py": "from ..d import x\n",
        "d.py": "x = 1\n\nclass K:\n    def m(self):\n        from pkg import a\n",
    })
    assert _found(root) == [("pkg.d", 5, "pkg.a", ["pkg.sub.c", "pkg.d"])]


def test_lazy_loads_without_a_cycle_pass(tmp_path: Path) -> None:
    root = _package(tmp_path, {
        "heavy.py": "import tvm\n\ndef run():\n    return tvm\n",
        "user.py": "def f():\n    from pkg.heavy import run\n    return run()\n",
        "typed.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.user import f\n",
        "user2.py": "def g():\n    from pkg.typed import TYPE_CHECKING\n",
    })
    imports = scan(root)
    assert {(e.source, e.target) for e in imports.local} == {("pkg.user", "pkg.heavy"), ("pkg.user2", "pkg.typed")}
    assert not [e for e in imports.top if e.source == "pkg.typed"]   # TYPE_CHECKING is not an edge
    assert _found(root) == []
