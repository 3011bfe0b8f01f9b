"""TorchScript archives that depend only on the model: the per-process counters renumbered.

``torch.jit.save`` writes a zip whose entry times are fixed, but two saves of the same model
in one process differ: every traced module's class gets the next number of a process-wide
counter (``__torch__.torch.fx.graph_module.___torch_mangle_3.GraphModule``), and the source
ranges in ``*.debug_pkl`` quote the FX code under a name with another counter
(``<eval_with_key>.37``) and index into that text by character offsets.
:func:`canonical_torchscript` renumbers the class counter in order of first appearance
(0, 1, …) in every entry name, code file and pickle, leaves the ``*.debug_pkl`` records out
(source ranges only improve TorchScript's error messages; renaming inside them would move
their offsets), and writes the archive again with torch's own zip writer (aligned records;
the serialization id is derived from the contents)::

    archive/code/__torch__/torch/fx/graph_module/___torch_mangle_3.py   ->  ___torch_mangle_0.py
    data.pkl:   GLOBAL '__torch__.torch.fx.graph_module.___torch_mangle_3 mlp_module'  ->  ___torch_mangle_0
    archive/code/__torch__/torch/fx/graph_module/___torch_mangle_3.py.debug_pkl       ->  (left out)

``torch.jit.load`` reads the result as it reads the original (it loads into a fresh
compilation unit, where the names are free).
"""
from __future__ import annotations

import io
import pickletools
import re
import struct
import zipfile
from collections.abc import Callable

import torch

__all__ = ["canonical_torchscript"]

_COUNTERS = (re.compile(rb"___torch_mangle_(\d+)"),)
_SERIALIZATION_ID = ".data/serialization_id"


def canonical_torchscript(payload: bytes) -> bytes:
    """``payload`` (a ``torch.jit.save`` archive) with its process counters renumbered (module doc)."""
    with zipfile.ZipFile(io.BytesIO(payload)) as zf:
        entries = [(info.filename, zf.read(info)) for info in zf.infolist()]
    renames = [_numbering(pattern, entries) for pattern in _COUNTERS]

    def rename(data: bytes) -> bytes:
        for pattern, table in zip(_COUNTERS, renames):
            data = pattern.sub(lambda m, t=table: m.group(0)[: m.start(1) - m.start(0)] + t[m.group(1)], data)
        return data

    out = io.BytesIO()
    writer = torch._C.PyTorchFileWriter(out)
    prefix = entries[0][0].split("/", 1)[0] + "/"
    for name, data in entries:
        inner = name[len(prefix):] if name.startswith(prefix) else name
        if inner == _SERIALIZATION_ID or inner.endswith(".debug_pkl"):   # derived by the writer / left out
            continue
        if inner.endswith(".pkl"):
            data = _repickle(data, rename)
        elif inner.endswith(".py"):
            data = rename(data)
        new = rename(inner.encode()).decode()
        writer.write_record(new, data, len(data))
    writer.write_end_of_file()
    return out.getvalue()


def _numbering(pattern: re.Pattern[bytes], entries: list[tuple[str, bytes]]) -> dict[bytes, bytes]:
    """Each number ``pattern`` captures, in order of first appearance in names then contents, -> 0, 1, …"""
    table: dict[bytes, bytes] = {}
    for name, data in entries:
        for text in (name.encode(), data):
            for m in pattern.finditer(text):
                table.setdefault(m.group(1), str(len(table)).encode())
    return table


def _repickle(data: bytes, rename: Callable[[bytes], bytes]) -> bytes:
    """``data`` (a pickle) with ``rename`` applied to its strings and globals; other opcodes copied byte for byte."""
    ops = list(pickletools.genops(data))
    out = bytearray()
    for i, (op, arg, pos) in enumerate(ops):
        end = ops[i + 1][2] if i + 1 < len(ops) else len(data)
        if op.name == "GLOBAL":
            module, _, name = arg.partition(" ")
            out += b"c" + rename(module.encode()) + b"\n" + rename(name.encode()) + b"\n"
        elif op.name in ("BINUNICODE", "SHORT_BINUNICODE", "BINUNICODE8") and _has_counter(arg):
            out += _unicode(op.name, rename(arg.encode("utf-8")))
        else:
            out += data[pos:end]
    return bytes(out)


def _has_counter(text: str) -> bool:
    raw = text.encode("utf-8", "surrogatepass")
    return any(p.search(raw) for p in _COUNTERS)


# string opcodes, re-encoded as the original wrote them: (opcode byte, length format)
_UNICODE = {"BINUNICODE": (b"X", "<I"), "SHORT_BINUNICODE": (b"\x8c", "<B"), "BINUNICODE8": (b"\x8d", "<Q")}


def _unicode(opname: str, text: bytes) -> bytes:
    code, size = _UNICODE[opname]
    return code + struct.pack(size, len(text)) + text
