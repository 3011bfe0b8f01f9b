"""How a file says "mlcomp wrote me" without changing what any reader of it sees.

Each file format mlcomp writes has one row in :data:`FORMATS`: the name suffixes it
must carry and the marker it holds.  A marker lives where the format keeps
free-form metadata, so ``torch.jit.load``, ``torch.export.load``, ``np.load``,
``onnx.load``/ONNX Runtime, image viewers and JSON readers see the same content:

==============  ==================  ============================================
format          suffixes            marker
==============  ==================  ============================================
``torchscript`` ``.pt``             zip archive comment ``written by mlcomp …``
``pt2``         ``.pt2``            zip archive comment
``torch``       ``.pt``             zip archive comment (``torch.save`` archive)
``npz``         ``.npz``            zip archive comment
``onnx``        ``.onnx``           ``metadata_props`` entry ``written_by``
``png``         ``.png``            ``tEXt`` chunk, keyword ``mlcomp``
``json``        ``.json``           first key ``"written_by"`` (of the first object in an array)
``dot``         ``.dot`` ``.gv``    last line ``// written by mlcomp …``
``ir``          ``.ir.txt``         last line ``# written by mlcomp …``
``csv``         ``.csv``            none: CSV has no comments
==============  ==================  ============================================

:func:`mark` adds the marker to a finished file (the writer calls it on its
temporary before the rename); it returns ``False`` where the content has no place
for one (a CSV, a JSON scalar or empty array), and such a file is never replaced.
:func:`written_by_mlcomp` recognises a marker by the file's *content* (zip, PNG,
ONNX, JSON or text), whatever its name, so a user's ``notes.pt`` is never taken
for an mlcomp output.

    >>> import tempfile, zipfile, os
    >>> path = os.path.join(tempfile.mkdtemp(), "a.npz")
    >>> with zipfile.ZipFile(path, "w") as z: z.writestr("x.npy", b"")
    >>> written_by_mlcomp(path)
    False
    >>> mark(path, "npz"), written_by_mlcomp(path)
    (True, True)
"""
from __future__ import annotations

import os
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from mlcomp.base.version import __version__

__all__ = ["FileFormat", "FORMATS", "SIGNATURE", "mark", "written_by_mlcomp", "format_named"]

SIGNATURE = f"written by mlcomp {__version__}"
_PREFIX = b"written by mlcomp"
_HEAD = 1 << 12            # bytes read to recognise a text marker


# ---------------------------------------------------------------------------
# zip archives (TorchScript, ExportedProgram, torch.save, numpy .npz): the end record's comment

_EOCD = b"PK\x05\x06"


def _eocd(data: bytes) -> int:
    """Offset of the end-of-central-directory record in the archive's tail ``data``, or -1."""
    at = data.rfind(_EOCD)
    while at >= 0:
        (length,) = struct.unpack_from("<H", data, at + 20) if at + 22 <= len(data) else (-1,)
        if at + 22 + length == len(data):
            return at
        at = data.rfind(_EOCD, 0, at)
    return -1


def _tail(path: Path, n: int = 22 + 0xFFFF) -> tuple[int, bytes]:
    size = path.stat().st_size
    with open(path, "rb") as fh:
        fh.seek(max(0, size - n))
        return max(0, size - n), fh.read()


def _mark_zip(path: Path) -> bool:
    start, data = _tail(path)
    at = _eocd(data)
    if at < 0:
        return False
    comment = SIGNATURE.encode()
    with open(path, "r+b") as fh:
        fh.seek(start + at + 20)
        fh.write(struct.pack("<H", len(comment)) + comment)
        fh.truncate()
    return True


def _zip_marked(path: Path) -> bool:
    _, data = _tail(path)
    at = _eocd(data)
    return at >= 0 and data[at + 22:].startswith(_PREFIX)


# ---------------------------------------------------------------------------
# ONNX (a protobuf ModelProto): a metadata_props entry (field 14) appended; protobuf merges fields

_ONNX_PROPS = 14


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _field(number: int, payload: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(payload)) + payload


def _read_varint(fh) -> int | None:
    shift = value = 0
    while True:
        byte = fh.read(1)
        if not byte:
            return None
        value |= (byte[0] & 0x7F) << shift
        if not byte[0] & 0x80:
            return value
        shift += 7
        if shift > 63:
            return None


def _mark_onnx(path: Path) -> bool:
    entry = _field(1, b"written_by") + _field(2, SIGNATURE.encode())
    with open(path, "ab") as fh:
        fh.write(_field(_ONNX_PROPS, entry))
    return True


def _onnx_marked(path: Path) -> bool:
    """Walk the top-level fields (skipping each payload): O(fields), whatever the weights' size."""
    size = path.stat().st_size
    skip = {0: _read_varint, 1: lambda fh: fh.seek(8, 1), 5: lambda fh: fh.seek(4, 1)}
    with open(path, "rb") as fh:
        while fh.tell() < size:
            key = _read_varint(fh)
            if key is None:
                return False
            number, wire = key >> 3, key & 7
            if wire == 2:
                length = _read_varint(fh)
                if length is None or fh.tell() + length > size:
                    return False
                if number == _ONNX_PROPS and length < 4096:
                    if _PREFIX in fh.read(length):
                        return True
                else:
                    fh.seek(length, 1)
            elif wire in skip:
                if skip[wire](fh) is None and wire == 0:
                    return False
            else:
                return False
    return False


# ---------------------------------------------------------------------------
# PNG: a tEXt chunk before IEND

_PNG = b"\x89PNG\r\n\x1a\n"
_PNG_KEY = b"mlcomp"


