"""The only way mlcomp writes its outputs: checked first, written aside, marked, renamed on success.

The rule, for every path any command or API function writes (file or folder):

* a new path is written;
* an existing mlcomp output is replaced only with ``force`` (``--force``);
* anything else that exists (a user's file, whatever its name; a link; a folder
  that is not empty and has no ``.mlcomp`` marker) is refused, even with ``force``;
* the command's input (model file, artifact folder) is never an output, even with
  ``force``: not the same file (through a link too), not a folder holding it, not a
  path inside it;
* a file's name ends in its format's suffix (:data:`mlcomp.base.marks.FORMATS`).

1. :func:`check_destination` applies the rule *before* any expensive work
   (capture, passes, builds), raising a one-paragraph :class:`OutputPathError`.
2. :func:`atomic_path` / :func:`atomic_dir` write under a temporary sibling, mark
   it and rename it into place when the block succeeds.  On any exception, Ctrl-C
   included, the temporary (and any parent folder they created) is removed and the
   old output is untouched.  They refuse a user's file or folder themselves, whoever
   called them.  A folder gets a small ``.mlcomp`` marker file; a file gets its
   format's marker (:mod:`mlcomp.base.marks`: a zip comment, ONNX metadata, a PNG
   text chunk, a JSON key, a comment line), which no reader of the file sees.
   :func:`written_by_mlcomp` reads it.
3. :class:`~mlcomp.base.interrupts.InterruptScope` (used by the CLI) turns Ctrl-C
   into ``KeyboardInterrupt`` and remembers it, so an interrupt that a native library
   swallowed still stops the next commit and still exits as an interruption.

Two refusals::

    mlcomp export m.pt2 --format pt2 -o m.pt2
      error: the output m.pt2 is the input /home/u/m.pt2; mlcomp never writes over its
              input, even with --force (at -o) ...                       (nothing touched)
    mlcomp export mlp --format onnx -o thesis.txt         (thesis.txt exists)
      error: the output thesis.txt is an existing file that mlcomp did not write ...

    >>> import tempfile; out = Path(tempfile.mkdtemp()) / "r.json"
    >>> check_destination(out, Kind.FILE, fmt="json") == out
    True
    >>> write_text_atomic(out, '{"a": 1}', fmt="json")
    >>> written_by_mlcomp(out), json.loads(out.read_text())["a"]
    (True, 1)
    >>> try:                                    # again: an earlier mlcomp output needs force
    ...     check_destination(out, Kind.FILE, fmt="json")
    ... except OutputPathError as err:
    ...     print(str(err).split(". ")[0].endswith("is an earlier mlcomp output"))
    True
    >>> check_destination(out, Kind.FILE, fmt="json", force=True) == out
    True
"""
from __future__ import annotations

import contextlib
import enum
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

from mlcomp.base.errors import OutputPathError
from mlcomp.base.interrupts import InterruptScope, raise_if_interrupted, shielded as _shielded
from mlcomp.base.marks import FORMATS, mark, written_by_mlcomp
from mlcomp.base.version import __version__

__all__ = ["sha256_file", "Kind", "MARKER", "FORMATS", "check_destination", "is_mlcomp_output", "written_by_mlcomp",
           "atomic_path", "write_text_atomic", "atomic_dir", "mark_folder", "InterruptScope", "raise_if_interrupted"]

MARKER = ".mlcomp"
_MANIFEST = "manifest.json"


class Kind(enum.Enum):
    """What a destination must be."""

    FILE = "file"
    DIR = "folder"


# ---------------------------------------------------------------------------
# checking a destination

