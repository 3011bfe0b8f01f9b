"""The corpus harness: run a command as a user runs it, in a folder holding the user's files.

Every case asserts the corpus rules (see :func:`check`): the expected exit code, no traceback, stderr one
paragraph (``error: ...`` or ``interrupted``), and the folder byte for byte as it was before (nothing
written, nothing left, nothing changed).  The user's folder (:func:`make_user_folder`) holds
``userdir/important.txt``, ``hello.txt``, an earlier mlcomp output ``earlier/`` and an empty ``x.pt2``.
"""
from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest
from click.testing import CliRunner

from mlcomp.cli.main import main

REPO = Path(__file__).resolve().parents[2]


def snapshot(root: Path) -> dict[str, str]:
    """Every path under ``root`` → a digest of its content ("dir" for folders)."""
    out = {}
    for p in sorted(root.rglob("*")):
        key = p.relative_to(root).as_posix()
        out[key] = "dir" if p.is_dir() else hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def make_user_folder(tmp_path: Path) -> Path:
    """The folder a case runs in, with the user's files (see module doc)."""
    root = tmp_path / "work"
    (root / "userdir").mkdir(parents=True)
    (root / "userdir" / "important.txt").write_text("the user's data\n")
    (root / "hello.txt").write_text("hello\n")
    (root / "earlier").mkdir()
    (root / "earlier" / ".mlcomp").write_text('{"written_by": "mlcomp", "kind": "report"}\n')
    (root / "earlier" / "index.html").write_text("<html>an earlier report</html>\n")
    (root / "x.pt2").write_bytes(b"")
    return root


def readonly_dir(tmp_path: Path) -> Path:
    """A folder no file can be created in (root ignores permissions: use a read-only mount then)."""
    if os.geteuid() != 0:
        ro = tmp_path / "readonly"
        ro.mkdir()
        ro.chmod(0o555)
        return ro
    for candidate in (Path("/sys"), Path("/proc")):
        try:
            (candidate / ".mlcomp-probe").write_text("")
        except OSError:
            return candidate
        (candidate / ".mlcomp-probe").unlink()
    pytest.skip("no read-only folder is available to a root user here")


def check(folder: Path, args: list[str], *, code: int = 2, expect: tuple[str, ...] = ()) -> str:
    """Run ``mlcomp ARGS`` in ``folder`` and assert the corpus rules; returns stderr."""
    before = snapshot(folder)
    runner = CliRunner()
    cwd = os.getcwd()
    os.chdir(folder)
    try:
        res = runner.invoke(main, args)
    finally:
        os.chdir(cwd)
    err = res.stderr.strip()
    assert isinstance(res.exception, SystemExit) or res.exception is None, repr(res.exception)
    assert res.exit_code == code, (res.exit_code, res.output)
    assert "Traceback" not in res.output
    assert err.startswith("error: ") or (code == 130 and err == "interrupted"), err
    assert "\n" not in err, err                                      # one paragraph, one line
    for text in expect:
        assert text in err, (text, err)
    assert snapshot(folder) == before                               # nothing left, nothing changed
    return err
