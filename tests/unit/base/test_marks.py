"""mlcomp's file marker (:mod:`mlcomp.base.marks`), per format: marking makes ``written_by_mlcomp`` true,
the marked file still loads in its own tool with the same content, and a user's file of the same kind
(or anything under that name) is not taken for mlcomp's."""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from mlcomp.base.marks import FORMATS, mark, written_by_mlcomp

X = torch.randn(1, 4)


def _lin() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2).eval()


def _torchscript(p: Path):
    torch.jit.save(torch.jit.trace(_lin(), (X,)), str(p))
    return lambda: torch.jit.load(str(p))(X)


def _pt2(p: Path):
    torch.export.save(torch.export.export(_lin(), (X,)), str(p))
    return lambda: torch.export.load(str(p)).module()(X)


def _torch(p: Path):
    torch.save({"y": X}, p)
    return lambda: torch.load(p)["y"]


def _npz(p: Path):
    np.savez(p, y=X.numpy())
    return lambda: torch.from_numpy(np.load(p)["y"])


def _onnx(p: Path):
    import onnx
    import onnxruntime as ort

    with torch.no_grad():
        torch.onnx.export(_lin(), (X,), str(p), dynamo=False)

    def load():
        onnx.checker.check_model(onnx.load(str(p)))
        session = ort.InferenceSession(str(p), providers=["CPUExecutionProvider"])
        return torch.from_numpy(session.run(None, {session.get_inputs()[0].name: X.numpy()})[0])
    return load


def _png(p: Path):
    from PIL import Image

    Image.new("RGB", (3, 2), (10, 20, 30)).save(p)

    def load():
        with Image.open(p) as im:
            im.load()
            return torch.tensor(list(im.getdata()), dtype=torch.float32)
    return load


def _json(p: Path):
    p.write_text(json.dumps([{"a": 1}, {"a": 2}], indent=2))
    return lambda: torch.tensor([row["a"] for row in json.loads(p.read_text())], dtype=torch.float32)


def _dot(p: Path):
    p.write_text('digraph "g" {\n  "a" -> "b";\n}')
    return lambda: torch.tensor([p.read_text().startswith("digraph"), "-> \"b\"" in p.read_text()],
                                dtype=torch.float32)


def _ir(p: Path):
    p.write_text("graph g(x):\n  y = relu(x)\n")
    return lambda: torch.tensor([p.read_text().startswith("graph g(x):")], dtype=torch.float32)


WRITERS = {"torchscript": (_torchscript, "m.pt"), "pt2": (_pt2, "m.pt2"), "torch": (_torch, "o.pt"),
           "npz": (_npz, "o.npz"), "onnx": (_onnx, "m.onnx"), "png": (_png, "p.png"), "json": (_json, "r.json"),
           "dot": (_dot, "g.dot"), "ir": (_ir, "00-input.ir.txt")}


@pytest.mark.parametrize("fmt", sorted(WRITERS))
def test_marked_files_are_recognised_and_still_load(tmp_path, fmt):
    write, name = WRITERS[fmt]
    path = tmp_path / name
    load = write(path)
    before = load()
    assert not written_by_mlcomp(path)                     # a user's file of this kind
    assert FORMATS[fmt].fits(path)
    assert mark(path, fmt) is True
    assert written_by_mlcomp(path)
    assert torch.equal(load(), before)                     # its readers see the same content


def test_json_marker_is_a_first_key(tmp_path):
    path = tmp_path / "r.json"
    path.write_text(json.dumps({"model": "mlp", "seconds": {"a": 1.0}}, indent=1))
    mark(path, "json")
    data = json.loads(path.read_text())
    assert list(data)[0] == "written_by" and data["seconds"] == {"a": 1.0}


@pytest.mark.parametrize("content", ["[]", "3", '"text"'])
def test_json_without_an_object_cannot_be_marked(tmp_path, content):
    path = tmp_path / "r.json"
    path.write_text(content)
    assert mark(path, "json") is False and not written_by_mlcomp(path) and path.read_text() == content


def test_csv_has_no_marker(tmp_path):
    path = tmp_path / "t.csv"
    path.write_text("a,b\n1,2\n")
    assert mark(path, "csv") is False and not written_by_mlcomp(path) and path.read_text() == "a,b\n1,2\n"


@pytest.mark.parametrize("name, content", [
    ("notes.pt", b"my notes"),                     # text under a torch name
    ("fake.npz", b"PK\x03\x04 not really a zip"),
    ("m.onnx", b"\x08\x07\x12\x04user"),           # a protobuf without the marker
    ("m.onnx", b"\xff\xff\xff"),                   # not even a protobuf
    ("p.png", b"\x89PNG\r\n\x1a\n"),               # a truncated PNG
    ("r.json", b'{"written_by": "me"}'),
    ("empty.pt2", b""),
    ("g.dot", b"// written by me\ndigraph g {}\n"),
])
def test_other_files_are_not_taken_for_mlcomp_outputs(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    assert not written_by_mlcomp(path)


def test_a_folder_or_a_missing_path_is_not_a_marked_file(tmp_path):
    assert not written_by_mlcomp(tmp_path) and not written_by_mlcomp(tmp_path / "missing.pt")


def test_the_marker_is_recognised_by_content_not_name(tmp_path):
    path = tmp_path / "m.pt2"
    _pt2(path)
    mark(path, "pt2")
    renamed = path.rename(tmp_path / "anything.bin")
    assert written_by_mlcomp(renamed)
