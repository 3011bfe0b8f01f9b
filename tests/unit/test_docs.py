"""docs/ARCHITECTURE.md and README.md checked against the code, where a statement can be checked.

* the architecture document stays under 300 lines;
* every module, package and ``file.py:name`` it names in backticks exists (in the decision
  records and benchmarks/RESULTS.md too);
* its layer table is the import-linter layers contract of ``pyproject.toml``, in order, and
  README's Layout paragraph lists the same layers in the same order;
* every backend and pass family of the independence contracts is named in it;
* "adding a backend: four edits in two files": the registries it names exist, agree with each
  other, and no other module registers a backend's classes;
* CLI modules are named after their commands, except the shared ones the document lists;
* README keeps exactly its two fresh-machine commands;
* every section of benchmarks/RESULTS.md names its host and a script that exists;
* every decision record is dated, short, has context/decision/consequences and is in the index;
* no source file of ``mlcomp/`` carries history: issue or stop numbers, "Before:" change notes.

Everything is read as text or with ``ast``: nothing is imported.
"""
from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PKG = ROOT / "mlcomp"
DOC = ROOT / "docs" / "ARCHITECTURE.md"
README = ROOT / "README.md"
MAX_LINES = 300


def _prose(text: str) -> str:
    """``text`` without its fenced code blocks (diagrams and examples are not claims about paths)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _ticked(text: str) -> list[str]:
    return re.findall(r"`([^`\n]+)`", _prose(text))


def _layers() -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    contracts = config["tool"]["importlinter"]["contracts"]
    layers = next(c for c in contracts if c["type"] == "layers")["layers"]
    return [" | ".join(sorted(part.strip() for part in row.split("|"))) for row in layers]


def _independent(prefix: str) -> list[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for contract in config["tool"]["importlinter"]["contracts"]:
        if contract["type"] == "independence" and all(m.startswith(prefix) for m in contract["modules"]) \
                and len(contract["modules"]) > 2:
            return [m.rsplit(".", 1)[1] for m in contract["modules"]]
    raise AssertionError(f"pyproject.toml has no independence contract over {prefix}*")


def _top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {t.id for t in targets if isinstance(t, ast.Name)}
    return names


def _resolve(token: str) -> Path | None:
    """A path token (``mlcomp/ir/graph.py``, ``ir/graph.py``, ``targets/tvm/offload/``) as a file or folder."""
    for base in (ROOT, PKG):
        candidate = base / token
        if candidate.exists():
            return candidate
    return None


def test_architecture_is_short():
    lines = DOC.read_text().splitlines()
    assert len(lines) <= MAX_LINES, f"docs/ARCHITECTURE.md has {len(lines)} lines (at most {MAX_LINES})"


DOCS = [DOC, ROOT / "benchmarks" / "RESULTS.md", *sorted((ROOT / "docs" / "decisions").glob("*.md"))]


@pytest.mark.parametrize("doc", DOCS, ids=[d.name for d in DOCS])
def test_every_named_path_exists(doc):
    missing = []
    for token in _ticked(doc.read_text()):
        if "<" in token or " " in token:
            continue                                    # a placeholder such as passes/<family>/
        path, _, name = token.partition(":")
        if re.fullmatch(r"[\w/.]+\.py|[\w/]+/", path):
            found = _resolve(path)
            if found is None:
                missing.append(token)
            elif name and found.is_file() and name not in _top_level_names(found):
                missing.append(token)
    assert not missing, f"{doc.name} names paths that do not exist: {missing}"


def test_every_named_module_exists():
    missing = []
    for token in _ticked(DOC.read_text()):
        if not re.fullmatch(r"mlcomp(\.\w+)+", token):
            continue
        parts = token.split(".")
        module = PKG.joinpath(*parts[1:])
        if module.is_dir() or module.with_suffix(".py").is_file():
            continue
        parent = PKG.joinpath(*parts[1:-1])
        init = parent / "__init__.py" if parent.is_dir() else parent.with_suffix(".py")
        # a public function of a package, e.g. mlcomp.export: listed in its __all__
        if not (init.is_file() and re.search(rf"[\"']{parts[-1]}[\"']", init.read_text())):
            missing.append(token)
    assert not missing, f"docs/ARCHITECTURE.md names modules that do not exist: {missing}"


def _all(path: Path) -> list[str]:
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", "") == "__all__" for t in node.targets):
            return list(ast.literal_eval(node.value))
    return []


def test_public_entry_points_resolve():
    """``mlcomp.compile/load/export`` are ``mlcomp.api``'s, which defines them in ``compiler``."""
    top = (PKG / "__init__.py").read_text()
    for name in ("compile", "load", "export"):
        assert name in _all(PKG / "__init__.py") and name in _all(PKG / "api" / "__init__.py"), name
        assert f'"{name}"' in top.split("def __getattr__", 1)[1], name
        assert name in _top_level_names(PKG / "api" / "compiler.py"), name
    assert "capture" in _top_level_names(PKG / "__init__.py")


def test_layer_table_matches_importlinter():
    text = DOC.read_text()
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and "`mlcomp." in line]
    table = [" | ".join(sorted(re.findall(r"`(mlcomp\.\w+)`", row.split("|")[2]))) for row in rows]
    assert table == _layers()


def test_readme_layers_match_importlinter():
    text = README.read_text()
    layout = text.split("## Layout", 1)[1]
    paragraph = layout.strip().split("\n\n", 1)[0]
    named = re.findall(r"`(\w+)`", paragraph.split("`make test`", 1)[0])
    expected = [row.replace("mlcomp.", "") for row in _layers()]
    joined: list[str] = []
    for row in expected:
        joined.extend(part.strip() for part in row.split("|"))
    assert [n for n in named if n in set(joined)] == joined


