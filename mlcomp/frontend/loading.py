"""Model sources: turn what the user names into something :mod:`mlcomp.frontend.capture` can take.

A model spec is one of

* a zoo name (``resnet18``; see ``mlcomp models list``);
* a TorchScript archive (``torch.jit.save`` output, usually ``.pt``);
* an ExportedProgram (``torch.export.save`` output, ``.pt2``);
* a factory ``path/to/file.py:fn`` or ``package.module:fn`` returning a module,
  ``(module, example_inputs)``, ``(module, loss_fn)`` or ``(module, example_inputs,
  loss_fn)``, where ``loss_fn(output, target)`` is the loss a training step uses
  (``ModelSource.loss_fn``; ``--train`` refuses a ``--loss`` given beside it);
* an ``nn.Module`` object (Python API).

A pickled full module (``torch.save(model)``) runs code when loaded and is
refused unless ``trust_pickle=True``.  Input shapes come from the source when it
carries them (zoo, ``.pt2``, a factory returning inputs, the input spec that
``mlcomp models save`` stores in TorchScript archives) or from ``--input-shape``.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import json
import os
import re
import sys
import zipfile
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
from torch import nn

from mlcomp import models
from mlcomp.base.errors import ModelLoadError, UnsafePickleError
from mlcomp.base.quiet import quiet_torch
from mlcomp.frontend.model_faults import train_mode_notes
from mlcomp.frontend.programs import program_module
from mlcomp.frontend.source import INPUT_SPEC_FILE, InputSpec, ModelSource, graph_random_inputs
from mlcomp.base.registry import did_you_mean
from mlcomp.models import random_tensor

__all__ = ["INPUT_SPEC_FILE", "InputSpec", "ModelSource", "graph_random_inputs", "kept_modes", "load_model",
           "save_torchscript"]

@contextlib.contextmanager
def kept_modes(model: Any) -> Iterator[None]:
    """Within the block a user's ``nn.Module`` may be switched to eval or train; on exit every submodule's
    ``training`` flag is what it was, so compiling never changes the caller's model.

    >>> m = nn.Sequential(nn.Linear(2, 2), nn.Dropout()).train()
    >>> with kept_modes(m):
    ...     _ = m.eval()
    >>> [x.training for x in m.modules()]
    [True, True, True]
    """
    modes = [(m, m.training) for m in model.modules()] if isinstance(model, nn.Module) else []
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def load_model(spec: str | nn.Module, *, input_shapes: Sequence[str | InputSpec] = (),
               example_inputs: Sequence[torch.Tensor] | None = None, trust_pickle: bool = False,
               batch: int | None = None) -> ModelSource:
    """Resolve a model spec (see module docstring) to a :class:`ModelSource`."""
    specs = [s if isinstance(s, InputSpec) else InputSpec.parse(s) for s in input_shapes]
    given = tuple(example_inputs) if example_inputs is not None else (
        tuple(s.random(torch.Generator().manual_seed(i)) for i, s in enumerate(specs)) if specs else None)
    if isinstance(spec, nn.Module):
        notes = train_mode_notes(spec, type(spec).__name__)
        return ModelSource(type(spec).__name__, spec.eval(), given, notes=notes)
    text = str(spec)
    if ":" in text and not os.path.exists(text) and not re.match(r"^[A-Za-z]:\\", text):
        return _load_factory(text, given, batch)
    path = Path(text)
    if not path.exists():
        zoo = models
        if text in zoo.ZOO:
            z = zoo.get(text)
            return ModelSource(text, z.build(), given or z.example_inputs(batch or 1), kind="zoo")
        close = did_you_mean(text, zoo.ZOO)
        raise ModelLoadError(f"model file {text} does not exist"
                             + (f" and no zoo model has that name (did you mean {close!r}?)" if close else ""),
                             hint=f"give a .pt/.pt2 file, a factory file.py:fn, or a zoo name "
                                  f"({', '.join(zoo.ZOO)})")
    if path.is_dir():
        raise ModelLoadError(f"{text} is a directory, not a model file",
                             hint="to run a compiled artifact folder use `mlcomp run DIR`")
    if path.stat().st_size == 0:
        raise ModelLoadError(f"model file {text} is empty", hint="save the model again")
    return _load_file(path, given, trust_pickle)


# ---------------------------------------------------------------------------
# Files


def _archive_kind(path: Path) -> str:
    """torchscript | exported | pickle | unknown, from the zip layout (no code is run)."""
    if not zipfile.is_zipfile(path):
        with open(path, "rb") as fh:
            head = fh.read(4)
        if head == b"PK\x03\x04":            # a zip's first entry without its end: the file was cut short
            raise ModelLoadError(
                f"{path} is cut short: it begins as a zip archive (what torch.export.save, torch.jit.save and "
                f"torch.save write) but its end is missing ({path.stat().st_size} bytes)",
                hint="the file is an incomplete copy or download; copy it again in full (or save it again)")
        return "legacy-pickle" if head[:1] == b"\x80" else "unknown"
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            bad = zf.testzip()
    except (zipfile.BadZipFile, OSError, EOFError) as exc:
        raise ModelLoadError(f"{path} is a damaged archive ({exc})",
                             hint="the file is truncated or corrupt; save the model again") from None
    if bad is not None:
        raise ModelLoadError(f"{path} is a damaged archive (entry {bad} fails its checksum)",
                             hint="the file is truncated or corrupt; save the model again")
    if any("/models/" in n and n.endswith(".json") for n in names) or any(
            n.endswith("serialized_exported_program.json") for n in names):
        return "exported"
    if any("/code/" in n for n in names) and any(n.endswith("constants.pkl") for n in names):
        return "torchscript"
    if any(n.endswith("data.pkl") for n in names):
        return "pickle"
    return "unknown"


def _load_file(path: Path, given: tuple[torch.Tensor, ...] | None, trust_pickle: bool) -> ModelSource:
    try:
        kind = _archive_kind(path)
    except zipfile.BadZipFile as exc:  # pragma: no cover - _archive_kind converts
        raise ModelLoadError(f"{path} is damaged: {exc}") from None
    name = re.sub(r"\W", "_", path.stem)
    if kind == "torchscript":
        extra = {INPUT_SPEC_FILE: ""}
        try:
            module = torch.jit.load(str(path), map_location="cpu", _extra_files=extra)
        except Exception as exc:  # noqa: BLE001
            raise ModelLoadError(f"TorchScript archive {path} could not be loaded: {_short(exc)}",
                                 hint="the file may be truncated or from an incompatible torch; save it again") from None
        inputs = given
        if inputs is None and extra[INPUT_SPEC_FILE]:
            specs = [InputSpec.from_json(d) for d in json.loads(extra[INPUT_SPEC_FILE])]
            inputs = tuple(s.random(torch.Generator().manual_seed(i)) for i, s in enumerate(specs))
        return ModelSource(name, module.eval(), inputs, str(path), kind="torchscript")
    if kind == "exported":
        try:
            ep = torch.export.load(str(path))
        except Exception as exc:  # noqa: BLE001
            raise ModelLoadError(f"ExportedProgram {path} could not be loaded: {_short(exc)}",
                                 hint="the file may be truncated or written by another torch version") from None
        inputs = given
        if inputs is None:
            args, _ = ep.example_inputs or ((), {})
            if args:
                inputs = tuple(a for a in args)
            else:
                inputs = tuple(_placeholder_inputs(ep))
        return ModelSource(name, program_module(ep), inputs, str(path), exported=ep, kind="exported")
    if kind in ("pickle", "legacy-pickle"):
        return _load_pickle(path, given, trust_pickle)
    raise ModelLoadError(f"{path} is not a TorchScript archive, an ExportedProgram or a torch.save file",
                         hint="save the model with torch.jit.save, torch.export.save, or give a factory file.py:fn")


def _placeholder_inputs(ep: Any) -> list[torch.Tensor]:
    out = []
    user = {s.arg.name for s in ep.graph_signature.input_specs if s.kind.name == "USER_INPUT"}
    for node in ep.graph.nodes:
        if node.op == "placeholder" and node.name in user:
            val = node.meta["val"]
            shape = [int(d) if not isinstance(d, torch.SymInt) else int(d.node.hint or 1) for d in val.shape]
            out.append(random_tensor(shape, val.dtype))
    return out


def _load_pickle(path: Path, given: tuple[torch.Tensor, ...] | None, trust_pickle: bool) -> ModelSource:
    try:
        obj = torch.load(str(path), map_location="cpu", weights_only=True)
    except Exception as exc:  # noqa: BLE001 - not weights-only: it wants to run code
        if not trust_pickle:
            raise UnsafePickleError(
                f"{path} is a pickled Python object (torch.save of a whole module); loading it would "
                "execute code stored in the file",
                hint="if you trust its author, pass --trust-pickle (trust_pickle=True); better, save the "
                     "model with torch.jit.save or torch.export.save, or give a factory file.py:fn") from None
        try:
            obj = torch.load(str(path), map_location="cpu", weights_only=False)
        except Exception as exc2:  # noqa: BLE001
            raise ModelLoadError(f"{path} could not be unpickled: {_short(exc2)}",
                                 hint="the classes it references must be importable") from None
        del exc
    if isinstance(obj, nn.Module):
        return ModelSource(path.stem, obj.eval(), given, str(path), kind="module")
    if isinstance(obj, dict):
        raise ModelLoadError(f"{path} holds only weights (a state dict), not a model",
                             hint="give a factory file.py:fn that builds the module and loads these weights")
    raise ModelLoadError(f"{path} holds a {type(obj).__name__}, not a model")


def _short(exc: BaseException) -> str:
    lines = [ln for ln in str(exc).strip().splitlines() if ln.strip()]
    return lines[0][:300] if lines else type(exc).__name__


# ---------------------------------------------------------------------------
# Factories


def _load_factory(text: str, given: tuple[torch.Tensor, ...] | None, batch: int | None) -> ModelSource:
    target, _, fn_name = text.rpartition(":")
    if not fn_name.isidentifier():
        raise ModelLoadError(f"{text!r} is not of the form path/to/file.py:function or package.module:function")
    if target.endswith(".py") or os.sep in target:
        path = Path(target)
        if not path.exists():
            raise ModelLoadError(f"factory file {target} does not exist", where=text,
                                 hint="check the path (relative to the current directory)")
        mod_name = "_mlcomp_factory_" + re.sub(r"\W", "_", path.stem)
        spec = importlib.util.spec_from_file_location(mod_name, path)
        module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
        sys.modules[mod_name] = module
        try:
            spec.loader.exec_module(module)  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001
            raise ModelLoadError(f"importing {target} failed: {type(exc).__name__}: {_short(exc)}",
                                 where=text) from None
    else:
        try:
            module = importlib.import_module(target)
        except ImportError as exc:
            raise ModelLoadError(f"module {target} cannot be imported ({exc})", where=text,
                                 hint="install it or give a file path path/to/file.py:function") from None
    fn = getattr(module, fn_name, None)
    if fn is None or not callable(fn):
        raise ModelLoadError(f"{target} has no function {fn_name}", where=text,
                             hint="name a function that returns an nn.Module (or (module, example_inputs))")
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001
        raise ModelLoadError(f"factory {text} raised {type(exc).__name__}: {_short(exc)}", where=text) from None
    inputs, loss_fn = given, None
    if isinstance(result, tuple) and len(result) >= 2 and isinstance(result[0], nn.Module):
        count = len(result)
        result, *rest = result
        if rest and _is_loss(rest[-1]):
            loss_fn = rest.pop()
        if len(rest) > 1 or (len(rest) == 1 and _is_loss(rest[0])):
            raise ModelLoadError(f"factory {text} returned {count} items; expected (module, "
                                 "example_inputs), (module, loss_fn) or (module, example_inputs, loss_fn)",
                                 where=text, hint="return the loss function last" if count <= 3 else
                                 f"drop the extra item(s) after the third ({', '.join(type(r).__name__ for r in rest[2:])})")
        if rest and inputs is None:
            fac_inputs = rest[0]
            inputs = tuple(fac_inputs) if isinstance(fac_inputs, (list, tuple)) else (fac_inputs,)
    if not isinstance(result, nn.Module):
        raise ModelLoadError(f"factory {text} returned a {type(result).__name__}, not an nn.Module")
    notes = train_mode_notes(result, text)           # before eval(): which modules train() mode changes
    return ModelSource(fn_name, result.eval(), inputs, text, kind="module", loss_fn=loss_fn, notes=notes)


def _is_loss(value: Any) -> bool:
    """A loss function: callable, and not example inputs (tensors are not callable; modules are)."""
    return callable(value) and not isinstance(value, (torch.Tensor, list, tuple))


def save_torchscript(module: nn.Module, inputs: Sequence[torch.Tensor], path: str | Path) -> None:
    """``torch.jit.trace`` and save with the input spec embedded (see ``INPUT_SPEC_FILE``)."""
    # Trace the exported (static-shape, functional) module rather than the raw one:
    # tracing nn.MultiheadAttention directly records sizes as tensors (int(tensor)),
    # which no converter can turn back into static shapes.

    with quiet_torch():
        flat = torch.export.export(module, tuple(inputs)).module()
        scripted = torch.jit.trace(flat, tuple(inputs), check_trace=False)
    extra = {INPUT_SPEC_FILE: json.dumps([InputSpec.of(t).to_json() for t in inputs])}
    torch.jit.save(scripted, str(path), _extra_files=extra)
