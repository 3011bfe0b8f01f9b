"""Where captured things come from, and how to say so: module origins, source lines, capture failures, output names.

Every IR node carries an :class:`~mlcomp.ir.Origin` (module path, module type,
``file.py:line`` of user code) taken from torch.export's node metadata; a
failed capture becomes one paragraph that names the user's line::

    >>> fx_node = torch.fx.Graph().placeholder("x")      # as torch.export leaves a node's metadata
    >>> fx_node.meta["nn_module_stack"] = {"L['self'].layer1[0].conv1": ("L['self'].layer1[0].conv1",
    ...                                                                  "torch.nn.Conv2d")}
    >>> fx_node.meta["stack_trace"] = 'File "model.py", line 42, in forward\\n    x = self.conv1(x)'
    >>> origin_of(fx_node)
    Origin(module_path='layer1.0.conv1', module_type='Conv2d', source='model.py:42')
    >>> exc = RuntimeError('Could not guard on data-dependent expression u0 > 0\\n'
    ...                    '  File "model.py", line 7, in forward\\n    if x.sum() > 0:')
    >>> print(explain_export_failure(exc, "net").message)
    model net branches on the value of a tensor (data-dependent control flow), ...
    >>> output_names({"logits": torch.zeros(2), "aux": [torch.zeros(1), torch.zeros(1)]})
    ['logits', 'aux_0', 'aux_1']
"""
from __future__ import annotations

import re
import traceback
from typing import Any

import torch
from torch.utils._pytree import tree_flatten_with_path

from mlcomp.base.errors import CaptureError, InputSpecError
from mlcomp.ir import Origin


def origin_of(fx_node: torch.fx.Node) -> Origin:
    stack = fx_node.meta.get("nn_module_stack") or {}
    path, mtype = "", ""
    if stack:
        path, qual = list(stack.values())[-1]
        mtype = str(qual).rsplit(".", 1)[-1]
        path = _clean_path(path)
    return Origin(path, mtype, _source_line(fx_node.meta.get("stack_trace") or ""))


def _clean_path(path: str) -> str:
    # export spells module paths like "L['self'].layer1[0].conv1" in some versions
    path = re.sub(r"^L\['self'\]\.?", "", str(path))
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    path = path.replace("._modules['", ".").replace("']", "")
    return path.strip(".")


_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def _source_line(stack_trace: str) -> str:
    """The innermost frame of user code (not torch's) as ``file.py:line``."""
    frames = _FRAME.findall(stack_trace)
    user = [f for f in frames if "/torch/" not in f[0] and "site-packages" not in f[0]]
    pick = (user or frames)[-1] if (user or frames) else None
    return f"{pick[0]}:{pick[1]}" if pick else ""


def identifier(name: str) -> str:
    return re.sub(r"\W", "_", name) or "graph"


# ---------------------------------------------------------------------------
# Failures


def first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def user_frame(exc: BaseException) -> str | None:
    frames = traceback.extract_tb(exc.__traceback__)
    user = [f for f in frames if "/torch/" not in f.filename and "/mlcomp/" not in f.filename
            and "site-packages" not in f.filename and not f.filename.startswith("<")]
    if not user:
        return None
    f = user[-1]
    return f"{f.filename}:{f.lineno} ({(f.line or '').strip()})"


def explain_export_failure(exc: BaseException, name: str) -> CaptureError:
    text = str(exc)
    where = None
    m = re.search(r'File "([^"]+)", line (\d+), in (\w+)\n\s*(.+)', text)
    if m:
        where = f"{m.group(1)}:{m.group(2)} in {m.group(3)} ({m.group(4).strip()})"
    else:
        where = user_frame(exc)
    data_dependent = any(k in text for k in ("data-dependent", "GuardOnDataDependent", "control flow"))
    if data_dependent or "DataDependent" in type(exc).__name__:
        return CaptureError(
            f"model {name} branches on the value of a tensor (data-dependent control flow), "
            "which a static graph cannot capture without silently fixing one branch",
            where=where,
            hint="rewrite the branch with torch.cond(pred, true_fn, false_fn, operands) or torch.where, "
                 "or move it out of the compiled model")
    if isinstance(exc, InputSpecError):
        return CaptureError(exc.message)
    if any(k in text for k in ("size mismatch", "shape", "Expected", "mat1 and mat2", "must match")):
        return CaptureError(f"running {name} on the example inputs failed: {first_line(exc)}",
                            where=where,
                            hint="check --input-shape: the shapes must be ones the model accepts")
    return CaptureError(f"torch.export could not capture {name}: {first_line(exc)}", where=where,
                        hint="try --capture fx, or simplify the unsupported construct it names")


def output_names(outputs: Any) -> list[str]:
    """Public names of a model's outputs (its tensors in flattening order), from the value it returns.

    A dict or a ``ModelOutput`` names them by key, a named tuple by field;
    positional ones are ``output``, ``output_1``, ``output_2`` ... (never an
    internal op such as ``addmm``).

        >>> output_names(torch.zeros(2)), output_names((torch.zeros(2), torch.zeros(3)))
        (['output'], ['output', 'output_1'])
        >>> output_names({"logits": torch.zeros(2), "aux": [torch.zeros(1), torch.zeros(1)]})
        ['logits', 'aux_0', 'aux_1']
    """
    leaves, _ = tree_flatten_with_path(outputs)
    names: list[str] = []
    for i, (path, leaf) in enumerate(p for p in leaves if isinstance(p[1], torch.Tensor)):
        keys = [str(getattr(k, "key", getattr(k, "name", getattr(k, "idx", "")))) for k in path]
        named = any(not hasattr(k, "idx") for k in path)
        name = "_".join(identifier(k) for k in keys) if named else ("output" if i == 0 else f"output_{i}")
        while name in names:
            name += "_"
        names.append(name)
    return names


__all__ = ["origin_of", "explain_export_failure", "first_line", "identifier", "output_names", "user_frame"]