def _mark_png(path: Path) -> bool:
    data = path.read_bytes()
    if not data.startswith(_PNG) or data[-12:-8] != b"\x00\x00\x00\x00" or data[-8:-4] != b"IEND":
        return False
    body = b"tEXt" + _PNG_KEY + b"\x00" + SIGNATURE.encode("latin-1")
    chunk = struct.pack(">I", len(body) - 4) + body + struct.pack(">I", zlib.crc32(body) & 0xFFFFFFFF)
    path.write_bytes(data[:-12] + chunk + data[-12:])
    return True


def _png_marked(path: Path) -> bool:
    size = path.stat().st_size
    with open(path, "rb") as fh:
        if fh.read(8) != _PNG:
            return False
        while fh.tell() + 8 <= size:
            length, kind = struct.unpack(">I4s", fh.read(8))
            if kind == b"tEXt" and length < 4096:
                key, _, text = fh.read(length).partition(b"\x00")
                if key == _PNG_KEY and text.startswith(_PREFIX):
                    return True
                fh.seek(4, 1)
            elif kind == b"IEND":
                return False
            else:
                fh.seek(length + 4, 1)
    return False


# ---------------------------------------------------------------------------
# text: JSON objects (a first key), Graphviz dot and IR text (a last-line comment)

_JSON_MARK = re.compile(rb'\A\s*(\[\s*)?\{\s*"written_by"\s*:\s*"written by mlcomp')
_JSON_OPEN = re.compile(r"\A\s*(\[\s*)?\{")


def _mark_json(path: Path) -> bool:
    """The key goes first in the object, or in an array's first object; a scalar or ``[]`` has no place."""
    text = path.read_text()
    opening = _JSON_OPEN.match(text)
    if opening is None:
        return False
    brace = opening.end() - 1
    rest = text[brace + 1:]
    gap = rest[:len(rest) - len(rest.lstrip())] or " "
    entry = f'"written_by": "{SIGNATURE}"' + ("" if rest.lstrip().startswith("}") else ",")
    path.write_text(text[:brace + 1] + gap + entry + rest)
    return True


def _head(path: Path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(_HEAD)


def _comment(prefix: str) -> tuple[Callable[[Path], bool], Callable[[Path], bool]]:
    """A last-line comment: the file still starts as its readers expect (``digraph``, ``graph``)."""
    line = f"{prefix} {SIGNATURE}\n"

    def write(path: Path) -> bool:
        text = path.read_text()
        path.write_text(text + ("" if not text or text.endswith("\n") else "\n") + line)
        return True

    def read(path: Path) -> bool:
        _, tail = _tail(path, 512)
        last = tail.rstrip().rsplit(b"\n", 1)[-1]
        return last.startswith(f"{prefix} ".encode() + _PREFIX)
    return write, read


def _never(path: Path) -> bool:
    return False


# ---------------------------------------------------------------------------
# the table

@dataclass(frozen=True)
class FileFormat:
    """One kind of file mlcomp writes: its name suffixes and how it carries the marker."""

    name: str
    suffixes: tuple[str, ...]
    marker: str                              # where the marker lives, in words
    add: Callable[[Path], bool]
    found: Callable[[Path], bool]

    def fits(self, path: str | os.PathLike[str]) -> bool:
        return Path(path).name.lower().endswith(self.suffixes)


_DOT = _comment("//")
_IR = _comment("#")
FORMATS: dict[str, FileFormat] = {f.name: f for f in (
    FileFormat("torchscript", (".pt",), "zip archive comment", _mark_zip, _zip_marked),
    FileFormat("pt2", (".pt2",), "zip archive comment", _mark_zip, _zip_marked),
    FileFormat("torch", (".pt",), "zip archive comment", _mark_zip, _zip_marked),
    FileFormat("npz", (".npz",), "zip archive comment", _mark_zip, _zip_marked),
    FileFormat("onnx", (".onnx",), "ONNX metadata_props written_by", _mark_onnx, _onnx_marked),
    FileFormat("png", (".png",), "PNG tEXt chunk 'mlcomp'", _mark_png, _png_marked),
    FileFormat("json", (".json",), 'first key "written_by" (of the first object in an array)', _mark_json, lambda p: bool(_JSON_MARK.match(_head(p)))),
    FileFormat("dot", (".dot", ".gv"), "last line // comment", *_DOT),
    FileFormat("ir", (".ir.txt",), "last line # comment", *_IR),
    FileFormat("csv", (".csv",), "none (CSV has no comments)", _never, _never),
)}

# content signature -> the formats whose marker such content may hold (checked in order)
_SNIFF: tuple[tuple[Callable[[bytes, Path], bool], tuple[str, ...]], ...] = (
    (lambda head, p: head.startswith((b"PK\x03\x04", _EOCD)), ("npz",)),
    (lambda head, p: head.startswith(_PNG), ("png",)),
    (lambda head, p: head.lstrip().startswith((b"{", b"[")), ("json",)),
    (lambda head, p: p.name.lower().endswith(".onnx"), ("onnx",)),
    (lambda head, p: True, ("dot", "ir")),                       # any other text: its last line
)


def format_named(name: str) -> FileFormat:
    return FORMATS[name]


def mark(path: str | os.PathLike[str], fmt: str) -> bool:
    """Add mlcomp's marker to the finished file ``path`` of format ``fmt``; False if it has no place for one."""
    return FORMATS[fmt].add(Path(path))


def written_by_mlcomp(path: str | os.PathLike[str]) -> bool:
    """True if the file ``path`` carries mlcomp's marker (recognised from its content, not its name)."""
    file = Path(path)
    try:
        if not file.is_file():
            return False
        head = _head(file)
        for matches, names in _SNIFF:
            if matches(head, file):
                return any(FORMATS[n].found(file) for n in names)
    except (OSError, ValueError, struct.error):
        return False
    return False
