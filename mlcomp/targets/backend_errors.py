"""A backend's real first error (ONNX exporter, TVM), with the op, the node and the module it came from.

Backends wrap the error that matters in boilerplate: the ONNX exporter's
message starts with "Next steps:" and buries the cause under "## Exception
summary"; an export inside TVM ends with "Use tlparse to see full graph"; TVM's
own errors end a long C++ backtrace.  :func:`first_error` picks the real error
line, the ATen op and the FX node it names, and maps the node back to the
model's module path through the ``mlcomp_origin`` that
:mod:`mlcomp.runtime.codegen` records on every node.

The exporter's own message, and what :func:`first_error` makes of it, for an op it cannot translate::

    raw:     exporting m to ONNX failed: ConversionError: Failed to convert the exported program to
            an ONNX model. This is step 3/3 of exporting the model to ONNX. Next steps:. ...
            exporter log: .
    reduced: exporting m to ONNX failed: DispatchError: No ONNX function found for
            aten._convolution.default. Where: node %_convolution (aten._convolution.default),
            module features.0 (Conv2d). ...

    failure = first_error(exc, fx_module)
    failure.message, failure.op, failure.node, failure.module
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

__all__ = ["BackendFailure", "first_error"]

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_SUMMARY_ENTRY = re.compile(r"<class '(?:[\w.]+\.)?(\w+)'>: (.+)")
_OVERLOAD = re.compile(r"OpOverload\(op='([\w.]+)', overload='(\w+)'\)")
_TORCH_OP = re.compile(r"torch\.ops\.(\w+\.\w+\.\w+)")
_ATEN = re.compile(r"\b(aten::\w+|aten\.\w+\.\w+)")
_NODE = re.compile(r"node %(\w+)")
_ERROR_LINE = re.compile(r"\b\w*(Error|Exception)\b|Check failed|error:|not supported|unsupported", re.I)
# lines that are advice or decoration, never the error itself
_NOISE = ("tlparse", "TORCH_LOGS", "TORCHDYNAMO", "For more information", "Refer to the full stack",
          "Traceback", "Stack trace", "from user code", "Set TORCH", "See the stack trace", "Next steps",
          "If there is", "Create an error report", "This is step", "Exception summary", "⬆")


@dataclass(frozen=True)
class BackendFailure:
    """The error line a user should read, and where it points (each part None when unknown)."""

    message: str
    op: str | None = None
    node: str | None = None
    module: str | None = None

    def where(self) -> str | None:
        """``node %x (aten.op), module a.b (Conv2d)``, or None if the error names no node or op."""
        parts = []
        if self.node:
            parts.append(f"node %{self.node}" + (f" ({self.op})" if self.op else ""))
        elif self.op:
            parts.append(f"op {self.op}")
        if self.module:
            parts.append(f"module {self.module}")
        return ", ".join(parts) or None


def first_error(exc: BaseException, module: Any = None) -> BackendFailure:
    """The real first error of ``exc`` (its causes included); ``module``: the FX module given to the backend."""
    texts = []
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:     # the exception and its causes, outermost first
        seen.add(id(e))
        texts.append((type(e).__name__, _ANSI.sub("", str(e))))
        e = e.__cause__ or e.__context__
    full = "\n".join(t for _, t in texts)
    message = _summary_entry(full) or _first_error_line(texts)
    op = _op(full)
    node = next(iter(_NODE.findall(full)), None)
    return BackendFailure(message, op, node, _module_of(module, node))


def _summary_entry(text: str) -> str | None:
    """The ONNX exporter's "## Exception summary": its first ``<class 'X'>: message`` entry."""
    if "## Exception summary" not in text:
        return None
    for line in text.split("## Exception summary", 1)[1].splitlines():
        m = _SUMMARY_ENTRY.match(line.strip())
        if m:
            return f"{m.group(1)}: {_clean(m.group(2))}"
    return None


def _first_error_line(texts: list[tuple[str, str]]) -> str:
    """The first line that reads as an error, innermost cause first; else the first informative line."""
    fallback = None
    for type_name, text in reversed(texts):
        lines = [ln.strip() for ln in text.splitlines()
                 if ln.strip() and not ln.startswith((" ", "\t")) and not ln.lstrip().startswith(("File ", "#"))
                 and not any(noise in ln for noise in _NOISE)]
        for line in lines:
            if _ERROR_LINE.search(line):
                return _clean(line) if ":" in line else f"{type_name}: {_clean(line)}"
        if lines and fallback is None:
            fallback = f"{type_name}: {_clean(lines[0])}"
    return fallback or texts[0][0]


def _op(text: str) -> str | None:
    m = _OVERLOAD.search(text)
    if m:
        return f"{m.group(1)}.{m.group(2)}"
    m = _TORCH_OP.search(text) or _ATEN.search(text)
    return m.group(1) if m else None


def _module_of(module: Any, node: str | None) -> str | None:
    graph = getattr(module, "graph", None)
    if node is None or graph is None:
        return None
    for fx_node in graph.nodes:
        if fx_node.name == node:
            origin = fx_node.meta.get("mlcomp_origin")
            path = getattr(origin, "module_path", "") or ""
            mtype = getattr(origin, "module_type", "") or ""
            return (f"{path or '<root>'} ({mtype})" if mtype else path) or None
    return None


def _clean(text: str) -> str:
    text = re.sub(r"<?OpOverload\(op='([\w.]+)', overload='(\w+)'\)>?", r"\1.\2", text)
    text = re.sub(r"\s*See the stack trace for more information\.?", "", text)
    text = " ".join(text.split())
    return text if len(text) <= 300 else text[:299] + "…"