def test_backends_and_families_are_named():
    text = DOC.read_text()
    where = text.split("## Where code goes", 1)[1].split("\n## ", 1)[0]
    for backend in _independent("mlcomp.targets."):
        assert f"`{backend}`" in where, f"backend {backend} is not in 'Where code goes'"
    for family in _independent("mlcomp.passes."):
        assert f"`{family}`" in where, f"pass family {family} is not in 'Where code goes'"


def _enum_values(path: Path, cls: str) -> list[str]:
    node = next(n for n in ast.parse(path.read_text()).body if isinstance(n, ast.ClassDef) and n.name == cls)
    return [ast.literal_eval(a.value) for a in node.body if isinstance(a, ast.Assign)]


def _table_keys(path: Path, name: str) -> list[str]:
    """The keys of the dict literal handed to ``name = LazyRegistry(kind, {...})``."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if getattr(target, "id", "") == name:
                table = next(a for a in node.value.args if isinstance(a, ast.Dict))
                return [ast.literal_eval(k) for k in table.keys]
    raise AssertionError(f"{path.name} has no {name}")


def test_adding_a_backend_is_four_edits_in_two_files():
    text = DOC.read_text()
    for name in ("TargetName", "TARGETS", "RuntimeKind", "RUNTIMES", "mlcomp/targets/registry.py",
                 "mlcomp/runtime/artifact.py"):
        assert f"`{name}`" in text
    registry, artifact = PKG / "targets" / "registry.py", PKG / "runtime" / "artifact.py"
    assert set(_enum_values(registry, "TargetName")) == set(_table_keys(registry, "TARGETS"))
    assert set(_enum_values(artifact, "RuntimeKind")) == set(_table_keys(artifact, "RUNTIMES"))
    # a registration is a "mlcomp.targets.<backend>.module:Class" string outside that backend's package
    registering = set()
    for backend in _independent("mlcomp.targets."):
        ref = re.compile(rf"[\"']mlcomp\.targets\.{backend}(\.\w+)*:\w+[\"']")
        registering |= {str(p.relative_to(ROOT)) for p in PKG.rglob("*.py")
                        if f"targets/{backend}/" not in p.as_posix() and ref.search(p.read_text())}
    assert registering == {"mlcomp/targets/registry.py", "mlcomp/runtime/artifact.py"}


def test_cli_modules_are_named_after_their_commands():
    table = _table_keys(PKG / "cli" / "main.py", "COMMANDS")
    text = (PKG / "cli" / "main.py").read_text()
    refs = dict(re.findall(r'"([\w-]+)": "mlcomp\.cli\.(\w+):\w+"', text))
    assert set(refs) == set(table)
    shared = {name: module for name, module in refs.items() if module != name}
    where = DOC.read_text().split("## Where code goes", 1)[1].split("\n## ", 1)[0]
    row = next(line for line in where.splitlines() if line.startswith("| a CLI command"))
    for name, module in shared.items():
        assert f"`{name}`" in row and f"`cli/{module}.py`" in row, (name, module)


def test_readme_keeps_its_two_commands():
    blocks = re.findall(r"^```sh\n(.*?)^```", README.read_text(), flags=re.S | re.M)
    commands = [line.split("#")[0].strip() for block in blocks for line in block.splitlines()
                if line.startswith("make ")]
    assert commands == ["make demo", "make test"]


def test_results_name_host_and_script():
    text = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    sections = re.split(r"^## ", _prose(text), flags=re.M)[1:]
    assert sections
    for section in sections:
        title = section.splitlines()[0]
        assert re.search(r"^Scripts?: ", section, re.M), f"RESULTS.md '{title}' names no script"
        assert "Host" in section, f"RESULTS.md '{title}' names no host"
    scripts = set(re.findall(r"`(benchmarks/\w+\.py)", text))
    assert scripts and all((ROOT / s).is_file() for s in scripts), scripts


def test_decision_records_are_indexed_and_short():
    folder = ROOT / "docs" / "decisions"
    records = sorted(folder.glob("[0-9][0-9][0-9][0-9]-*.md"))
    assert records
    index = (folder / "README.md").read_text()
    for number, record in enumerate(records, start=1):
        text = record.read_text()
        assert record.name.startswith(f"{number:04d}-"), f"records are numbered without gaps: {record.name}"
        assert f"]({record.name})" in index, f"{record.name} is not in docs/decisions/README.md"
        assert re.search(r"^Date: \d{4}-\d\d-\d\d", text, re.M), f"{record.name} has no date"
        for part in ("## Context", "## Decision", "## Consequences"):
            assert part in text, f"{record.name} has no '{part}'"
        assert len(text.splitlines()) <= 40, f"{record.name} is over 40 lines"


HISTORY = [
    (re.compile(r"\bissue\s+#?\d+", re.I), "an issue number"),
    (re.compile(r"\bstop\s+\d+\b", re.I), "a stop number"),
    (re.compile(r"^\s*Before:", re.M), "a 'Before:' change note"),
    (re.compile(r"this AVX2 machine", re.I), "a statement about one machine"),
]


@pytest.mark.parametrize("pattern,what", HISTORY, ids=[w for _, w in HISTORY])
def test_sources_state_the_present(pattern, what):
    hits = [f"{p.relative_to(ROOT)}:{p.read_text()[:m.start()].count(chr(10)) + 1}"
            for p in sorted(PKG.rglob("*.py")) for m in pattern.finditer(p.read_text())]
    assert not hits, f"{what} in comments or docstrings (state what is; figures go to benchmarks/RESULTS.md): {hits}"