def is_mlcomp_output(path: str | os.PathLike[str]) -> bool:
    """A folder mlcomp wrote: it holds the ``.mlcomp`` marker or an mlcomp ``manifest.json``."""
    folder = Path(path)
    if (folder / MARKER).is_file():
        return True
    try:
        manifest = json.loads((folder / _MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(manifest, dict) and str(manifest.get("format", "")).startswith("mlcomp")


def _existing_ancestor(path: Path) -> Path:
    for parent in path.absolute().parents:
        if os.path.lexists(parent):
            return parent
    return Path(path.absolute().anchor)


def _writable(folder: Path) -> str | None:
    """``None`` if a file can be created in ``folder``, else why not (a real probe: root and read-only mounts)."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".mlcomp-probe.", dir=folder)
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    os.close(fd)
    os.unlink(probe)
    return None


def _existing_inputs(inputs: Iterable[str | os.PathLike[str]]) -> list[Path]:
    """The inputs that name files or folders (a factory ``file.py:fn`` names ``file.py``; zoo names none)."""
    found = []
    for spec in inputs:
        text = os.fspath(spec)
        for candidate in (text, text.rsplit(":", 1)[0]):
            if candidate and os.path.exists(candidate):
                found.append(Path(os.path.realpath(candidate)))
                break
    return found


def _refuse_input(dest: Path, inputs: Iterable[str | os.PathLike[str]], option: str) -> None:
    """The command's own input is never an output, whatever ``force`` says."""
    real = Path(os.path.realpath(dest))
    for inp in _existing_inputs(inputs):
        if real == inp or (os.path.exists(dest) and os.path.samefile(dest, inp)):
            why = f"the output {dest} is the input {inp}"
        elif inp.is_relative_to(real):
            why = f"the output folder {dest} holds the input {inp}"
        elif inp.is_dir() and real.is_relative_to(inp):
            why = f"the output {dest} is inside the input folder {inp}"
        else:
            continue
        raise OutputPathError(f"{why}; mlcomp never writes over its input, even with --force", where=option,
                              hint="give the output a path of its own")


def _force(option: str) -> str:
    """How the caller says "replace": the ``--force`` flag, or ``force=True`` for a Python argument."""
    return "--force" if option.startswith("-") else "force=True"


def _refuse_existing_file(dest: Path, force: bool, option: str, example: str) -> None:
    if dest.is_symlink():
        raise OutputPathError(f"the output {dest} is a symbolic link (to {os.readlink(dest)}); mlcomp never "
                              f"replaces a link or writes through it", where=option, hint=f"give a new file name {example}")
    if dest.is_dir():
        raise OutputPathError(f"the output {dest} is an existing folder; mlcomp will not replace a folder "
                              f"by a file", where=option, hint=f"give a file name {example}")
    if not written_by_mlcomp(dest):
        plain = [f.name.upper() for f in FORMATS.values() if f.fits(dest) and f.marker.startswith("none")]
        why = f"; a {plain[0]} file has no place for that marker" if plain else ""
        raise OutputPathError(f"the output {dest} is an existing file that mlcomp did not write (it carries no "
                              f"mlcomp marker{why}); mlcomp never replaces it, even with --force", where=option,
                              hint=f"give a new file name {example}")
    if not force:
        raise OutputPathError(f"the output {dest} is an earlier mlcomp output", where=option,
                              hint=f"pass {_force(option)} to replace it, or give a new file name")


def _refuse_existing_folder(dest: Path, force: bool, option: str) -> None:
    if not dest.is_dir():
        raise OutputPathError(f"the output {dest} is an existing file; mlcomp will not replace a file by a folder",
                              where=option, hint="give the name of a new or empty folder")
    if not any(dest.iterdir()):
        return
    if not is_mlcomp_output(dest):
        raise OutputPathError(f"the output folder {dest} is not empty and was not written by mlcomp "
                              f"(it has no {MARKER} marker or mlcomp manifest.json); mlcomp never deletes it, "
                              f"even with --force", where=option, hint="give a new or empty folder")
    if not force:
        raise OutputPathError(f"the output folder {dest} holds an earlier mlcomp output", where=option,
                              hint=f"pass {_force(option)} to replace it, or give a new folder")


def _example(fmt: str | None) -> str:
    """What a new file name must look like: ``ending in .onnx`` (nothing when the format is open)."""
    return f"ending in {FORMATS[fmt].suffixes[0]}" if fmt is not None else "one that does not exist yet"


def check_destination(path: str | os.PathLike[str], kind: Kind = Kind.FILE, *, force: bool = False,
                      option: str = "-o", fmt: str | None = None,
                      inputs: Iterable[str | os.PathLike[str]] = ()) -> Path:
    """Refuse a destination mlcomp must not write (the rule in the module doc); returns it as a ``Path``.

    ``fmt`` names the file's format in :data:`mlcomp.base.marks.FORMATS` (its suffix is checked);
    ``inputs`` are the command's inputs (model file, artifact folder), never valid outputs.
    """
    text = os.fspath(path)
    if not str(text).strip():
        raise OutputPathError(f"the output path given to {option} is empty",
                              hint=f"give a {kind.value} name, e.g. {option} out/model")
    dest = Path(text)
    _refuse_input(dest, inputs, option)
    what = "file" if kind is Kind.FILE else "folder"
    anc = _existing_ancestor(dest)
    if not anc.is_dir():
        raise OutputPathError(f"cannot write the output {what} {dest}: {anc} is a file, not a folder",
                              where=option, hint="choose a path that is not under an existing file")
    reason = _writable(anc)
    if reason:
        raise OutputPathError(f"cannot write the output {what} {dest}: the folder {anc} is not writable ({reason})",
                              where=option, hint="choose a folder you can write to")
    if os.path.lexists(dest):
        if kind is Kind.FILE:
            _refuse_existing_file(dest, force, option, _example(fmt))
        else:
            _refuse_existing_folder(dest, force, option)
    if kind is Kind.FILE and fmt is not None and not FORMATS[fmt].fits(dest):
        wanted = " or ".join(FORMATS[fmt].suffixes)
        raise OutputPathError(f"the output {dest} is a {fmt} file, whose name must end in {wanted}", where=option,
                              hint=f"name it {dest.with_name(dest.stem + FORMATS[fmt].suffixes[0])}")
    return dest


# ---------------------------------------------------------------------------
# writing

def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _make_parents(folder: Path) -> list[Path]:
    """Create ``folder`` and missing parents; return those created (deepest last)."""
    missing = [p for p in (folder, *folder.parents) if not os.path.lexists(p)]
    created: list[Path] = []
    try:
        for p in reversed(missing):
            p.mkdir()
            created.append(p)
    except OSError as exc:
        _remove_created(created)
        raise OutputPathError(f"cannot create the folder {folder}: {exc.strerror or exc}",
                              hint="choose a folder you can write to") from None
    return created


def _remove_created(created: list[Path]) -> None:
    for p in reversed(created):
        with contextlib.suppress(OSError):
            p.rmdir()    # only if still empty


def _refuse_file(target: Path) -> None:
    """The last guard for a file: a folder, a link or a file without mlcomp's marker is never replaced."""
    if target.is_dir():
        raise OutputPathError(f"the output {target} is an existing folder; mlcomp will not replace a folder "
                              f"by a file", hint="give a file name")
    if target.is_symlink() or (os.path.lexists(target) and not written_by_mlcomp(target)):
        raise OutputPathError(f"the output {target} is an existing file that mlcomp did not write; mlcomp never "
                              f"replaces it", hint="give a new file name")


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], fmt: str | None = None) -> Iterator[str]:
    """Yield a temporary file path next to ``path``; mark it as ``fmt`` and rename it to ``path`` on success."""
    target = Path(path)
    _refuse_file(target)
    created = _make_parents(target.parent)
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    except OSError as exc:
        _remove_created(created)
        raise OutputPathError(f"cannot write {target}: {exc.strerror or exc}",
                              hint="choose a folder you can write to") from None
    os.close(fd)
    ok = False
    try:
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; results are ordinary files
        yield tmp
        if fmt is not None:
            mark(tmp, fmt)
        raise_if_interrupted()
        _refuse_file(target)              # again: it may have appeared meanwhile
        os.replace(tmp, target)
        ok = True
    finally:
        with _shielded():
            if os.path.exists(tmp):
                os.unlink(tmp)
            if not ok:
                _remove_created(created)


