"""What a compile checks before anything is loaded, and how a model source is loaded.

An absurd size is refused before any allocation: ``mlcomp compile mlp --batch 100000000`` says
"--batch 100000000 needs 191 GiB for one input, more than this machine's N GiB of memory".

    >>> check_model_inputs("model.pt2", ["1x3x32x32"], None)
    Traceback (most recent call last):
    mlcomp.base.errors.InputSpecError: --input-shape was given with model.pt2, an ExportedProgram that
    carries its own input shapes...
"""
from __future__ import annotations

import math
import os
from typing import Any, Sequence

import torch

from mlcomp import models
from mlcomp.analysis.verify import check_tolerance
from mlcomp.base.errors import InputSpecError, MlcompError, ModelLoadError, OptionError
from mlcomp.frontend.loading import load_model
from mlcomp.ir.dtypes import parse_dtype

__all__ = ["check_model_inputs", "check_options", "load_source", "LOAD_KEYS", "TRAIN_KEYS"]

LOAD_KEYS = ("input_shapes", "batch", "capture", "dynamic", "dynamic_batch", "trust_pickle")
TRAIN_KEYS = ("loss", "optimizer", "y", "instruments", "pipeline_verify", "loss_scale", "randomness",   # mode="train"
              "update_in_backward", "host_memory")


def load_source(model_or_path: Any, example_inputs: Sequence[torch.Tensor] | torch.Tensor | None,
                load_opts: dict[str, Any]):
    """The :class:`~mlcomp.frontend.loading.ModelSource` for a module, file or zoo name."""
    if isinstance(example_inputs, torch.Tensor):
        example_inputs = (example_inputs,)
    return load_model(model_or_path, example_inputs=example_inputs,
                      input_shapes=load_opts.get("input_shapes") or (),
                      trust_pickle=bool(load_opts.get("trust_pickle")), batch=load_opts.get("batch"))


def _memory_bytes() -> int:
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return 1 << 40


def _check_size(what: str, shape: tuple[int, ...], itemsize: int, option: str) -> None:
    if any(d < 1 for d in shape):
        raise InputSpecError(f"{option} {what}: every size must be a positive integer",
                             hint="give sizes of at least 1, e.g. --input-shape 1x3x32x32")
    need, have = math.prod(shape) * itemsize, _memory_bytes()
    if need > have:
        raise InputSpecError(f"{option} {what} needs {need / 2**30:.3g} GiB for one input, more than this "
                             f"machine's {have / 2**30:.3g} GiB of memory", hint="give a smaller shape or batch")


def check_model_inputs(model: Any, input_shapes: Sequence[Any], batch: int | None,
                       capture_method: str = "export") -> None:
    """Shapes and batch checked before anything is loaded or allocated (non-positive, absurd, inapplicable).

    ``--input-shape 100000x100000x1000`` gives "--input-shape 100000x100000x1000 needs 3.73e+04 GiB for one input, more than …".
    """
    if isinstance(model, str) and not model.strip():
        raise ModelLoadError("the MODEL argument is empty", hint="give a zoo name (see `mlcomp models list`), "
                             "a .pt/.pt2 file or a factory path/to/file.py:fn")
    if input_shapes and isinstance(model, str) and model.endswith(".pt2"):
        raise InputSpecError(f"--input-shape was given with {model}, an ExportedProgram that carries its own "
                             f"input shapes", hint="drop --input-shape; export the model again for other shapes")
    if batch is not None and isinstance(model, str) and model.endswith(".pt2"):
        raise InputSpecError(f"--batch {batch} was given with {model}, an ExportedProgram that carries its own "
                             f"input shapes (its batch is fixed when it is exported)",
                             hint="drop --batch; export the model again (`mlcomp models save NAME --format pt2 "
                                  "--batch N`) for another batch")
    if capture_method == "fx" and isinstance(model, str) and model.endswith(".pt2"):
        raise InputSpecError(f"--capture fx does not apply to {model}: an ExportedProgram is already captured "
                             f"by torch.export", hint="drop --capture fx (the default, export, reads the file as is)")
    for text in input_shapes:
        if not isinstance(text, str):
            continue                      # an InputSpec object: checked by whoever built it
        dims, _, dtype_text = text.partition(":")
        try:
            shape = tuple(int(d) for d in dims.lower().split("x"))
            itemsize = parse_dtype(dtype_text).itemsize if dtype_text else 4
        except (ValueError, MlcompError):
            continue                      # malformed: the loader explains the syntax
        _check_size(text, shape, itemsize, "--input-shape")
    if isinstance(batch, int) and not input_shapes:
        if isinstance(model, str) and model in models.ZOO:
            _check_size(str(batch), (batch, *models.ZOO[model].input_shape), 4, "--batch")


def check_options(model: Any, load_opts: dict[str, Any], tolerance: Any) -> None:
    """Values checked before anything is loaded: batch, tolerance."""
    batch = load_opts.get("batch")
    if batch is not None and (isinstance(batch, bool) or not isinstance(batch, int) or batch < 1):
        raise OptionError(f"batch={batch!r} is not a positive integer", hint="give batch=1 or more")
    check_tolerance(tolerance, option="tolerance")
    if isinstance(model, str):
        check_model_inputs(model, load_opts.get("input_shapes") or (), batch, load_opts.get("capture", "export"))