def write_text_atomic(path: str | os.PathLike[str], text: str, fmt: str | None = None) -> None:
    """Write ``text`` to ``path`` through :func:`atomic_path` (marked as ``fmt``)."""
    with atomic_path(path, fmt) as tmp:
        Path(tmp).write_text(text)


def mark_folder(path: str | os.PathLike[str], label: str) -> None:
    """Write the ``.mlcomp`` marker into the folder ``path`` (it holds mlcomp's ``label``: artifact, dump …)."""
    (Path(path) / MARKER).write_text(json.dumps({"written_by": "mlcomp", "version": __version__,
                                                 "kind": label}) + "\n")


def _refuse_folder(target: Path) -> None:
    """The last guard against data loss, whatever the caller checked before."""
    if not os.path.lexists(target):
        return
    if not target.is_dir():
        raise OutputPathError(f"the output {target} is an existing file; mlcomp will not replace a file by a folder",
                              hint="give the name of a new or empty folder")
    if any(target.iterdir()) and not is_mlcomp_output(target):
        raise OutputPathError(f"the output folder {target} is not empty and was not written by mlcomp "
                              f"(it has no {MARKER} marker or mlcomp manifest.json); mlcomp never deletes it",
                              hint="give a new or empty folder")


def _swap_in(tmp: Path, target: Path) -> None:
    """Rename ``tmp`` to ``target``; an old ``target`` is moved aside first and restored if that fails."""
    if not os.path.lexists(target):
        os.replace(tmp, target)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".old", dir=target.parent))
    os.replace(target, old / "previous")
    try:
        os.replace(tmp, target)
    except BaseException:
        os.replace(old / "previous", target)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike[str], *, overwrite: bool = True, label: str = "output") -> Iterator[Path]:
    """Yield a temporary directory next to ``path``; move it to ``path`` when the block succeeds.

    An existing ``path`` is replaced only if it is empty or an earlier mlcomp output
    (and ``overwrite``); the committed folder carries the ``.mlcomp`` marker (``label``
    says what it holds: artifact, report, export).
    """
    target = Path(path)
    _refuse_folder(target)
    if os.path.lexists(target) and not overwrite:
        raise OutputPathError(f"the output folder {target} already exists", hint="give a new folder")
    created = _make_parents(target.parent)
    try:
        tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    except OSError as exc:
        _remove_created(created)
        raise OutputPathError(f"cannot write {target}: {exc.strerror or exc}",
                              hint="choose a folder you can write to") from None
    ok = False
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp makes 0700
        yield tmp
        mark_folder(tmp, label)
        raise_if_interrupted()
        _refuse_folder(target)            # again: it may have appeared meanwhile
        with _shielded():
            _swap_in(tmp, target)
            ok = True
    finally:
        with _shielded():
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
            if not ok:
                _remove_created(created)


def sha256_file(path: str | os.PathLike[str]) -> str:
    """The hex SHA-256 of a file's bytes, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()
